"""The Rust kernels as Python sees them: published vectors, round trips, and hostile input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire import WireError, wire


def templar_pack_12bit(indices: np.ndarray) -> bytes:
    """Templar's pack_12bit_indices layout: two 12-bit values in three bytes."""
    v = indices.astype(np.uint32)
    out = bytearray()
    for i in range(0, len(v), 2):
        a = int(v[i])
        b = int(v[i + 1]) if i + 1 < len(v) else 0
        out += bytes([a & 0xFF, (a >> 8) | ((b & 0x0F) << 4), b >> 4])
    return bytes(out[: (len(v) * 12 + 7) // 8])


def pack_reference(values, bits: int) -> bytes:
    stream = 0
    for i, v in enumerate(values):
        stream |= int(v) << (i * bits)
    return stream.to_bytes((len(values) * bits + 7) // 8, "little")


# --- pack_bits / unpack_bits ----------------------------------------------------------------


def test_pack_bits_at_12_bits_matches_templar_layout():
    rng = np.random.default_rng(1)
    for n in (0, 1, 2, 3, 7, 100, 1001):
        idx = rng.integers(0, 4096, n, dtype=np.uint32)
        assert wire.pack_bits(idx, 12) == templar_pack_12bit(idx)


def test_pack_bits_stream_is_lsb_first():
    assert wire.pack_bits([1], 1) == b"\x01"
    assert wire.pack_bits([1, 0, 1], 1) == b"\x05"
    assert wire.pack_bits([0xABC], 12) == b"\xbc\x0a"
    assert wire.pack_bits([3, 1], 3) == bytes([3 | (1 << 3)])


@given(st.integers(1, 32).flatmap(lambda b: st.tuples(st.just(b), st.lists(st.integers(0, 2**b - 1), max_size=300))))
@settings(max_examples=200, deadline=None)
def test_pack_then_unpack_returns_the_values_for_every_width(case):
    bits, values = case
    packed = wire.pack_bits(np.array(values, dtype=np.uint32), bits)
    assert packed == pack_reference(values, bits)
    assert len(packed) == (len(values) * bits + 7) // 8
    out = wire.unpack_bits(packed, bits, len(values))
    assert out.dtype == np.uint32
    assert out.tolist() == values
    assert wire.unpack_bits_exact(packed, bits, len(values)).tolist() == values


def test_pack_bits_rejects_a_value_wider_than_bits():
    with pytest.raises(ValueError, match="12"):
        wire.pack_bits([4095, 4096], 12)
    with pytest.raises(WireError):
        wire.pack_bits([2], 1)


@pytest.mark.parametrize("bits", [0, 33, 64])
def test_pack_bits_rejects_widths_outside_1_to_32(bits):
    with pytest.raises(ValueError):
        wire.pack_bits([0], bits)


def test_pack_bits_rejects_negative_values():
    with pytest.raises(ValueError):
        wire.pack_bits(np.array([-1], dtype=np.int64), 12)


def test_unpack_bits_rejects_data_too_short_for_count():
    with pytest.raises(ValueError):
        wire.unpack_bits(b"\x00\x00", 12, 2)  # needs 3 bytes


def test_unpack_bits_exact_rejects_extra_bytes_and_nonzero_padding():
    packed = wire.pack_bits([5], 12)  # 2 bytes, top 4 bits padding
    with pytest.raises(ValueError):
        wire.unpack_bits_exact(packed + b"\x00", 12, 1)
    with pytest.raises(ValueError):
        wire.unpack_bits_exact(bytes([packed[0], packed[1] | 0x80]), 12, 1)


def test_kernels_accept_any_bytes_like_without_copying_semantics_changing():
    idx = np.arange(10, dtype=np.uint32)
    packed = wire.pack_bits(idx, 4)
    for form in (packed, bytearray(packed), memoryview(packed), np.frombuffer(packed, np.uint8)):
        assert wire.unpack_bits(form, 4, 10).tolist() == list(range(10))


# --- 3LC quartic encoding -------------------------------------------------------------------


@pytest.mark.parametrize(
    "trits, expected",
    [
        ([0, -1, 1, 0, 0, 1, 0], [147, 45]),
        ([0] * 7, [120, 117]),
        ([0] * 10, [121, 121]),
    ],
)
def test_quartic_encode_matches_the_3lc_vectors(trits, expected):
    assert list(wire.quartic_encode(np.array(trits, np.int8))) == expected
    assert wire.quartic_decode(bytes(expected), len(trits)).tolist() == trits


def test_quartic_byte_i_holds_elements_i_plus_multiples_of_l():
    n = 23
    trits = np.random.default_rng(3).integers(-1, 2, n).astype(np.int8)
    out = np.frombuffer(wire.quartic_encode(trits), np.uint8)
    length = -(-n // 5)
    padded = np.concatenate([trits + 1, np.zeros(5 * length - n, np.int8)]).reshape(5, length).astype(int)
    assert out.tolist() == (padded * np.array([81, 27, 9, 3, 1])[:, None]).sum(0).tolist()


@given(st.lists(st.sampled_from([-1, 0, 1]), max_size=400))
@settings(max_examples=200, deadline=None)
def test_quartic_round_trips_and_stays_within_0_to_242(trits):
    data = wire.quartic_encode(np.array(trits, np.int8))
    assert len(data) == -(-len(trits) // 5)
    assert all(b <= 242 for b in data)
    assert wire.quartic_decode(data, len(trits)).tolist() == trits


def test_quartic_encode_rejects_a_value_outside_the_three():
    with pytest.raises(ValueError):
        wire.quartic_encode(np.array([0, 2, 0], np.int8))


def test_quartic_decode_rejects_bytes_above_242_and_inconsistent_counts():
    with pytest.raises(ValueError):
        wire.quartic_decode(bytes([243]), 5)
    with pytest.raises(ValueError):
        wire.quartic_decode(bytes([121, 121]), 5)  # 5 values need 1 byte
    with pytest.raises(ValueError):
        wire.quartic_decode(bytes([121]), 6)


# --- 3LC zero-run encoding ------------------------------------------------------------------


def test_zero_run_encodes_runs_as_the_paper_says():
    z = 121
    assert wire.zero_run_encode(bytes([z])) == bytes([z])
    assert wire.zero_run_encode(bytes([z, z])) == bytes([243])
    assert wire.zero_run_encode(bytes([z] * 13)) == bytes([254])
    assert wire.zero_run_encode(bytes([z] * 14)) == bytes([255])
    assert wire.zero_run_encode(bytes([z] * 15)) == bytes([255, z])
    assert wire.zero_run_encode(bytes([z] * 16)) == bytes([255, 243])
    assert wire.zero_run_encode(bytes([7, z, z, z, 8])) == bytes([7, 244, 8])


@pytest.mark.parametrize("run", [14, 28, 42, 140])
def test_zero_runs_of_exact_multiples_of_14_round_trip_without_a_stray_byte(run):
    data = bytes([5]) + bytes([121] * run) + bytes([6])
    enc = wire.zero_run_encode(data)
    assert enc == bytes([5]) + bytes([255] * (run // 14)) + bytes([6])
    assert wire.zero_run_decode(enc) == data


@given(st.lists(st.one_of(st.just(121), st.integers(0, 242)), max_size=500))
@settings(max_examples=300, deadline=None)
def test_zero_run_round_trips_any_quartic_bytes(values):
    data = bytes(values)
    enc = wire.zero_run_encode(data)
    assert len(enc) <= len(data)
    assert wire.zero_run_decode(enc) == data
    assert wire.zero_run_decode(enc, len(data)) == data


def test_zero_run_encode_refuses_bytes_above_242():
    with pytest.raises(ValueError):
        wire.zero_run_encode(bytes([1, 243]))


def test_zero_run_decode_checks_the_expected_length():
    enc = wire.zero_run_encode(bytes([121] * 30))
    with pytest.raises(ValueError):
        wire.zero_run_decode(enc, 29)
    with pytest.raises(ValueError):
        wire.zero_run_decode(enc, 31)


# --- CRC-32C --------------------------------------------------------------------------------


def test_crc32c_check_value():
    assert wire.crc32c(b"123456789") == 0xE3069283
    assert wire.crc32c(b"") == 0


@given(st.binary(max_size=2000), st.integers(0, 2000))
@settings(max_examples=100, deadline=None)
def test_crc32c_continues_a_running_checksum(data, cut):
    cut = min(cut, len(data))
    assert wire.crc32c(data[cut:], wire.crc32c(data[:cut])) == wire.crc32c(data)


def test_crc32c_matches_an_independent_implementation():
    from reference_reader import crc32c as reference_crc

    data = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    assert wire.crc32c(data) == reference_crc(data)


# --- decoding into the caller's buffer ------------------------------------------------------


def test_decoders_write_into_a_caller_buffer_and_check_its_size():
    idx = np.arange(1000, dtype=np.uint32) % 4096
    out = np.empty(1000, np.uint32)
    assert wire.unpack_bits(wire.pack_bits(idx, 12), 12, 1000, out=out) is out
    assert np.array_equal(out, idx)
    exact = np.empty(1000, np.uint32)
    assert np.array_equal(wire.unpack_bits_exact(wire.pack_bits(idx, 12), 12, 1000, out=exact), idx)
    trits = (np.arange(23) % 3 - 1).astype(np.int8)
    tout = np.empty(23, np.int8)
    assert np.array_equal(wire.quartic_decode(wire.quartic_encode(trits), 23, out=tout), trits)
    data = bytes([121] * 30 + [7])
    zout = np.empty(31, np.uint8)
    assert wire.zero_run_decode(wire.zero_run_encode(data), out=zout).tobytes() == data
    with pytest.raises(ValueError, match="1000"):
        wire.unpack_bits(wire.pack_bits(idx, 12), 12, 1000, out=np.empty(999, np.uint32))
    with pytest.raises(ValueError):
        wire.zero_run_decode(wire.zero_run_encode(data), out=np.empty(30, np.uint8))
    with pytest.raises(TypeError):
        wire.quartic_decode(wire.quartic_encode(trits), 23, out=np.empty(23, np.int16))
