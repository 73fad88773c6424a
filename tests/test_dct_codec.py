"""gradwire.DCTCodec: frames of DCT top-k int8 records (FORMAT.md §5.2), and the decoder's checks."""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import struct

import numpy as np
import pytest
import torch

import gradwire
from gradwire import FrameError, wire
from gradwire.dct import DCTCodec, index_bits_for, pack_params, unpack_params
from gradwire.frame import read_frame, write_frame

CUDA = torch.cuda.is_available()


def _rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _entry(frame: bytes):
    return read_frame(frame).entries[0]


# ---------------------------------------------------------------------------------------------
# Round trips

SHAPES = [
    (4096,),  # 1-D, whole chunks
    (1000,),  # 1-D, padded
    (97,),  # prime length
    (13, 7),  # odd sizes
    (64, 64),
    (130, 70),
    (8, 3, 3, 3),  # conv weight
    (32, 16, 3, 3),  # conv weight
    (),  # scalar
    (1,),
]


@pytest.mark.parametrize("mode", ["flat", "tiles"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_frame_round_trip_equals_compress_reconstruction(mode, shape):
    codec = DCTCodec(chunk_shape=(64, 64), topk=32, mode=mode)
    x = _rand(shape, seed=1)
    entry, recon = codec.compress(x, "w")
    frame = write_frame([entry])
    out = gradwire.decode(frame)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, recon)  # bit for bit: receivers decode exactly what the sender accounted for
    assert torch.equal(codec.decode(codec.encode(x)), recon)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", ["flat", "tiles"])
def test_other_dtypes_round_trip_in_their_dtype(dtype, mode):
    codec = DCTCodec(topk=64, mode=mode)
    x = _rand((96, 80), dtype, seed=2)
    entry, recon = codec.compress(x)
    assert entry.dtype == dtype and recon.dtype == dtype
    out = gradwire.decode(write_frame([entry]))
    assert out.dtype == dtype and torch.equal(out, recon)


@pytest.mark.parametrize("mode", ["flat", "tiles"])
@pytest.mark.parametrize("shape", [(64, 64), (100, 30), (37,), (8, 3, 3, 3)], ids=str)
def test_keeping_every_coefficient_reconstructs_within_quantization_error(mode, shape):
    codec = DCTCodec(chunk_shape=(16, 16), topk=10**6, mode=mode)  # k_eff = C
    x = _rand(shape, seed=3)
    out = codec.decode(codec.encode(x))
    assert (out - x).abs().max() < 0.1
    assert (out - x).norm() < 0.05 * x.norm()


def test_topk_keeps_the_largest_coefficients():
    from gradwire.dct import idct_nd

    coeffs = torch.zeros(64, 64)
    coeffs[0, 3], coeffs[5, 1], coeffs[63, 63] = 4.0, -2.0, 1.0
    x = idct_nd(coeffs)
    codec = DCTCodec(topk=3)
    entry, recon = codec.compress(x)
    idx = wire.unpack_bits(entry.sections["idx"], 12, 3)
    assert idx.tolist() == [3, 5 * 64 + 1, 64 * 64 - 1]
    assert (recon - x).abs().max() < 1e-3


def test_indices_packed_at_12_bits_for_64x64_chunks():
    x = _rand((3 * 4096,), seed=4)
    entry = _entry(DCTCodec(chunk_shape=(64, 64), topk=32).encode(x))
    p = unpack_params(entry.params)
    assert p == dict(mode=0, chunk_shape=(64, 64), k=32, index_bits=12, value_bits=8, index_coding=0, pad_count=0)
    assert entry.sections["idx"].dtype == np.uint8
    assert entry.sections["idx"].shape == (3 * 32 * 12 // 8,)  # 144 bytes
    assert entry.sections["val"].dtype == np.int8 and entry.sections["val"].shape == (96,)
    assert entry.sections["scale"].dtype == np.float32 and entry.sections["scale"].shape == (3,)
    assert entry.sections["min"].dtype == np.float32 and entry.sections["min"].shape == (3,)
    assert list(entry.sections) == ["idx", "val", "scale", "min"]


def test_indices_ascend_within_each_chunk():
    entry = _entry(DCTCodec(topk=50).encode(_rand((5, 4096), seed=5)))
    idx = wire.unpack_bits_exact(entry.sections["idx"], 12, 5 * 50).reshape(5, 50).astype(np.int64)
    assert np.all(np.diff(idx, axis=1) > 0)


def test_k_is_capped_at_the_chunk_size():
    entry, _ = DCTCodec(chunk_shape=(4, 4), topk=32).compress(_rand((40,), seed=6))
    p = unpack_params(entry.params)
    assert p["k"] == 16 and p["index_bits"] == 4 and p["pad_count"] == 8


@pytest.mark.parametrize(
    "shape, tile, k",
    [
        ((1024, 64), (64, 64), 24),  # full tiles keep topk
        ((1000, 100), (50, 50), 15),  # 2500-element tiles: 24 × 2500 / 4096 = 14.6
        ((512,), (64,), 1),  # a bias's 64-element tiles: 0.375, at least 1
        ((7,), (7,), 1),
    ],
)
def test_proportional_topk_keeps_a_chunks_share_of_a_full_chunks_budget(shape, tile, k):
    codec = DCTCodec(chunk_shape=(64, 64), topk=24, mode="tiles", topk_scaling="proportional")
    x = _rand(shape, seed=21)
    entry, recon = codec.compress(x)
    p = unpack_params(entry.params)
    assert (p["chunk_shape"], p["k"]) == (tile, k)
    assert codec.chunk_topk(math.prod(tile)) == k
    # The record carries its k: a reader decodes it like any other, bit for bit.
    assert torch.equal(gradwire.decode(write_frame([entry])), recon)
    fixed = unpack_params(DCTCodec(chunk_shape=(64, 64), topk=24, mode="tiles").compress(x)[0].params)["k"]
    assert fixed == min(24, math.prod(tile))


def test_model_record_codec_keeps_the_topk_scaling():
    from gradwire.model_record import model_record_codec

    flat = model_record_codec(DCTCodec(mode="tiles", topk=24, topk_scaling="proportional"))
    assert (flat.mode, flat.topk_scaling) == (0, "proportional")
    assert "topk_scaling='proportional'" in repr(flat)


@pytest.mark.parametrize(
    "shape, chunk_shape",
    [((64, 3, 3, 3), (64, 27)), ((4096, 1024), (64, 64)), ((100, 30), (50, 30)), ((), (1,))],
)
def test_tiles_mode_records_the_tile_shape(shape, chunk_shape):
    x = torch.zeros(shape) if math.prod(shape) > 10**5 else _rand(shape, seed=7)
    entry, _ = DCTCodec(mode="tiles", topk=8).compress(x)
    p = unpack_params(entry.params)
    assert p["mode"] == 1 and p["chunk_shape"] == chunk_shape and p["pad_count"] == 0


def test_empty_tensor_round_trips_in_both_modes():
    for mode in ("flat", "tiles"):
        x = torch.zeros(0, 5)
        out = gradwire.decode(DCTCodec(mode=mode).encode(x))
        assert out.shape == (0, 5)


def test_chunks_beyond_the_decode_limits_are_refused_up_front():
    # Bounds on C and on each side keep the exact decode's work and memory small for any valid record.
    with pytest.raises(ValueError, match="2\\^16"):
        DCTCodec(chunk_shape=(1 << 20,), topk=4)
    with pytest.raises(ValueError, match="1024"):
        DCTCodec(chunk_shape=(2048, 2), topk=4)
    codec = DCTCodec(chunk_shape=(1024,), topk=4)
    x = _rand((3000,), seed=14)
    entry, recon = codec.compress(x)
    assert unpack_params(entry.params)["index_bits"] == 10
    assert torch.equal(gradwire.decode(write_frame([entry])), recon)


def test_index_bits_rule():
    assert [index_bits_for(c) for c in (1, 2, 3, 4, 5, 4096, 4097, 1 << 24)] == [1, 1, 2, 2, 3, 12, 13, 24]


def test_non_finite_input_is_rejected():
    x = _rand((64,), seed=8)
    x[3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        DCTCodec(chunk_shape=(64,)).compress(x)
    x[3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        DCTCodec(chunk_shape=(64,)).compress(x)


def test_integer_tensors_are_rejected():
    with pytest.raises(ValueError):
        DCTCodec().compress(torch.arange(10))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(chunk_shape=()),
        dict(chunk_shape=(0, 4)),
        dict(chunk_shape=(1,) * 9),
        dict(chunk_shape=(4097, 4096)),
        dict(topk=0),
        dict(mode="zigzag"),
        dict(mode=2),
        dict(topk_scaling="density"),
    ],
)
def test_bad_codec_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        DCTCodec(**kwargs)


def test_make_codec_builds_a_dct_codec():
    codec = gradwire.make_codec("dct", topk=8, mode="tiles")
    assert isinstance(codec, DCTCodec) and codec.topk == 8


def test_bundle_of_several_tensors_round_trips():
    codec = DCTCodec(topk=16)
    tensors = {
        "a": _rand((64, 64), seed=9),
        "b": _rand((10,), torch.bfloat16, seed=10),
        "c": _rand((3, 3, 3, 3), seed=11),
    }
    out = gradwire.decode_bundle(codec.encode_bundle(tensors))
    assert list(out) == ["a", "b", "c"]
    for n, t in tensors.items():
        assert torch.equal(out[n], codec.compress(t, n)[1])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["flat", "tiles"])
def test_cuda_round_trip_equals_compress_reconstruction(mode):
    codec = DCTCodec(topk=32, mode=mode)
    x = _rand((300, 200), seed=12).cuda()
    entry, recon = codec.compress(x)
    assert recon.device == x.device
    out = gradwire.decode(write_frame([entry]), device=x.device)
    assert out.device == x.device and torch.equal(out, recon)
    # ... and the CPU decodes the same frame to the same values up to float rounding.
    torch.testing.assert_close(gradwire.decode(write_frame([entry])), recon.cpu(), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Malformed records: each rule raises FrameError naming it. Records are edited and re-written with
# write_frame, so the CRC is valid and only the DCT decoder can object.


def _good(mode="flat", shape=(100, 70), topk=8, chunk_shape=(16, 16)):
    codec = DCTCodec(chunk_shape=chunk_shape, topk=topk, mode=mode)
    entry = _entry(codec.encode(_rand(shape, seed=13), name="w"))
    entry.sections = {k: np.array(v) for k, v in entry.sections.items()}  # writable copies
    return entry


def _decode_edited(entry):
    return gradwire.decode(write_frame([entry]))


def _params(entry, **changes):
    p = unpack_params(entry.params)
    p.update(changes)
    c = math.prod(p["chunk_shape"])
    nd = len(p["chunk_shape"])
    return struct.pack(f"<BB{nd}I", p["mode"], nd, *p["chunk_shape"]) + struct.pack(
        "<IBBBQ",
        p["k"],
        changes.get("index_bits", index_bits_for(c)),
        p["value_bits"],
        p["index_coding"],
        p["pad_count"],
    )


def test_unedited_record_decodes():
    _decode_edited(_good())
    _decode_edited(_good("tiles"))


PARAM_CASES = [
    ("short params", lambda e: b"\x00", "params must be at least 2 bytes"),
    ("mode", lambda e: _params(e, mode=2), "mode must be 0"),
    ("chunk_ndim 0", lambda e: b"\x00\x00" + e.params[2 + 8 :], "chunk_ndim must lie in 1..8"),
    ("chunk_ndim 9", lambda e: _params(e, chunk_shape=(1,) * 9), "chunk_ndim must lie in 1..8"),
    ("params length", lambda e: e.params + b"\x00", "params length must be"),
    ("params truncated", lambda e: e.params[:-1], "params length must be"),
    ("zero dim", lambda e: _params(e, chunk_shape=(0, 16)), "chunk_shape dimensions must be >= 1"),
    ("C too large", lambda e: _params(e, chunk_shape=(257, 256)), "exceeds 2^16"),
    ("side too long", lambda e: _params(e, chunk_shape=(2048, 2)), "exceeds 1024"),
    ("k zero", lambda e: _params(e, k=0), "1 <= k <= C"),
    ("k above C", lambda e: _params(e, k=257), "1 <= k <= C"),
    ("index_bits", lambda e: _params(e, index_bits=9), "index_bits must equal max(1, ceil(log2 C))"),
    ("value_bits", lambda e: _params(e, value_bits=3), "value_bits must be 8, 4, 2 or 1"),
    ("index_coding", lambda e: _params(e, index_coding=2), "index_coding must be 0 (fixed-width) or 1 (Rice)"),
    ("pad_count", lambda e: _params(e, pad_count=0), "pad_count must be (C - numel mod C) mod C"),
    (
        "pad_count plus C",
        lambda e: _params(e, pad_count=unpack_params(e.params)["pad_count"] + 256),
        "pad_count must be",
    ),
]


@pytest.mark.parametrize("case", PARAM_CASES, ids=[c[0] for c in PARAM_CASES])
def test_malformed_params_raise_frame_error_naming_the_rule(case):
    _, edit, rule = case
    e = _good()
    e.params = edit(e)
    with pytest.raises(FrameError, match=_re(rule)) as info:
        _decode_edited(e)
    assert "dct" in str(info.value)


def _re(s):
    import re

    return re.escape(s)


def test_mode1_pad_count_must_be_zero():
    e = _good("tiles")
    e.params = _params(e, pad_count=3)
    with pytest.raises(FrameError, match="pad_count must be 0 in mode 1"):
        _decode_edited(e)


def test_mode1_chunk_shape_is_recomputed_and_must_match():
    e = _good("tiles")  # (100, 70) -> tiles (50, 35)
    assert unpack_params(e.params)["chunk_shape"] == (50, 35)
    e.params = _params(e, chunk_shape=(35, 50))
    with pytest.raises(FrameError, match=r"mode 1 \(tiles\) chunk_shape must be \(50, 35\)"):
        _decode_edited(e)
    e.params = _params(e, chunk_shape=(50, 35, 1))
    with pytest.raises(FrameError, match="chunk_shape must be"):
        _decode_edited(e)


def test_mode1_needs_an_element():
    e = gradwire.Entry(
        name="w",
        codec=1,
        dtype=torch.float32,
        shape=(0, 4),
        params=pack_params(1, (1, 1), 1, 0),
        sections={
            "idx": np.zeros(0, np.uint8),
            "val": np.zeros(0, np.int8),
            "scale": np.zeros(0, np.float32),
            "min": np.zeros(0, np.float32),
        },
    )
    with pytest.raises(FrameError, match="at least one element"):
        _decode_edited(e)


@pytest.mark.parametrize("name", ["idx", "val", "scale", "min"])
def test_missing_section_is_rejected(name):
    e = _good()
    del e.sections[name]
    with pytest.raises(FrameError, match=f"section '{name}' is missing"):
        _decode_edited(e)


def test_unexpected_section_is_rejected():
    e = _good()
    e.sections["extra"] = np.zeros(1, np.uint8)
    with pytest.raises(FrameError, match="unexpected section 'extra'"):
        _decode_edited(e)


def test_sections_out_of_order_are_rejected():
    e = _good()
    e.sections = {k: e.sections[k] for k in ("val", "idx", "scale", "min")}
    with pytest.raises(FrameError, match="order"):
        _decode_edited(e)


@pytest.mark.parametrize(
    "name, dtype",
    [("idx", np.uint16), ("val", np.uint8), ("scale", np.float64), ("min", np.float16), ("scale", np.int32)],
)
def test_section_of_the_wrong_type_is_rejected(name, dtype):
    e = _good()
    e.sections[name] = e.sections[name].astype(dtype)
    with pytest.raises(FrameError, match=f"section '{name}' must have element type"):
        _decode_edited(e)


def test_bf16_tagged_scale_is_rejected():
    e = _good()
    e.sections["scale"] = np.zeros(e.sections["scale"].shape, np.uint16)
    e.section_elems = {"scale": 9}
    with pytest.raises(FrameError, match="section 'scale' must have element type"):
        _decode_edited(e)


@pytest.mark.parametrize(
    "name, rule",
    [
        ("idx", "ceil(num_chunks * k * index_bits / 8)"),
        ("val", "num_chunks * k"),
        ("scale", "num_chunks"),
        ("min", "num_chunks"),
    ],
)
@pytest.mark.parametrize("delta", [-1, 1])
def test_section_of_the_wrong_length_is_rejected(name, rule, delta):
    e = _good()
    a = e.sections[name]
    e.sections[name] = a[:-1] if delta < 0 else np.concatenate([a, a[:1]])
    with pytest.raises(FrameError, match=_re(f"section '{name}' must hold {rule}")):
        _decode_edited(e)


def _set_indices(e, idx):
    p = unpack_params(e.params)
    e.sections["idx"] = np.frombuffer(
        wire.pack_bits(idx.reshape(-1).astype(np.uint32), p["index_bits"]), np.uint8
    ).copy()


def _indices(e):
    p = unpack_params(e.params)
    n = e.sections["scale"].shape[0]
    return wire.unpack_bits_exact(e.sections["idx"], p["index_bits"], n * p["k"]).reshape(n, p["k"]).astype(np.int64)


def test_nonzero_padding_bits_are_rejected():
    e = _good(shape=(3, 16), topk=3, chunk_shape=(16,))  # 3 chunks * 3 * 4 bits = 36 bits -> 4 padding bits
    assert e.sections["idx"].shape == (5,)
    e.sections["idx"][-1] |= 0x80
    with pytest.raises(FrameError, match="idx"):
        _decode_edited(e)


def test_index_out_of_range_is_rejected():
    e = _good(shape=(10, 10), topk=4, chunk_shape=(5, 5))  # C = 25, 5-bit indices can reach 31
    idx = _indices(e)
    idx[1, -1] = 25
    _set_indices(e, idx)
    with pytest.raises(FrameError, match="index out of range"):
        _decode_edited(e)


@pytest.mark.parametrize("how", ["repeat", "descending"])
def test_indices_repeated_or_not_ascending_are_rejected(how):
    e = _good()
    idx = _indices(e)
    if how == "repeat":
        idx[2, 1] = idx[2, 0]
    else:
        idx[2] = idx[2][::-1]
    _set_indices(e, idx)
    with pytest.raises(FrameError, match="strictly ascending"):
        _decode_edited(e)


@pytest.mark.parametrize(
    "name, value, rule",
    [
        ("scale", 0.0, "scales must be > 0"),
        ("scale", -1.0, "scales must be > 0"),
        ("scale", np.nan, "scales must be finite"),
        ("scale", np.inf, "scales must be finite"),
        ("min", np.nan, "mins must be finite"),
        ("min", -np.inf, "mins must be finite"),
        ("scale", 3e38, "dequantized coefficients must be finite"),
    ],
)
def test_bad_scales_and_mins_are_rejected(name, value, rule):
    e = _good()
    e.sections[name][1] = value
    with pytest.raises(FrameError, match=_re(rule)):
        _decode_edited(e)


def test_checks_run_before_the_dense_output_is_allocated(monkeypatch):
    from gradwire.dct import parse

    def boom(*a, **k):
        raise AssertionError("dense output allocated before validation")

    good = _good()  # encoded (the encoder decodes too) before the spy goes in
    e = _good()
    e.shape = (1 << 30,)  # a 4 GiB output if it were allocated
    e.params = _params(e, pad_count=0)
    # The decoder allocates the dense output in ``decode_levels``, which the parser's ``decode_parsed``
    # calls as gradwire.dct.parse imported it: the spy goes there. A valid record reaches it.
    monkeypatch.setattr(parse, "decode_levels", boom)
    with pytest.raises(AssertionError, match="dense output allocated"):
        _decode_edited(good)
    with pytest.raises(FrameError, match="section 'idx' must hold"):
        _decode_edited(e)


def test_decoder_rejects_a_hostile_record_from_raw_bytes_too():
    # A bit flip inside a section is caught by the CRC; the same change with a valid CRC reaches the
    # DCT decoder and is caught there.
    e = _good()
    e.sections["scale"][0] = -e.sections["scale"][0]
    frame = write_frame([e])
    with pytest.raises(FrameError, match="scales must be > 0"):
        gradwire.decode(frame)
    bad = bytearray(frame)
    bad[-10] ^= 1
    with pytest.raises(FrameError):
        gradwire.decode(bytes(bad))


# -- tile mode never degenerates (the fallback to flat chunks) ---------------------------------------


def _mode_of(codec, shape):
    from gradwire.dct import unpack_params

    entry, recon = codec.compress(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), "x")
    assert torch.equal(recon, gradwire.decode_entry(entry))
    return unpack_params(entry.params)


def test_tiles_fall_back_to_flat_chunks_where_tiles_would_be_small():
    from gradwire import dct as D

    codec = gradwire.DCTCodec(mode="tiles", topk=32)
    # 431,463 = 3 × 143,821: tiles would have 3 elements.
    assert D.tile_chunk_shape((431_463,)) == (3,) and D.small_tiles((431_463,))
    p = _mode_of(codec, (431_463,))
    assert p["mode"] == D.MODE_FLAT and p["chunk_shape"] == (64, 64)
    # A 103-row embedding: 1×64 tiles.
    assert D.tile_chunk_shape((103, 64)) == (1, 64) and D.small_tiles((103, 64))
    p = _mode_of(codec, (103, 64))
    assert p["mode"] == D.MODE_FLAT and p["chunk_shape"] == (64, 64)
    # Normal weights keep their tiles; so do tensors that fit one tile, and half-size tiles.
    for shape, tile in [
        ((256, 512), (64, 64)),
        ((1000, 1000), (50, 50)),
        ((8, 12), (8, 12)),
        ((96, 10), (48, 10)),
        ((70,), (35,)),
        ((4, 2, 3, 3), (4, 18)),
        ((97,), None),
    ]:
        p = _mode_of(codec, shape)
        if tile is None:
            # A prime-length vector longer than a tile (its tiles had 1 element before the fallback).
            assert p["mode"] == D.MODE_FLAT and p["pad_count"] == 4096 - 97
        else:
            assert p["mode"] == D.MODE_TILES and p["chunk_shape"] == tile, (shape, p)


def test_tile_fallback_uses_the_configured_chunk_shape():
    from gradwire import dct as D

    p = _mode_of(gradwire.DCTCodec(mode="tiles", chunk_shape=(1024,), topk=8), (103, 64))
    assert p["mode"] == D.MODE_FLAT and p["chunk_shape"] == (1024,)


def test_records_parsed_once_shares_a_parse_per_record_object_inside_the_block():
    from gradwire.dct import parse_record, records_parsed_once

    entry, _ = DCTCodec(mode="tiles", topk=8).compress(_rand((128, 64), seed=31))
    twin = read_frame(write_frame([entry])).entries[0]  # equal bytes, another object
    assert parse_record(entry) is not parse_record(entry)  # outside the block: parsed each time
    with records_parsed_once():
        first = parse_record(entry)
        assert parse_record(entry) is first
        assert parse_record(twin) is not first
        assert torch.equal(parse_record(twin).values, first.values)
    assert parse_record(entry) is not first
    # A record that fails its checks fails every time, block or not.
    bad = read_frame(write_frame([entry])).entries[0]
    bad.sections["scale"] = bad.sections["scale"][:-1]
    with records_parsed_once(), pytest.raises(FrameError):
        parse_record(bad)
    with records_parsed_once(), pytest.raises(FrameError):
        parse_record(bad)


# ---------------------------------------------------------------------------------------------
# A bundle compressed in one batch (what DCTCodec.compress_bundle does on a GPU)

BUNDLE = {
    "emb": (300, 64),  # 60×64 tiles
    "w1": (256, 128),  # 64×64 tiles
    "w2": (128, 128),
    "bias": (128,),  # flat chunks
    "odd": (97, 13),  # small tiles: flat chunks of chunk_shape
    "conv": (8, 3, 3, 3),
    "empty": (0, 5),
}


@pytest.mark.parametrize(
    "codec",
    [
        DCTCodec(topk=16, mode="tiles"),
        DCTCodec(topk=7, mode="tiles", index_coding="rice", value_bits=2, topk_scaling="proportional"),
        DCTCodec(chunk_shape=(64,), topk=5, mode="flat", index_coding="auto", value_bits=4),
    ],
    ids=repr,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bundle_compressed_in_one_batch_gives_each_tensors_own_record_and_reconstruction(codec, dtype):
    tensors = {n: _rand(s, dtype, seed=i) for i, (n, s) in enumerate(BUNDLE.items())}
    batched = codec.compress_batched(tensors)
    assert list(batched) == list(tensors)
    same_bytes = 0
    for name, t in tensors.items():
        entry, recon = codec.compress(t, name)
        b_entry, b_recon = batched[name]
        # Each record decodes exactly to the reconstruction the batch returned for it.
        assert b_recon.dtype == t.dtype
        assert torch.equal(gradwire.decode(write_frame([b_entry])), b_recon.float()), name
        dims = codec.plan(t.shape).chunk_shape
        if len(dims) == 2 and all(d & (d - 1) == 0 for d in dims) or t.numel() == 0:
            # 2-D power-of-two tiles take the Rust transform, the same bits in any batch: the same bytes.
            assert write_frame([b_entry]) == write_frame([entry]), name
            assert torch.equal(b_recon, recon), name
            same_bytes += 1
        else:
            # BLAS's last bits depend on the batch's size: a value at a rounding edge may take the next level.
            assert b_entry.shape == entry.shape and b_entry.dtype == entry.dtype
            assert float((b_recon.float() - recon.float()).norm()) <= 0.25 * float(recon.float().norm()), name
    assert same_bytes >= (3 if codec.mode == 1 else 1)


def test_a_batch_holding_a_non_finite_tensor_is_refused_naming_it():
    tensors = {"ok": _rand((64, 64)), "bad": _rand((64, 64), seed=1)}
    tensors["bad"][3, 5] = float("inf")
    with pytest.raises(ValueError, match="'bad'"):
        DCTCodec(topk=8, mode="tiles").compress_batched(tensors)


def test_decode_level_chunks_decodes_stacked_records_to_each_records_bits():
    from gradwire import dct

    codec = DCTCodec(topk=9, mode="tiles")
    parts = [
        codec.compress_coefficients(dct.encode_chunks(_rand(s, seed=i), codec.plan(s)), codec.plan(s))[1]
        for i, s in enumerate([(128, 64), (64, 192), (256, 64)])
    ]
    stacked = dct.decode_level_chunks(
        torch.cat([p.idx for p in parts]),
        torch.cat([p.levels for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.mins for p in parts]),
        (64, 64),
    )
    row = 0
    for p in parts:
        n = p.plan.num_chunks
        assert torch.equal(dct.from_chunks(stacked[row : row + n], p.plan), p.decode())
        row += n


def test_a_gpu_decode_of_a_large_tiled_tensor_takes_a_few_blocks_within_its_scratch_budget():
    # On a GPU every block is a dozen kernel launches: a 4096×4096 tensor in 64×64 tiles (4,096 chunks)
    # took 128 blocks of the CPU's size, 33–58 ms a decode on an H200 against DeMo's 1–2 ms.
    from gradwire.dct import decode as dd

    gpu = torch.device("cuda")
    for k in (1, 32, 512):
        block = dd._exact_block(gpu, k, (64, 64))
        assert math.ceil(4096 / block) <= (5 if k <= 32 else 24)
        assert block * (6 * 4096 + k * max(64 + 4 * 64, 4 * 64)) * 8 <= 256 * 2**20
    assert dd._exact_block(torch.device("cpu"), 1, (64, 64)) == dd._EXACT_BLOCK_ELEMS // (2 * 4096)


# ---------------------------------------------------------------------------------------------
# Records decoded together (what exact_mean does on a GPU), run here on the CPU through the switches


def _mixed_records(seed: int):
    codecs = [
        DCTCodec(topk=9, mode="tiles"),
        DCTCodec(topk=12, mode="tiles", topk_scaling="proportional", value_bits=4, index_coding="rice"),
    ]
    shapes = {"a": (128, 64), "b": (64, 192), "bias": (100,), "empty": (0, 3), "odd": (37, 5), "c": (60, 64)}
    out = []
    for j, codec in enumerate(codecs):
        for i, (n, s) in enumerate(shapes.items()):
            dtype = torch.bfloat16 if n == "c" else torch.float32
            out.append(codec.compress(_rand(s, dtype, seed=seed * 100 + 10 * j + i), f"{n}{j}")[0])
    return out


def test_records_decoded_together_are_bit_identical_to_each_decoded_alone(monkeypatch):
    from gradwire.dct import capabilities as cd
    from gradwire.frame import decode_entries, decode_entry

    entries = _mixed_records(1)
    assert cd.decode_dct_batch(entries, torch.device("cpu")) is None  # the CPU decodes one by one
    monkeypatch.setattr(cd, "_decodes_stacked", lambda dev: True)
    monkeypatch.setattr(cd, "_BATCH_DECODE_ELEMS", 5000)  # several batches per chunk shape
    together = decode_entries(entries)
    for e, t in zip(entries, together):
        alone = decode_entry(e)
        assert t.dtype == alone.dtype and t.shape == alone.shape and torch.equal(t, alone), e.name


def test_a_hostile_record_among_records_decoded_together_is_refused_before_the_batch_is_decoded(monkeypatch):
    from gradwire.dct import capabilities as cd
    from gradwire.frame import Entry, decode_entries

    entries = _mixed_records(2)
    bad = entries[7]  # b1: a 64×192 weight
    bad_val = bad.sections["scale"].copy()
    bad_val[0] = -1.0
    entries[7] = Entry(
        name=bad.name,
        codec=bad.codec,
        dtype=bad.dtype,
        shape=bad.shape,
        params=bad.params,
        sections={**bad.sections, "scale": bad_val},
        section_elems={},
    )
    monkeypatch.setattr(cd, "_decodes_stacked", lambda dev: True)
    stacked = []
    monkeypatch.setattr(cd, "_decode_stacked", lambda *a: stacked.append(a))
    with pytest.raises(FrameError, match="scales must be > 0"):
        decode_entries(entries)
    assert stacked == []


def test_the_exact_mean_with_records_decoded_together_has_the_same_bits(monkeypatch):
    from gradwire import aggregation
    from gradwire.dct import capabilities as cd

    senders = [_mixed_records(s) for s in range(3)]
    weights = [0.5, 0.3, 0.2]
    alone = aggregation.exact_mean(senders, weights)
    monkeypatch.setattr(cd, "_decodes_stacked", lambda dev: True)
    monkeypatch.setattr(aggregation, "_decodes_in_batches", lambda dev: True)
    monkeypatch.setattr(cd, "weighted_sum_dct", lambda *a: None)
    monkeypatch.setattr(aggregation, "weighted_sum_fused", lambda *a: None)
    for limit in (1 << 26, 20_000):  # every tensor in one batch; a few at a time
        monkeypatch.setattr(aggregation, "_GPU_DECODE_ELEMS", limit)
        together = aggregation.exact_mean(senders, weights)
        assert list(together) == list(alone)
        assert all(torch.equal(together[n], alone[n]) for n in alone)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_bundles_encode_and_decode_together_to_the_bits_the_cpu_decodes():
    from gradwire.frame import decode_entries

    codec = DCTCodec(topk=16, mode="tiles", index_coding="rice", value_bits=2)
    tensors = {n: _rand(s, seed=i).cuda() for i, (n, s) in enumerate(BUNDLE.items())}
    got = codec.compress_bundle(tensors)
    entries = [e for e, _ in got.values()]
    for (entry, recon), decoded in zip(got.values(), decode_entries(entries, "cuda")):
        assert recon.device.type == "cuda" and torch.equal(decoded, recon), entry.name
        assert torch.equal(gradwire.decode(write_frame([entry])), recon.cpu()), entry.name


@pytest.mark.parametrize("value_bits,topk", [(8, 22), (2, 472)])
def test_an_own_record_taken_as_kept_is_what_parsing_its_bytes_gives(value_bits, topk):
    """A record handed to the parser in its codec's own_records skips the parse: what it returns must be
    exactly what the hostile-input parser reads from the record's bytes (positions, levels, grid,
    coefficients); any other record object, a copy of it included, is parsed as hostile input."""
    from gradwire.dct import parse_record

    codec = gradwire.DCTCodec(chunk_shape=(64, 64), topk=topk, mode="tiles", value_bits=value_bits, index_coding="rice")
    g = torch.Generator().manual_seed(5)
    tensors = {
        "w": torch.randn(256, 128, generator=g),
        "b": torch.randn(300, generator=g),
        "v": torch.randn(64, 192, generator=g),
    }
    done = codec.compress_bundle(tensors)
    entries = [e for e, _ in done.values()]
    own = codec.own_records(entries, "cpu")
    assert len(own) == len(entries)
    # a codec knows only its own records: a twin with the same settings wrote none of these
    assert len(gradwire.DCTCodec(chunk_shape=(64, 64), topk=topk, mode="tiles").own_records(entries)) == 0
    for entry in entries:
        parsed = parse_record(entry)  # no cache: parsed from its sections
        kept = parse_record(entry, cache=own)
        assert kept is own.get(entry, "cpu") and kept is not parsed
        for field in ("idx", "levels", "scales", "mins", "values"):
            a, b = getattr(kept, field), getattr(parsed, field)
            assert a.dtype == b.dtype and torch.equal(a, b), (entry.name, field)
        assert kept.k == parsed.k and kept.plan == parsed.plan
        # any other record object (what a peer's bytes become) is parsed as hostile input, cache or not
        tampered = dataclasses.replace(entry, sections={**entry.sections, "scale": -entry.sections["scale"]})
        with pytest.raises(FrameError, match="scales must be > 0"):
            parse_record(tampered, cache=own)
        read_back = read_frame(write_frame([entry])).entries[0]
        assert own.get(read_back, "cpu") is None
        assert torch.equal(parse_record(read_back, cache=own).values, parsed.values)


def test_a_record_a_codec_wrote_leaves_its_own_records_as_it_dies():
    codec = gradwire.DCTCodec(topk=8, mode="tiles")
    entry, _ = codec.compress(_rand((128, 64), seed=3))
    assert len(codec.own_records([entry])) == 1
    held = len(codec._written.by_id)
    del entry
    gc.collect()
    assert len(codec._written.by_id) == held - 1
    # a copy of the codec (the sharded exchange's downlink twin) starts with no records of its own
    kept, _ = codec.compress(_rand((64, 64), seed=4))
    assert len(copy.deepcopy(codec)._written.by_id) == 0 and len(codec.own_records([kept])) == 1
