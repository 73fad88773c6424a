"""Errors keep their structure: every error carries a stable ``kind``, from real hostile input.

Each case feeds corrupted frame bytes or bad kernel input through the public API and checks the
``kind`` and the exact class raised; the table of kinds in docs/FORMAT.md section 7.1 is compared
with what the native module can raise.
"""

from __future__ import annotations

import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from gradwire import _native, wire
from gradwire.errors import ERROR_KINDS, PYTHON_KINDS, FrameError, WireError, error
from gradwire.frame import Entry, Limits, decode_entry, read_frame, write_frame

FORMAT_MD = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"

# Header fields (FORMAT.md section 2): offset and struct format.
VERSION, FLAGS, TOTAL_LEN, ENTRY_COUNT = (4, "H"), (6, "H"), (8, "Q"), (28, "I")


def tensor_frame(codec: int = 0) -> bytes:
    entry = Entry(
        name="w",
        codec=codec,
        dtype=torch.float32,
        shape=(2, 3),
        sections={"data": np.arange(6, dtype=np.float32)},
    )
    return write_frame([entry], round=7, sender=3)


def with_crc(body: bytes) -> bytes:
    """``body`` (a frame without its trailer) with its CRC-32C appended."""
    return body + struct.pack("<I", wire.crc32c(body))


def patched(frame: bytes, field: tuple[int, str], value: int, *, fix_crc: bool = True) -> bytes:
    offset, fmt = field
    b = bytearray(frame)
    struct.pack_into("<" + fmt, b, offset, value)
    return with_crc(bytes(b[:-4])) if fix_crc else bytes(b)


def flipped(frame: bytes, index: int, mask: int = 0x01) -> bytes:
    b = bytearray(frame)
    b[index] ^= mask
    return bytes(b)


def empty_bundle_with_leftover() -> bytes:
    frame = write_frame([], bundle=True)
    body = frame[:-4] + b"\x00"
    return patched(with_crc(body), TOTAL_LEN, len(body) + 4)


FRAME_CASES = {
    "frame_too_short": lambda: tensor_frame()[:20],
    "bad_magic": lambda: b"GWIX" + tensor_frame()[4:],
    "unsupported_version": lambda: patched(tensor_frame(), VERSION, 2, fix_crc=False),
    "frame_truncated": lambda: tensor_frame()[:-1],
    "frame_trailing_bytes": lambda: tensor_frame() + b"\x00",
    "checksum_mismatch": lambda: flipped(tensor_frame(), 40, 0x10),
    "reserved_flags": lambda: patched(tensor_frame(), FLAGS, 0b10),
    "tensor_frame_entry_count": lambda: patched(tensor_frame(), ENTRY_COUNT, 2),
    "field_overrun": lambda: patched(write_frame([], bundle=True), ENTRY_COUNT, 1),
    "leftover_bytes": empty_bundle_with_leftover,
}


@pytest.mark.parametrize("kind", sorted(FRAME_CASES))
def test_corrupted_frame_raises_its_kind(kind):
    with pytest.raises(FrameError) as info:
        read_frame(FRAME_CASES[kind]())
    assert info.value.kind == kind, str(info.value)
    assert type(info.value) is ERROR_KINDS[kind]


def test_every_single_byte_flip_raises_a_frame_kind():
    frame = tensor_frame()
    for i in range(len(frame)):
        with pytest.raises(FrameError) as info:
            read_frame(flipped(frame, i))
        assert info.value.kind in ERROR_KINDS and ERROR_KINDS[info.value.kind] is FrameError


def test_frame_above_the_readers_limit():
    frame = tensor_frame()
    with pytest.raises(FrameError) as info:
        read_frame(frame, limits=Limits(max_frame_bytes=len(frame) - 1))
    assert info.value.kind == "frame_too_large"


def u8(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint8)


#: Two f32 ones as bit patterns, and a GComp exponent codebook that codes them.
F32_ONES = np.float32([1, 1]).view(np.uint32)
GCOMP_BOOK = wire.huffman_book(np.bincount([127], minlength=256).astype(np.uint64), 12)

KERNEL_CASES = {
    "invalid_bit_width": lambda: wire.pack_bits([1, 2], 0),
    "value_too_wide": lambda: wire.pack_bits([1, 8, 2], 3),
    "input_too_short": lambda: wire.unpack_bits(u8(0xFF), 12, 2),
    "nonzero_padding_bits": lambda: wire.unpack_bits_exact(u8(0xFF), 4, 1),
    "length_mismatch": lambda: wire.quartic_decode(u8(0, 0), 5),
    "invalid_trit": lambda: wire.quartic_encode(np.array([0, 2], dtype=np.int8)),
    "invalid_quartic_byte": lambda: wire.quartic_decode(u8(243), 5),
    "nonzero_quartic_padding": lambda: wire.quartic_decode(u8(1), 4),
    "zero_run_input_byte": lambda: wire.zero_run_encode(u8(250)),
    "zero_run_too_long": lambda: wire.zero_run_decode(u8(255), expected_len=3),
    "zero_run_too_short": lambda: wire.zero_run_decode(u8(1, 2), expected_len=3),
    "not_strictly_ascending": lambda: wire.rice_encode(np.array([3, 3], dtype=np.uint32), 16, 1),
    "index_out_of_range": lambda: wire.rice_encode(np.array([3, 20], dtype=np.uint32), 16, 1),
    "invalid_rice_parameter": lambda: wire.rice_encode(np.array([3], dtype=np.uint32), 16, 40),
    "not_whole_sets": lambda: wire.rice_encode(np.array([1, 2, 3], dtype=np.uint32), 16, 1, set_len=2),
    "elias_zero": lambda: wire.elias_encode([1, 0], "gamma"),
    "stream_truncated": lambda: wire.elias_decode(wire.elias_encode([5, 6], "gamma"), 3, "gamma"),
    "invalid_code_length_cap": lambda: wire.huffman_book(np.ones(256, dtype=np.uint64), 0),
    "invalid_field_format": lambda: wire.gcomp_encode(F32_ONES, 2, 1, u8(0, 0), GCOMP_BOOK),
    "invalid_block_size": lambda: wire.gcomp_encode(F32_ONES, 0, 0, u8(), GCOMP_BOOK),
    "block_count": lambda: wire.gcomp_encode(F32_ONES, 0, 1, u8(0), GCOMP_BOOK),
    "invalid_block_level": lambda: wire.gcomp_encode(F32_ONES, 0, 1, u8(0, 4), GCOMP_BOOK),
    "non_finite_value": lambda: wire.gcomp_encode(np.float32([1, np.inf]).view(np.uint32), 0, 1, u8(0, 0), GCOMP_BOOK),
    "operand_length": lambda: wire.gcomp_metric("sgd", F32_ONES, np.ones(3, np.float32), lr=0.1),
}


@pytest.mark.parametrize("kind", sorted(KERNEL_CASES))
def test_bad_kernel_input_raises_its_kind(kind):
    with pytest.raises(WireError) as info:
        KERNEL_CASES[kind]()
    assert info.value.kind == kind, str(info.value)
    assert type(info.value) is WireError is ERROR_KINDS[kind]


def test_kind_survives_pickling():
    with pytest.raises(FrameError) as info:
        read_frame(tensor_frame()[:-1])
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is FrameError and again.kind == "frame_truncated" and str(again) == str(info.value)


def test_kind_of_an_out_buffer_error_is_the_kernels():
    out = np.empty(5, dtype=np.int8)
    with pytest.raises(WireError) as info:
        wire.quartic_decode(u8(243), 5, out=out)
    assert info.value.kind == "invalid_quartic_byte"


def test_errors_raised_from_python_carry_the_class_default():
    assert FrameError("record 'x': section 'idx' is missing").kind == "invalid_record"
    assert WireError("bad").kind == "invalid_input"
    with pytest.raises(FrameError) as info:
        decode_entry(read_frame(tensor_frame(codec=999)).entry())
    assert info.value.kind == "invalid_record"
    # A native error sets its kind on the instance, not on the class.
    with pytest.raises(FrameError):
        read_frame(b"GWIX" + tensor_frame()[4:])
    assert FrameError.kind == "invalid_record" and WireError.kind == "invalid_input"


def documented_kinds() -> dict[str, str]:
    """``{kind: class name}`` from the table of FORMAT.md section 7.1."""
    text = FORMAT_MD.read_text()
    section = text.split("### 7.1 Error kinds", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \|", section, flags=re.M)
    kinds = dict(rows)
    assert len(kinds) == len(rows), "a kind is listed twice"
    return kinds


def test_format_md_lists_exactly_the_kinds_the_module_raises():
    native = {kind: cls.__name__ for kind, cls in ERROR_KINDS.items()}
    python_defaults = {FrameError.kind: "FrameError", WireError.kind: "WireError"}
    python_kinds = {kind: cls.__name__ for kind, cls in PYTHON_KINDS.items()}
    assert not set(native) & set(python_defaults)
    assert not (set(native) | set(python_defaults)) & set(python_kinds)
    assert documented_kinds() == {**native, **python_defaults, **python_kinds}


def test_python_kinds_are_set_on_the_instance():
    for kind, cls in PYTHON_KINDS.items():
        exc = error(kind, "message")
        assert type(exc) is cls and exc.kind == kind and str(exc) == "message"
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is cls and again.kind == kind
    assert FrameError.kind == "invalid_record"


def test_kinds_are_distinct_snake_case():
    kinds = [*ERROR_KINDS, FrameError.kind, WireError.kind, *PYTHON_KINDS]
    assert len(set(kinds)) == len(kinds)
    for kind in kinds:
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", kind), kind
    assert _native.ERROR_KINDS is ERROR_KINDS
    assert set(ERROR_KINDS.values()) == {FrameError, WireError}
