"""The one place that checks records: params, sections and their element types, for every decoder.

Decoders treat a record as hostile input: every helper here raises :class:`~gradwire.errors.FrameError`
with a message of the form ``record 'name': codec: rule`` before anything of the tensor's size is
allocated. Every codec's decoder (and DCT's :func:`~gradwire.dct.parse_record`) goes through
these helpers, so a rule is worded the same way for all of them. Encoders use the same helpers to put
float payloads (f16, bf16, f32) into sections.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..errors import FrameError, WireError
from ..frame import ELEM_BF16, Entry
from ..lowrank import matrix_shape

__all__ = [
    "FLOAT_DTYPES",
    "VALUE_DTYPES",
    "bad",
    "byte_section",
    "check_float_input",
    "check_record_dtype",
    "entry",
    "expect_sections",
    "float_section",
    "matrix_shape",
    "no_params",
    "params",
    "section",
    "tensor_from_values",
    "values_payload",
    "wire_call",
]

#: Tensor dtypes a record may carry (FORMAT.md §4.1, floating-point codes).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Element types a codec may choose for the float values it sends.
VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NUMPY_VALUE = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
_TORCH_VALUE = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


def entry(
    codec_id: int,
    name: str,
    tensor: torch.Tensor,
    *,
    params: bytes = b"",
    sections: dict[str, np.ndarray],
    section_elems: dict[str, int | None] | None = None,
) -> Entry:
    """The record of ``tensor`` (its dtype and shape) made by codec ``codec_id``; element codes of
    ``section_elems`` that are ``None`` (no bf16 tag) are left out."""
    elems = {k: e for k, e in (section_elems or {}).items() if e is not None}
    return Entry(
        name=name,
        codec=codec_id,
        dtype=tensor.dtype,
        shape=tuple(tensor.shape),
        params=params,
        sections=sections,
        section_elems=elems,
    )


def bad(entry: Entry, codec: str, rule: str) -> FrameError:
    """The error for a record that breaks ``rule``."""
    return FrameError(f"record {entry.name!r}: {codec}: {rule}")


def check_float_input(tensor: torch.Tensor) -> None:
    """Encoders take floating-point tensors only."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"expected a float16/bfloat16/float32/float64 tensor, got {tensor.dtype}")


def check_record_dtype(entry: Entry, codec: str) -> None:
    if entry.dtype not in FLOAT_DTYPES:
        raise bad(entry, codec, f"dtype must be a floating-point type, got {entry.dtype}")


def params(entry: Entry, codec: str, layout: struct.Struct, fields: str) -> tuple:
    """Unpack ``entry.params``, which must be exactly ``layout.size`` bytes (``fields`` names them)."""
    if len(entry.params) != layout.size:
        raise bad(entry, codec, f"params must be {layout.size} bytes ({fields}), got {len(entry.params)}")
    return layout.unpack(entry.params)


def no_params(entry: Entry, codec: str) -> None:
    """The record carries no parameters."""
    if entry.params:
        raise bad(entry, codec, f"params must be empty, got {len(entry.params)} bytes")


def expect_sections(entry: Entry, codec: str, names: Sequence[str]) -> None:
    """The record holds exactly the sections ``names``, in that order."""
    have = list(entry.sections)
    for s in names:
        if s not in entry.sections:
            raise bad(entry, codec, f"section {s!r} is missing")
    for s in have:
        if s not in names:
            raise bad(entry, codec, f"unexpected section {s!r} (expected exactly {', '.join(names)})")
    if tuple(have) != tuple(names):
        raise bad(entry, codec, f"sections must be in the order {', '.join(names)}, got {', '.join(have)}")


def _elem_name(entry: Entry, name: str) -> str:
    return "bf16" if entry.section_elems.get(name) == ELEM_BF16 else str(entry.sections[name].dtype)


def section(entry: Entry, codec: str, name: str, dtype, count: int, count_rule: str) -> np.ndarray:
    """Section ``name`` with element type ``dtype`` holding exactly ``count`` elements."""
    arr = entry.sections[name]
    want = np.dtype(dtype)
    if name in entry.section_elems or arr.dtype != want:
        raise bad(entry, codec, f"section {name!r} must have element type {want}, got {_elem_name(entry, name)}")
    if arr.ndim != 1 or arr.shape[0] != count:
        raise bad(entry, codec, f"section {name!r} must hold {count_rule} = {count} elements, got {arr.size}")
    return arr


def byte_section(entry: Entry, codec: str, name: str) -> np.ndarray:
    """Section ``name`` of uint8 bytes, of any length (a stream whose decoder checks its length)."""
    arr = entry.sections[name]
    if name in entry.section_elems or arr.dtype != np.uint8:
        raise bad(entry, codec, f"section {name!r} must have element type uint8, got {_elem_name(entry, name)}")
    return arr


def float_section(
    entry: Entry,
    codec: str,
    name: str,
    count: int,
    count_rule: str,
    allowed: Iterable[torch.dtype] = VALUE_DTYPES,
    finite: bool = True,
) -> torch.Tensor:
    """Section ``name`` of f16, bf16, f32 (or f64, where ``allowed``) values as a CPU tensor of that dtype."""
    arr = entry.sections[name]
    allowed = tuple(allowed)
    if entry.section_elems.get(name) == ELEM_BF16:
        dtype = torch.bfloat16
    else:
        dtype = _TORCH_VALUE.get(arr.dtype)
    if dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        got = str(dtype).replace("torch.", "") if dtype is not None else str(arr.dtype)
        raise bad(entry, codec, f"section {name!r} must have element type {names}, got {got}")
    if arr.ndim != 1 or arr.shape[0] != count:
        raise bad(entry, codec, f"section {name!r} must hold {count_rule} = {count} elements, got {arr.size}")
    t = tensor_from_values(arr, dtype)
    if finite and count and not bool(torch.isfinite(t).all()):
        raise bad(entry, codec, f"section {name!r} must hold finite values")
    return t


def tensor_from_values(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` from a section's array (bf16 sections are uint16 words)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.array(arr, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr, dtype=_NUMPY_VALUE[dtype]))


def values_payload(values: torch.Tensor) -> tuple[np.ndarray, int | None]:
    """A 1-D float tensor (f16, bf16 or f32, any device) as a section array and its bf16 tag, if any."""
    host = values.detach().reshape(-1).contiguous().cpu()
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16), ELEM_BF16
    return host.numpy(), None


def wire_call(entry: Entry, codec: str, what: str, fn, *args):
    """Run a :mod:`gradwire.wire` kernel on record bytes; its ``WireError`` becomes a ``FrameError``."""
    try:
        return fn(*args)
    except FrameError:
        raise
    except (WireError, ValueError) as e:
        raise bad(entry, codec, f"{what}: {e}") from None
