"""Throughput of the Rust kernels on 64 MiB, beside memcpy and numpy, measured in one run.

Every row works on 64 MiB of *uncompressed* data: what an encoder reads and a decoder writes (uint32
indices for bit packing, int8 trits for quartic coding, quartic bytes for zero-run coding, raw bytes for
CRC-32C). Figures are those uncompressed bytes per second, best of ``--repeat`` runs, so an encoder and
its decoder are measured on the same amount of data. Beside each: a plain copy of that 64 MiB buffer
into a preallocated one in the same process (numpy.copyto, i.e. memcpy), and a vectorised numpy
implementation of the same transformation (for CRC-32C, which has no vectorised numpy form, zlib's C
CRC-32 of the same bytes stands in). Decoders write into a preallocated buffer (their ``out=``), as
memcpy does; encoders allocate their (small) output on every call.

Usage: python bench/kernels.py [--mib 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import zlib

import numpy as np
from rich.console import Console
from rich.table import Table

from gradwire import wire
from timing import best

# ------------------------------------------------------------------------------------------------
# numpy versions of the same transformations


def np_pack_bits(values: np.ndarray, bits: int) -> bytes:
    if bits == 12:  # two values → three bytes, as Templar's pack_12bit_indices
        v = values.astype(np.uint32)
        if v.size % 2:
            v = np.append(v, 0)
        a, b = v[0::2], v[1::2]
        out = np.empty((a.size, 3), np.uint8)
        out[:, 0] = a & 0xFF
        out[:, 1] = ((a >> 8) & 0x0F) | ((b & 0x0F) << 4)
        out[:, 2] = b >> 4
        return out.tobytes()[: (values.size * 12 + 7) // 8]
    bitplanes = ((values[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(bitplanes.reshape(-1), bitorder="little").tobytes()


def np_unpack_bits(data: bytes, bits: int, count: int) -> np.ndarray:
    if bits == 12:
        n2 = (count + 1) // 2
        raw = np.frombuffer(data, np.uint8)
        raw = np.concatenate([raw, np.zeros(n2 * 3 - raw.size, np.uint8)]).reshape(n2, 3).astype(np.uint32)
        out = np.empty((n2, 2), np.uint32)
        out[:, 0] = raw[:, 0] | ((raw[:, 1] & 0x0F) << 8)
        out[:, 1] = (raw[:, 1] >> 4) | (raw[:, 2] << 4)
        return out.reshape(-1)[:count]
    stream = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")[: count * bits]
    return (stream.reshape(count, bits).astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(1, dtype=np.uint32)


_POW = np.array([81, 27, 9, 3, 1], np.uint8)


def np_quartic_encode(trits: np.ndarray) -> bytes:
    d = (trits + 1).astype(np.uint8)
    length = -(-d.size // 5)
    planes = np.zeros(5 * length, np.uint8)
    planes[: d.size] = d
    return (planes.reshape(5, length) * _POW[:, None]).sum(0, dtype=np.uint8).tobytes()


def np_quartic_decode(data: bytes, count: int) -> np.ndarray:
    b = np.frombuffer(data, np.uint8)
    planes = (b[None, :] // _POW[:, None]) % 3
    return planes.reshape(-1)[:count].astype(np.int8) - 1


def np_zero_run_encode(data: bytes) -> bytes:
    b = np.frombuffer(data, np.uint8)
    is_z = b == 121
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_z.astype(np.int8), [0]])))
    starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
    rem = lengths % 14
    tail = np.where(rem >= 2, 243 + rem - 2, 121).astype(np.uint8)
    other = np.flatnonzero(~is_z)
    # tokens (value, repeat) ordered by where they stand: key 2p for a byte or a run's 255s, 2p+1 for a run's tail
    keys = np.concatenate([2 * other, 2 * starts, 2 * starts + 1])
    vals = np.concatenate([b[other], np.full(starts.size, 255, np.uint8), tail])
    reps = np.concatenate([np.ones(other.size, np.int64), lengths // 14, (rem >= 1).astype(np.int64)])
    order = np.argsort(keys, kind="stable")
    return np.repeat(vals[order], reps[order]).tobytes()


def np_zero_run_decode(data: bytes) -> bytes:
    b = np.frombuffer(data, np.uint8)
    reps = np.where(b > 242, b.astype(np.int64) - 241, 1)
    vals = np.where(b > 242, np.uint8(121), b)
    return np.repeat(vals, reps).tobytes()


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n_bytes = args.mib << 20
    rng = np.random.default_rng(0)

    # Inputs of n_bytes each, shaped like what the codecs feed these kernels.
    idx12 = rng.integers(0, 4096, n_bytes // 4, dtype=np.uint32)
    packed12 = wire.pack_bits(idx12, 12)
    trits = rng.choice(np.array([-1, 0, 1], np.int8), n_bytes, p=[0.05, 0.9, 0.05])
    quartic = wire.quartic_encode(trits)
    zr_in = np.frombuffer(
        wire.quartic_encode(rng.choice(np.array([-1, 0, 1], np.int8), 5 * n_bytes, p=[0.01, 0.98, 0.01])), np.uint8
    )[:n_bytes].copy()
    zr = wire.zero_run_encode(zr_in)
    zr_share = float((zr_in == 121).mean())
    # 3LC with a larger sparsity multiplier (or sparser gradients) makes longer runs.
    zr_sparse = np.frombuffer(
        wire.quartic_encode(rng.choice(np.array([-1, 0, 1], np.int8), 5 * n_bytes, p=[0.0025, 0.995, 0.0025])), np.uint8
    )[:n_bytes].copy()
    # Decoders write into a buffer reused across calls (their `out=`), as memcpy writes into one.
    idx_out, trit_out, zr_out = np.empty_like(idx12), np.empty_like(trits), np.empty_like(zr_in)
    blob = rng.integers(0, 256, n_bytes, dtype=np.uint8)

    assert np_pack_bits(idx12, 12) == packed12
    assert np.array_equal(np_unpack_bits(packed12, 12, idx12.size), idx12)
    assert np_quartic_encode(trits) == quartic
    assert np.array_equal(np_quartic_decode(quartic, trits.size), trits)
    assert np_zero_run_decode(zr) == zr_in.tobytes()
    assert np_zero_run_encode(zr_in.tobytes()) == zr

    rows = [
        # name, the uncompressed buffer (throughput base), rust fn, numpy fn, target ×memcpy
        ("pack_bits (12 bit)", idx12, lambda: wire.pack_bits(idx12, 12), lambda: np_pack_bits(idx12, 12), 0.25),
        (
            "unpack_bits (12 bit)",
            idx12,
            lambda: wire.unpack_bits(packed12, 12, idx12.size, out=idx_out),
            lambda: np_unpack_bits(packed12, 12, idx12.size),
            0.25,
        ),
        ("quartic_encode", trits, lambda: wire.quartic_encode(trits), lambda: np_quartic_encode(trits), 0.25),
        (
            "quartic_decode",
            trits,
            lambda: wire.quartic_decode(quartic, trits.size, out=trit_out),
            lambda: np_quartic_decode(quartic, trits.size),
            0.25,
        ),
        (
            "zero_run_encode",
            zr_in,
            lambda: wire.zero_run_encode(zr_in),
            lambda: np_zero_run_encode(zr_in.tobytes()),
            0.25,
        ),
        (
            "zero_run_encode, 97.5% runs",
            zr_sparse,
            lambda: wire.zero_run_encode(zr_sparse),
            lambda: np_zero_run_encode(zr_sparse.tobytes()),
            0.25,
        ),
        ("zero_run_decode", zr_in, lambda: wire.zero_run_decode(zr, out=zr_out), lambda: np_zero_run_decode(zr), 0.25),
        ("crc32c (numpy: zlib crc32)", blob, lambda: wire.crc32c(blob), lambda: zlib.crc32(blob), 0.5),
    ]
    table = Table(
        title=f"gradwire kernels: uncompressed bytes/s (best of {args.repeat}); "
        f"zero-run input {zr_share:.0%} zero-run bytes"
    )
    for col in ("kernel", "data", "kernel GB/s", "memcpy GB/s", "× memcpy", "numpy GB/s", "× numpy", "target", "ok"):
        table.add_column(col, justify="right")
    for name, arr, rust_fn, np_fn, target in rows:
        src = np.ascontiguousarray(arr)
        dst = np.empty_like(src)
        t_copy = best(lambda: np.copyto(dst, src), args.repeat)
        t_rust = best(rust_fn, args.repeat)
        t_np = best(np_fn, max(1, args.repeat // 2))
        nb = src.nbytes
        ratio = t_copy / t_rust
        table.add_row(
            name,
            f"{nb / 2**20:.0f} MiB",
            f"{nb / t_rust / 1e9:.2f}",
            f"{nb / t_copy / 1e9:.2f}",
            f"{ratio:.2f}",
            f"{nb / t_np / 1e9:.2f}",
            f"{t_np / t_rust:.1f}",
            f"≥ {target}",
            "yes" if ratio >= target else "NO",
        )
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
