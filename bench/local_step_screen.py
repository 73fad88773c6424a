"""Screens of SparseLoCo's loop in plain torch, for ideas not worth a codec until they measure well:
values on a support every node knows without it being sent, low rank, and DiLoCo's outer step (docs/results/reencode.md,
"The local-step floor").

Every node takes ``--H`` local AdamW steps on its own shard (the bench's tasks, shards, batches, seeds and
held-out loss: :mod:`convergence`), then each packed tensor (:class:`convergence.Packer`) syncs on a support:

- ``--support all``: every coordinate (with ``--bits 32``, uncompressed DiLoCo: the bench's ``diloco`` row);
- ``--support random``: a fraction of the coordinates drawn afresh each round from a seed every node derives
  from the round number, so positions cost nothing and the server's aggregate lives on the same support;
- ``--support cyclic``: a window of one fixed random permutation, moved each round (every coordinate once
  per ``1/fraction`` rounds).
- ``--support blocks``: the blocks of ``--block`` coordinates whose error norms, summed over the nodes, were
  largest after the previous round (each node reports 8 bits a block; the server names the blocks);
  ``blocks-now``: the same from this round's errors (a second exchange per sync);
- ``--support topk``: each node's own largest ``p`` of each tensor, positions entropy-coded (``H(p)`` bits a
  coordinate, counted); the server adds the mean to its error buffer and publishes its own top ``p``.
- ``--support powersgd``: each weight matrix at rank ``--rank`` (PowerSGD, two phases per sync: the nodes send
  ``M Q`` for the last published ``Q``, the server publishes the mean, every node orthonormalizes it to ``P``,
  the nodes send ``Mᵀ P``, the server publishes that mean). The factors are linear in ``M``, so the server's
  mean is exact and a published factor is the size of a sent one whatever the node count; the server's own
  error buffer (what re-quantizing the mean dropped) joins the next sync as one more contributor;
- ``--support subspace``: one phase per sync, alternating sides: each sync projects every node's matrix onto
  the orthonormalized factor published by the previous sync (its column space, then its row space), so the
  basis is one every node derives from what it already received.

  In both, the factors travel at ``--bits`` (8: uniform levels, 16: float16) and the 1-D parameters as one bit
  a coordinate with error feedback; the measured ratio follows from ``--rank`` and ``--H`` (``--ratio`` unused).

On the support a node sends its error buffer (no decay) quantized to ``--bits`` (1: the sign and each side's
mean, as ``gradwire.OneBit`` does per column, here per tensor; 2–8: uniform levels over ±2.5 RMS; 32: exact).
The server averages exactly, adds its own error buffer, quantizes the same way on the same support and
publishes that; the outer step is ``--outer-lr`` (with ``--momentum``, Nesterov) on the decoded aggregate.
The support's fraction is set by ``--ratio`` (fp32 bytes per local step over the bits sent, each way; the
scales' 64 bits per tensor counted, the frame headers not). With ``--support all --bits 1 --H 11`` this is
the bench's ``signloco/agg`` row but for per-tensor scales: seed 0 at 16 nodes gave 1.4458 here against the
bench's 1.4446.

Three knobs on the nodes (docs/results/reencode.md, "The codec is not the gap"): ``--inner muon`` (the bench's
``+muon`` rows: Muon on the weight matrices, AdamW on the rest), ``--node-decay`` (each node's error buffer
decays at each sync, as top-k SparseLoCo's does) and ``--reset-momentum α`` (after each sync every node's AdamW
first moment moves a fraction α toward the one that would have taken the published step: a global momentum at
no cost in bytes). ``--support dense`` is the bench's dense row (the mean of the nodes' gradients, one step of
``--inner`` on it) for the same batches.

Nothing here goes through frames; the bytes are counted, not written. Each run appends one JSON line to
``--out`` (default ``bench/results/local_step_screen.jsonl``, kept in the repository) and prints held-out loss at eight
points.

Usage: python bench/local_step_screen.py [--task stdlib] [--nodes 16] [--H 4] [--support random] [--bits 1]
           [--inner adamw|muon] [--node-decay 1] [--reset-momentum 0]
           [--block 256] [--rank 1] [--ratio 300] [--lr 0.01] [--outer-lr 1] [--momentum 0] [--seed 0] [--steps 2048]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

try:
    from bench import convergence as cv  # python -m bench.local_step_screen
except ImportError:
    import convergence as cv  # python bench/local_step_screen.py

SCALE_BITS = 64  # the two scales of a 1-bit tensor, or one of a b-bit tensor, rounded up


def quantize(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``v`` (1-D) at ``bits`` bits, decoded: 1 bit = the sign and the mean of each side; 2–8 bits = uniform
    levels (midrise) over ±2.5 RMS; 32 = ``v`` itself."""
    if bits >= 32 or v.numel() == 0:
        return v.clone()
    if bits == 1:
        pos = v >= 0
        up = v[pos].mean() if pos.any() else v.new_zeros(())
        down = v[~pos].mean() if (~pos).any() else v.new_zeros(())
        return torch.where(pos, up, down)
    levels = 2**bits
    c = 2.5 * v.pow(2).mean().sqrt().clamp_min(1e-30)
    width = 2 * c / levels
    q = torch.clamp(torch.floor((v + c) / width), 0, levels - 1)
    return (q + 0.5) * width - c


def support(kind: str, fraction: float, rnd: int, tensor_index: int, numel: int) -> torch.Tensor:
    """The positions of one tensor synced in round ``rnd``: the same on every node, never sent."""
    if kind == "all" or fraction >= 1.0:
        return torch.arange(numel)
    k = max(1, round(fraction * numel))
    if kind == "random":
        g = torch.Generator().manual_seed(1_000_003 * rnd + 7919 * tensor_index + 1)
        return torch.randperm(numel, generator=g)[:k]
    g = torch.Generator().manual_seed(7919 * tensor_index + 1)
    return torch.randperm(numel, generator=g).roll(-((rnd * k) % numel))[:k]


def block_scores(errors: Sequence[torch.Tensor], block: int) -> torch.Tensor:
    """The sum over nodes of each ``block``-coordinate block's error norm (what each node reports, 8 bits a
    block, for ``--support blocks``)."""
    numel = errors[0].numel()
    pad = (-numel) % block
    total = torch.zeros((numel + pad) // block)
    for e in errors:
        flat = torch.nn.functional.pad(e.reshape(-1), (0, pad))
        total += flat.reshape(-1, block).norm(dim=1)
    return total


def block_support(scores: torch.Tensor, fraction: float, block: int, numel: int) -> torch.Tensor:
    """The coordinates of the ``fraction`` of blocks with the largest ``scores`` (ties by position)."""
    k = max(1, round(fraction * scores.numel()))
    chosen = torch.sort(torch.topk(scores, k, sorted=False).indices).values
    idx = (chosen[:, None] * block + torch.arange(block)[None, :]).reshape(-1)
    return idx[idx < numel]


def entropy_bits(p: float) -> float:
    """Bits per coordinate of an entropy-coded set holding a fraction ``p`` of them (the binary entropy)."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def topk_fraction(budget: float, bits: int) -> float:
    """The fraction ``p`` a per-sender top-k can keep within ``budget`` bits per coordinate: ``bits``
    per kept value plus the positions entropy-coded (``bits · p + H(p) = budget``, bisection)."""
    lo, hi = 0.0, 0.5
    for _ in range(60):
        mid = (lo + hi) / 2
        if bits * mid + entropy_bits(mid) > budget:
            hi = mid
        else:
            lo = mid
    return lo


def topk_positions(v: torch.Tensor, fraction: float) -> torch.Tensor:
    """The positions of ``v``'s ``fraction`` largest magnitudes (its own, not shared with anyone)."""
    k = max(1, round(fraction * v.numel()))
    return torch.topk(v.abs(), k, sorted=False).indices


def quantize_factor(v: torch.Tensor, bits: int) -> torch.Tensor:
    """A low-rank factor at ``bits``: 16 = float16, 32 = exact, fewer = uniform levels per column."""
    if bits >= 32:
        return v.clone()
    if bits == 16:
        return v.to(torch.float16).to(v.dtype)
    return torch.stack([quantize(c, bits) for c in v.T], dim=1)


def orthonormal(v: torch.Tensor) -> torch.Tensor:
    """``v``'s columns orthonormalized (reduced QR): what every node computes alike from a published factor."""
    return torch.linalg.qr(v, mode="reduced").Q


class LowRankSync:
    """One weight matrix synced at rank ``rank`` (``--support powersgd`` / ``subspace``): the server's error
    buffer and the last published factors; :meth:`sync` takes the nodes' error buffers (updated in place),
    returns the step every node applies and the bits one node sent (the server publishes as many)."""

    def __init__(self, shape: tuple, rank: int, bits: int, two_phase: bool, seed: int):
        m, n = shape
        self.rank, self.bits, self.two_phase = min(rank, m, n), bits, two_phase
        g = torch.Generator().manual_seed(seed)
        self.right = torch.randn(n, self.rank, generator=g)  # the last published Q (n × r)
        self.left: torch.Tensor | None = None  # the last published P (m × r)
        self.server = torch.zeros(shape)

    def _published(self, parts: Sequence[torch.Tensor], server_part: torch.Tensor) -> torch.Tensor:
        """What the server publishes: the exact mean of the nodes' quantized factors plus its own, quantized."""
        return quantize_factor(torch.stack(parts).mean(0) + server_part, self.bits)

    def _column_side(self, errors: Sequence[torch.Tensor], basis: torch.Tensor) -> torch.Tensor:
        """Project on the column space ``basis`` (m × r): nodes send ``Mᵀ basis``; returns the step."""
        parts = [quantize_factor(e.T @ basis, self.bits) for e in errors]
        q = self._published(parts, self.server.T @ basis)
        for e, part in zip(errors, parts):
            e -= basis @ part.T
        step = basis @ q.T
        self.server += basis @ torch.stack(parts).mean(0).T - step
        self.right = q
        return step

    def _row_side(self, errors: Sequence[torch.Tensor], basis: torch.Tensor) -> torch.Tensor:
        """Project on the row space ``basis`` (n × r): nodes send ``M basis``; returns the step."""
        parts = [quantize_factor(e @ basis, self.bits) for e in errors]
        p = self._published(parts, self.server @ basis)
        for e, part in zip(errors, parts):
            e -= part @ basis.T
        step = p @ basis.T
        self.server += torch.stack(parts).mean(0) @ basis.T - step
        self.left = p
        return step

    def sync(self, errors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int]:
        m, n = self.server.shape
        if self.two_phase:  # PowerSGD: P = mean M Q (only a basis: nothing applied), then Q = mean Mᵀ orth(P)
            p = self._published([quantize_factor(e @ self.right, self.bits) for e in errors], self.server @ self.right)
            return self._column_side(errors, orthonormal(p)), (m + n) * self.rank * self.bits
        if self.left is None:  # subspace, alternating: the row space of the last Q, then the column space of P
            step = self._row_side(errors, orthonormal(self.right))
            return step, m * self.rank * self.bits
        step = self._column_side(errors, orthonormal(self.left))
        self.left = None
        return step, n * self.rank * self.bits


class _Unpacked:
    """The named parameters as they are (``--support powersgd`` / ``subspace``), in place of ``cv.Packer``."""

    def pack(self, d):
        return dict(d)

    def unpack(self, d):
        return dict(d)


def _apply_outer(anchor: torch.Tensor, step: torch.Tensor, momentum: torch.Tensor, args) -> None:
    """The outer step on the decoded aggregate: ``--outer-lr``, with ``--momentum`` Nesterov's."""
    if args.momentum:
        momentum.mul_(args.momentum).add_(step)
        step = step + args.momentum * momentum
    anchor -= args.outer_lr * step


def _reset_momentum(model, opt, per_step: dict, args) -> None:
    """``--reset-momentum α``: move a node's AdamW first moment toward the one that would have taken the
    published step ``per_step`` (the decoded aggregate over ``H``, in parameter units) under the node's own
    second moment: ``m̂ = u·(√v̂ + ε)/lr``. Every node knows the published step, so this costs no bytes."""
    beta1, beta2 = opt.param_groups[0]["betas"]
    eps, lr = opt.param_groups[0]["eps"], opt.param_groups[0]["lr"]
    for nm, p in model.named_parameters():
        st = opt.state[p]
        t = float(st["step"])
        v_hat = st["exp_avg_sq"] / (1 - beta2**t)
        target = per_step[nm] * (v_hat.sqrt() + eps) / lr * (1 - beta1**t)
        st["exp_avg"].mul_(1 - args.reset_momentum).add_(target, alpha=args.reset_momentum)


def inner_optimizers(model: torch.nn.Module, args) -> list:
    """The optimizers one node steps: AdamW on everything (``--inner adamw``), or the bench's ``+muon`` rows'
    (``--inner muon``: Muon on the weight matrices outside the embeddings and the head, AdamW on the rest)."""
    if args.inner == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)]
    return cv.muon_and_adamw(model, args.lr)


def run_dense(args, task, model, shards, gens) -> dict:
    """``--support dense``: one model, each step the mean of the nodes' losses on their own batches (the
    mean of their gradients, the bench's dense row), stepped by ``--inner``."""
    opts = inner_optimizers(model, args)
    every = max(1, args.steps // 8)
    curve, t0 = [], time.time()
    for step in range(1, args.steps + 1):
        model.zero_grad(set_to_none=True)
        loss = sum(task.loss(model, task.batch(shards[i], gens[i])) for i in range(args.nodes)) / args.nodes
        loss.backward()
        for o in opts:
            o.step()
        if step % every == 0 or step == args.steps:
            curve.append((step, task.held_out_loss(model)))
            print(f"step {step}/{args.steps}: held-out {curve[-1][1]:.4f} ({time.time() - t0:.0f} s)", flush=True)
    return dict(
        vars(args),
        out=str(args.out),
        fraction=1.0,
        ratio_measured=1.0,
        held_out=curve[-1][1],
        curve=curve,
        seconds=time.time() - t0,
    )


def run(args) -> dict:
    torch.set_num_threads(1)
    scale = cv.Scale(**{**asdict(cv.SCALES[False][args.task]), "steps": args.steps})
    task = cv.TASKS[args.task](scale)
    n = args.nodes
    torch.manual_seed(args.seed)
    model = task.build()
    lowrank = args.support in ("powersgd", "subspace")
    # Low rank works on each weight matrix as it is (a stack of matrices is not low rank): no packing.
    packer = _Unpacked() if lowrank else cv.Packer(cv._params(model))
    numel = sum(p.numel() for p in model.parameters())
    shards = task.shards(n)
    gens = [torch.Generator().manual_seed(args.seed * 1000 + 17 + i) for i in range(n)]
    if args.support == "dense":
        return run_dense(args, task, model, shards, gens)
    # Block supports: each node reports 8 bits per block (its error's norm there); the server publishes
    # which blocks sync next (1 bit a block); both counted against the budget, uplink's being the larger.
    report_bits = 8 / args.block if args.support.startswith("blocks") else 0.0
    fraction = (
        1.0
        if args.support in ("all", "powersgd", "subspace")
        else min(1.0, (32 * args.H / args.ratio - report_bits) / args.bits * 0.97)
    )
    if args.support == "topk":  # each sender's own positions, entropy-coded, and the server's likewise
        fraction = topk_fraction(32 * args.H / args.ratio * 0.97, args.bits)
        report_bits = entropy_bits(fraction)
    anchor = {k: v.detach().clone() for k, v in packer.pack(cv._params(model)).items()}
    names = sorted(anchor)
    syncs = {
        nm: LowRankSync(tuple(anchor[nm].shape), args.rank, args.bits, args.support == "powersgd", seed=j)
        for j, nm in enumerate(names)
        if lowrank and anchor[nm].dim() == 2
    }
    value_bits = 1 if lowrank else args.bits  # what the coordinate supports send (low rank: the 1-D tensors)
    nodes = [task.build() for _ in range(n)]
    for m in nodes:
        m.load_state_dict(model.state_dict())
    inner = [inner_optimizers(m, args) for m in nodes]
    errors = [{k: torch.zeros_like(v) for k, v in anchor.items()} for _ in range(n)]
    server = {k: torch.zeros_like(v) for k, v in anchor.items()}
    momentum = {k: torch.zeros_like(v) for k, v in anchor.items()}
    stale_scores: dict[str, torch.Tensor] = {}
    rounds = args.steps // args.H
    every = max(1, rounds // 8)
    curve, bits_sent, t0 = [], 0, time.time()
    for step in range(1, args.steps + 1):
        for i, m in enumerate(nodes):
            m.zero_grad(set_to_none=True)
            task.loss(m, task.batch(shards[i], gens[i])).backward()
            for o in inner[i]:
                o.step()
        if step % args.H:
            continue
        rnd = step // args.H
        current = [packer.pack({nm: p.detach() for nm, p in m.named_parameters()}) for m in nodes]
        before = packer.unpack({k: v.clone() for k, v in anchor.items()}) if args.reset_momentum else None
        for j, nm in enumerate(names):
            for i in range(n):
                if args.node_decay != 1.0:
                    errors[i][nm].mul_(args.node_decay)
                errors[i][nm].add_(anchor[nm] - current[i][nm])
            numel_j = anchor[nm].numel()
            if nm in syncs:
                step_, sent_bits = syncs[nm].sync([e[nm] for e in errors])
                _apply_outer(anchor[nm], step_, momentum[nm], args)
                # the scales: one per factor column, each factor sent (PowerSGD sends two per sync)
                bits_sent += sent_bits + SCALE_BITS * syncs[nm].rank * (2 if syncs[nm].two_phase else 1)
                continue
            if args.support == "blocks-now":  # two phases: the norms of this round's errors, then the values
                idx = block_support(block_scores([e[nm] for e in errors], args.block), fraction, args.block, numel_j)
            elif args.support == "blocks" and nm in stale_scores:  # one phase: last round's residual norms
                idx = block_support(stale_scores[nm], fraction, args.block, numel_j)
            elif args.support == "blocks":  # the first round has no reports yet
                idx = support("random", fraction, rnd, j, numel_j)
            else:
                idx = support(args.support, fraction, rnd, j, numel_j)
            if args.support == "topk":
                total = torch.zeros(numel_j)
                for i in range(n):
                    e = errors[i][nm].reshape(-1)
                    mine = topk_positions(e, fraction)
                    sent = quantize(e[mine], value_bits)
                    e[mine] -= sent
                    total[mine] += sent
                s = server[nm].reshape(-1)
                s += total / n
                idx = topk_positions(s, fraction)
            else:
                total = torch.zeros(idx.numel())
                for i in range(n):
                    e = errors[i][nm].reshape(-1)
                    sent = quantize(e[idx], value_bits)
                    e[idx] -= sent
                    total += sent
                s = server[nm].reshape(-1)
                s[idx] += total / n
            published = quantize(s[idx], value_bits)
            s[idx] -= published
            step_ = torch.zeros(anchor[nm].numel())
            step_[idx] = published
            _apply_outer(anchor[nm], step_.reshape(anchor[nm].shape), momentum[nm], args)
            if args.support == "blocks":
                stale_scores[nm] = block_scores([e[nm] for e in errors], args.block)
            bits_sent += idx.numel() * min(value_bits, 32) + SCALE_BITS + report_bits * numel_j
        new = packer.unpack(anchor)
        with torch.no_grad():
            for m in nodes + [model]:
                for nm, p in m.named_parameters():
                    p.copy_(new[nm])
            if before is not None:
                for m, opts in zip(nodes, inner):
                    _reset_momentum(m, opts[0], {nm: (before[nm] - new[nm]) / args.H for nm in new}, args)
        if rnd % every == 0 or rnd == rounds:
            curve.append((step, task.held_out_loss(model)))
            print(f"step {step}/{args.steps}: held-out {curve[-1][1]:.4f} ({time.time() - t0:.0f} s)", flush=True)
    return dict(
        vars(args),
        out=str(args.out),
        fraction=fraction,
        ratio_measured=32 * numel * rounds * args.H / bits_sent,
        held_out=curve[-1][1],
        curve=curve,
        seconds=time.time() - t0,
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="stdlib", choices=list(cv.TASKS))
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument(
        "--support",
        default="random",
        choices=("dense", "all", "random", "cyclic", "blocks", "blocks-now", "topk", "powersgd", "subspace"),
    )
    ap.add_argument("--rank", type=int, default=1, help="rank of each weight matrix (--support powersgd, subspace)")
    ap.add_argument("--block", type=int, default=256, help="coordinates per block (--support blocks, blocks-now)")
    ap.add_argument("--bits", type=int, default=1, choices=(1, 2, 3, 4, 6, 8, 16, 32))
    ap.add_argument("--ratio", type=float, default=300.0)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument(
        "--inner",
        default="adamw",
        choices=("adamw", "muon"),
        help="the nodes' optimizer (and dense's): AdamW, or Muon on the blocks' matrices and AdamW on the rest",
    )
    ap.add_argument(
        "--node-decay", type=float, default=1.0, help="each node's error buffer decays by this at each sync"
    )
    ap.add_argument(
        "--reset-momentum",
        type=float,
        default=0.0,
        help="at each sync move each node's AdamW first moment this far toward the published step's",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=cv.ROOT / "bench" / "results" / "local_step_screen.jsonl")
    args = ap.parse_args(argv)
    if args.reset_momentum and args.inner != "adamw":
        ap.error("--reset-momentum moves AdamW's first moment: it needs --inner adamw")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"held-out {result['held_out']:.4f} at {result['ratio_measured']:.0f}× each way; appended to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
