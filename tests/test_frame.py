"""Frame format v1 through the Python API: round trips, and every malformed frame a named FrameError."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import gradwire
from gradwire import Entry, FrameError, IdentityCodec, Limits, read_frame, write_frame
from gradwire.wire import crc32c


def fix_crc(frame: bytes) -> bytes:
    """Recompute the trailer so that the structure, not the checksum, is what a test breaks."""
    return frame[:-4] + struct.pack("<I", crc32c(frame[:-4]))


def set_u(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(frame)
    struct.pack_into("<" + fmt, b, offset, value)
    return fix_crc(bytes(b))


def small_frame() -> bytes:
    return IdentityCodec().encode(torch.arange(6, dtype=torch.float32).reshape(2, 3), name="w", round=7, sender=3)


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4), (2, 3, 4, 5)])
def test_identity_frame_round_trips_exactly(dtype, shape):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = gradwire.decode(IdentityCodec().encode(t))
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)


@pytest.mark.parametrize("wire_dtype", [torch.float16, torch.bfloat16])
def test_identity_with_a_narrower_wire_type_decodes_to_the_original_dtype(wire_dtype):
    t = torch.randn(100)
    frame = IdentityCodec(wire_dtype).encode(t)
    out = gradwire.decode(frame)
    assert out.dtype == torch.float32
    assert torch.equal(out, t.to(wire_dtype).float())
    assert len(frame) < 100 * 4


def test_header_fields_survive_the_round_trip():
    f = read_frame(small_frame())
    assert (f.round, f.sender, f.bundle) == (7, 3, False)
    (e,) = f.entries
    assert (e.name, e.codec, e.dtype, e.shape) == ("w", 0, torch.float32, (2, 3))


def test_bundle_frame_carries_many_named_tensors_with_mixed_codecs():
    tensors = {"layer.weight": torch.randn(64, 64), "layer.bias": torch.randn(64), "scalar": torch.tensor(2.5)}
    entries = [
        gradwire.DCTCodec(topk=16).compress(tensors["layer.weight"], "layer.weight")[0],
        IdentityCodec().compress(tensors["layer.bias"], "layer.bias")[0],
        IdentityCodec(torch.float16).compress(tensors["scalar"], "scalar")[0],
    ]
    frame = write_frame(entries, round=11, sender=2, bundle=True)
    out = gradwire.decode_bundle(frame)
    assert list(out) == ["layer.weight", "layer.bias", "scalar"]
    assert out["layer.weight"].shape == (64, 64)
    assert torch.equal(out["layer.bias"], tensors["layer.bias"])
    assert out["scalar"].item() == 2.5
    with pytest.raises(FrameError, match="bundle"):
        gradwire.decode(frame)


def test_empty_bundle_is_the_smallest_frame():
    frame = write_frame([], bundle=True)
    assert len(frame) == 36
    assert gradwire.decode_bundle(frame) == {}


def test_sections_are_zero_copy_views_of_the_input():
    buf = bytearray(small_frame())
    data = read_frame(buf).entries[0].sections["data"]
    assert data.base is not None and not data.flags.owndata


# --- every malformed frame is a FrameError naming the rule --------------------------------------


def test_every_single_bit_flip_is_detected():
    frame = small_frame()
    for bit in range(len(frame) * 8):
        bad = bytearray(frame)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameError):
            gradwire.decode(bytes(bad))


def test_every_truncation_is_detected():
    frame = small_frame()
    for n in range(len(frame)):
        with pytest.raises(FrameError):
            read_frame(frame[:n])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda f: b"XWIR" + f[4:], "magic"),
        (lambda f: f[:4] + struct.pack("<H", 2) + f[6:], "version"),
        (lambda f: f + b"\x00", "trailing|total|length"),
        (lambda f: f[:-1], "truncat"),
        (lambda f: f[:-4] + struct.pack("<I", crc32c(f[:-4]) ^ 1), "checksum|crc"),
        (lambda f: set_u(f, 6, "H", 2), "flag"),
        (lambda f: set_u(f, 28, "I", 2), "entr|record|truncat|end"),
    ],
)
def test_header_violations_name_the_rule(mutate, message):
    with pytest.raises(FrameError, match=f"(?i){message}"):
        read_frame(mutate(small_frame()))


def test_a_frame_larger_than_the_limit_is_refused():
    frame = small_frame()
    with pytest.raises(FrameError, match="(?i)limit|large|exceed"):
        read_frame(frame, limits=Limits(max_frame_bytes=len(frame) - 1))
    read_frame(frame, limits=Limits(max_frame_bytes=len(frame)))


def test_a_declared_tensor_beyond_the_element_limit_is_refused_before_allocation():
    # The record declares 2**40 elements but carries 24 bytes: refused on the declaration alone.
    e = Entry("w", 0, torch.float32, (2**20, 2**20), sections={"data": np.zeros(6, np.float32)})
    with pytest.raises(FrameError, match="(?i)element|limit|exceed"):
        read_frame(write_frame([e]))


def test_identity_record_whose_length_disagrees_with_its_shape_is_refused():
    e = Entry("w", 0, torch.float32, (2, 4), sections={"data": np.zeros(6, np.float32)})
    with pytest.raises(FrameError, match="'data' must hold numel = 8 elements, got 6"):
        gradwire.decode(write_frame([e]))


def test_unknown_codec_is_refused_by_name():
    e = Entry("w", 999, torch.float32, (1,), sections={"data": np.zeros(1, np.float32)})
    with pytest.raises(FrameError, match="unknown codec id 999"):
        gradwire.decode(write_frame([e]))


def test_duplicate_names_in_a_bundle_are_refused():
    e = IdentityCodec().compress(torch.zeros(2), "x")[0]
    with pytest.raises(ValueError, match="(?i)duplicate|unique"):
        write_frame([e, e], bundle=True)
    # and a reader refuses one written by hand: rename the second record's "y" to "x" and re-seal
    f = write_frame([e, IdentityCodec().compress(torch.zeros(2), "y")[0]], bundle=True)
    pos = f.rindex(b"\x01\x00y")
    bad = fix_crc(f[: pos + 2] + b"x" + f[pos + 3 :])
    with pytest.raises(FrameError, match="(?i)duplicate|unique"):
        read_frame(bad)


def test_wrong_dtype_code_and_element_code_are_refused():
    frame = small_frame()
    # record starts at 32: name_len(2) name(1) codec(2) dtype(1)
    with pytest.raises(FrameError, match="(?i)dtype"):
        read_frame(set_u(frame, 32 + 2 + 1 + 2, "B", 3))  # i16 is not a float dtype
    # section header: after shape and params_len and section_count
    sec = 32 + 2 + 1 + 2 + 1 + 1 + 2 * 8 + 4 + 1
    assert frame[sec : sec + 5] == b"\x04data"
    with pytest.raises(FrameError, match="(?i)elem"):
        read_frame(set_u(frame, sec + 5, "B", 12))


def test_byte_len_not_a_multiple_of_the_element_size_is_refused():
    e = Entry("w", 0, torch.float32, (1,), sections={"data": np.zeros(4, np.uint8)})
    frame = write_frame([e])
    sec = 32 + 2 + 1 + 2 + 1 + 1 + 8 + 4 + 1
    bad = set_u(frame, sec + 5, "B", 10)  # call the 4 bytes f32: fine; now call 3 of them f32
    read_frame(bad)
    e2 = Entry("w", 0, torch.float32, (1,), sections={"data": np.zeros(3, np.uint8)})
    bad2 = set_u(write_frame([e2]), sec + 5, "B", 10)
    with pytest.raises(FrameError, match="(?i)multiple"):
        read_frame(bad2)


def test_non_finite_values_pass_the_identity_codec_unchanged():
    # Finiteness of *gradients* is the server's rule, not the format's: the codec must not hide NaN.
    t = torch.tensor([1.0, float("nan"), float("inf")])
    out = gradwire.decode(IdentityCodec().encode(t))
    assert torch.isnan(out[1]) and torch.isinf(out[2])
