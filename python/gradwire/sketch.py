"""A keyed count sketch of an update, for the direction check of large rounds without reading every
update again at the round's close.

``bounded_mean``'s direction check (:func:`gradwire.aggregation.opposed_senders`) needs each sender's
inner product with the rest of its round, ``⟨uᵢ, Σⱼ aⱼ uⱼ⟩``. Read exactly it is a pass over every record
of the round once the last update is in, which at 256 nodes of SparseLoCo's ~1 MB frames is most of a
second on two cores. A count sketch (Charikar, Chen & Farach-Colton 2002) maps an update linearly to
:data:`SKETCH_DIM` numbers, each kept coordinate ``p`` of tensor ``t`` adding ``σ(t, p) · value`` into
bucket ``h(t, p)``; then ``⟨sketch(u), sketch(v)⟩`` is an unbiased estimate of ``⟨u, v⟩`` with a standard
deviation of about ``|u| |v| / √SKETCH_DIM`` (a cosine within about 0.006). The sketch is computed as
each update arrives (in the server's validation pool), and the close is ``O(senders × SKETCH_DIM)``.

The hash is keyed by a secret of the server's (:attr:`gradwire.rule.Rule.sketch_key`): a node that knew
it could place coefficients where they collide with the honest mass and look aligned in the sketch while
it opposes the round; without it a collision is chance. The key, the tensor's name and the record's
coefficient basis (the DCT's chunk plan) seed each tensor's hash, so records of one tensor in two bases
land in unrelated buckets (they read as orthogonal, not as aligned).

Coordinates: a DCT record's kept coefficients at their positions in its chunk plan's coefficient space
(the transform is orthonormal, so inner products there are the decoded tensors'); any other record's
decoded tensor, flattened (:func:`gradwire.accumulate.entry_coefficients`).
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Hashable, Sequence

import numpy as np

from .accumulate import Coefficients, entry_coefficients
from .frame import Entry

__all__ = ["SKETCH_DIM", "count_sketch", "positions_hash", "sketch_update", "sketched_alignment"]

#: Buckets of a round's direction-check sketch: 256 KiB of float64 per update; a cosine within about
#: 0.006 (one standard deviation) of the exact one, against drop thresholds an order of magnitude wider.
SKETCH_DIM = 1 << 15
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _seed(name: str, basis: Hashable, key: bytes | None) -> np.uint64:
    """A tensor's 64-bit hash seed: unkeyed, of its name alone (the sender histories' fixed hash); keyed, of
    its name and coefficient basis under ``key``."""
    if key is None:
        return np.uint64(zlib.crc32(name.encode("utf-8")) * 0x100000001)
    digest = hashlib.blake2b(repr((name, basis)).encode(), key=key, digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def positions_hash(seed: np.uint64, positions: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each position under ``seed`` (Fibonacci hashing; uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        h = (positions.astype(np.uint64) ^ seed) * _GOLDEN
        h ^= h >> np.uint64(29)
        return h * _GOLDEN


def count_sketch(views: Sequence[tuple[str, Coefficients]], buckets: int, key: bytes | None = None) -> np.ndarray:
    """The count sketch (float64[``buckets``]) of records read as ``(tensor name, coefficients)``: each
    coefficient added into bucket ``(h >> 32) mod buckets`` with the sign of bit 16 of ``h``, its position's
    :func:`positions_hash` under its tensor's seed (``key``: see :func:`_seed`), in position order."""
    out = np.zeros(buckets, dtype=np.float64)
    for name, view in views:
        values = np.ascontiguousarray(view.values.detach().cpu().numpy(), dtype=np.float64)
        if values.size == 0:
            continue
        positions = (
            np.arange(view.size, dtype=np.int64)
            if view.idx is None
            else np.ascontiguousarray(view.idx.detach().cpu().numpy(), dtype=np.int64)
        )
        h = positions_hash(_seed(name, view.basis, key), positions)
        bucket = (h >> np.uint64(32)) % np.uint64(buckets)
        sign = np.where((h >> np.uint64(16)) & np.uint64(1), 1.0, -1.0)
        out += np.bincount(bucket.astype(np.int64), weights=sign * values, minlength=buckets)
    return out


def sketch_update(entries: Sequence[Entry], key: bytes) -> np.ndarray:
    """The update's direction-check sketch (float64, :data:`SKETCH_DIM`) under ``key``: every record's
    coordinates (:func:`gradwire.accumulate.entry_coefficients`) in :func:`count_sketch`."""
    return count_sketch([(e.name, entry_coefficients(e)) for e in entries], SKETCH_DIM, key)


def sketched_alignment(
    sketches: Sequence[np.ndarray] | np.ndarray, sq_norms: Sequence[float], coeffs: Sequence[float]
) -> list[float]:
    """:func:`gradwire.aggregation.sender_alignment` from sketches: the cosine of each sender's update with
    ``Σ_{j≠i} coeffsⱼ uⱼ``, its inner products estimated from ``sketches`` and its squared norm exact
    (``sq_norms``: each update's ``|uᵢ|²``); 0 where either is zero. ``sketches``: one per sender, or their
    ``(senders, SKETCH_DIM)`` matrix (read in place: no copy of a round's sketches)."""
    n = len(sketches)
    if len(coeffs) != n or len(sq_norms) != n:
        raise ValueError(f"got {len(coeffs)} coefficients and {len(sq_norms)} norms for {n} sketches")
    if n == 0:
        return []
    m = sketches if isinstance(sketches, np.ndarray) and sketches.ndim == 2 else np.stack(sketches)
    a = np.asarray([float(c) for c in coeffs], dtype=np.float64)
    dot = m @ (a @ m)  # <u_i, S>, S = Σ_j a_j u_j
    s_sq = float(a @ dot)  # |S|² = Σ_j a_j <u_j, S>
    out = []
    for i in range(n):
        sq = float(sq_norms[i])
        rest_dot = float(dot[i]) - a[i] * sq
        rest_sq = max(0.0, s_sq - 2.0 * a[i] * float(dot[i]) + a[i] * a[i] * sq)
        denom = math.sqrt(sq) * math.sqrt(rest_sq)
        out.append(rest_dot / denom if denom > 0.0 and math.isfinite(denom) else 0.0)
    return out
