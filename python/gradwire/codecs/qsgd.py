"""QSGD (id 4): stochastic quantization to ``s`` levels per bucket, Elias-coded (Alistarh et al. 2017;
FORMAT.md §5.5).

The tensor, flattened in row-major order, is cut into buckets of ``bucket`` elements (the last one may
be shorter). With ``‖v‖`` a bucket's L2 norm, element ``v_i`` becomes ``‖v‖ · sign(v_i) · ξ_i / s``, where
``ξ_i`` is ``l`` or ``l + 1`` for ``l = floor(s · |v_i| / ‖v‖)``, ``l + 1`` with probability
``s · |v_i| / ‖v‖ − l``: an unbiased estimate of ``v_i`` (its expectation over the random draw is ``v_i``)
with variance at most ``min(d / s², √d / s) · ‖v‖²`` per bucket of ``d`` elements.

The frame carries each bucket's norm as f32 and, as in the paper, the nonzero levels only: per nonzero,
the Elias code (ω by default, or γ) of the distance to the previous nonzero position, a sign bit and the
Elias code of the level — the Rust sparse level stream (FORMAT.md §6.3). Few levels and large buckets
leave most levels zero, which then cost nothing.

Randomness comes from a ``torch.Generator`` seeded with ``seed`` on the tensor's device, advanced by
every call: a codec built with the same seed and called with the same tensors in the same order produces
the same frames. The quantization runs on the tensor's device; only the norms and the sparse
(position, level) pairs cross to the host.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import wire
from ..capabilities import CodecCapabilities, declare
from ..frame import Entry
from . import record as rec
from . import statedict as sd
from .base import Codec

__all__ = ["QSGD", "dequantize", "quantize", "unpack_params"]

_CODEC = "qsgd"
_PARAMS = struct.Struct("<IIBQ")  # levels, bucket, elias, nnz
_ELIAS = {"omega": 0, "gamma": 1}
_ELIAS_NAMES = {v: k for k, v in _ELIAS.items()}
#: The largest level count: ``level / s`` is then exact in float32.
MAX_LEVELS = 1 << 24
SECTIONS = ("norm", "data")


def quantize(
    flat: torch.Tensor, levels: int, bucket: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int32 of flat's length, norms float32 per bucket)``: signed levels in ``[-s, s]``.

    ``flat`` is a 1-D float32 tensor; uniform draws come from ``generator`` (on ``flat``'s device).
    """
    n = flat.numel()
    nb = -(-n // bucket)
    padded = torch.zeros(nb * bucket, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    v = padded.view(nb, bucket)
    norms = torch.linalg.vector_norm(v, dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    r = v.abs() / safe[:, None] * float(levels)
    low = torch.floor(r)
    u = torch.rand(r.shape, generator=generator, device=flat.device, dtype=torch.float32)
    # Rounding can put |v_i| / ‖v‖ a hair above 1; the clamp keeps levels in [0, s].
    level = (low + (u < (r - low)).to(torch.float32)).clamp_(max=float(levels))
    q = (torch.sign(v) * level).to(torch.int32)
    return q.reshape(-1)[:n], norms


def dequantize(q: torch.Tensor, norms: torch.Tensor, levels: int, bucket: int) -> torch.Tensor:
    """``norm · (q / s)`` per element in float32 (dense; encoder and decoder both compute this)."""
    n = q.numel()
    bucket_of = torch.arange(n, device=q.device) // bucket
    return norms.to(torch.float32)[bucket_of] * (q.to(torch.float32) / float(levels))


def _sparse_dequantize(
    positions: torch.Tensor, lv: torch.Tensor, norms: torch.Tensor, levels: int, bucket: int, numel: int
) -> torch.Tensor:
    """The same values as :func:`dequantize`, from the nonzero (position, level) pairs."""
    out = torch.zeros(numel, dtype=torch.float32, device=norms.device)
    if positions.numel():
        vals = norms.to(torch.float32)[positions // bucket] * (lv.to(torch.float32) / float(levels))
        out[positions] = vals
    return out


class QSGD(Codec):
    """Stochastic quantization to ``levels`` levels per bucket of ``bucket`` elements (unbiased),
    Elias-coded.

    ``levels`` is QSGD's ``s`` (1 ≤ s ≤ 2^24); ``elias`` is ``"omega"`` (the paper's recursive code)
    or ``"gamma"``; ``seed`` seeds the quantization's random draws.
    """

    codec_id = 4
    name = "qsgd"

    def __init__(self, levels: int = 4, bucket: int = 512, *, elias: str = "omega", seed: int = 0):
        levels, bucket = int(levels), int(bucket)
        if not 1 <= levels <= MAX_LEVELS:
            raise ValueError(f"levels must lie in [1, 2^24], got {levels}")
        if not 1 <= bucket < (1 << 32):
            raise ValueError(f"bucket must lie in [1, 2^32), got {bucket}")
        if elias not in _ELIAS:
            raise ValueError(f"elias must be 'omega' or 'gamma', got {elias!r}")
        self.levels = levels
        self.bucket = bucket
        self.elias = elias
        self.seed = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}
        # Loaded generator states of devices this process has not used (or cannot build) yet.
        self._pending: dict[str, torch.Tensor] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            state = self._pending.pop(str(device), None)
            if state is None:
                g.manual_seed(self.seed)
            else:
                g.set_state(state)
            self._generators[device] = g
        return g

    def state_dict(self) -> dict[str, Any]:
        """``{"generators": {device: state}}``: the random generator of each device the codec has drawn on
        (``"cpu"``, ``"cuda:0"``, ...), as the uint8 tensor of ``torch.Generator.get_state()``."""
        gens = {k: v.clone() for k, v in self._pending.items()}
        gens.update({str(d): g.get_state().clone() for d, g in self._generators.items()})
        return {"generators": gens}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        s = sd.fields(state, "QSGD state", ("generators",))
        pending: dict[str, torch.Tensor] = {}
        for key, t in sd.mapping(s["generators"], "QSGD state 'generators'").items():
            what = f"QSGD generator state of {key!r}"
            t = sd.tensor(t, what, dtype=torch.uint8, ndim=1).detach().cpu().clone()
            try:
                device = torch.device(key)
            except (RuntimeError, ValueError):
                raise ValueError(f"{what}: not a device name") from None
            if device.type == "cpu":
                try:
                    torch.Generator().set_state(t)
                except RuntimeError as e:
                    raise ValueError(f"{what}: {e}") from None
            pending[str(device)] = t
        self._generators, self._pending = {}, pending

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        flat = tensor.detach().reshape(-1).to(torch.float32)
        if flat.numel() and not bool(torch.isfinite(flat).all()):
            raise ValueError(f"tensor {name!r} holds non-finite values")
        q, norms = quantize(flat, self.levels, self.bucket, self._generator(flat.device))
        norms_host = norms.cpu().numpy()
        if not np.isfinite(norms_host).all():
            raise ValueError(f"tensor {name!r}: a bucket's norm overflows float32")
        recon = dequantize(q, norms, self.levels, self.bucket).reshape(tensor.shape).to(tensor.dtype)
        # Only the nonzero levels and their positions cross to the host.
        nz = torch.nonzero(q, as_tuple=True)[0]
        positions = nz.cpu().numpy().astype(np.uint64)
        lv = q[nz].cpu().numpy()
        data = wire.sparse_levels_encode(positions, lv, self.elias)
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            params=_PARAMS.pack(self.levels, self.bucket, _ELIAS[self.elias], positions.size),
            sections={"norm": norms_host.astype(np.float32, copy=False), "data": np.frombuffer(data, np.uint8)},
        )
        return entry, recon

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, bucket={self.bucket}, elias={self.elias!r}, seed={self.seed})"


def unpack_params(params: bytes) -> dict:
    """A record's parameters as a dict (layout only; the decoder checks ranges)."""
    levels, bucket, elias, nnz = _PARAMS.unpack(params)
    return dict(levels=levels, bucket=bucket, elias=_ELIAS_NAMES.get(elias, elias), nnz=nnz)


def _decode_qsgd(entry: Entry, device: torch.device | None) -> torch.Tensor:
    rec.check_record_dtype(entry, _CODEC)
    levels, bucket, elias, nnz = rec.params(entry, _CODEC, _PARAMS, "u32 levels, u32 bucket, u8 elias, u64 nnz")
    if not 1 <= levels <= MAX_LEVELS:
        raise rec.bad(entry, _CODEC, f"levels must lie in [1, 2^24], got {levels}")
    if bucket < 1:
        raise rec.bad(entry, _CODEC, "bucket must be >= 1, got 0")
    if elias not in _ELIAS_NAMES:
        raise rec.bad(entry, _CODEC, f"elias must be 0 (omega) or 1 (gamma), got {elias}")
    n = entry.numel
    if nnz > n:
        raise rec.bad(entry, _CODEC, f"nnz must be <= numel = {n}, got {nnz}")
    rec.expect_sections(entry, _CODEC, SECTIONS)
    nb = -(-n // bucket)
    norms = rec.section(entry, _CODEC, "norm", np.float32, nb, "ceil(numel / bucket)")
    if nb and not bool(np.all(np.isfinite(norms) & (norms >= 0))):
        raise rec.bad(entry, _CODEC, "norms must be finite and >= 0")
    data = rec.byte_section(entry, _CODEC, "data")
    # The Rust decoder checks the stream (positions ascending and < numel, 1 <= |level| <= s, exact
    # length) and refuses an nnz the bytes cannot hold before allocating.
    positions, lv = rec.wire_call(
        entry, _CODEC, "section 'data'", wire.sparse_levels_decode, data, nnz, n, levels, _ELIAS_NAMES[elias]
    )
    dev = torch.device("cpu") if device is None else torch.device(device)
    pos_t = torch.from_numpy(positions.astype(np.int64)).to(dev)
    lv_t = torch.from_numpy(lv).to(dev)
    norms_t = torch.from_numpy(np.array(norms, dtype=np.float32)).to(dev)
    out = _sparse_dequantize(pos_t, lv_t, norms_t, levels, bucket, n)
    return out.reshape(entry.shape).to(entry.dtype)


CAPABILITIES = declare(CodecCapabilities(QSGD.codec_id, "qsgd", decode=_decode_qsgd))
