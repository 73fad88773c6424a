"""Held-out loss against steps at 16 nodes on the byte LM: dense AdamW, dense Muon, uncompressed DiLoCo at 11 local
steps, and one bit both ways (303× up, 301× down) with AdamW or Muon as the nodes' inner optimizer (MuLoCo).

It draws what the runs already measured, nothing new: the screens' lines in ``bench/results/local_step_screen.jsonl``
(``bench/local_step_screen.py``) and the bench's runs in ``bench/results/reencode.json``
(``bench/convergence_nodes.py``),
the commands in docs/results/reencode.md ("The codec is not the gap"). A curve whose run is missing is left out.

Usage: python bench/muloco_curves.py [--screens bench/results/local_step_screen.jsonl]
           [--cache bench/results/reencode.json] [--out docs/results/muloco-16.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"  # the runs behind the docs, kept in the repository

#: (label, where, match): ``where`` is "screen" (a line of the screens' JSONL whose fields equal ``match``) or
#: "bench" (a cached run whose fields equal ``match``).
CURVES = (
    ("dense AdamW (lr 0.01)", "screen", dict(support="dense", inner="adamw", lr=0.01, nodes=16, seed=0)),
    ("dense Muon (lr 0.02)", "screen", dict(support="dense", inner="muon", lr=0.02, nodes=16, seed=0)),
    (
        "DiLoCo, fp32 both ways, H 11 (AdamW inner)",
        "screen",
        dict(support="all", bits=32, H=11, inner="adamw", lr=0.01, nodes=16, seed=0),
    ),
    (
        "1 bit both ways, H 11, AdamW inner",
        "screen",
        dict(support="all", bits=1, H=11, inner="adamw", lr=0.01, nodes=16, seed=0, reset_momentum=0.0),
    ),
    (
        "1 bit both ways, H 11, Muon inner (MuLoCo, lr 0.04), seed 0",
        "bench",
        dict(task="stdlib", row="signloco+muon/agg", lr=0.04, seed=0, nodes=16),
    ),
    ("the same, seed 1", "bench", dict(task="stdlib", row="signloco+muon/agg", lr=0.04, seed=1, nodes=16)),
)


def _screens(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curves(screens: Path, cache: Path) -> list[tuple[str, list[tuple[int, float]]]]:
    """``(label, [(step, held-out loss)])`` for every curve of :data:`CURVES` that a run measured (the last such
    run, at 2,048 steps; a bench run at 11 local steps per sync, whose last sync is step 2,046)."""
    lines = _screens(screens)
    runs = list(json.loads(cache.read_text()).values()) if cache.exists() else []
    out = []
    for label, where, match in CURVES:
        if where == "screen":
            found = [
                r
                for r in lines
                if r.get("steps") == 2048
                and all(r.get(k, "adamw" if k == "inner" else 0.0) == v for k, v in match.items())
            ]
            pts = [(int(s), float(h)) for s, h in found[-1]["curve"]] if found else []
        else:
            # 2,046 is the last sync of H 11
            found = [r for r in runs if all(r.get(k) == v for k, v in match.items()) and r["curve"][-1][0] == 2046]
            pts = [(int(c[0]), float(c[-1])) for c in found[-1]["curve"] if c[0] > 0] if found else []
        if pts:
            out.append((label, pts))
    return out


def plot(found: Sequence[tuple[str, list[tuple[int, float]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    styles = {
        "dense": dict(color="black"),
        "DiLoCo": dict(color="C4", ls="--"),
        "AdamW inner": dict(color="C5"),
        "MuLoCo": dict(color="C2", lw=2),
        "the same": dict(color="C2", lw=1, ls=":"),
    }
    for label, pts in found:
        style = next((v for k, v in styles.items() if k in label), {})
        if label.startswith("dense Muon"):
            style = dict(color="grey", ls="-.")
        ax.plot([s for s, _ in pts], [h for _, h in pts], label=label, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_ylim(1.3, 1.8)
    ax.set_title("16 nodes, byte LM, 8 sequences per node")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--screens", type=Path, default=RESULTS / "local_step_screen.jsonl")
    ap.add_argument("--cache", type=Path, default=RESULTS / "reencode.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "muloco-16.png")
    args = ap.parse_args(argv)
    found = curves(args.screens, args.cache)
    if not found:
        sys.exit(f"no run to draw in {args.screens} or {args.cache}")
    for label, pts in found:
        print(f"{label}: held-out {pts[-1][1]:.4f} at step {pts[-1][0]}")
    plot(found, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
