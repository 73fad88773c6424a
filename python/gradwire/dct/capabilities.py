"""The DCT codec's capability object (codec id 1): what the frame readers, the accumulators and the
aggregation rules find under its id (:mod:`gradwire.capabilities`), and the decoders it declares.

Decoding: one record, many at once, and the fused weighted sum of several — each the exact decode
(``gradwire.dct.decode_levels``), so every node gets the same bits. On a GPU the records of one chunk
shape are decoded together (one exact decode over all their chunks, in batches); on the CPU the Rust
decode of one record at a time is the fast path, and the weighted sum of records chunked alike runs in
one Rust pass (:func:`gradwire.dct.decode_levels_weighted_sum`). Every record is checked by
:mod:`.parse` before anything of its size is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..capabilities import CodecCapabilities, declare
from ..frame import Entry
from .chunks import put_back_chunks
from .decode import decode_level_chunks, decode_levels_weighted_sum
from .domain import dct_accumulator, dct_record_coefficients, dct_record_norm
from .layout import CODEC_ID, MODE_NAMES, unpack_params
from .parse import checked_arrays, decode_parsed, parse_record

__all__ = ["CAPABILITIES", "decode_dct", "decode_dct_batch", "weighted_sum_dct"]


def decode_dct(entry: Entry, device: torch.device | None) -> torch.Tensor:
    """Decode a DCT record, validating every field as hostile input first."""
    return decode_parsed(parse_record(entry, device)).to(entry.dtype)


#: Output elements of one batch of :func:`decode_dct_batch` (float32: 256 MiB).
_BATCH_DECODE_ELEMS = 1 << 26


def _decodes_stacked(dev: torch.device) -> bool:
    """Whether :func:`decode_dct_batch` applies on ``dev``: not on the CPU, where the Rust decode of one
    record at a time is faster."""
    return dev.type != "cpu"


def decode_dct_batch(entries: Sequence[Entry], device: torch.device | None) -> list[torch.Tensor] | None:
    """DCT records decoded together on a GPU: the records of one chunk shape and ``k`` stacked, one exact
    decode (:func:`gradwire.dct.decode_level_chunks`, which decodes each chunk on its own: the same bits as
    record by record), in batches of at most :data:`_BATCH_DECODE_ELEMS` outputs. ``None`` on the CPU,
    where the Rust decode of one record at a time is the fast path. Every record is checked before
    anything of the batch is allocated on the device."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if not _decodes_stacked(dev):
        return None
    checked = [checked_arrays(e) for e in entries]
    groups: dict[tuple, list[int]] = {}
    for i, (plan, k, *_rest) in enumerate(checked):
        groups.setdefault((plan.chunk_shape, k), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(entries)
    for (dims, _k), members in groups.items():
        batch: list[int] = []
        size = 0
        for j, i in enumerate(members):
            batch.append(i)
            size += checked[i][0].num_chunks * checked[i][0].chunk_numel
            if size >= _BATCH_DECODE_ELEMS or j == len(members) - 1:
                _decode_stacked([checked[b] for b in batch], dims, dev, [entries[b] for b in batch], batch, out)
                batch, size = [], 0
    return out  # type: ignore[return-value]


def _to_device_all(arrays: Sequence[np.ndarray], dev: torch.device) -> list[torch.Tensor]:
    """The host ``arrays`` on ``dev`` in one host-to-device copy: laid end to end as bytes (each padded to 8
    bytes, so every one stays aligned), copied once, cut back into typed views."""
    spans, offset = [], 0
    for a in arrays:
        spans.append(offset)
        offset += a.nbytes + (-a.nbytes % 8)
    blob = np.zeros(offset, dtype=np.uint8)
    for a, start in zip(arrays, spans):
        blob[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    moved = torch.from_numpy(blob).to(dev)
    return [
        moved[start : start + a.nbytes].view(getattr(torch, a.dtype.name)).reshape(a.shape)
        if a.nbytes
        else torch.empty(a.shape, dtype=getattr(torch, a.dtype.name), device=dev)
        for a, start in zip(arrays, spans)
    ]


def _decode_stacked(parts, dims, dev: torch.device, entries, at: list[int], out: list) -> None:
    idx, levels, scales, mins = _to_device_all(
        [
            np.concatenate([p[2].astype(np.int64).reshape(-1, p[1]) for p in parts]),
            np.concatenate([np.asarray(p[3], dtype=np.int16).reshape(-1, p[1]) for p in parts]),
            np.concatenate([np.array(p[4], dtype=np.float32) for p in parts]),
            np.concatenate([np.array(p[5], dtype=np.float32) for p in parts]),
        ],
        dev,
    )
    decoded = decode_level_chunks(idx, levels, scales, mins, dims)
    # Every record's chunks put back into its shape by one _foreach_copy_ (exact copies).
    put_back = put_back_chunks(
        decoded.reshape(decoded.shape[0], math.prod(dims)), [(None, None, p[0]) for p in parts], dims
    )
    for t, entry, i in zip(put_back, entries, at):
        out[i] = t if t.dtype == entry.dtype else t.to(entry.dtype)


def weighted_sum_dct(
    entries: Sequence[Entry], weights: Sequence[float], device: torch.device | None
) -> torch.Tensor | None:
    """The fused weighted sum of float32 DCT records chunked alike, on the CPU
    (:func:`gradwire.dct.decode_levels_weighted_sum`); ``None`` for anything else."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type != "cpu" or any(e.dtype != torch.float32 for e in entries):
        return None
    parsed = [parse_record(e, dev) for e in entries]
    plan = parsed[0].plan
    if any(p.plan != plan for p in parsed[1:]):
        return None
    return decode_levels_weighted_sum([(p.idx, p.levels, p.scales, p.mins) for p in parsed], weights, plan)


def _dct_setting(entry: Entry) -> dict:
    p = unpack_params(entry.params)
    return {
        "codec": "dct",
        "mode": MODE_NAMES.get(p["mode"], p["mode"]),
        "chunk_shape": p["chunk_shape"],
        "topk": p["k"],
    }


CAPABILITIES = declare(
    CodecCapabilities(
        CODEC_ID,
        "dct",
        decode=decode_dct,
        decode_batch=decode_dct_batch,
        weighted_sum=weighted_sum_dct,
        accumulator=dct_accumulator,
        norm=dct_record_norm,
        coefficients=dct_record_coefficients,
        setting=_dct_setting,
    )
)
