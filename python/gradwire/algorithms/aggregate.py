"""The aggregation side shared by every algorithm: the bit-exact mean of the senders' records.

Why it is exact everywhere: each record is decoded with :func:`gradwire.decode_entry`, whose DCT decode
computes its inverse transform in integers held exactly in float64 (``gradwire.dct.decode_levels``) and
rounds only elementwise at the end, so a record decodes to the same float32 bits on any thread count,
BLAS or device. The decoded tensors are then combined by a fixed sequence of elementwise float32
operations — ``t_i * w_i`` (one correctly rounded multiply by the weight rounded to float32) and
``acc + t_i`` (one correctly rounded add), in the given sender order — with no reduction whose order a
library may choose, no fused multiply-add and no atomics. IEEE 754 fixes the result of each such
operation, so every process that runs :func:`exact_mean` on the same records gets the same bits.

(The transform-domain sum of :class:`gradwire.codecs.dct.DCTAccumulator` is faster but ends in one
float32 inverse transform, a matrix product whose rounding follows the BLAS and thread count: it is not
used here.)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..frame import Entry, decode_entry

__all__ = ["exact_mean"]


def exact_mean(
    records: Sequence[Sequence[Entry]],
    weights: Optional[Sequence[float]] = None,
    device=None,
) -> dict[str, torch.Tensor]:
    """``{name: Σ_i w_i · decode(records[i][name])}`` in float32, bit-identical wherever it runs.

    ``records[i]`` holds sender ``i``'s records, one per tensor name, the same names (and shapes) for
    every sender; ``weights`` defaults to ``1/n`` for ``n`` senders. Each weight is rounded to float32;
    the sum runs elementwise in the given sender order (``acc = t_0·w_0``, then ``acc = acc + t_i·w_i``).
    The result is keyed in the first sender's record order, on ``device`` (default: the CPU).
    ``ValueError`` if senders disagree on names or shapes, a sender repeats a name, or there are none.
    """
    n = len(records)
    if n == 0:
        raise ValueError("exact_mean needs at least one sender's records")
    if weights is None:
        weights = [1.0 / n] * n
    elif len(weights) != n:
        raise ValueError(f"got {len(weights)} weights for {n} senders")
    dev = torch.device("cpu") if device is None else torch.device(device)

    layout: dict[str, tuple[int, ...]] = {}
    for e in records[0]:
        if e.name in layout:
            raise ValueError(f"sender 0 sent tensor {e.name!r} twice")
        layout[e.name] = tuple(e.shape)
    per_sender: list[dict[str, Entry]] = []
    for i, recs in enumerate(records):
        mine: dict[str, Entry] = {}
        for e in recs:
            if e.name in mine:
                raise ValueError(f"sender {i} sent tensor {e.name!r} twice")
            mine[e.name] = e
        if set(mine) != set(layout):
            missing = sorted(set(layout) - set(mine))[:5]
            extra = sorted(set(mine) - set(layout))[:5]
            raise ValueError(f"sender {i} disagrees with sender 0 on the tensor names (missing {missing}, extra {extra})")
        for name, e in mine.items():
            if tuple(e.shape) != layout[name]:
                raise ValueError(
                    f"sender {i} sent {name!r} with shape {tuple(e.shape)}, sender 0 with {layout[name]}"
                )
        per_sender.append(mine)

    # Python floats rounded to float32 once, so every device multiplies by the same number.
    w32 = [float(torch.tensor(float(w), dtype=torch.float32)) for w in weights]
    out: dict[str, torch.Tensor] = {}
    for name in layout:
        acc: Optional[torch.Tensor] = None
        for mine, w in zip(per_sender, w32):
            t = decode_entry(mine[name], dev).to(torch.float32)
            t = torch.mul(t, w)
            acc = t if acc is None else torch.add(acc, t)
        out[name] = acc
    return out
