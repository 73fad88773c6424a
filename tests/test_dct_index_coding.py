"""Entropy-coded DCT positions (index_coding 1, Rice) and values below a byte (value_bits 4, 2, 1):
FORMAT.md §5.2 and §6.2."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradwire
from gradwire import DCTCodec, ErrorFeedback, FrameError, wire
from gradwire.accumulate import make_accumulator
from gradwire.dct import INDEX_CODING_FIXED, INDEX_CODING_RICE, index_stream_sizes, parse_record, unpack_params
from gradwire.frame import write_frame

CUDA = torch.cuda.is_available()


def _rand(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _floor_bits(c: int, k: int) -> float:
    return (math.lgamma(c + 1) - math.lgamma(k + 1) - math.lgamma(c - k + 1)) / math.log(2)


def test_default_and_explicit_fixed_give_byte_identical_frames():
    x = _rand((96, 80), 1)
    a = DCTCodec(chunk_shape=(16, 16), topk=8).encode(x, name="w")
    b = DCTCodec(chunk_shape=(16, 16), topk=8, index_coding="fixed", value_bits=8).encode(x, name="w")
    assert a == b
    assert unpack_params(gradwire.read_frame(a).entry().params)["index_coding"] == INDEX_CODING_FIXED


@pytest.mark.parametrize("mode", ["flat", "tiles"])
@pytest.mark.parametrize("coding", ["rice", "auto"])
def test_entropy_coded_positions_decode_to_the_same_tensor_as_fixed(mode, coding):
    x = _rand((130, 70), 2)
    fixed = DCTCodec(chunk_shape=(16, 16), topk=6, mode=mode)
    coded = DCTCodec(chunk_shape=(16, 16), topk=6, mode=mode, index_coding=coding)
    e_fixed, r_fixed = fixed.compress(x, "w")
    e_coded, r_coded = coded.compress(x, "w")
    assert torch.equal(r_fixed, r_coded)
    out = gradwire.decode(write_frame([e_coded]))
    assert torch.equal(out, r_coded)
    # Same positions and values; only the idx section differs.
    np.testing.assert_array_equal(e_fixed.sections["val"], e_coded.sections["val"])
    assert e_coded.sections["idx"].nbytes < e_fixed.sections["idx"].nbytes


def test_rice_section_is_the_rice_stream_of_the_sorted_positions():
    x = _rand((64, 64), 3)
    entry, _ = DCTCodec(chunk_shape=(32, 32), topk=16, index_coding="rice").compress(x)
    p = unpack_params(entry.params)
    assert p["index_coding"] == INDEX_CODING_RICE
    rec = parse_record(entry)
    idx = rec.idx.numpy().astype(np.uint32)
    param, nbytes = wire.rice_param(idx, 1024, set_len=16)
    assert p["index_bits"] == param
    assert entry.sections["idx"].tobytes() == wire.rice_encode(idx, 1024, param, set_len=16)
    assert entry.sections["idx"].nbytes == nbytes


@pytest.mark.parametrize("ratio", [1024, 256, 64, 16])
def test_rice_positions_are_within_five_percent_of_the_floor(ratio):
    # Gaussian noise has no preferred frequencies, so its top-k positions are a uniform k-subset.
    c = 4096
    k = c // ratio
    chunks = 400 if k < 16 else 60
    x = _rand((chunks * 64, 64), ratio)
    entry, _ = DCTCodec(chunk_shape=(64, 64), topk=k, index_coding="rice").compress(x)
    bits_per_chunk = entry.sections["idx"].nbytes * 8 / chunks
    assert bits_per_chunk <= 1.05 * _floor_bits(c, k)
    assert bits_per_chunk < 12 * k  # far below fixed packing


def test_auto_takes_the_smaller_coding_per_tensor():
    codec = DCTCodec(chunk_shape=(64,), topk=3, index_coding="auto")
    # C = 64, k = 3: fixed 18 bits per chunk vs Rice about 17; and k = 48 of 64: Rice (about 64 bits)
    # far below fixed (288 bits).
    for topk, shape in ((3, (4096,)), (48, (4096,)), (1, (64,))):
        codec = DCTCodec(chunk_shape=(64,), topk=topk, index_coding="auto")
        entry, _ = codec.compress(_rand(shape, topk))
        rec = parse_record(entry)
        sizes = index_stream_sizes(rec.idx.numpy().astype(np.uint32), 64)
        best = min(sizes, key=lambda cd: (sizes[cd][0], cd))
        assert unpack_params(entry.params)["index_coding"] == best
        assert entry.sections["idx"].nbytes == sizes[best][0]
    # Both codings occur.
    codings = {
        unpack_params(DCTCodec(chunk_shape=shape, topk=k, index_coding="auto").compress(_rand((8, 4096), 9))[0].params)[
            "index_coding"
        ]
        for shape, k in (((4,), 1), ((64, 64), 32))
    }
    assert codings == {INDEX_CODING_FIXED, INDEX_CODING_RICE}


@pytest.mark.parametrize("bits", [8, 4, 2, 1])
def test_value_bits_quantize_to_two_to_the_b_levels_between_min_and_max(bits):
    x = _rand((64, 64), 4)
    entry, recon = DCTCodec(chunk_shape=(16, 16), topk=10, value_bits=bits).compress(x, "w")
    rec = parse_record(entry)
    levels = rec.levels
    assert int(levels.min()) == 0 and int(levels.max()) == (1 << bits) - 1
    n = rec.plan.num_chunks
    if bits == 8:
        assert entry.sections["val"].dtype == np.int8 and entry.sections["val"].size == n * 10
    else:
        assert entry.sections["val"].dtype == np.uint8
        assert entry.sections["val"].size == (n * 10 * bits + 7) // 8
        np.testing.assert_array_equal(
            wire.unpack_bits_exact(entry.sections["val"], bits, n * 10), levels.reshape(-1).numpy()
        )
    # Each chunk's extremes are exact: level 0 is its min and level L its max.
    vals = rec.values
    assert torch.allclose(vals.amin(1), rec.mins) and torch.allclose(
        vals.amax(1), rec.mins + rec.scales * ((1 << bits) - 1), rtol=1e-6
    )
    assert torch.equal(gradwire.decode(write_frame([entry])), recon)


def test_fewer_value_bits_cost_fewer_bytes_and_more_error():
    x = _rand((128, 128), 5)
    sizes, errors = [], []
    for bits in (8, 4, 2, 1):
        entry, recon = DCTCodec(chunk_shape=(32, 32), topk=64, value_bits=bits).compress(x)
        # The coefficients a receiver gets, against the exact top-k coefficients of the fixed 8-bit path.
        sizes.append(entry.sections["val"].nbytes)
        errors.append(float((recon - x).norm()))
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 8 * sizes[3]
    assert errors == sorted(errors)


def test_error_feedback_and_the_transform_domain_sum_work_with_rice_records():
    codec = DCTCodec(chunk_shape=(16, 16), topk=4, index_coding="rice", value_bits=4)
    ef = ErrorFeedback(codec)
    xs = [_rand((40, 40), s) for s in range(3)]
    entries = [ef.compress(x, "w") for x in xs]
    acc = make_accumulator(entries[0], None)
    for e in entries:
        acc.add(e)
    want = sum(gradwire.decode_entry(e) for e in entries)
    torch.testing.assert_close(acc.finish(), want, rtol=1e-4, atol=1e-4)
    # What error feedback carries is what the codec dropped.
    assert ef.residual("w").abs().sum() > 0


# ------------------------------------------------------------------------------------------------
# Hostile records


def _entry(**kw):
    codec = DCTCodec(chunk_shape=(16, 16), topk=5, **kw)
    return codec.compress(_rand((32, 32), 6), "w")[0]


def _with_params(entry, **changes):
    p = unpack_params(entry.params)
    p.update(changes)
    nd = len(p["chunk_shape"])
    import struct

    entry.params = struct.pack(f"<BB{nd}I", p["mode"], nd, *p["chunk_shape"]) + struct.pack(
        "<IBBBQ", p["k"], p["index_bits"], p["value_bits"], p["index_coding"], p["pad_count"]
    )
    return entry


def _decode(entry):
    return gradwire.decode(write_frame([entry]))


def test_rice_parameter_above_the_index_width_is_rejected():
    with pytest.raises(FrameError, match=r"parameter \(index_bits\) must be <= 8"):
        _decode(_with_params(_entry(index_coding="rice"), index_bits=9))


def test_corrupt_rice_streams_name_the_idx_section():
    e = _entry(index_coding="rice")
    idx = e.sections["idx"].copy()
    e.sections["idx"] = idx[:-1]
    with pytest.raises(FrameError, match="section 'idx'"):
        _decode(e)
    e.sections["idx"] = np.concatenate([idx, np.zeros(1, np.uint8)])
    with pytest.raises(FrameError, match="section 'idx'.*length mismatch"):
        _decode(e)
    e.sections["idx"] = np.zeros(idx.size, np.uint8)
    with pytest.raises(FrameError, match="section 'idx'"):
        _decode(e)
    e.sections["idx"] = idx.view(np.int8)
    with pytest.raises(FrameError, match="section 'idx' must have element type uint8"):
        _decode(e)


def test_a_rice_stream_whose_positions_leave_the_chunk_is_rejected():
    e = _entry(index_coding="rice")
    p = unpack_params(e.params)
    n = 4
    # One chunk's gaps summing past C = 256.
    bad = np.array([[0, 1, 2, 3, 300]] + [[0, 1, 2, 3, 4]] * (n - 1), np.uint32)
    e.sections["idx"] = np.frombuffer(wire.rice_encode(bad, 512, p["index_bits"], set_len=5), np.uint8)
    with pytest.raises(FrameError, match="not below the universe 256"):
        _decode(e)


@pytest.mark.parametrize("bits", [4, 2, 1])
def test_packed_values_are_checked(bits):
    e = _entry(value_bits=bits)
    val = e.sections["val"].copy()
    e.sections["val"] = np.concatenate([val, np.zeros(1, np.uint8)])
    with pytest.raises(FrameError, match=f"section 'val' must hold ceil\\(num_chunks \\* k \\* {bits} / 8\\)"):
        _decode(e)
    e.sections["val"] = val.view(np.int8)
    with pytest.raises(FrameError, match="section 'val' must have element type uint8"):
        _decode(e)
    total = 4 * 5
    if total * bits % 8:
        padded = val.copy()
        padded[-1] |= 0x80
        e.sections["val"] = padded
        with pytest.raises(FrameError, match="section 'val'.*padding"):
            _decode(e)


def test_unknown_value_bits_and_codings_are_rejected():
    with pytest.raises(FrameError, match="value_bits must be 8, 4, 2 or 1"):
        _decode(_with_params(_entry(), value_bits=3))
    with pytest.raises(FrameError, match="index_coding must be 0"):
        _decode(_with_params(_entry(), index_coding=3))
    with pytest.raises(ValueError, match="value_bits"):
        DCTCodec(value_bits=3)
    with pytest.raises(ValueError, match="index_coding"):
        DCTCodec(index_coding="bitmap")


def test_overflowing_scales_are_checked_at_the_record_width():
    # 15 * scale is finite, 255 * scale would not be: a 4-bit record with it is valid.
    e = _entry(value_bits=4)
    big = np.float32(3.0e38 / 15 / 1.01)
    e.sections["scale"] = np.full_like(e.sections["scale"], big)
    e.sections["min"] = np.zeros_like(e.sections["min"])
    assert torch.isfinite(parse_record(e).values).all()
    e = _entry(value_bits=8)
    e.sections["scale"] = np.full_like(e.sections["scale"], big)
    with pytest.raises(FrameError, match="must be finite"):
        _decode(e)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_tensors_encode_and_decode_on_their_device():
    x = _rand((256, 96), 7).cuda()
    codec = DCTCodec(chunk_shape=(32, 32), topk=12, index_coding="auto", value_bits=2)
    entry, recon = codec.compress(x, "w")
    assert recon.device == x.device
    cpu_entry, cpu_recon = codec.compress(x.cpu(), "w")
    out = gradwire.decode(write_frame([entry]), device="cuda")
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), recon.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("index_coding", ["fixed", "rice", "auto"])
@pytest.mark.parametrize("value_bits", [8, 4, 2, 1])
def test_one_native_call_codes_every_record_as_the_single_kernels_do(index_coding, value_bits):
    """``_native.dct_payloads`` codes a step's records in one call: each record's idx and val sections
    are what ``wire.pack_bits`` / ``wire.rice_encode`` give it alone, at the parameter the codec names."""
    codec = DCTCodec(chunk_shape=(8, 8), topk=5, mode="tiles", index_coding=index_coding, value_bits=value_bits)
    tensors = {"a": _rand((32, 24), 1), "b": _rand((16, 16), 2), "c": _rand((40,), 3)}
    records = [codec.compress(t, n)[0] for n, t in tensors.items()]
    together = codec.compress_bundle(tensors)
    for entry in records:
        # the batched path, byte for byte the per-tensor one
        assert write_frame([together[entry.name][0]], round=0, sender=0) == write_frame([entry], round=0, sender=0)
        p = unpack_params(entry.params)
        c = 1
        for d in p["chunk_shape"]:
            c *= d
        k = p["k"]
        parsed = parse_record(entry)
        idx = parsed.idx.numpy().reshape(-1).astype(np.uint32)
        bits = max(1, (c - 1).bit_length())
        fixed = wire.pack_bits(idx, bits)
        rice_param, rice_len = wire.rice_param(idx, c, set_len=k)
        rice = wire.rice_encode(idx, c, rice_param, set_len=k)
        want = {
            "fixed": (INDEX_CODING_FIXED, fixed),
            "rice": (INDEX_CODING_RICE, rice),
            "auto": (INDEX_CODING_FIXED, fixed) if len(fixed) <= len(rice) else (INDEX_CODING_RICE, rice),
        }
        coding, stream = want[index_coding]
        assert p["index_coding"] == coding and bytes(entry.sections["idx"]) == stream
        if value_bits < 8:
            levels = parsed.levels.numpy().reshape(-1).astype(np.uint32)
            assert bytes(entry.sections["val"]) == wire.pack_bits(levels, value_bits)


def test_the_native_payload_call_refuses_layouts_that_do_not_add_up():
    from gradwire import _native
    from gradwire.errors import WireError

    with pytest.raises(WireError) as err:
        _native.dct_payloads(
            np.arange(5, dtype=np.uint32), np.empty(0, np.uint32), np.array([1, 4, 16], dtype=np.uint64), 0, 8
        )
    assert err.value.kind == "length_mismatch"
    with pytest.raises(WireError) as err:
        _native.dct_payloads(
            np.array([3, 1], dtype=np.uint32), np.empty(0, np.uint32), np.array([1, 2, 16], dtype=np.uint64), 1, 8
        )
    assert err.value.kind == "not_strictly_ascending"
    with pytest.raises(ValueError, match="index_coding must be 0, 1 or 2"):
        _native.dct_payloads(
            np.array([1, 3], dtype=np.uint32), np.empty(0, np.uint32), np.array([1, 2, 16], dtype=np.uint64), 7, 8
        )
