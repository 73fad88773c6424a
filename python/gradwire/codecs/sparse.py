"""Sparsification: top-k (id 7; DGC, Lin et al. 2018) and random-k (id 8; Stich et al. 2018).
FORMAT.md §5.8 and §5.9.

**Top-k** keeps the ``k`` elements of largest magnitude. Their positions are sorted ascending and sent as
gaps (``i_0``, then ``i_j − i_{j−1} − 1``) packed at the smallest fixed width that holds the largest gap;
the ``index_coding`` byte leaves room for entropy-coded gaps. ``scope="global"`` chooses the ``k``
largest over all the tensors of a bundle (:meth:`TopK.compress_bundle`, :meth:`TopK.encode_bundle`,
:func:`global_topk_bundle`); each tensor still gets its own record with the positions it won.

**Random-k** keeps ``k`` positions drawn from a counter-based hash of a 64-bit seed, so the frame carries
the seed instead of the positions and any device regenerates the same set: position ``i`` gets the key
``mix64(i XOR seed)`` (splitmix64's finalizer, a bijection of 64-bit integers) and the ``k`` positions of
smallest key are kept. Each call takes a fresh seed from a per-codec counter, so successive steps send
different coordinates, and codecs built with the same ``seed`` and called in the same order agree.
With ``unbiased=True`` the values are multiplied by ``numel / k``, so the expectation of the decoded
tensor over seeds is the input.

Both are linear in the values, so sums of their records are sparse sums: they register an accumulator
(scatter-add of each record's values into one dense sum, in :meth:`add` order, never two additions to
one position in one step) and a norm that reads the values alone.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import wire
from ..capabilities import CodecCapabilities, declare
from ..frame import Entry, decode_entry
from . import record as rec
from . import statedict as sd
from .base import Codec

__all__ = [
    "RandomK",
    "SparseAccumulator",
    "TopK",
    "global_topk_bundle",
    "mix64",
    "random_k_indices",
    "resolve_k",
]

INDEX_CODING_FIXED = 0
_TOPK_PARAMS = struct.Struct("<BBQ")  # index_coding, index_param, k
_RANDK_PARAMS = struct.Struct("<QQB")  # seed, k, scaled
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def resolve_k(numel: int, k: int | None, density: float | None) -> int:
    """Elements kept of a tensor of ``numel``: ``min(k, numel)`` or ``max(1, ceil(density · numel))``."""
    if numel == 0:
        return 0
    if k is not None:
        return min(int(k), numel)
    return min(numel, max(1, math.ceil(density * numel)))


def _check_k_density(k, density) -> tuple[int | None, float | None]:
    if (k is None) == (density is None):
        raise ValueError("give exactly one of k and density")
    if k is not None:
        k = int(k)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
    else:
        density = float(density)
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must lie in (0, 1], got {density}")
    return k, density


def _check_value_dtype(value_dtype: torch.dtype) -> torch.dtype:
    if value_dtype not in rec.VALUE_DTYPES:
        raise ValueError(f"value_dtype must be float32, float16 or bfloat16, got {value_dtype}")
    return value_dtype


def _scatter(idx: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """The dense float32 vector of a sparse record. Encoder and decoder both call exactly this."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    return out.index_copy_(0, idx, values.to(torch.float32))


def _values_for_wire(values: torch.Tensor, value_dtype: torch.dtype, name: str) -> torch.Tensor:
    sent = values.to(value_dtype)
    if sent.numel() and not bool(torch.isfinite(sent).all()):
        raise ValueError(f"tensor {name!r} holds non-finite values (or values too large for {value_dtype})")
    return sent


# ---------------------------------------------------------------------------------------------
# Top-k


def _topk_entry(
    name: str, tensor: torch.Tensor, idx: torch.Tensor, value_dtype: torch.dtype
) -> tuple[Entry, torch.Tensor]:
    """The record and reconstruction of ``tensor`` keeping the positions ``idx`` (sorted, unique)."""
    flat = tensor.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    if n > (1 << 32):
        raise ValueError(f"tensor {name!r} has {n} elements; top-k records hold at most 2^32")
    sent = _values_for_wire(flat[idx], value_dtype, name)
    gaps = torch.diff(idx, prepend=torch.full((1,), -1, dtype=idx.dtype, device=idx.device)) - 1
    gaps_host = gaps.cpu().numpy()
    width = max(1, int(gaps_host.max()).bit_length()) if gaps_host.size else 1
    payload, elem = rec.values_payload(sent)
    entry = rec.entry(
        TopK.codec_id,
        name,
        tensor,
        params=_TOPK_PARAMS.pack(INDEX_CODING_FIXED, width, idx.numel()),
        sections={
            "idx": np.frombuffer(wire.pack_bits(gaps_host.astype(np.uint32), width), dtype=np.uint8),
            "val": payload,
        },
        section_elems={"val": elem},
    )
    recon = _scatter(idx, sent, n).reshape(tensor.shape).to(tensor.dtype)
    return entry, recon


class TopK(Codec):
    """Top-k sparsification: the ``k`` (or ``density · numel``) elements of largest magnitude.

    Costs ``k · (b/8 + size(value_dtype))`` bytes with ``b`` the bits of the largest gap between kept
    positions (about ``log2(1/density) + 1``): at density 1% with f32 values, about 4.9 bytes per kept
    element, 0.049 bytes per element. ``scope="tensor"`` keeps ``k`` per tensor; ``scope="global"``
    keeps ``k`` over all tensors of a bundle (a single tensor is its own bundle).
    """

    codec_id = 7
    name = "topk"

    def __init__(
        self,
        k: int | None = None,
        density: float | None = None,
        *,
        scope: str = "tensor",
        value_dtype: torch.dtype = torch.float32,
    ):
        self.k, self.density = _check_k_density(k, density)
        if scope not in ("tensor", "global"):
            raise ValueError(f"scope must be 'tensor' or 'global', got {scope!r}")
        self.scope = scope
        self.value_dtype = _check_value_dtype(value_dtype)

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        flat = tensor.detach().reshape(-1)
        k = resolve_k(flat.numel(), self.k, self.density)
        idx = torch.topk(flat.to(torch.float32).abs(), k, sorted=False).indices
        return _topk_entry(name, tensor, torch.sort(idx).values, self.value_dtype)

    def compress_bundle(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[Entry, torch.Tensor]]:
        """``{name: (record, reconstruction)}``; with ``scope="global"`` ``k`` counts over all tensors."""
        if self.scope == "tensor":
            return super().compress_bundle(tensors)
        names = list(tensors)
        if not names:
            return {}
        for t in tensors.values():
            rec.check_float_input(t)
        device = tensors[names[0]].device
        flats = [tensors[n].detach().reshape(-1).to(device=device, dtype=torch.float32) for n in names]
        sizes = [f.numel() for f in flats]
        k = resolve_k(sum(sizes), self.k, self.density)
        chosen = torch.topk(torch.cat(flats).abs(), k, sorted=False).indices
        chosen = torch.sort(chosen).values
        out = {}
        start = 0
        for n, size in zip(names, sizes):
            lo = torch.searchsorted(chosen, start)
            hi = torch.searchsorted(chosen, start + size)
            idx = chosen[lo:hi] - start
            out[n] = _topk_entry(n, tensors[n], idx.to(tensors[n].device), self.value_dtype)
            start += size
        return out

    @property
    def bundle_budget(self) -> bool:
        """``scope="global"`` spends ``k`` over the whole bundle."""
        return self.scope == "global"

    def __repr__(self) -> str:
        amount = f"k={self.k}" if self.k is not None else f"density={self.density}"
        extra = "" if self.value_dtype == torch.float32 else f", value_dtype={self.value_dtype}"
        return f"TopK({amount}, scope={self.scope!r}{extra})"


def global_topk_bundle(
    tensors: Mapping[str, torch.Tensor],
    k: int | None = None,
    density: float | None = None,
    *,
    round: int = 0,
    sender: int = 0,
    value_dtype: torch.dtype = torch.float32,
) -> bytes:
    """A bundle frame keeping the ``k`` (or ``density``) largest-magnitude elements over all tensors."""
    codec = TopK(k=k, density=density, scope="global", value_dtype=value_dtype)
    return codec.encode_bundle(tensors, round=round, sender=sender)


# ---------------------------------------------------------------------------------------------
# Random-k


def _mix64_int(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def _xor_shr_(z: torch.Tensor, s: int, tmp: torch.Tensor) -> torch.Tensor:
    """``z ^= z >>> s`` in place: a logical right shift of int64 lanes (torch's ``>>`` is arithmetic)."""
    torch.bitwise_right_shift(z, s, out=tmp)
    tmp.bitwise_and_((1 << (64 - s)) - 1)
    return z.bitwise_xor_(tmp)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 lanes holding unsigned 64-bit values (wrapping arithmetic).

    Works in place on a copy of ``z`` with one scratch buffer: large temporaries cost more than the
    arithmetic.
    """
    z = z.clone()
    tmp = torch.empty_like(z)
    _xor_shr_(z, 30, tmp).mul_(_signed(_M1))
    _xor_shr_(z, 27, tmp).mul_(_signed(_M2))
    return _xor_shr_(z, 31, tmp)


def random_k_indices(seed: int, numel: int, k: int, device: torch.device | None = None) -> torch.Tensor:
    """The ``k`` positions of ``[0, numel)`` whose key ``mix64(i XOR seed)`` is smallest, ascending.

    Keys are compared as unsigned 64-bit integers; ``mix64`` is a bijection, so keys never tie and every
    device computes the same set.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    keys = torch.arange(numel, dtype=torch.int64, device=device).bitwise_xor_(_signed(seed & _MASK64))
    keys = mix64(keys).bitwise_xor_(_signed(1 << 63))  # unsigned order as signed order
    idx = torch.topk(keys, k, largest=False, sorted=False).indices
    return torch.sort(idx).values


class RandomK(Codec):
    """Random-k sparsification: ``k`` (or ``density · numel``) positions drawn from a seed in the frame.

    Costs ``k · size(value_dtype) + 17`` bytes: no positions on the wire. ``unbiased=True`` scales the
    kept values by ``numel / k`` (an unbiased estimate of the tensor); ``False`` sends them as they are
    (what error feedback wants). ``seed`` starts the per-call seed sequence.
    """

    codec_id = 8
    name = "randomk"

    def __init__(
        self,
        k: int | None = None,
        density: float | None = None,
        seed: int = 0,
        *,
        unbiased: bool = True,
        value_dtype: torch.dtype = torch.float32,
    ):
        self.k, self.density = _check_k_density(k, density)
        self.seed = int(seed) & _MASK64
        self.unbiased = bool(unbiased)
        self.value_dtype = _check_value_dtype(value_dtype)
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"calls": n}``: how many seeds the codec has drawn (the next call uses seed number ``n + 1``)."""
        return {"calls": self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        s = sd.fields(state, "RandomK state", ("calls",))
        self.calls = sd.integer(s["calls"], "RandomK state 'calls'")

    def next_seed(self) -> int:
        """The seed of the next call: splitmix64 of ``seed`` advanced by the call counter."""
        self.calls += 1
        return _mix64_int(self.seed + self.calls * _GOLDEN)

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        flat = tensor.detach().reshape(-1).to(torch.float32)
        n = flat.numel()
        k = resolve_k(n, self.k, self.density)
        seed = self.next_seed()
        idx = random_k_indices(seed, n, k, flat.device)
        values = flat[idx]
        if self.unbiased and k:
            values = values * float(np.float32(n / k))
        sent = _values_for_wire(values, self.value_dtype, name)
        payload, elem = rec.values_payload(sent)
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            params=_RANDK_PARAMS.pack(seed, k, int(self.unbiased)),
            sections={"val": payload},
            section_elems={"val": elem},
        )
        recon = _scatter(idx, sent, n).reshape(tensor.shape).to(tensor.dtype)
        return entry, recon

    def __repr__(self) -> str:
        amount = f"k={self.k}" if self.k is not None else f"density={self.density}"
        extra = "" if self.value_dtype == torch.float32 else f", value_dtype={self.value_dtype}"
        return f"RandomK({amount}, seed={self.seed}, unbiased={self.unbiased}{extra})"


def unpack_topk_params(params: bytes) -> dict:
    """A top-k record's parameters as a dict (layout only; the decoder checks ranges)."""
    coding, index_param, k = _TOPK_PARAMS.unpack(params)
    return dict(index_coding=coding, index_param=index_param, k=k)


def unpack_randomk_params(params: bytes) -> dict:
    """A random-k record's parameters as a dict (layout only; the decoder checks ranges)."""
    seed, k, scaled = _RANDK_PARAMS.unpack(params)
    return dict(seed=seed, k=k, scaled=scaled)


# ---------------------------------------------------------------------------------------------
# Decoding: both yield (positions, values) first, so the accumulator and the norm share the checks.


def _topk_parts(entry: Entry) -> tuple[np.ndarray, torch.Tensor]:
    codec = "topk"
    rec.check_record_dtype(entry, codec)
    coding, width, k = rec.params(entry, codec, _TOPK_PARAMS, "u8 index_coding, u8 index_param, u64 k")
    n = entry.numel
    if coding != INDEX_CODING_FIXED:
        raise rec.bad(entry, codec, f"index_coding must be 0 (fixed-width gaps), got {coding}")
    if not 1 <= width <= 32:
        raise rec.bad(entry, codec, f"index_param (gap width) must lie in 1..32, got {width}")
    if k > n:
        raise rec.bad(entry, codec, f"k must be <= numel = {n}, got {k}")
    rec.expect_sections(entry, codec, ("idx", "val"))
    packed = rec.section(entry, codec, "idx", np.uint8, (k * width + 7) // 8, "ceil(k * index_param / 8)")
    values = rec.float_section(entry, codec, "val", k, "k")
    gaps = rec.wire_call(entry, codec, "section 'idx'", wire.unpack_bits_exact, packed, width, k)
    if k:
        if int(gaps.max()) >= n:
            raise rec.bad(entry, codec, f"index out of range: a gap of {int(gaps.max())} >= numel = {n}")
        if k * n >= 1 << 63:
            raise rec.bad(entry, codec, "k * numel must be < 2^63")
    idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if k and int(idx[-1]) >= n:
        raise rec.bad(entry, codec, f"index out of range: positions must be < numel = {n}, got {int(idx[-1])}")
    return idx, values


def _randomk_values(entry: Entry) -> tuple[int, int, torch.Tensor]:
    codec = "randomk"
    rec.check_record_dtype(entry, codec)
    seed, k, scaled = rec.params(entry, codec, _RANDK_PARAMS, "u64 seed, u64 k, u8 scaled")
    n = entry.numel
    if k > n:
        raise rec.bad(entry, codec, f"k must be <= numel = {n}, got {k}")
    if scaled not in (0, 1):
        raise rec.bad(entry, codec, f"scaled must be 0 or 1, got {scaled}")
    rec.expect_sections(entry, codec, ("val",))
    return seed, k, rec.float_section(entry, codec, "val", k, "k")


def _randomk_parts(entry: Entry, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    seed, k, values = _randomk_values(entry)
    return random_k_indices(seed, entry.numel, k, device), values


def _decode_topk(entry: Entry, device: torch.device | None) -> torch.Tensor:
    idx, values = _topk_parts(entry)
    dev = torch.device("cpu") if device is None else torch.device(device)
    out = _scatter(torch.from_numpy(idx).to(dev), values.to(dev), entry.numel)
    return out.reshape(entry.shape).to(entry.dtype)


def _decode_randomk(entry: Entry, device: torch.device | None) -> torch.Tensor:
    dev = torch.device("cpu") if device is None else torch.device(device)
    idx, values = _randomk_parts(entry, dev)
    return _scatter(idx, values.to(dev), entry.numel).reshape(entry.shape).to(entry.dtype)


# ---------------------------------------------------------------------------------------------
# Sums and norms in the sparse domain


class SparseAccumulator:
    """A weighted sum of top-k / random-k records: each record's values scatter-added into one sum.

    Positions within one record are unique, so no position is added twice in one step and the sum is
    deterministic on every device. Records of other codecs (the same tensor sent densely) are decoded
    and added whole.
    """

    def __init__(self, shape: tuple[int, ...], device: torch.device | None = None):
        self.shape = tuple(shape)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        numel = 1
        for d in self.shape:
            numel *= d
        self.total = torch.zeros(numel, dtype=torch.float32, device=self.device)
        self.count = 0

    def add(self, entry: Entry, weight: float = 1.0) -> None:
        if tuple(entry.shape) != self.shape:
            raise ValueError(f"record {entry.name!r} has shape {tuple(entry.shape)}, the sum has {self.shape}")
        if entry.codec == TopK.codec_id:
            idx, values = _topk_parts(entry)
            idx_t = torch.from_numpy(idx).to(self.device)
        elif entry.codec == RandomK.codec_id:
            idx_t, values = _randomk_parts(entry, self.device)
        else:
            dense = decode_entry(entry, self.device).to(torch.float32).reshape(-1)
            self.total += dense * weight if weight != 1.0 else dense
            self.count += 1
            return
        # The record's own rounding to its dtype is part of what it decodes to.
        v = values.to(torch.float32).to(entry.dtype).to(torch.float32).to(self.device)
        if weight != 1.0:
            v = v * weight
        # Positions are unique within a record: a gather, an add and a scatter, deterministic on every
        # device (index_add_ would take the atomic path on CUDA).
        self.total.index_copy_(0, idx_t, self.total.index_select(0, idx_t) + v)
        self.count += 1

    def finish(self) -> torch.Tensor:
        return self.total.reshape(self.shape)


def _sparse_accumulator(first: Entry, device: torch.device | None) -> SparseAccumulator:
    return SparseAccumulator(tuple(first.shape), device)


def _topk_norm(entry: Entry) -> float:
    _, values = _topk_parts(entry)
    return float(values.to(torch.float32).to(entry.dtype).to(torch.float64).norm())


def _randomk_norm(entry: Entry) -> float:
    _, _, values = _randomk_values(entry)
    return float(values.to(torch.float32).to(entry.dtype).to(torch.float64).norm())


def _topk_setting(entry: Entry) -> dict:
    k = unpack_topk_params(entry.params)["k"]
    return {"codec": "topk", "k": k, "density": k / entry.numel if entry.numel else 0.0}


def _randomk_setting(entry: Entry) -> dict:
    p = unpack_randomk_params(entry.params)
    k = p["k"]
    return {
        "codec": "randomk",
        "k": k,
        "density": k / entry.numel if entry.numel else 0.0,
        "unbiased": bool(p["scaled"]),
    }


TOPK_CAPABILITIES = declare(
    CodecCapabilities(
        TopK.codec_id,
        "topk",
        decode=_decode_topk,
        accumulator=_sparse_accumulator,
        norm=_topk_norm,
        setting=_topk_setting,
    )
)
RANDOMK_CAPABILITIES = declare(
    CodecCapabilities(
        RandomK.codec_id,
        "randomk",
        decode=_decode_randomk,
        accumulator=_sparse_accumulator,
        norm=_randomk_norm,
        setting=_randomk_setting,
    )
)
