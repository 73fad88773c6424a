"""Every codec on the same real gradients, beside the dense baselines measured in the same run.

Gradients come from :func:`gradwire_apps.gradients.collect_gradients`: the digits MLP and the character-level
transformer trained on Python's ``pydoc_data`` text, a few recorded steps each. For every codec row, on
each model, the whole model's gradient goes through ``encode_bundle`` → frame → ``decode_bundle``:

- bytes/param: frame bytes (header, names and CRC included) per parameter, mean over recorded steps;
- × vs fp32: the identity fp32 frame's bytes over this row's (measured in this run);
- rel. error: ‖decoded − g‖ / ‖g‖ over the whole model, mean over steps (no error feedback);
- EF sum error: with ``ErrorFeedback`` over the recorded steps, ‖Σ decoded − Σ g‖ / ‖Σ g‖;
- encode / decode: milliseconds per million parameters (best over the first three recorded steps, each
  run ``--repeat`` times), and × the identity fp32 row's time.

Other engineers add their codecs by appending ``BenchRow`` s to ``ROWS``.
The table is also written to ``bench/out/codecs.md`` and a plot of error against size to
``bench/out/codecs.png``.

Usage: python bench/codecs.py [--steps 32] [--record-every 2] [--repeat 3] [--threads N] [--device cpu]
           [--models digits char_transformer]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import gradwire
from gradwire import (
    QSGD,
    Accordion,
    Codec,
    DCTCodec,
    ErrorFeedback,
    GComp,
    IdentityCodec,
    MinMaxUInt8,
    OneBit,
    PowerSGD,
    RandomK,
    SignSGD,
    ThreeLC,
    TopK,
)
from gradwire_apps.gradients import MODELS, collect_gradients
from gradwire_apps.progress import progress as progress_bar

OUT = Path(__file__).resolve().parent / "out"
#: Recorded steps whose encode and decode are timed.
TIMED_STEPS = 3


@dataclass
class BenchRow:
    """One codec setting of the table: ``factory()`` builds a fresh codec (state starts anew per model)."""

    label: str
    factory: Callable[[], Codec]
    #: whether to measure the summed updates with error feedback (the method uses it)
    error_feedback: bool = True


#: The dense baselines: the first is what every ratio is relative to.
BASELINES = [
    BenchRow("identity fp32 (dense)", lambda: IdentityCodec(), error_feedback=False),
    BenchRow("identity fp16 (dense)", lambda: IdentityCodec(torch.float16), error_feedback=False),
]

#: Every codec setting measured. Append rows here to add a codec to the table.
ROWS: list[BenchRow] = [
    BenchRow("minmax uint8 (chunk 1024)", lambda: MinMaxUInt8(chunk=1024)),
    BenchRow("3lc s=1.0", lambda: ThreeLC(1.0)),
    BenchRow("3lc s=1.9", lambda: ThreeLC(1.9)),
    BenchRow("1-bit SGD", lambda: OneBit()),
    BenchRow("EF-signSGD (mean |g|)", lambda: SignSGD("mean_abs")),
    BenchRow("top-k 10%", lambda: TopK(density=0.10)),
    BenchRow("top-k 1%", lambda: TopK(density=0.01)),
    BenchRow("top-k 1% global", lambda: TopK(density=0.01, scope="global"), error_feedback=False),
    BenchRow("top-k 1% fp16 values", lambda: TopK(density=0.01, value_dtype=torch.float16)),
    BenchRow("random-k 1% (n/k scaled)", lambda: RandomK(density=0.01), error_feedback=False),
    BenchRow("random-k 10% (unscaled)", lambda: RandomK(density=0.10, unbiased=False)),
    BenchRow("PowerSGD rank 1", lambda: PowerSGD(rank=1)),
    BenchRow("PowerSGD rank 4", lambda: PowerSGD(rank=4)),
    BenchRow("Accordion PowerSGD r4↔r1", lambda: Accordion(PowerSGD(rank=4), PowerSGD(rank=1), interval=2)),
    BenchRow("DCT 64×64 k=32 (flat)", lambda: DCTCodec(topk=32)),
    BenchRow("DCT tiles k=32", lambda: DCTCodec(topk=32, mode="tiles")),
    BenchRow("DCT 64×64 k=32 Rice idx", lambda: DCTCodec(topk=32, index_coding="rice")),
    BenchRow("DCT 64×64 k=32 Rice idx 4-bit", lambda: DCTCodec(topk=32, index_coding="rice", value_bits=4)),
    BenchRow("DCT 64×64 k=64 Rice idx 2-bit", lambda: DCTCodec(topk=64, index_coding="rice", value_bits=2)),
    BenchRow("QSGD s=4 bucket 512", lambda: QSGD(levels=4, bucket=512), error_feedback=False),
    BenchRow("QSGD s=1 bucket 4096", lambda: QSGD(levels=1, bucket=4096), error_feedback=False),
    BenchRow("QSGD s=16 bucket 512 (γ)", lambda: QSGD(levels=16, bucket=512, elias="gamma"), error_feedback=False),
    # GComp without the parameters (δ needs them: bench/gcomp_levels.py) at fixed mantissa levels; each
    # frame carries its codebook, as this table decodes every frame on its own.
    BenchRow("GComp lossless (level 0)", lambda: GComp(carry_book="always"), error_feedback=False),
    BenchRow("GComp drop 12 bits (level 2)", lambda: GComp(fixed_level=2, carry_book="always"), error_feedback=False),
    BenchRow("GComp drop 18 bits (level 3)", lambda: GComp(fixed_level=3, carry_book="always"), error_feedback=False),
]


@dataclass
class Result:
    label: str
    bytes_per_param: float
    rel_error: float
    ef_sum_error: float | None
    encode_s: float
    decode_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors.values()])


def measure(row: BenchRow, steps: list[dict[str, torch.Tensor]], repeat: int, device: torch.device) -> Result:
    """One row on one model's recorded gradients."""
    params = sum(t.numel() for t in steps[0].values())
    codec = row.factory()
    sizes, errors = [], []
    best_enc, best_dec = float("inf"), float("inf")
    for i, grads in enumerate(steps):
        # Timings: the first TIMED_STEPS steps, each run `repeat` times (stateful codecs move on).
        for _ in range(repeat if i < TIMED_STEPS else 1):
            _sync(device)
            t0 = time.perf_counter()
            frame = codec.encode_bundle(grads, round=i)
            _sync(device)
            t1 = time.perf_counter()
            decoded = gradwire.decode_bundle(frame, device=device)
            _sync(device)
            t2 = time.perf_counter()
            if i < TIMED_STEPS:
                best_enc, best_dec = min(best_enc, t1 - t0), min(best_dec, t2 - t1)
        sizes.append(len(frame))
        g = _flat(grads)
        errors.append(float((_flat(decoded) - g).norm() / g.norm()))

    ef_error = None
    if row.error_feedback:
        ef = ErrorFeedback(row.factory())
        sum_in = sum_out = None
        for i, grads in enumerate(steps):
            out = _flat(gradwire.decode_bundle(ef.encode_bundle(grads, round=i), device=device))
            g = _flat(grads)
            sum_in = g if sum_in is None else sum_in + g
            sum_out = out if sum_out is None else sum_out + out
        ef_error = float((sum_out - sum_in).norm() / sum_in.norm())
    return Result(
        row.label,
        bytes_per_param=sum(sizes) / len(sizes) / params,
        rel_error=sum(errors) / len(errors),
        ef_sum_error=ef_error,
        encode_s=best_enc,
        decode_s=best_dec,
    )


def _table(title: str, results: list[Result], params: int) -> tuple[Table, list[str]]:
    base = results[0]
    table = Table(title=title)
    headers = [
        "codec",
        "bytes/param",
        "× vs fp32",
        "rel. error",
        "EF sum error",
        "encode ms/M",
        "× fp32",
        "decode ms/M",
        "× fp32",
    ]
    for h in headers:
        table.add_column(h, justify="left" if h == "codec" else "right")
    md = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    per_m = 1e6 / params * 1e3
    for r in results:
        cells = [
            r.label,
            f"{r.bytes_per_param:.4f}",
            f"{base.bytes_per_param / r.bytes_per_param:.1f}",
            f"{r.rel_error:.3f}",
            "—" if r.ef_sum_error is None else f"{r.ef_sum_error:.3f}",
            f"{r.encode_s * per_m:.1f}",
            f"{r.encode_s / base.encode_s:.1f}",
            f"{r.decode_s * per_m:.1f}",
            f"{r.decode_s / base.decode_s:.1f}",
        ]
        table.add_row(*cells)
        md.append("| " + " | ".join(cells) + " |")
    return table, md


def _plot(all_results: dict[str, list[Result]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(8 * len(all_results), 6.5), squeeze=False)
    for ax, (model, results) in zip(axes[0], all_results.items()):
        dense = results[0]
        ax.axvline(dense.bytes_per_param, color="grey", ls="--", lw=1)
        ax.text(dense.bytes_per_param, 1.5, " dense fp32", color="grey", fontsize=8, rotation=90, va="bottom")
        for i, r in enumerate(results[1:]):
            color = f"C{i % 10}"
            ax.scatter(r.bytes_per_param, r.rel_error, s=30, color=color)
            if r.ef_sum_error is not None:
                # Hollow marker: the error of the summed updates with error feedback.
                ax.scatter(r.bytes_per_param, max(r.ef_sum_error, 1e-4), s=30, facecolors="none", edgecolors=color)
                ax.plot([r.bytes_per_param] * 2, [r.rel_error, max(r.ef_sum_error, 1e-4)], color=color, lw=0.8)
            ax.annotate(
                r.label,
                (r.bytes_per_param, r.rel_error),
                fontsize=6.5,
                rotation=30,
                xytext=(3, 3),
                textcoords="offset points",
                color=color,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(1e-4, 30)
        ax.set_xlabel("bytes per parameter (whole frame)")
        ax.set_ylabel("relative error: ● one step   ○ summed over the steps, with error feedback")
        ax.set_title(f"{model}: codecs on real gradients")
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--steps", type=int, default=32, help="training steps per model")
    ap.add_argument("--record-every", type=int, default=2, help="record the gradient of every n-th step")
    ap.add_argument("--repeat", type=int, default=3, help="timing repeats (best of)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of row labels to keep")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (1 gives steadier timings on a machine shared with other work)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    console = Console(width=200)
    rows = ROWS if not args.only else [r for r in ROWS if any(s in r.label for s in args.only)]
    OUT.mkdir(parents=True, exist_ok=True)
    md_lines = [
        f"# Codec bench ({device.type}, {torch.get_num_threads()} torch threads, {args.steps} training steps,"
        f" one step in {args.record_every} recorded)",
        "",
    ]
    all_results: dict[str, list[Result]] = {}
    for model in args.models:
        steps = collect_gradients(model, args.steps, record_every=args.record_every, device=device)
        params = sum(t.numel() for t in steps[0].values())
        results = []
        for row in progress_bar(BASELINES + rows, desc=f"codecs on {model}", leave=False):
            results.append(measure(row, steps, args.repeat, device))
        title = f"{model}: {params:,} parameters, {len(steps)} recorded steps, {device.type}"
        table, md = _table(title, results, params)
        console.print(table)
        md_lines += [f"## {title}", ""] + md + [""]
        all_results[model] = results
    (OUT / "codecs.md").write_text("\n".join(md_lines))
    _plot(all_results, OUT / "codecs.png")
    console.print(f"wrote {OUT / 'codecs.md'} and {OUT / 'codecs.png'}")


if __name__ == "__main__":
    main()
