"""SparseLoCo (sparse, quantized DiLoCo): the node side and the outer step.

Between syncs each node trains alone with its inner optimizer. At a sync it forms the pseudo-gradient
``anchor − current`` (the weights at the last sync minus now), adds it to a decaying error buffer
(``e = error_decay · e + pg``), sends the compressed buffer (top-k DCT, 2-bit values) and keeps the rest
(``e −= reconstruction``). Every node averages the senders' records
(:func:`gradwire.algorithms.exact_mean`) and applies :class:`OuterStep` to the anchor; the new anchor is
everyone's new weights.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, MutableMapping, Optional

import torch

from ..codecs import statedict as sd
from ..codecs.base import Codec
from ..codecs.dct import DCTCodec
from ..frame import Entry
from ._state import load_tensors, save_tensors, send_and_keep_rest, take_back

__all__ = ["OuterStep", "SparseLoCoState", "default_sparseloco_codec"]

#: The largest per-chunk budget of the default codec (SparseLoCo's own: 64 of each 64×64 chunk's 4096).
DEFAULT_TOPK = 64
#: The ratio the default codec aims for (fp32 bytes per local step over frame bytes per local step),
#: with a margin over the 300× it promises.
_TARGET_RATIO = 330.0
_TILE = 64 * 64


def _estimated_chunk_bytes(k: int, value_bits: int = 2) -> float:
    """Bytes one 64×64 chunk of ``k`` kept coefficients takes: Rice-coded positions (within 3 % of the
    ``log2(C choose k)`` floor), the packed values, a float32 scale and minimum."""
    floor_bits = (math.lgamma(_TILE + 1) - math.lgamma(k + 1) - math.lgamma(_TILE - k + 1)) / math.log(2)
    return 1.03 * floor_bits / 8 + k * value_bits / 8 + 8


def default_sparseloco_codec(sync_every: int = 32) -> Codec:
    """SparseLoCo's default codec for syncs every ``sync_every`` local steps: DCT on 64×64 tiles (flat
    64×64 chunks where tiles would be small), 2-bit values, positions Rice-coded (or packed, if smaller).

    The per-chunk budget ``k`` is the largest of 64, 32, 16, … whose estimated bytes per sync, spread over
    ``sync_every`` local steps, stay ≥ 330× below fp32 on 64×64 tiles: 64 (SparseLoCo's own choice) for
    ``sync_every >= 2``, 16 for ``sync_every == 1``. Measured on a 1024×1024 weight in
    tests/test_algorithms.py.
    """
    sync_every = int(sync_every)
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    k = DEFAULT_TOPK
    while k > 1 and 4 * _TILE * sync_every / _estimated_chunk_bytes(k) < _TARGET_RATIO:
        k //= 2
    return DCTCodec(chunk_shape=(64, 64), topk=k, mode="tiles", index_coding="auto", value_bits=2)


class SparseLoCoState:
    """SparseLoCo's node side: one float32 error buffer per tensor name, the codec, ``error_decay``."""

    def __init__(self, codec: Optional[Codec] = None, *, error_decay: float = 0.95):
        error_decay = float(error_decay)
        if not 0.0 <= error_decay <= 1.0:
            raise ValueError(f"error_decay must lie in [0, 1], got {error_decay}")
        self.codec = codec if codec is not None else default_sparseloco_codec()
        self.error_decay = error_decay
        self.errors: dict[str, torch.Tensor] = {}

    def compress(self, anchor: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> list[Entry]:
        """``pg = anchor − current``; ``e = error_decay·e + pg``; the codec compresses every buffer (one
        ``compress_bundle`` in sorted name order); ``e −= reconstruction``. Records in sorted name order."""
        names = sorted(anchor)
        if set(current) != set(anchor):
            raise ValueError("anchor and current must name the same tensors")
        for n in names:
            a, c = anchor[n], current[n]
            if tuple(a.shape) != tuple(c.shape):
                raise ValueError(f"{n!r}: anchor has shape {tuple(a.shape)}, current {tuple(c.shape)}")
            pg = torch.sub(a.detach().to(torch.float32), c.detach().to(device=a.device, dtype=torch.float32))
            e = self.errors.get(n)
            if e is None:
                e = pg
            else:
                if tuple(e.shape) != tuple(pg.shape):
                    raise ValueError(f"{n!r} has shape {tuple(pg.shape)}, its error buffer {tuple(e.shape)}")
                e = torch.add(torch.mul(e.to(pg.device), self.error_decay), pg)
            self.errors[n] = e
        return send_and_keep_rest(self.codec, self.errors, names)

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        """Add back what a frame made by :meth:`compress` carried (decoded), when it never counted."""
        take_back(self.errors, sent)

    def state_dict(self) -> dict[str, Any]:
        """``{"errors": {name: float32 tensor}, "codec": codec.state_dict()}`` (copies)."""
        return {"errors": save_tensors(self.errors), "codec": self.codec.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = sd.fields(state, "SparseLoCoState state", ("errors", "codec"))
        errors = load_tensors(state["errors"], "error buffer")
        self.codec.load_state_dict(state["codec"])
        self.errors = errors

    def __repr__(self) -> str:
        return f"SparseLoCoState({self.codec!r}, error_decay={self.error_decay}, errors={len(self.errors)})"


class OuterStep:
    """The outer optimizer, the same on every node and on the server: SGD on the anchor with the mean
    pseudo-gradient as its gradient.

    - plain (``momentum=0``): ``anchor −= outer_lr · delta``;
    - with ``momentum`` μ (torch's SGD, no dampening): ``b = μ·b + delta`` (``b = delta`` at the first
      step), then ``anchor −= outer_lr · b``, or with ``nesterov`` ``anchor −= outer_lr · (delta + μ·b)``.

    DiLoCo's recipe is Nesterov momentum 0.9 with outer learning rate 0.7
    (``OuterStep(outer_lr=0.7, momentum=0.9, nesterov=True)``). Every operation is one elementwise,
    once-rounded multiply or add, so the same deltas give the same anchors on every device.
    """

    def __init__(self, outer_lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False):
        outer_lr, momentum = float(outer_lr), float(momentum)
        if not outer_lr > 0.0 or not math.isfinite(outer_lr):
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
        if nesterov and momentum == 0.0:
            raise ValueError("nesterov needs a momentum > 0")
        self.outer_lr = outer_lr
        self.momentum = momentum
        self.nesterov = bool(nesterov)
        self.buffers: dict[str, torch.Tensor] = {}

    def apply(self, anchor: MutableMapping[str, torch.Tensor], mean_delta: Mapping[str, torch.Tensor]) -> None:
        """Step ``anchor`` (the last synced weights, updated in place) by ``mean_delta``, in sorted name order."""
        missing = sorted(set(anchor) - set(mean_delta))
        if missing:
            raise ValueError(f"no mean delta for {missing[:5]}")
        with torch.no_grad():
            for n in sorted(anchor):
                a = anchor[n]
                d = mean_delta[n]
                if tuple(d.shape) != tuple(a.shape):
                    raise ValueError(f"mean delta {n!r} has shape {tuple(d.shape)}, the anchor {tuple(a.shape)}")
                d = d.to(device=a.device, dtype=torch.float32)
                if self.momentum:
                    b = self.buffers.get(n)
                    b = d.clone() if b is None else torch.add(torch.mul(b.to(a.device), self.momentum), d)
                    self.buffers[n] = b
                    step = torch.add(d, torch.mul(b, self.momentum)) if self.nesterov else b
                else:
                    step = d
                a.sub_(torch.mul(step, self.outer_lr).to(a.dtype))

    def state_dict(self) -> dict[str, Any]:
        """``{"buffers": {name: float32 momentum buffer}}`` (empty without momentum)."""
        return {"buffers": save_tensors(self.buffers)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = sd.fields(state, "OuterStep state", ("buffers",))
        self.buffers = load_tensors(state["buffers"], "outer momentum buffer")

    def __repr__(self) -> str:
        return f"OuterStep(outer_lr={self.outer_lr}, momentum={self.momentum}, nesterov={self.nesterov})"
