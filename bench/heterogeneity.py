"""Honest heterogeneity and colluders side by side, through a real server: what the default rule costs runs
whose honest nodes hold data of their own, and what it holds against colluders.

``python bench/heterogeneity.py [--rounds 30] [--seeds 0 1] [--modes ...] [--rows ...] [--full]``

Every run is ``bench/attacks.py``'s ``run_one``: a real ``gradwire_server`` on loopback and real
:class:`gradwire.client.Node` clients on threads, one small MLP, quorum = every node. Ratios are held-out
losses of the final weights, same seeds and samples, measured in this one run of the bench.

**Honest rows** (0 attackers; ``--rows``; ``iid``, every node on the majority's data, only where asked),
each under the default rule (``default``: ``bounded_mean``, no
data assignment) and the plain ``mean`` (a column ``default + validators`` is left for the validators'
branch):

- ``minority``: 8 nodes, 2 of them (ids 7, 8) on data of their own: inputs from another region of the input
  space (shifted by +2 in every coordinate) labelled by another rule (other input features, other signs).
  Held-out loss on the 75/25 mixture and on each group's own data.
- ``dirichlet0.1``, ``dirichlet1``: a 10-class task (Gaussian classes in 16 dimensions, cross-entropy) dealt
  over 8 nodes by Dirichlet label proportions (α = 0.1: most nodes see two or three classes; α = 1: every
  class, in skewed shares). Held-out loss on the mixture (every class in the nodes' pooled shares) and on
  each node's own distribution (the worst node's ratio is printed).

For each row and mode, the weight each group received: its mean share of a round, over all rounds, as the
run's :class:`gradwire.rule.Rule` computes it from the frames the nodes submitted (the rule replayed here on
the same frames; for the modes that publish frames the published weights are these).

**Colluder grid** (``--colluders``; the attacks of ``bench/attacks.py``): 2 of 8 nodes collude, on the IID
regression and on the ``minority`` data (non-IID: the colluders are nodes 7, 8 and the honest minority is
then nodes 5, 6), under the default rule without an assignment (``default``), the default in a run that
assigns its data (``assigned``: honest nodes IID, sender histories on) and the plain ``mean``. Each cell is
held-out loss ÷ the clean run's (same mode and rule, on the mixture). The default size runs a few attacks in
a few modes; ``--full`` runs every attack in every mode.

Writes ``docs/results/heterogeneity.md`` (``--out``) with the date, the command and the tables.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gradwire.aggregation import update_norm
from gradwire.binding import strip_binding
from gradwire.frame import read_frame
from gradwire_server.aggregate import Update, published_weights
from gradwire_server.config import AggregationConfig
from gradwire_server.launcher import LoopbackServer


def _attacks_bench():
    """bench/attacks.py, this bench's harness (bench/ is no package: loaded by path, as the tests load it)."""
    if "attacks_bench" in sys.modules:
        return sys.modules["attacks_bench"]
    spec = importlib.util.spec_from_file_location("attacks_bench", Path(__file__).resolve().parent / "attacks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["attacks_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


attacks = _attacks_bench()

N = 8
MINORITY = (7, 8)


# -- the data -----------------------------------------------------------------------------------------


def _majority(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x[:, :4]) * 0.8 - 0.5 * x[:, 4:8]


def _minority(x: torch.Tensor) -> torch.Tensor:
    return -0.6 * torch.tanh(x[:, 8:12]) + 0.4 * (x[:, 12:16] - 2.0)


def _regression_batch(group: str, stream: int, step: int, size: int = 128):
    g = torch.Generator().manual_seed(7919 * stream + step)
    x = torch.randn(size, 16, generator=g)
    if group == "minority":
        x = x + 2.0
        return x, _minority(x)
    return x, _majority(x)


@dataclass
class Groups:
    """A data layout: the DataSpec each node trains on, each group's node ids and held-out loss, and the
    mixture's (each group's loss weighed by its share of the nodes)."""

    data: attacks.DataSpec
    members: dict[str, list[int]]
    losses: dict[str, Callable[[dict[str, torch.Tensor]], float]]

    def mixture(self, state: dict[str, torch.Tensor]) -> float:
        total = sum(len(m) for m in self.members.values())
        return sum(len(self.members[g]) / total * self.losses[g](state) for g in self.members)


def _load(make: Callable[[], nn.Module], state: dict[str, torch.Tensor]) -> nn.Module:
    m = make()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(state[name])
    return m


def minority_groups(minority: Sequence[int] = MINORITY, nodes: int = N) -> Groups:
    """``minority``'s nodes on data of their own, the rest on the majority's."""
    held = {g: _regression_batch(g, 10_000, 0, size=1024) for g in ("majority", "minority")}

    def batch(node: int, step: int, task: float):
        x, y = _regression_batch("minority" if node in minority else "majority", node, step)
        return x, task * y

    def loss_of(group: str):
        def loss(state):
            with torch.no_grad():
                return float(attacks.mse(_load(attacks.model, state), held[group]))

        return loss

    data = attacks.DataSpec(attacks.model, batch, lambda state: 0.0)
    members = {
        "majority": [i for i in range(1, nodes + 1) if i not in minority],
        "minority": [i for i in range(1, nodes + 1) if i in minority],
    }
    members = {g: m for g, m in members.items() if m}
    groups = Groups(data, members, {g: loss_of(g) for g in members})
    return Groups(attacks.DataSpec(attacks.model, batch, groups.mixture), members, groups.losses)


CLASSES = 10


def _classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def _ce(module: nn.Module, xy) -> torch.Tensor:
    x, y = xy
    return nn.functional.cross_entropy(module(x), y)


_CENTERS = torch.randn(CLASSES, 16, generator=torch.Generator().manual_seed(4242)) * 1.2


def _class_batch(shares: torch.Tensor, stream: int, step: int, size: int = 128):
    g = torch.Generator().manual_seed(104729 * stream + step)
    y = torch.multinomial(shares, size, replacement=True, generator=g)
    return _CENTERS[y] + torch.randn(size, 16, generator=g), y


def dirichlet_groups(alpha: float, nodes: int = N) -> Groups:
    """A 10-class task dealt over ``nodes`` by Dirichlet(``alpha``) label shares (fixed seed): every node is a
    group of its own."""
    dist = torch.distributions.Dirichlet(torch.full((CLASSES,), float(alpha)))
    torch.manual_seed(31337)
    shares = {i: dist.sample().clamp_min(1e-6) for i in range(1, nodes + 1)}
    pooled = torch.stack(list(shares.values())).mean(0)
    held = {f"node{i}": _class_batch(s, 20_000 + i, 0, size=512) for i, s in shares.items()}
    mix = _class_batch(pooled, 30_000, 0, size=2048)

    def batch(node: int, step: int, task: float):
        return _class_batch(shares[node], node, step)

    def loss_of(xy):
        def loss(state):
            with torch.no_grad():
                return float(_ce(_load(_classifier, state), xy))

        return loss

    members = {f"node{i}": [i] for i in shares}
    return Groups(
        attacks.DataSpec(_classifier, batch, loss_of(mix), _ce), members, {g: loss_of(held[g]) for g in members}
    )


ROWS: dict[str, Callable[[], Groups]] = {
    "iid": lambda: minority_groups(minority=()),
    "minority": minority_groups,
    "dirichlet0.1": lambda: dirichlet_groups(0.1),
    "dirichlet1": lambda: dirichlet_groups(1.0),
}


# -- the weights --------------------------------------------------------------------------------------


def group_weights(out: attacks.Outcome, rule: str, members: dict[str, list[int]], rounds: int) -> dict[str, float]:
    """Each group's mean share of a round (its nodes' coefficients summed), over the run's rounds, by the
    run's rule replayed on the frames its nodes submitted (the server's :class:`~gradwire.rule.Rule`, built
    from the same settings and stepped the same way)."""
    if rule == "mean":
        total = sum(len(m) for m in members.values())
        return {g: len(m) / total for g, m in members.items()}
    cfg = AggregationConfig(**(attacks.aggregation_settings(rule) or {}))
    the_rule = cfg.rule_object(data_assigned=False)
    nodes = sorted(i for m in members.values() for i in m)
    got = {g: 0.0 for g in members}
    counted = 0
    for r in range(rounds):
        raw = [out.frames.by_key.get((r, i), (None, None))[0] for i in nodes]
        if any(b is None for b in raw):
            continue
        ups = []
        for i, b in zip(nodes, raw):
            frame = strip_binding(read_frame(b))
            ups.append(Update(frame, 1.0, update_norm(frame.entries), i))
        coeffs, _ = published_weights(ups, the_rule)
        the_rule.step(nodes, [u.norm for u in ups], [u.frame.entries for u in ups], coeffs)
        by_node = dict(zip(nodes, coeffs))
        for g, m in members.items():
            got[g] += sum(by_node[i] for i in m)
        counted += 1
    return {g: w / max(counted, 1) for g, w in got.items()}


# -- the honest rows ----------------------------------------------------------------------------------


@dataclass
class HonestCell:
    row: str
    mode: str
    rule: str
    seed: int
    mixture: float
    own: dict[str, float]
    weights: dict[str, float]
    seconds: float


def _seeded(data: attacks.DataSpec, seed: int) -> attacks.DataSpec:
    """``data`` with its model's initial weights from ``seed`` and every node's stream shifted by it (the
    groups keep their node ids)."""
    if seed == 0:
        return data
    make, base = data.model, data.batch
    return attacks.DataSpec(
        lambda: make(seed), lambda n, s, t: base(n, s + 1_000_000 * seed, t), data.held_out_loss, data.loss
    )


def honest_cell(server, row: str, mode: str, rule: str, seed: int, rounds: int) -> HonestCell:
    groups = ROWS[row]()
    out = attacks.run_one(server, mode, "clean", rule, rounds, nodes=N, rogues=0, data=_seeded(groups.data, seed))
    return HonestCell(
        row,
        mode,
        rule,
        seed,
        out.held_out,
        {g: loss(out.state) for g, loss in groups.losses.items()},
        group_weights(out, rule, groups.members, rounds),
        out.seconds,
    )


def honest_table(cells: Sequence[HonestCell]) -> str:
    """One line per (row, mode): the default's and the mean's held-out losses (mean over seeds), their
    ratio on the mixture and on each group's own data (the worst group for the Dirichlet rows), and each
    group's weight under the default."""
    lines = [
        "| row | mode | seeds | mixture: default | mean | default ÷ mean | worst group's own: ÷ mean (group) "
        "| default + validators | weight under default (group: share; mean's share) |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    keys = list(dict.fromkeys((c.row, c.mode) for c in cells))
    for row, mode in keys:
        by_rule = {r: [c for c in cells if (c.row, c.mode, c.rule) == (row, mode, r)] for r in ("default", "mean")}
        d, m = by_rule["default"], by_rule["mean"]
        if not d or not m:
            continue
        dm = statistics.fmean(c.mixture for c in d)
        mm = statistics.fmean(c.mixture for c in m)
        own = {g: statistics.fmean(c.own[g] for c in d) / statistics.fmean(c.own[g] for c in m) for g in d[0].own}
        worst = max(own, key=own.get)
        w = {g: statistics.fmean(c.weights[g] for c in d) for g in d[0].weights}
        wm = m[0].weights
        if len(w) > 2:
            low = min(w, key=w.get)
            shares = f"lowest {low}: {w[low]:.3f}; {wm[low]:.3f}"
        else:
            shares = "; ".join(f"{g}: {w[g]:.3f}; {wm[g]:.3f}" for g in w)
        own_text = ", ".join(f"{g} {own[g]:.3f}×" for g in own) if len(own) <= 2 else f"{own[worst]:.3f}× ({worst})"
        lines.append(
            f"| {row} | {mode} | {len(d)} | {dm:.4f} | {mm:.4f} | {dm / mm:.3f}× | {own_text} | – | {shares} |"
        )
    return "\n".join(lines)


# -- the colluder grid --------------------------------------------------------------------------------


DEFAULT_ATTACKS = ("alie", "ipm_large", "minmax")
DEFAULT_COLLUDER_MODES = ("adamw", "demo")


def colluder_grid(server, modes, attack_names, rounds: int, seed: int = 0) -> str:
    """Every (data, mode, attack): held-out loss ÷ the clean run's under ``assigned``, ``default`` and
    ``mean``, 2 of 8 colluding (nodes 7, 8)."""
    layouts = {
        "IID": attacks.REGRESSION,
        # Non-IID: an honest minority of 2 (nodes 5, 6) on data of their own beside the colluders.
        "non-IID": minority_groups(minority=(5, 6)).data,
    }
    rules = ("assigned", "default", "mean")
    lines = [
        "| data | mode | attack | assigned | default | mean |",
        "|---|---|---|---:|---:|---:|",
    ]
    for name, data in layouts.items():
        for mode in modes:
            clean = {r: attacks.run_one(server, mode, "clean", r, rounds, nodes=N, rogues=2, data=data) for r in rules}
            for attack in attack_names:
                cells = []
                for r in rules:
                    if name == "non-IID" and r == "assigned":
                        # An assignment makes the honest nodes IID: its cells are the IID rows'.
                        cells.append("–")
                        continue
                    got = attacks.run_one(server, mode, attack, r, rounds, nodes=N, rogues=2, data=data)
                    cells.append(f"{got.held_out / clean[r].held_out:.3f}×")
                lines.append(f"| {name} | {mode} | {attack} | {' | '.join(cells)} |")
                print(lines[-1], flush=True)
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="versions per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--modes", nargs="+", default=list(attacks.MODES), choices=list(attacks.MODES))
    p.add_argument("--rows", nargs="+", default=[r for r in ROWS if r != "iid"], choices=list(ROWS))
    p.add_argument("--colluders", action="store_true", help="also run the colluder grid")
    p.add_argument("--full", action="store_true", help="the colluder grid: every attack in every mode")
    p.add_argument("--out", default="docs/results/heterogeneity.md", help="the report page ('' for none)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    cells: list[HonestCell] = []
    with LoopbackServer() as server:
        for row in args.rows:
            for mode in args.modes:
                for seed in args.seeds:
                    for rule in ("default", "mean"):
                        c = honest_cell(server, row, mode, rule, seed, args.rounds)
                        cells.append(c)
                        print(
                            f"{row} {mode} {rule} seed {seed}: mixture {c.mixture:.4f} own "
                            f"{ {g: round(v, 4) for g, v in c.own.items()} } weights "
                            f"{ {g: round(v, 3) for g, v in c.weights.items()} } ({c.seconds:.0f} s)",
                            flush=True,
                        )
        honest = honest_table(cells)
        print("\n" + honest + "\n", flush=True)
        grid = ""
        if args.colluders or args.full:
            modes = list(attacks.MODES) if args.full else [m for m in DEFAULT_COLLUDER_MODES if m in args.modes]
            names = ("alie", "alie_own", "ipm_large", "minmax", "minsum", "mimic", "adaptive")
            grid = colluder_grid(server, modes, names if args.full else DEFAULT_ATTACKS, args.rounds)
            print("\n" + grid + "\n", flush=True)
    seconds = time.perf_counter() - t0
    print(f"{seconds:.0f} s in all")
    if args.out:
        write_page(Path(args.out), honest, grid, " ".join(sys.argv[1:] if argv is None else argv), seconds, args)


def write_page(path: Path, honest: str, grid: str, command: str, seconds: float, args) -> None:
    today = datetime.date.today().isoformat()
    text = f"""# Heterogeneity: the default rule against the plain mean, honest nodes on data of their own

Measured {today} by `python bench/heterogeneity.py {command}` ({seconds:.0f} s on 2 shared cores): a real
server on loopback, 8 real nodes per run, {args.rounds} versions, seeds {", ".join(map(str, args.seeds))}
(bench/heterogeneity.py says what each row is). Every figure is a ratio of held-out losses measured side by
side in that run. "default" is `bounded_mean` without a data assignment (gradwire.rule); the column
"default + validators" waits for the validators' branch.

Targets (issue 43): default ÷ mean ≤ 1.03× on the mixture and ≤ 1.10× on each group's own data, every mode.

## Honest rows (0 attackers)

{honest}
"""
    if grid:
        text += f"""
## Colluders, 2 of 8 (nodes 7, 8): held-out loss ÷ the clean run's (same mode and rule)

"assigned": the default rule in a run whose honest nodes are IID by construction (`honest_iid`, which a data
assignment sets): sender histories on. "default": no assignment. "mean": the plain mean, to show each attack
bites. Targets: assigned ≤ 1.10×; default never worse than the mean.

{grid}
"""
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
