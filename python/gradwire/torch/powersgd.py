"""PowerSGD in its collective form, as a DDP communication hook (Vogels et al., 2019).

Each gradient matrix ``M`` (a parameter's gradient viewed as ``(shape[0], -1)``) is approximated at
rank ``r`` by one step of subspace iteration whose two halves are all-reduced: ``P = M Q``, all-reduce
``P``, orthogonalize it, ``Q = Mᵀ P̂``, all-reduce ``Q`` (mean), and ``M ≈ P̂ Qᵀ``. ``Q`` is kept for the
next step (warm start) and what the approximation missed is added to the next step's gradient (error
feedback). Vectors, and matrices whose factors would not be ``min_compression_rate`` times smaller than
they are, are averaged uncompressed. The arithmetic follows torch's own ``powerSGD_hook`` step by step
(same orthogonalization, same seeded draw of the first ``Q``, same compress-or-not rule: all three from
:mod:`gradwire.lowrank`, which the frame codec ``gradwire.PowerSGD`` uses too), so the two train alike.

Where it differs, by design:

- State (residuals, ``Q``) is kept per *parameter*, not per bucket index, so DDP's bucket rebuild after
  the first iteration cannot misalign it and compression may start at iteration 0 (torch's needs
  ``start_powerSGD_iter >= 2``).
- The uncompressed tensors travel in the same all-reduce as the ``P`` factors: two collectives per
  bucket instead of three.
- Residuals are kept for compressed matrices only. For a tensor averaged exactly, torch's residual is
  the rank's deviation from the mean, whose mean over ranks is zero: it changes no averaged gradient.

Every rank ends with the same gradients: the all-reduced factors are identical everywhere and the
rest is deterministic arithmetic on them.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against the real types.

import numpy as np
import torch
import torch.distributed as dist

from ..lowrank import compressible, initial_q, orthogonalize_

__all__ = ["PowerSGDState", "powersgd_hook"]


class PowerSGDState:
    """Hyperparameters and per-parameter state of :func:`powersgd_hook`.

    ``rank`` is the approximation rank r. The first ``start_iter`` iterations are averaged
    uncompressed (a dense warm-up often helps accuracy; 0 compresses from the start).
    ``bytes_sent`` counts the elements this rank puts into all-reduces, in bytes of the gradients'
    dtype; ``dense_bytes`` what the buckets weigh uncompressed; ``iter`` finished iterations.
    """

    def __init__(
        self,
        rank: int = 1,
        *,
        process_group: dist.ProcessGroup | None = None,
        warm_start: bool = True,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
    ):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        self.process_group = process_group
        self.rank = int(rank)
        self.warm_start = warm_start
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = use_error_feedback
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        # One seed per fresh draw of Q factors, the same sequence on every rank (as torch does).
        self._rng = np.random.RandomState(seed)
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.bytes_sent = 0
        self.dense_bytes = 0

    def bytes_per_step(self) -> float:
        """Mean bytes this rank put into the all-reduces per finished iteration."""
        return self.bytes_sent / max(1, self.iter)

    def compression_ratio(self) -> float:
        return self.dense_bytes / max(1, self.bytes_sent)

    def parameter_error(self, param: torch.Tensor) -> torch.Tensor | None:
        """The error-feedback residual held for ``param`` (as its matrix view), or ``None``."""
        return self.errors.get(id(param))

    def __repr__(self) -> str:
        return (
            f"PowerSGDState(rank={self.rank}, start_iter={self.start_iter}, warm_start={self.warm_start},"
            f" use_error_feedback={self.use_error_feedback}, iter={self.iter})"
        )


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket across ranks with rank-r PowerSGD (see the module docstring)."""
    group = state.process_group
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    elem = buf.element_size()
    state.dense_bytes += buf.numel() * elem

    if state.iter < state.start_iter:
        buf.div_(world)
        dist.all_reduce(buf, group=group)
        state.bytes_sent += buf.numel() * elem
        if bucket.is_last():
            state.iter += 1
        return _done(buf)

    # Split the bucket into matrices worth compressing and tensors sent as they are.
    plain: list[torch.Tensor] = []
    by_shape: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        if compressible(grad.shape, state.rank, state.min_compression_rate):
            m = grad.view(grad.shape[0], -1)
            by_shape.setdefault(tuple(m.shape), []).append((id(param), m))
        else:
            plain.append(grad)
    # Matrices grouped by shape in order of first appearance: the order torch draws its Q factors in.
    matrices = [item for group_items in by_shape.values() for item in group_items]

    originals = []
    if state.use_error_feedback:
        for key, m in matrices:
            err = state.errors.get(key)
            if err is not None:
                m.add_(err)
        originals = [m.clone() for _, m in matrices]

    qs = _initial_qs(state, matrices, buf)
    ps = [m @ q for (_, m), q in zip(matrices, qs)]

    # One all-reduce for the uncompressed tensors and every P (P's scale is undone by orthogonalizing).
    first = torch.cat([g.reshape(-1) for g in plain] + [p.reshape(-1) for p in ps]) if (plain or ps) else buf[:0]
    dist.all_reduce(first, group=group)
    offset = 0
    if plain:
        n_plain = sum(g.numel() for g in plain)
        first[:n_plain].div_(world)
        for g in plain:
            g.copy_(first[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    for i, p in enumerate(ps):
        ps[i] = orthogonalize_(first[offset : offset + p.numel()].view_as(p), state.orthogonalization_epsilon)
        offset += p.numel()

    new_qs = [m.t() @ p for (_, m), p in zip(matrices, ps)]
    second = torch.cat([q.reshape(-1) for q in new_qs]) if new_qs else buf[:0]
    if new_qs:
        dist.all_reduce(second, group=group)
        second.div_(world)
    offset = 0
    for i, ((key, m), p, q) in enumerate(zip(matrices, ps, new_qs)):
        q_avg = second[offset : offset + q.numel()].view_as(q)
        offset += q.numel()
        torch.matmul(p, q_avg.t(), out=m)
        if state.use_error_feedback:
            state.errors[key] = originals[i] - m
        if state.warm_start:
            state.qs[key] = q_avg.clone()

    state.bytes_sent += (first.numel() + second.numel()) * elem
    if bucket.is_last():
        state.iter += 1
    return _done(buf)


def _initial_qs(
    state: PowerSGDState, matrices: list[tuple[int, torch.Tensor]], buf: torch.Tensor
) -> list[torch.Tensor]:
    """Each matrix's Q: last step's (warm start), else a seeded normal draw, orthogonalized."""
    fresh = [not state.warm_start or key not in state.qs for key, _ in matrices]
    generator = None
    if any(fresh):
        generator = torch.Generator().manual_seed(int(state._rng.randint(1_000_000_000)))
    qs = []
    for (key, m), draw in zip(matrices, fresh):
        r = min(m.shape[0], m.shape[1], state.rank)
        if draw:
            # Drawn on the host with a seeded generator, so every rank and device gets the same Q.
            q = initial_q(m.shape[1], r, generator, dtype=buf.dtype, device=buf.device)
        else:
            q = state.qs[key]
        qs.append(orthogonalize_(q, state.orthogonalization_epsilon))
    return qs
