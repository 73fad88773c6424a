"""GComp (id 3): near-lossless gradient compression (Li et al., SoCC'24; FORMAT.md §5.4).

Each float is split into sign, exponent and mantissa:

- **Exponents** (the biased 8-bit exponent; zero and denormals count as 0) are Huffman-coded with a
  code-length cap: a code that would be longer than the cap is replaced by an escape code followed by
  the raw exponent, and decoding looks up the next ``cap`` bits in a table (Rust, FORMAT.md §6.4). The
  codebook is built from the exponents observed for each tensor name and rebuilt every
  ``rebuild_every`` steps; a frame carries its book only when the book changed (``carry_book="changed"``)
  or always (``carry_book="always"``, for receivers that keep no state).
- **Zero pruning**: a zero (or denormal) gradient costs only its exponent code; it sends no sign and no
  mantissa.
- **Multi-level mantissa truncation**: blocks of ``block`` elements keep all of the 23 mantissa bits
  or drop the low 6, 12 or 18 (bf16 tensors: 0, 2, 4 or 6 of 7), a 2-bit level per block. The level
  comes from the quantization metric δ of the paper's Table 2 for the optimizer in use (SGD, momentum,
  Nesterov, AdaGrad, RMSProp, Adam, AdamW): δ is the ratio of what the parameter becomes without this
  gradient to what the gradient adds to it, so dropping ``d`` of ``W`` mantissa bits moves the updated
  parameter by at most ``2^(d − W) / |δ|`` of itself. A block takes the largest drop with
  ``|δ| ≥ 2^(d − W + p − tolerance_bits)`` for every nonzero element, ``p`` the parameter's precision
  (24 bits for float32): at ``tolerance_bits=0`` the change stays below half a unit in the last place of
  every parameter, which therefore rarely changes at all. Decoding puts the dropped bits back at the
  middle of their range (``1`` then zeros), halving the worst error of plain truncation.

The codec needs the parameter and its optimizer state to compute δ: pass them to :meth:`GComp.compress`
(``param=``, ``state=``), or :meth:`GComp.bind` the model's named parameters and optimizer once
(:meth:`GComp.from_optimizer` also reads the optimizer's hyperparameters), after which
``ErrorFeedback``, ``encode_bundle`` and every other caller of ``compress(tensor, name)`` get them by
name. Without a parameter every block keeps its full mantissa (``fixed_level`` forces one level
everywhere instead).

Receivers: ``gradwire.decode`` decodes a frame that carries its book; :class:`GCompDecoderState` keeps
the last book of each (sender, tensor name) stream and decodes frames that only name it.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import wire
from ..capabilities import CodecCapabilities, declare
from ..frame import Entry, Frame, decode_entry, read_frame
from ..wire import BytesLike
from . import record as rec
from . import statedict as sd
from .base import Codec

__all__ = [
    "DROPS",
    "GComp",
    "GCompDecoderState",
    "OPTIMIZERS",
    "block_levels",
    "level_thresholds",
    "quantization_metric",
    "unpack_params",
]

_CODEC = "gcomp"
_PARAMS = struct.Struct("<BII")  # format, block, book_id
FORMAT_F32 = 0
FORMAT_BF16 = 1
#: Mantissa bits of each format, and the bits each of the four levels drops.
MANTISSA_BITS = {FORMAT_F32: 23, FORMAT_BF16: 7}
DROPS = {FORMAT_F32: (0, 6, 12, 18), FORMAT_BF16: (0, 2, 4, 6)}
#: The optimizers of the paper's Table 2.
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam", "adamw")
#: Significand bits of a parameter of each dtype (half an ulp is 2^-p of its value).
_PARAM_PRECISION = {torch.float32: 24, torch.float64: 53, torch.float16: 11, torch.bfloat16: 8}
_CARRY = ("changed", "always")


# ---------------------------------------------------------------------------------------------
# The quantization metric (paper, Table 2)


@dataclass(frozen=True)
class OptimizerConfig:
    """The hyperparameters δ needs; field names follow torch.optim."""

    kind: str
    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    alpha: float = 0.99
    lr_decay: float = 0.0


def _state_tensor(state: Mapping, key: str, like: torch.Tensor) -> torch.Tensor:
    t = state.get(key) if state else None
    if t is None:
        return torch.zeros_like(like)
    return t.detach().to(device=like.device, dtype=like.dtype)


def _step(state: Mapping) -> int:
    """The step about to be taken (1 for the first): torch keeps the count of steps done."""
    s = state.get("step", 0) if state else 0
    return int(s.item() if isinstance(s, torch.Tensor) else s) + 1


def quantization_metric(
    grad: torch.Tensor, param: torch.Tensor, state: Mapping | None, opt: OptimizerConfig
) -> torch.Tensor:
    """δ of the paper's Table 2 for each element (float64, on ``grad``'s device).

    ``state`` is the optimizer's state of ``param`` *before* this step (torch.optim names:
    ``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``sum``, ``square_avg``, ``step``); missing
    entries are zeros, as before a first step. Elements with a zero gradient give ±inf or NaN.
    """
    g = grad.detach().to(torch.float64)
    th = param.detach().to(device=g.device, dtype=torch.float64)
    eta, lam = opt.lr, opt.weight_decay
    k = opt.kind
    with torch.no_grad():
        if k == "sgd":
            return th / (eta * g) - lam * th / g
        if k == "momentum":
            b = _state_tensor(state, "momentum_buffer", th)
            return (th - eta * opt.momentum * b) / (eta * (1 - opt.dampening) * g) - lam * th / g
        if k == "nesterov":
            b = _state_tensor(state, "momentum_buffer", th)
            mu = opt.momentum
            return ((1 - eta * lam * (1 + mu)) * th - eta * mu * mu * b) / (eta * (1 + mu) * g)
        if k == "adagrad":
            t = _step(state)
            eta_t = eta / (1 + (t - 1) * opt.lr_decay)
            r = _state_tensor(state, "sum", th) + (g + lam * th) ** 2
            return th * (r.sqrt() + opt.eps) / (eta_t * g) - lam * th / g
        if k == "rmsprop":
            v = opt.alpha * _state_tensor(state, "square_avg", th) + (1 - opt.alpha) * (g + lam * th) ** 2
            return th * (v.sqrt() + opt.eps) / (eta * g) - lam * th / g
        b1, b2 = opt.betas
        t = _step(state)
        m = _state_tensor(state, "exp_avg", th)
        if k == "adam":
            v = b2 * _state_tensor(state, "exp_avg_sq", th) + (1 - b2) * (g + lam * th) ** 2
            return (th * (v.sqrt() + opt.eps) * (1 - b1**t) - eta * b1 * m) / (eta * (1 - b1) * g) - lam * th / g
        if k == "adamw":
            v = b2 * _state_tensor(state, "exp_avg_sq", th) + (1 - b2) * g**2
            return (th * (v.sqrt() + opt.eps) * (1 - b1**t) * (1 - eta * lam) - eta * b1 * m) / (eta * (1 - b1) * g)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {k!r}")


def level_thresholds(fmt: int, param_precision: int, tolerance_bits: float = 0.0) -> tuple[float, float, float]:
    """The smallest ``|δ|`` each of levels 1–3 needs: ``2^(drop_l − W + p − tolerance)``."""
    w = MANTISSA_BITS[fmt]
    return tuple(2.0 ** (d - w + param_precision - tolerance_bits) for d in DROPS[fmt][1:])


_thresholds = functools.lru_cache(maxsize=64)(level_thresholds)


def block_levels(
    delta: torch.Tensor,
    nonzero: torch.Tensor,
    block: int,
    fmt: int,
    param_precision: int,
    tolerance_bits: float = 0.0,
) -> torch.Tensor:
    """Per block, the largest level ``l`` with ``|δ| ≥ 2^(drop_l − W + p − tolerance)`` for all its
    nonzero elements (int64, on ``delta``'s device). NaN δ allows level 0 only; a block of zeros gets 3.

    The Rust kernel ``wire.gcomp_block_levels`` computes the same levels from the gradient, the
    parameter and the optimizer state on the CPU; this is the one for other devices and dtypes."""
    n = delta.numel()
    nb = -(-n // block)
    mag = torch.nan_to_num(delta.abs().reshape(-1), nan=0.0)
    mag = torch.where(nonzero.reshape(-1), mag, torch.full_like(mag, math.inf))
    padded = torch.full((nb * block,), math.inf, dtype=mag.dtype, device=mag.device)
    padded[:n] = mag
    worst = padded.view(nb, block).amin(dim=1)
    level = torch.zeros(nb, dtype=torch.int64, device=mag.device)
    for lv, threshold in enumerate(level_thresholds(fmt, param_precision, tolerance_bits), start=1):
        level = torch.where(worst >= threshold, lv, level)
    return level


def _native_metric(
    x: torch.Tensor, param: torch.Tensor, state: Mapping | None, opt: OptimizerConfig
) -> tuple[str, list, dict] | None:
    """``(kind, [param, first, second], scalars)`` for ``wire.gcomp_block_levels`` when the Rust
    kernel computes exactly what :func:`quantization_metric` would: every operand on the CPU and
    exactly representable in float32 (f32, f16, bf16). None otherwise."""
    if not x.is_cpu or x.dtype not in _EXACT_IN_F32:
        return None
    operands = [None, None, None]
    for i, t in enumerate((param, *(state.get(k) if state else None for k in _STATE_KEYS[opt.kind]))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_cpu or t.dtype not in _EXACT_IN_F32:
            return None
        if t.numel() != x.numel():
            return None
        operands[i] = _host_f32(t)
    b1, b2 = opt.betas
    lr, bias_correction1 = opt.lr, 1.0
    if opt.kind == "adagrad":
        lr = opt.lr / (1 + (_step(state) - 1) * opt.lr_decay)
    elif opt.kind in ("adam", "adamw"):
        bias_correction1 = 1 - b1 ** _step(state)
    scalars = dict(
        lr=lr,
        weight_decay=opt.weight_decay,
        momentum=opt.momentum,
        dampening=opt.dampening,
        beta1=b1,
        beta2=b2,
        eps=opt.eps,
        alpha=opt.alpha,
        bias_correction1=bias_correction1,
    )
    return opt.kind, operands, scalars


# ``t.is_cpu`` rather than ``t.device.type == "cpu"`` on the per-tensor path: a tenth of the cost
# (building the device object takes a microsecond, paid several times per tensor).

#: Dtypes whose every value a float32 holds exactly.
_EXACT_IN_F32 = (torch.float32, torch.float16, torch.bfloat16)


def _host_f32(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a flat float32 array: a view when it already is one."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(torch.float32).contiguous()
    return t.numpy().reshape(-1)


#: The optimizer state δ reads, in the Rust kernel's order (``first``, ``second``).
_STATE_KEYS = {
    "sgd": (),
    "momentum": ("momentum_buffer",),
    "nesterov": ("momentum_buffer",),
    "adagrad": ("sum",),
    "rmsprop": ("square_avg",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
}


# ---------------------------------------------------------------------------------------------
# Float fields


def _f32_bits(x: torch.Tensor) -> np.ndarray:
    """The values of ``x`` as float32 bit patterns (uint32) on the host; a contiguous float32 CPU
    tensor is viewed, not copied."""
    if not x.is_cpu:
        x = x.to(device="cpu", dtype=torch.float32)
    return _host_f32(x).view(np.uint32)


def _compose(sign: torch.Tensor, exp: torch.Tensor, kept: torch.Tensor, drop: torch.Tensor, fmt: int) -> torch.Tensor:
    """Float32 values from the fields: dropped mantissa bits come back as ``1 0 … 0`` (the middle of
    their range); exponent 0 is zero. Encoder and decoder both call exactly this."""
    half = torch.where(drop > 0, torch.ones_like(drop) << (drop - 1).clamp_min(0), torch.zeros_like(drop))
    mant = (kept << drop) | half
    if fmt == FORMAT_BF16:
        mant = mant << 16
    # The sign bit as -2^31 added to the other 31 bits: no signed shift overflow.
    bits = ((exp << 23) | mant) + sign * torch.iinfo(torch.int32).min
    bits = torch.where(exp == 0, torch.zeros_like(bits), bits)
    return bits.to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------------------------------------
# The codec


@dataclass
class _Book:
    data: bytes
    book_id: int
    steps: int = 0
    counts: np.ndarray | None = None
    carried: bool = False


class GComp(Codec):
    """Near-lossless: Huffman-coded exponents, zero pruning, four-level mantissa truncation by δ.

    Parameters: ``optimizer`` (one of :data:`OPTIMIZERS`, or None: no δ, full mantissas) and its
    hyperparameters ``lr``, ``weight_decay``, ``momentum``, ``dampening``, ``betas``, ``eps``,
    ``alpha``, ``lr_decay`` (torch.optim names); ``block`` (elements per level), ``cap`` (longest
    Huffman code, 1..15), ``rebuild_every`` (steps between codebook rebuilds), ``carry_book``
    (``"changed"`` or ``"always"``), ``tolerance_bits`` (how many bits above half an ulp of the
    parameter the truncation may reach; 0 = near-lossless), ``fixed_level`` (0..3 everywhere).
    """

    codec_id = 3
    name = "gcomp"

    def __init__(
        self,
        optimizer: str | None = None,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        dampening: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        alpha: float = 0.99,
        lr_decay: float = 0.0,
        block: int = 64,
        cap: int = 12,
        rebuild_every: int = 50,
        carry_book: str = "changed",
        tolerance_bits: float = 0.0,
        fixed_level: int | None = None,
    ):
        if optimizer is not None and optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)} or None, got {optimizer!r}")
        if not 1 <= int(block) < (1 << 32):
            raise ValueError(f"block must lie in [1, 2^32), got {block}")
        if not 1 <= int(cap) <= 15:
            raise ValueError(f"cap must lie in [1, 15], got {cap}")
        if int(rebuild_every) < 1:
            raise ValueError(f"rebuild_every must be >= 1, got {rebuild_every}")
        if carry_book not in _CARRY:
            raise ValueError(f"carry_book must be 'changed' or 'always', got {carry_book!r}")
        if fixed_level is not None and fixed_level not in (0, 1, 2, 3):
            raise ValueError(f"fixed_level must be 0, 1, 2, 3 or None, got {fixed_level!r}")
        if optimizer is not None and not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.optimizer = (
            None
            if optimizer is None
            else OptimizerConfig(
                optimizer,
                float(lr),
                float(weight_decay),
                float(momentum),
                float(dampening),
                (float(betas[0]), float(betas[1])),
                float(eps),
                float(alpha),
                float(lr_decay),
            )
        )
        self.block = int(block)
        self.cap = int(cap)
        self.rebuild_every = int(rebuild_every)
        self.carry_book = carry_book
        self.tolerance_bits = float(tolerance_bits)
        self.fixed_level = fixed_level
        self._books: dict[str, _Book] = {}
        self._params: dict[str, torch.Tensor] = {}
        self._torch_optimizer: torch.optim.Optimizer | None = None
        self._group_configs: dict[int, OptimizerConfig] = {}

    # ----------------------------------------------------------------------------- binding

    def bind(
        self,
        named_parameters: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        optimizer: torch.optim.Optimizer | None = None,
    ) -> GComp:
        """Remember the parameters by name (and the torch optimizer holding their state), so that
        ``compress(grad, name)`` finds the parameter and state δ needs. Returns ``self``."""
        items = named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters
        self._params = {n: p for n, p in items}
        self._torch_optimizer = optimizer
        return self

    @classmethod
    def from_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        named_parameters: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        **kwargs,
    ) -> GComp:
        """A codec bound to a torch optimizer, its kind and hyperparameters read from it per parameter
        group (SGD with momentum is Table 2's Momentum, or Nesterov with ``nesterov=True``)."""
        codec = cls(_optimizer_kind(optimizer, optimizer.param_groups[0]), **kwargs)
        codec.bind(named_parameters, optimizer)
        for group in optimizer.param_groups:
            cfg = _config_of(optimizer, group)
            for p in group["params"]:
                codec._group_configs[id(p)] = cfg
        return codec

    def _context(self, name: str, param, state):
        if param is None:
            param = self._params.get(name)
        if param is not None and state is None and self._torch_optimizer is not None:
            state = self._torch_optimizer.state.get(param, {})
        cfg = self._group_configs.get(id(param), self.optimizer) if param is not None else self.optimizer
        return param, state, cfg

    # ----------------------------------------------------------------------------- encoding

    def compress(
        self,
        tensor: torch.Tensor,
        name: str = "",
        *,
        param: torch.Tensor | None = None,
        state: Mapping | None = None,
    ) -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        fmt = FORMAT_BF16 if tensor.dtype == torch.bfloat16 else FORMAT_F32
        x = tensor.detach()
        # Everything per element runs in Rust on the host, in one pass each (FORMAT.md §5.4):
        # exponent counts, δ's block levels (on the CPU), then all four sections and the
        # reconstruction together.
        bits = _f32_bits(x)
        counts = wire.gcomp_exponent_counts(bits)
        if counts[255]:
            raise ValueError(f"tensor {name!r} holds non-finite values (or values too large for float32)")
        levels = self._levels(x, bits, name, param, state, fmt)
        book = self._book_for(name, counts)
        exp, level, sign, mant, recon_bits = wire.gcomp_encode(bits, fmt, self.block, levels, book.data)
        # numpy's reshape, not torch's: a few microseconds per tensor of a small model.
        recon = torch.from_numpy(recon_bits.view(np.float32).reshape(tensor.shape))
        if tensor.dtype != torch.float32 or not x.is_cpu:
            recon = recon.to(device=x.device, dtype=tensor.dtype)
        sections: dict[str, np.ndarray] = {}
        if self.carry_book == "always" or not book.carried:
            sections["book"] = np.frombuffer(book.data, np.uint8)
            book.carried = True
        sections.update(exp=exp, level=level, sign=sign, mant=mant)
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            params=_PARAMS.pack(fmt, self.block, book.book_id),
            sections=sections,
        )
        return entry, recon

    def _levels(self, x, bits, name, param, state, fmt) -> np.ndarray:
        """One level per block (uint8, host)."""
        nb = -(-x.numel() // self.block)
        if self.fixed_level is not None:
            return np.full(nb, self.fixed_level, np.uint8)
        param, state, cfg = self._context(name, param, state)
        if param is None or cfg is None:
            return np.zeros(nb, np.uint8)
        if param.shape != x.shape:
            raise ValueError(f"parameter of {name!r} has shape {tuple(param.shape)}, the gradient {tuple(x.shape)}")
        precision = _PARAM_PRECISION.get(param.dtype, 24)
        thresholds = _thresholds(fmt, precision, self.tolerance_bits)
        native = _native_metric(x, param, state, cfg)
        if native is not None:
            kind, operands, scalars = native
            return wire.gcomp_block_levels(kind, bits, *operands, block=self.block, thresholds=thresholds, **scalars)
        # Other devices (δ where the gradient lives) and float64 operands: torch.
        delta = quantization_metric(x, param, state, cfg)
        nonzero = ((x.reshape(-1).to(torch.float32).view(torch.int32) >> 23) & 0xFF) != 0
        levels = block_levels(delta, nonzero, self.block, fmt, precision, self.tolerance_bits)
        return levels.to(torch.uint8).cpu().numpy()

    def _book_for(self, name: str, counts: np.ndarray) -> _Book:
        """The book this step is coded with: built at a name's first step, rebuilt from the counts of
        the last ``rebuild_every`` steps when that many have passed (a new id only if it changed)."""
        book = self._books.get(name)
        if book is None:
            book = _Book(wire.huffman_book(counts, self.cap), book_id=0, counts=np.zeros(256, np.uint64))
            self._books[name] = book
        elif book.steps >= self.rebuild_every:
            data = wire.huffman_book(book.counts, self.cap)
            if data != book.data:
                book.data, book.book_id, book.carried = data, (book.book_id + 1) & 0xFFFFFFFF, False
            book.steps, book.counts = 0, np.zeros(256, np.uint64)
        book.counts += counts
        book.steps += 1
        return book

    def book(self, name: str) -> tuple[int, bytes] | None:
        """``(book_id, serialized codebook)`` currently used for tensor ``name``, if any."""
        b = self._books.get(name)
        return None if b is None else (b.book_id, b.data)

    def reset(self) -> None:
        """Forget every codebook (the next frame of each tensor carries a new one)."""
        self._books.clear()

    def state_dict(self) -> dict[str, Any]:
        """``{"books": {name: {"book", "book_id", "steps", "counts", "carried"}}}``: per tensor name the
        serialized codebook (uint8 tensor), its id, the steps since it was built, the exponent counts of
        those steps (int64 tensor of 256) and whether a frame carried it yet. What :meth:`bind` was given
        (parameters, optimizer) is not state: bind the restored codec again."""
        return {
            "books": {
                n: {
                    "book": torch.frombuffer(bytearray(b.data), dtype=torch.uint8),
                    "book_id": b.book_id,
                    "steps": b.steps,
                    "counts": torch.from_numpy(b.counts.astype(np.int64)),
                    "carried": b.carried,
                }
                for n, b in self._books.items()
            }
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        s = sd.fields(state, "GComp state", ("books",))
        books = {}
        for n, v in sd.mapping(s["books"], "GComp state 'books'").items():
            what = f"GComp book of {n!r}"
            f = sd.fields(v, what, ("book", "book_id", "steps", "counts", "carried"))
            data = sd.tensor(f["book"], f"{what} 'book'", dtype=torch.uint8, ndim=1).cpu().numpy().tobytes()
            try:
                wire.huffman_book_lengths(data)
            except ValueError as e:  # WireError and FrameError are ValueErrors
                raise ValueError(f"{what}: not a valid codebook ({e})") from None
            counts = sd.tensor(f["counts"], f"{what} 'counts'", dtype=torch.int64, shape=(256,)).cpu().numpy()
            if (counts < 0).any():
                raise ValueError(f"{what} 'counts' must be >= 0")
            if not isinstance(f["carried"], bool):
                raise ValueError(f"{what} 'carried' must be a bool, got {f['carried']!r}")
            books[n] = _Book(
                data,
                sd.integer(f["book_id"], f"{what} 'book_id'", 0, 0xFFFFFFFF),
                sd.integer(f["steps"], f"{what} 'steps'"),
                counts.astype(np.uint64),
                f["carried"],
            )
        self._books = books

    def __repr__(self) -> str:
        kind = None if self.optimizer is None else self.optimizer.kind
        return (
            f"GComp(optimizer={kind!r}, block={self.block}, cap={self.cap}, rebuild_every={self.rebuild_every}, "
            f"carry_book={self.carry_book!r}, tolerance_bits={self.tolerance_bits}, fixed_level={self.fixed_level})"
        )


def _optimizer_kind(optimizer: torch.optim.Optimizer, group: Mapping) -> str:
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    if isinstance(optimizer, torch.optim.Adagrad):
        return "adagrad"
    if isinstance(optimizer, torch.optim.RMSprop):
        return "rmsprop"
    if isinstance(optimizer, torch.optim.SGD):
        if group.get("momentum", 0):
            return "nesterov" if group.get("nesterov", False) else "momentum"
        return "sgd"
    raise ValueError(f"no quantization metric for {type(optimizer).__name__}; supported: {', '.join(OPTIMIZERS)}")


def _config_of(optimizer: torch.optim.Optimizer, group: Mapping) -> OptimizerConfig:
    lr = group["lr"]
    return OptimizerConfig(
        kind=_optimizer_kind(optimizer, group),
        lr=float(lr.item() if isinstance(lr, torch.Tensor) else lr),
        weight_decay=float(group.get("weight_decay", 0.0)),
        momentum=float(group.get("momentum", 0.0)),
        dampening=float(group.get("dampening", 0.0)),
        betas=tuple(float(b) for b in group.get("betas", (0.9, 0.999))),
        eps=float(group.get("eps", 1e-8)),
        alpha=float(group.get("alpha", 0.99)),
        lr_decay=float(group.get("lr_decay", 0.0)),
    )


# ---------------------------------------------------------------------------------------------
# Decoding


def unpack_params(params: bytes) -> dict:
    """A record's parameters as a dict (layout only; the decoder checks ranges)."""
    fmt, block, book_id = _PARAMS.unpack(params)
    return dict(format=fmt, block=block, book_id=book_id)


def carried_book(entry: Entry) -> bytes | None:
    """The serialized codebook a GComp record carries, if it carries one (not validated)."""
    arr = entry.sections.get("book")
    return None if arr is None else np.asarray(arr, dtype=np.uint8).tobytes()


def decode_gcomp(entry: Entry, device: torch.device | None = None, book: bytes | None = None) -> torch.Tensor:
    """Decode a GComp record, with ``book`` when the record does not carry its own.

    Every field is checked as hostile input (FrameError naming the rule) before the output is built.
    """
    rec.check_record_dtype(entry, _CODEC)
    fmt, block, book_id = rec.params(entry, _CODEC, _PARAMS, "u8 format, u32 block, u32 book_id")
    if fmt not in MANTISSA_BITS:
        raise rec.bad(entry, _CODEC, f"format must be 0 (f32) or 1 (bf16), got {fmt}")
    if fmt == FORMAT_BF16 and entry.dtype != torch.bfloat16:
        raise rec.bad(entry, _CODEC, f"format 1 (bf16) needs dtype bfloat16, got {entry.dtype}")
    if block < 1:
        raise rec.bad(entry, _CODEC, "block must be >= 1, got 0")
    names = ("book", "exp", "level", "sign", "mant") if "book" in entry.sections else ("exp", "level", "sign", "mant")
    rec.expect_sections(entry, _CODEC, names)
    if "book" in entry.sections:
        book = rec.byte_section(entry, _CODEC, "book").tobytes()
    elif book is None:
        raise rec.bad(
            entry,
            _CODEC,
            f"codebook not carried (book_id {book_id}): decode with a GCompDecoderState that received it",
        )
    n = entry.numel
    exp = rec.wire_call(
        entry, _CODEC, "section 'exp'", wire.huffman_decode, rec.byte_section(entry, _CODEC, "exp"), n, book
    )
    if n and bool((exp == 255).any()):
        raise rec.bad(entry, _CODEC, "exponent 255 (infinity or NaN) is not allowed")
    nb = -(-n // block)
    level_bytes = rec.section(entry, _CODEC, "level", np.uint8, (2 * nb + 7) // 8, "ceil(num_blocks / 4)")
    levels = rec.wire_call(entry, _CODEC, "section 'level'", wire.unpack_bits_exact, level_bytes, 2, nb)
    nonzero = exp != 0
    nnz = int(nonzero.sum())
    sign_bytes = rec.section(entry, _CODEC, "sign", np.uint8, (nnz + 7) // 8, "ceil(nonzero / 8)")
    signs = rec.wire_call(entry, _CODEC, "section 'sign'", wire.unpack_bits_exact, sign_bytes, 1, nnz)
    # The mantissa part of each level: its nonzeros, in element order, at (W - drop) bits.
    width = MANTISSA_BITS[fmt]
    # Never more than 2·numel entries, whatever `block` says.
    block_level = (
        np.repeat(levels.astype(np.int8), block)[:n] if block < n else np.full(n, levels[0] if nb else 0, np.int8)
    )
    nz_level = block_level[nonzero]
    counts = np.bincount(nz_level, minlength=4).tolist()
    lens = [(c * (width - d) + 7) // 8 for c, d in zip(counts, DROPS[fmt])]
    mant_bytes = rec.section(entry, _CODEC, "mant", np.uint8, sum(lens), "the four levels' packed mantissas")
    kept = np.zeros(nnz, np.int32)
    start = 0
    for lv, (c, d, ln) in enumerate(zip(counts, DROPS[fmt], lens)):
        part = mant_bytes[start : start + ln]
        vals = rec.wire_call(entry, _CODEC, "section 'mant'", wire.unpack_bits_exact, part, width - d, c)
        if c == nnz:
            kept[:] = vals
        elif c:
            kept[nz_level == lv] = vals
        start += ln
    # Everything is checked; build the tensor on the requested device.
    dev = torch.device("cpu") if device is None else torch.device(device)
    exp_t = torch.from_numpy(exp.astype(np.int32)).to(dev)
    nz_t = torch.from_numpy(nonzero).to(dev)
    sign_t = torch.zeros(n, dtype=torch.int32, device=dev)
    sign_t[nz_t] = torch.from_numpy(signs.astype(np.int32)).to(dev)
    kept_t = torch.zeros(n, dtype=torch.int32, device=dev)
    kept_t[nz_t] = torch.from_numpy(kept).to(dev)
    drops = torch.tensor(DROPS[fmt], dtype=torch.int32, device=dev)
    drop_t = drops[torch.from_numpy(block_level.astype(np.int64)).to(dev)]
    out = _compose(sign_t, exp_t, kept_t, drop_t, fmt)
    return out.reshape(entry.shape).to(entry.dtype)


def _decode_registered(entry: Entry, device: torch.device | None) -> torch.Tensor:
    return decode_gcomp(entry, device)


class GCompDecoderState:
    """What a receiver keeps to decode GComp frames that do not carry their codebook: the last book of
    each (sender, tensor name) stream, with its id. Frames of other codecs decode as usual.

    A frame that carries a book updates the stream's book (after the book is validated); one that names
    a book id this state does not hold for the stream raises ``FrameError``.
    """

    def __init__(self) -> None:
        self._books: dict[tuple[int, str], tuple[int, bytes]] = {}

    def book(self, sender: int, name: str) -> tuple[int, bytes] | None:
        """``(book_id, serialized book)`` last received for the stream, if any."""
        return self._books.get((sender, name))

    def decode_entry(self, entry: Entry, sender: int, device: torch.device | None = None) -> torch.Tensor:
        """Decode one record of a frame from ``sender``."""
        if entry.codec != GComp.codec_id:
            return decode_entry(entry, device)
        if len(entry.params) != _PARAMS.size:
            return decode_gcomp(entry, device)  # raises, naming the rule
        book_id = _PARAMS.unpack(entry.params)[2]
        key = (int(sender), entry.name)
        carried = carried_book(entry)
        if carried is not None:
            rec.wire_call(entry, _CODEC, "section 'book'", wire.huffman_book_lengths, carried)
            out = decode_gcomp(entry, device)
            self._books[key] = (book_id, carried)
            return out
        known = self._books.get(key)
        if known is None:
            raise rec.bad(
                entry, _CODEC, f"codebook not carried (book_id {book_id}) and none received from sender {sender}"
            )
        if known[0] != book_id:
            raise rec.bad(
                entry,
                _CODEC,
                f"codebook not carried: the record names book_id {book_id}, the last received from sender "
                f"{sender} is {known[0]}",
            )
        return decode_gcomp(entry, device, known[1])

    def decode_bundle(
        self, frame: BytesLike | Frame, *, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        """Decode every record of a frame (bundle or tensor frame) into ``{name: tensor}``."""
        f = frame if isinstance(frame, Frame) else read_frame(frame)
        dev = None if device is None else torch.device(device)
        return {e.name: self.decode_entry(e, f.sender, dev) for e in f.entries}

    def decode(self, frame: BytesLike | Frame, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Decode a tensor frame."""
        f = frame if isinstance(frame, Frame) else read_frame(frame)
        dev = None if device is None else torch.device(device)
        return self.decode_entry(f.entry(), f.sender, dev)

    def reset(self) -> None:
        self._books.clear()


CAPABILITIES = declare(CodecCapabilities(GComp.codec_id, "gcomp", decode=_decode_registered))
