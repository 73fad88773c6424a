"""Seeds the fuzz corpora (rust/core/fuzz/corpus/<target>/) from the golden vectors and the encoders.

Every seed is an input the target's decoder accepts, laid out as that target reads its input (the
leading parameter bytes each fuzz_targets/<target>.rs takes apart, then the encoded bytes): the golden
frames of tests/vectors and a frame of every wire codec for the frame targets, published versions and
catch-ups for the frame stream, layout frames of its templates for the layout frame target, and for the
section decoders what gradwire's encoders write at a spread of widths, counts and parameters. The fuzzer
starts from valid inputs and mutates inward instead of having to discover the layouts first.

The corpora are checked in minimized (`make fuzz-cmin` after a campaign); run this only to re-seed, then
minimize: ``.venv/bin/python rust/core/fuzz/make_corpus.py && make fuzz-cmin``.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path

import numpy as np
import torch

import gradwire
from gradwire import wire
from gradwire.codecs import CODECS, make_codec
from gradwire.frame import RecordTemplate
from gradwire.published import write_published, write_published_aggregate

HERE = Path(__file__).resolve().parent
VECTORS = HERE.parents[2] / "tests" / "vectors"
rng = np.random.default_rng(20261127)


def u16(n: int) -> bytes:
    return struct.pack("<H", n)


def write(target: str, seeds: list[bytes]) -> None:
    """Each seed in corpus/<target>/ under its SHA-1, as libFuzzer names corpus files."""
    folder = HERE / "corpus" / target
    folder.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        (folder / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
    print(f"{target}: {len(seeds)} seeds, {sum(map(len, seeds))} bytes")


def golden_frames() -> list[bytes]:
    return [p.read_bytes() for p in sorted(VECTORS.glob("*.gwf"))]


#: What the codecs that need a parameter get.
SPARSE_PARAMS = {"topk": {"k": 16}, "randomk": {"k": 16}}


def codec_frames() -> list[bytes]:
    """One bundle frame per wire codec, of a 2-D and a 1-D tensor (a codec that refuses one is skipped)."""
    g = torch.Generator().manual_seed(7)
    tensors = {"w": torch.randn(24, 20, generator=g), "b": torch.randn(37, generator=g)}
    frames = []
    for name in CODECS:
        try:
            codec = make_codec(name, **SPARSE_PARAMS.get(name, {}))
            entries = [entry for entry, _ in codec.compress_bundle(tensors).values()]
            frames.append(gradwire.write_frame(entries, round=3, sender=2, bundle=True))
        except (ValueError, TypeError, RuntimeError) as exc:
            print(f"  codec {name}: skipped ({exc})", file=sys.stderr)
    return frames


def parse_frame_seeds(frames: list[bytes]) -> list[bytes]:
    # even first byte: the frame as is; odd: the target puts magic, version, length and CRC around
    # bytes 6..-4 of it (flags, round, sender, entry count, then the records)
    return [b"\x00" + f for f in frames] + [b"\x01" + f[6:-4] for f in frames]


def frame_stream_seeds(frames: list[bytes]) -> list[bytes]:
    identity = make_codec("identity")
    node = [gradwire.write_frame([identity.compress(torch.full((5,), float(i)), "x")[0]], round=4, sender=i + 1,
                                 bundle=True) for i in range(3)]
    verbatim = write_published(4, node, [0.5, 0.25, 0.25])
    trimmed = write_published(5, node, [1.0, 1.0, 1.0], trim=1)
    reencoded = write_published_aggregate(6, [identity.compress(torch.ones(5), "x")[0]], senders=3)
    streams = [verbatim, trimmed, reencoded, verbatim + reencoded, b"".join(frames[:4]), b"".join(frames[4:])]
    return [mode + s for s in streams for mode in (b"\x00", b"\x01")]


#: The layout_frame target's templates (fuzz_targets/layout_frame.rs holds the same): the default DCT codec's
#: records of a 24×20 and of a 37-element float32 tensor, and an identity record of 8×4 bf16 values.
DCT_SECTIONS = (("idx", 0), ("val", 1), ("scale", 10), ("min", 10))
WEIGHT_PARAMS = bytes.fromhex("00024000000040000000200000000c0800200e000000000000")  # 64×64 chunks, k 32, pad 3616
BIAS_PARAMS = bytes.fromhex("00024000000040000000200000000c0800db0f000000000000")  # the same, pad 4059
LAYOUT_TEMPLATES = (
    RecordTemplate("layers.0.weight", 1, torch.float32, (24, 20), WEIGHT_PARAMS, DCT_SECTIONS),
    RecordTemplate("layers.0.bias", 1, torch.float32, (37,), BIAS_PARAMS, DCT_SECTIONS),
    RecordTemplate("embed", 0, torch.bfloat16, (8, 4), b"", (("data", 9),)),
)


def layout_frame_seeds() -> list[bytes]:
    """Layout frames of the target's templates: compact records with the template's params and with their
    own, full ones (no template, another shape), an empty frame; a full record that matches its template
    (the writer writes it compact: the rewrite is shorter); a plain bundle (flag bit 1 clear)."""
    g = torch.Generator().manual_seed(11)
    dct, few, identity = make_codec("dct"), make_codec("dct", topk=8), make_codec("identity")
    w = dct.compress(torch.randn(24, 20, generator=g), "layers.0.weight")[0]
    w8 = few.compress(torch.randn(24, 20, generator=g), "layers.0.weight")[0]  # its own params
    b = dct.compress(torch.randn(37, generator=g), "layers.0.bias")[0]
    b36 = dct.compress(torch.randn(36, generator=g), "layers.0.bias")[0]  # not the template's shape: full
    emb = identity.compress(torch.randn(8, 4, generator=g).to(torch.bfloat16), "embed")[0]
    head = identity.compress(torch.randn(5, generator=g), "head")[0]  # no template: full

    def layout(entries: list, round: int, sender: int) -> bytes:
        return gradwire.write_frame(entries, round=round, sender=sender, bundle=True, templates=LAYOUT_TEMPLATES)

    frames = [layout([w, b, emb], 3, 1), layout([emb, w8, head, b36], 9, 4), layout([], 1, 2)]
    # even first byte: the frame as is; odd: magic, version, length and CRC put around bytes 6..-4 of it,
    # the flags set to a layout bundle (first byte 7 mod 8: the flags' bits 0 and 1 kept)
    seeds = [b"\x00" + f for f in frames] + [b"\x01" + f[6:-4] for f in frames]
    one = gradwire.write_frame([w], round=3, sender=1, bundle=True)
    seeds.append(b"\x01" + b"\x03\x00" + one[8:32] + b"\x00" + one[32:-4])  # the record behind tag 0
    plain = gradwire.write_frame([b, head], round=2, sender=5, bundle=True)
    seeds += [b"\x00" + plain, b"\x07" + plain[6:-4]]
    return seeds


def unpack_bits_seeds() -> list[bytes]:
    out = []
    for bits in (1, 2, 3, 5, 8, 13, 16, 31, 32):
        for count in (0, 1, 7, 64, 333):
            values = rng.integers(0, 1 << bits, count, dtype=np.uint64).astype(np.uint32)
            out.append(bytes([bits]) + u16(count) + wire.pack_bits(values, bits))
    return out


def quartic_count_bytes(count: int, length: int) -> bytes:
    """The target's two count bytes for `count` trits in `length` bytes: odd raw values are the count
    itself, even ones `5·length - raw % 5`."""
    if count % 2:
        return u16(count)
    pad = 5 * length - count
    return u16(pad if pad % 2 == 0 else pad + 5)


def quartic_seeds() -> list[bytes]:
    out = []
    for count in (1, 4, 5, 9, 10, 121, 500):
        data = wire.quartic_encode(rng.integers(-1, 2, count).astype(np.int8))
        out.append(quartic_count_bytes(count, len(data)) + data)
    return out


def zero_run_seeds() -> list[bytes]:
    out = []
    for count, density in ((10, 0.5), (605, 0.02), (5000, 0.001), (300, 0.0), (2000, 0.3)):
        trits = np.where(rng.random(count) < density, rng.choice([-1, 1], count), 0).astype(np.int8)
        quartic = wire.quartic_encode(trits)
        encoded = wire.zero_run_encode(quartic)
        out.append(b"\x01\x00\x00" + encoded)  # mode 1: the decoded length read from the data
        if len(quartic) < 1 << 16:
            out.append(b"\x02" + u16(len(quartic)) + encoded)  # mode 2: the length given
    return out


def rice_seeds() -> list[bytes]:
    out = []
    for universe, set_len, sets in ((64, 8, 3), (4096, 32, 4), (1 << 20, 100, 2), (17, 17, 1), (300, 1, 40)):
        idx = np.concatenate([np.sort(rng.choice(universe, set_len, replace=False)) for _ in range(sets)])
        idx = idx.astype(np.uint32)
        param, _ = wire.rice_param(idx, universe, set_len=set_len)
        for p in sorted({param, max(param - 2, 0), min(param + 3, 31)}):
            data = wire.rice_encode(idx, universe, p, set_len=set_len)
            out.append(bytes([p]) + u16(len(idx)) + bytes([set_len]) + struct.pack("<I", universe - 1)[:3] + data)
    return out


def elias_seeds() -> list[bytes]:
    out = []
    for kind, code in (("gamma", 0), ("omega", 1)):
        for count, top in ((1, 2), (20, 9), (300, 70000), (64, 1 << 40)):
            values = rng.integers(1, top, count, dtype=np.uint64)
            out.append(bytes([code]) + u16(count) + b"\x00\x00\x00" + wire.elias_encode(values, kind))
        for count, universe, max_level in ((5, 40, 1), (60, 5000, 127), (200, 65535, 255)):
            positions = np.sort(rng.choice(universe, count, replace=False)).astype(np.uint64)
            levels = (rng.integers(1, max_level + 1, count) * rng.choice([-1, 1], count)).astype(np.int32)
            data = wire.sparse_levels_encode(positions, levels, kind)
            out.append(bytes([code]) + u16(count) + bytes([max_level]) + u16(universe) + data)
    return out


def huffman_seeds() -> list[bytes]:
    out = []
    for cap, alphabet, count in ((8, 4, 100), (12, 40, 1000), (15, 256, 3000), (10, 256, 50)):
        symbols = rng.zipf(1.6, count).clip(1, alphabet).astype(np.uint8) - 1
        book = wire.huffman_book(np.bincount(symbols, minlength=256).astype(np.uint64), cap)
        if len(book) > 255:
            continue
        out.append(bytes([len(book)]) + u16(count) + book + wire.huffman_encode(symbols, book))
    return out


def chunk_positions(rows: int, last: int, k: int, chunks: int) -> list[int]:
    """`k` ascending distinct positions below rows·last per chunk, as the target's bytes (position + 4)."""
    out = []
    for _ in range(chunks):
        out.extend(int(p) + 4 for p in np.sort(rng.choice(rows * last, k, replace=False)))
    return out


def dct_folded_seeds() -> list[bytes]:
    out = []
    for rows, last, k, chunks, threads, grid in ((8, 8, 11, 5, 1, 1), (4, 8, 3, 4, 2, 2), (6, 6, 5, 2, 3, 1),
                                                 (8, 4, 8, 3, 1, 3), (2, 2, 4, 1, 1, 1)):
        out.append(bytes([rows, last, k, chunks, threads, grid]) + bytes(chunk_positions(rows, last, k, chunks)))
    return out


def dct_folded_mean_seeds() -> list[bytes]:
    out = []
    for rows, last, senders, chunks, threads, grid in ((8, 8, 3, 4, 1, 1), (4, 8, 4, 2, 2, 2), (6, 6, 2, 3, 3, 1)):
        body = bytearray()
        ks = [int(rng.integers(1, 10)) for _ in range(senders)]
        for k in ks:
            body.append(k)
            body.extend(chunk_positions(rows, last, k, chunks))
        seed = bytes([rows, last, senders, chunks, threads, grid, 40]) + bytes(body)
        out.append(seed)
    return out


def dct_rows_seeds() -> list[bytes]:
    out = []
    for rows, last, k, chunks, threads in ((8, 8, 11, 5, 1), (3, 5, 4, 2, 2), (8, 7, 6, 3, 3)):
        out.append(bytes([0, rows, last, k, chunks, threads, 0]) + bytes(chunk_positions(rows, last, k, chunks)))
    for rows, last, chunks, first, grid, threads in ((6, 6, 4, 0, 1, 1), (4, 5, 2, 1, 3, 2), (3, 3, 3, 3, 2, 3)):
        total = first + chunks
        c = chunks + 5 * total  # chunks = c % 5, chunks of the whole output = c / 5 % 8
        sums = rng.integers(-128, 128, rows * chunks * 2 * last).astype(np.int8).tobytes()
        out.append(bytes([1, rows, last, c, first, grid, threads]) + sums)
    return out


def scatter_add_rows_seeds() -> list[bytes]:
    out = []
    for k, row_len, rows, weight in ((3, 16, 4, 16), (1, 8, 9, 200), (8, 9, 2, 1)):
        positions = [int(p) + 8 for _ in range(rows) for p in rng.choice(row_len, k, replace=False)]
        values = rng.integers(0, 256, rows * k).astype(np.uint8).tobytes()
        out.append(bytes([k, row_len, weight, 1]) + bytes(positions) + values)
    return out


def main() -> None:
    frames = golden_frames() + codec_frames()
    write("parse_frame", parse_frame_seeds(frames))
    write("frame_stream", frame_stream_seeds(frames))
    write("layout_frame", layout_frame_seeds())
    write("unpack_bits", unpack_bits_seeds())
    write("quartic_decode", quartic_seeds())
    write("zero_run_decode", zero_run_seeds())
    write("rice_decode", rice_seeds())
    write("elias_decode", elias_seeds())
    write("huffman_decode", huffman_seeds())
    write("dct_decode_folded", dct_folded_seeds())
    write("dct_decode_folded_mean", dct_folded_mean_seeds())
    write("dct_decode_rows", dct_rows_seeds())
    write("scatter_add_rows", scatter_add_rows_seeds())


if __name__ == "__main__":
    main()
