"""PowerSGD (id 9): rank-r approximation by one step of power iteration with warm start
(Vogels, Karimireddy, Jaggi 2019; FORMAT.md §5.10).

A tensor is viewed as a matrix ``M`` of ``(shape[0], numel / shape[0])``. With ``Q`` (``cols × r``) kept
from the previous step of the same tensor name (a seeded standard normal at the first step):

    P = M Q;  P̂ = orthogonalize(P);  Q = Mᵀ P̂;  M ≈ P̂ Qᵀ

``P̂`` and ``Q`` go in the frame; ``Q`` is kept for the next step (the warm start that makes one power
step per training step converge to the leading subspace). Vectors and biases (``ndim <= 1``) go
uncompressed, as a dense section of the same record, and so do matrices whose factors would not be
strictly smaller: factors only when ``(rows + cols) · r · min_compression < rows · cols``. The paper runs
PowerSGD with error feedback: ``ErrorFeedback(PowerSGD(...))``.

The compress-or-not rule, the draw of the first ``Q`` and the orthogonalization are
:mod:`gradwire.lowrank`'s, shared with the collective hook (:mod:`gradwire.torch.powersgd`). The first
``Q`` of a tensor is drawn from ``seed`` and the CRC-32 of its name (:func:`gradwire.lowrank.name_seed`),
so a codec needs no random state. The steps are exposed as functions: :func:`powersgd_p`,
:func:`powersgd_q`, :func:`powersgd_decompress`, with :func:`matrix_view` and :func:`first_q`.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import torch

from ..capabilities import CodecCapabilities, declare
from ..frame import Entry
from ..lowrank import compressible, initial_q, name_seed, orthogonalize_
from . import record as rec
from . import statedict as sd
from .base import Codec

__all__ = [
    "PowerSGD",
    "first_q",
    "matrix_view",
    "powersgd_decompress",
    "powersgd_p",
    "powersgd_q",
]

_CODEC = "powersgd"
_PARAMS = struct.Struct("<BI")  # mode, rank
MODE_DENSE = 0
MODE_FACTORS = 1


def matrix_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the matrix ``(shape[0], numel / shape[0])`` (a column for ``ndim <= 1``), float32."""
    rows, cols = rec.matrix_shape(tensor.shape)
    return tensor.detach().reshape(rows, cols).to(torch.float32)


def first_q(name: str, cols: int, rank: int, seed: int = 0, device=None) -> torch.Tensor:
    """The first ``Q`` (``cols × rank``, i.i.d. standard normal) of tensor ``name``, the same on every
    worker and device: drawn on the CPU from ``seed`` and the CRC-32 of the name."""
    return initial_q(cols, rank, torch.Generator().manual_seed(name_seed(name, seed)), device=device)


def powersgd_p(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """First half: ``P = M Q`` (all-reduce-mean ``P`` here in the collective version)."""
    return m @ q


def powersgd_q(m: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
    """Second half: ``Q = Mᵀ P̂`` (all-reduce-mean ``Q`` here in the collective version)."""
    return m.T @ p_hat


def powersgd_decompress(p_hat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``P̂ Qᵀ``. Encoder and decoder both call exactly this."""
    return p_hat.to(torch.float32) @ q.to(torch.float32).T


class PowerSGD(Codec):
    """Rank-``rank`` PowerSGD with warm start; factors in ``factor_dtype`` (f32, f16 or bf16).

    Costs ``r·(rows + cols)·size(factor_dtype)`` bytes for a compressed matrix, ``4·numel`` for the rest.
    Keeps one ``Q`` per tensor name: :meth:`state_dict` / :meth:`load_state_dict` / :meth:`reset`.
    """

    codec_id = 9
    name = "powersgd"

    def __init__(
        self,
        rank: int = 2,
        min_compression: float = 2.0,
        seed: int = 0,
        *,
        factor_dtype: torch.dtype = torch.float32,
    ):
        rank = int(rank)
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        min_compression = float(min_compression)
        if not min_compression >= 1.0:
            raise ValueError(f"min_compression must be >= 1, got {min_compression}")
        if factor_dtype not in rec.VALUE_DTYPES:
            raise ValueError(f"factor_dtype must be float32, float16 or bfloat16, got {factor_dtype}")
        self.rank = rank
        self.min_compression = min_compression
        self.seed = int(seed)
        self.factor_dtype = factor_dtype
        self._q: dict[str, torch.Tensor] = {}

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        if not compressible(tensor.shape, self.rank, self.min_compression):
            return self._dense(tensor, name)
        m = matrix_view(tensor)
        rows, cols = m.shape
        r = min(self.rank, rows, cols)
        q = self._q.get(name)
        if q is None or tuple(q.shape) != (cols, r):
            q = first_q(name, cols, r, self.seed, m.device)
        q = q.to(m.device)
        p_hat = orthogonalize_(powersgd_p(m, q))
        q_new = powersgd_q(m, p_hat)
        # Row-major copies: the receiver multiplies row-major factors, and so must the sender (QR may
        # return column-major storage, and a matmul's rounding can depend on the layout).
        p_sent = p_hat.to(self.factor_dtype).contiguous()
        q_sent = q_new.to(self.factor_dtype).contiguous()
        if not (bool(torch.isfinite(p_sent).all()) and bool(torch.isfinite(q_sent).all())):
            raise ValueError(f"tensor {name!r} holds non-finite values (or factors too large for {self.factor_dtype})")
        if bool((q_new.norm(dim=0) > 0).all()):
            # A zero column would stay zero forever (P = M Q); keep the old Q for such a step.
            self._q[name] = q_new
        else:
            self._q.setdefault(name, q)
        recon = powersgd_decompress(p_sent, q_sent).reshape(tensor.shape).to(tensor.dtype)
        p_payload, p_elem = rec.values_payload(p_sent)
        q_payload, q_elem = rec.values_payload(q_sent)
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            params=_PARAMS.pack(MODE_FACTORS, r),
            sections={"p": p_payload, "q": q_payload},
            section_elems={"p": p_elem, "q": q_elem},
        )
        return entry, recon

    def _dense(self, tensor: torch.Tensor, name: str) -> tuple[Entry, torch.Tensor]:
        sent = tensor.detach().to(torch.float32)
        if sent.numel() and not bool(torch.isfinite(sent).all()):
            raise ValueError(f"tensor {name!r} holds non-finite values")
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            params=_PARAMS.pack(MODE_DENSE, 0),
            sections={"data": sent.reshape(-1).cpu().numpy()},
        )
        return entry, sent.to(tensor.dtype)

    # -- warm-start state ------------------------------------------------------------------------

    def q(self, name: str = "") -> torch.Tensor | None:
        """The ``Q`` kept for ``name`` (the next step's warm start), or ``None``."""
        return self._q.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget every kept ``Q``, or only ``name``'s."""
        if name is None:
            self._q.clear()
        else:
            self._q.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        """``{"q": {name: Q}}``: each tensor's warm-start ``Q`` (float32, ``cols × r``). The first ``Q`` of a
        name is drawn from ``seed`` and the name, so there is no random state to keep."""
        return {"q": {n: q.detach().clone().contiguous() for n, q in self._q.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        s = sd.fields(state, "PowerSGD state", ("q",))
        new = {}
        for n, q in sd.mapping(s["q"], "PowerSGD state 'q'").items():
            q = sd.tensor(q, f"PowerSGD state Q of {n!r}", floating=True, ndim=2)
            if not 1 <= q.shape[1] <= self.rank:
                raise ValueError(f"PowerSGD state Q of {n!r} must have 1..rank = {self.rank} columns, got {q.shape[1]}")
            new[n] = q.detach().to(torch.float32).clone()
        self._q = new

    def __repr__(self) -> str:
        extra = "" if self.factor_dtype == torch.float32 else f", factor_dtype={self.factor_dtype}"
        return f"PowerSGD(rank={self.rank}, min_compression={self.min_compression}, seed={self.seed}{extra})"


def unpack_params(params: bytes) -> dict:
    """A record's parameters as a dict (layout only; the decoder checks ranges)."""
    mode, rank = _PARAMS.unpack(params)
    return dict(mode=mode, rank=rank)


def _decode_powersgd(entry: Entry, device: torch.device | None) -> torch.Tensor:
    rec.check_record_dtype(entry, _CODEC)
    mode, rank = rec.params(entry, _CODEC, _PARAMS, "u8 mode, u32 rank")
    dev = torch.device("cpu") if device is None else torch.device(device)
    if mode == MODE_DENSE:
        if rank != 0:
            raise rec.bad(entry, _CODEC, f"rank must be 0 in mode 0 (dense), got {rank}")
        rec.expect_sections(entry, _CODEC, ("data",))
        data = rec.float_section(entry, _CODEC, "data", entry.numel, "numel", allowed=(torch.float32,))
        return data.to(dev).reshape(entry.shape).to(entry.dtype)
    if mode != MODE_FACTORS:
        raise rec.bad(entry, _CODEC, f"mode must be 0 (dense) or 1 (factors), got {mode}")
    if len(entry.shape) < 2:
        raise rec.bad(entry, _CODEC, f"mode 1 (factors) needs ndim >= 2, got shape {tuple(entry.shape)}")
    rows, cols = rec.matrix_shape(entry.shape)
    if not 1 <= rank <= min(rows, cols):
        raise rec.bad(entry, _CODEC, f"rank must lie in 1..min(rows, cols) = {min(rows, cols)}, got {rank}")
    rec.expect_sections(entry, _CODEC, ("p", "q"))
    p = rec.float_section(entry, _CODEC, "p", rows * rank, "shape[0] * rank")
    q = rec.float_section(entry, _CODEC, "q", cols * rank, "(numel / shape[0]) * rank")
    if p.dtype != q.dtype:
        raise rec.bad(entry, _CODEC, f"sections 'p' and 'q' must share an element type, got {p.dtype} and {q.dtype}")
    out = powersgd_decompress(p.reshape(rows, rank).to(dev), q.reshape(cols, rank).to(dev))
    return out.reshape(entry.shape).to(entry.dtype)


def _powersgd_setting(entry: Entry) -> dict:
    p = unpack_params(entry.params)
    return {"codec": "powersgd", "rank": p["rank"], "dense": p["mode"] == MODE_DENSE}


CAPABILITIES = declare(
    CodecCapabilities(PowerSGD.codec_id, "powersgd", decode=_decode_powersgd, setting=_powersgd_setting)
)
