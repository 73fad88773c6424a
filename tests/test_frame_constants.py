"""The protocol constants ``gradwire.frame`` re-exports are the Rust core's and match FORMAT.md."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from gradwire import _native, frame
from gradwire.errors import FrameError


def test_constants_are_the_native_ones_with_the_documented_values():
    assert frame.FORMAT_VERSION == _native.FORMAT_VERSION == 1
    assert frame.FRAME_MAGIC == _native.FRAME_MAGIC == b"GWIR"
    assert frame.FRAME_HEADER_BYTES == _native.FRAME_HEADER_BYTES == 32
    assert frame.MIN_FRAME_BYTES == _native.MIN_FRAME_BYTES == 36
    assert frame.MAX_NAME_BYTES == _native.MAX_NAME_BYTES == 1024
    table_4_1 = ["u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64", "f16", "bf16", "f32", "f64"]
    assert dict(frame.ELEM_CODES) == dict(_native.ELEM_CODES) == {n: c for c, n in enumerate(table_4_1)}
    for name, code in frame.ELEM_CODES.items():
        assert getattr(frame, f"ELEM_{name.upper()}") == code
    assert frame.ELEM_BF16 == 9
    with pytest.raises(TypeError):
        frame.ELEM_CODES["u8"] = 5  # read-only


def test_a_written_frame_has_the_constants_layout():
    empty = frame.write_frame([], bundle=True)
    assert len(empty) == frame.MIN_FRAME_BYTES
    assert empty[:4] == frame.FRAME_MAGIC
    assert struct.unpack_from("<H", empty, 4)[0] == frame.FORMAT_VERSION
    e = frame.Entry("x" * frame.MAX_NAME_BYTES, 0, torch.float32, (1,), sections={"data": np.zeros(1, np.float32)})
    assert frame.read_frame(frame.write_frame([e])).entries[0].name == e.name
    e.name += "x"
    with pytest.raises(FrameError) as info:
        frame.write_frame([e])
    assert info.value.kind == "name_too_long"


@pytest.mark.parametrize("name", ["u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64", "f16", "f32", "f64"])
def test_every_numpy_element_type_round_trips_with_its_code(name):
    dt = np.dtype(f"{name[0]}{int(name[1:]) // 8}")
    e = frame.Entry("x", 0, torch.float32, (3,), sections={"s": np.arange(3).astype(dt)})
    (got,) = frame.read_frame(frame.write_frame([e])).entries
    assert got.sections["s"].dtype == dt and got.sections["s"].tolist() == [0, 1, 2]
