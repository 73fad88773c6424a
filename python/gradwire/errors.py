"""The exceptions gradwire raises.

Both are defined by the native module so that Rust errors surface as these exact classes:

- ``WireError`` (a ``ValueError``): a kernel was given input it cannot encode or decode
  (a value wider than its bit width, a byte outside the quartic alphabet, a short buffer).
- ``FrameError`` (a ``WireError``): a frame, or one of its records, breaks a rule of
  docs/FORMAT.md. The message names the rule.
"""

from ._native import FrameError, WireError

__all__ = ["FrameError", "WireError"]
