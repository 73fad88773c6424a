"""The exceptions gradwire raises.

Both are defined by the native module so that Rust errors surface as these exact classes:

- ``WireError`` (a ``ValueError``): a kernel was given input it cannot encode or decode
  (a value wider than its bit width, a byte outside the quartic alphabet, a short buffer).
- ``FrameError`` (a ``WireError``): a frame, or one of its records, breaks a rule of
  docs/FORMAT.md. The message names the rule.

Every instance has a ``kind``: a stable snake_case name of the problem, for code that must tell
problems apart without parsing messages (``except FrameError as e: if e.kind == "checksum_mismatch"``).
Messages may be reworded; a kind is never renamed or reused. The kinds are listed, each with the
rule it stands for, in docs/FORMAT.md section 7.1:

- an error of the Rust core carries the kind of its ``WireError`` variant, the variant's name in
  snake case (``"checksum_mismatch"``, ``"frame_truncated"``, ``"bad_magic"``,
  ``"value_too_wide"`` ...); ``ERROR_KINDS`` maps each to the class raised with it;
- an error raised by Python code carries its class default: ``"invalid_record"`` for
  ``FrameError`` (a codec decoder rejecting a record by a rule of FORMAT.md section 5) and
  ``"invalid_input"`` for ``WireError``;
- an error raised by Python code for a rule of its own carries one of :data:`PYTHON_KINDS`
  (``"model_spec_mismatch"``, ``"invalid_model_record"``: the whole-model records of FORMAT.md
  section 9), set on the instance by :func:`error`.
"""

from collections.abc import Mapping
from types import MappingProxyType

from ._native import ERROR_KINDS, FrameError, WireError

__all__ = ["ERROR_KINDS", "PYTHON_KINDS", "FrameError", "WireError", "error"]

#: The kinds Python code of the library raises besides the two class defaults, mapped to the class
#: raised with each (as :data:`ERROR_KINDS` does for the core's). Read-only.
PYTHON_KINDS: Mapping[str, type[WireError]] = MappingProxyType(
    {
        # A whole-model record made for another model spec than the receiver's (FORMAT.md section 9).
        "model_spec_mismatch": FrameError,
        # A frame that breaks a rule of whole-model records: not one record in a bundle, a name that is
        # not "@model:" and 32 lowercase hex digits, a record that is not 1-D f32 of the spec's length.
        "invalid_model_record": FrameError,
        # A run-binding record (FORMAT.md section 10) that is not one empty float32 identity record named
        # "@run:" and 32 lowercase hex digits.
        "invalid_run_binding": FrameError,
    }
)


def error(kind: str, message: str) -> WireError:
    """An exception of the class :data:`PYTHON_KINDS` gives ``kind``, carrying ``kind`` on the instance."""
    exc = PYTHON_KINDS[kind](message)
    exc.kind = kind
    return exc
