"""Which exact-decode route a device takes: the integer one or the float64 one, chosen by measurement.

Both routes give the same bits (:mod:`.decode`, :mod:`.integer`), so the choice only changes the time
taken, and it may be made by timing them on the device itself, once, as ``cudnn.benchmark`` picks a
convolution. What decides it: a GPU's float64 rate is 1/64 of its float32 rate on consumer parts and
about 1/2 on the data-centre parts of 2020–2024 (A100, H100, H200), while its int8 rate is the highest
it has on most parts and cut on some recent data-centre ones. So no rule written here would hold for
every device: each device measures.

``GRADWIRE_EXACT_DECODE`` (or :func:`set_exact_decode`) sets the policy:

- ``auto`` (the default): on a non-CPU device, the first decode of each (device, chunk shape, ``k``
  bucket) times both routes on a block of that shape and keeps the faster (:func:`choices` lists what
  was measured; a device where the integer route raises keeps the float64 one);
- ``integer``: the integer route on every non-CPU device (no float64 at all but the final elementwise
  combination);
- ``float64``: the float64 route everywhere (the reference).

The CPU takes neither: its Rust pass (``_native.dct_decode_folded``) is faster than both.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

from .basis import device_key

__all__ = ["MODES", "exact_decode_mode", "set_exact_decode", "device_route", "choices", "kept_route"]

MODES = ("auto", "integer", "float64")
_ENV = "GRADWIRE_EXACT_DECODE"
_mode: str | None = None
_CHOICES: dict = {}
_LOCK = threading.Lock()


def exact_decode_mode() -> str:
    """The policy in force: :func:`set_exact_decode`'s, else ``GRADWIRE_EXACT_DECODE``'s, else ``auto``."""
    if _mode is not None:
        return _mode
    env = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if env not in MODES:
        raise ValueError(f"{_ENV}={env!r}: expected one of {', '.join(MODES)}")
    return env


def set_exact_decode(mode: str | None) -> None:
    """Set the policy for this process (``None``: back to the environment's); forgets what was measured."""
    global _mode
    if mode is not None and mode not in MODES:
        raise ValueError(f"exact decode mode must be one of {', '.join(MODES)}, got {mode!r}")
    with _LOCK:
        _mode = mode
        _CHOICES.clear()


def _k_bucket(k: int) -> int:
    return 1 << max(0, (int(k) - 1).bit_length())


def device_route(
    k: int, dims: tuple[int, ...], device: torch.device, float_route: str, time_route: Callable[[str], float]
) -> str:
    """``"integer"`` or ``float_route`` for ``k`` coefficients per chunk of shape ``dims`` on ``device``
    (not the CPU), under the policy; ``time_route(route)`` returns the seconds one decode of a test block
    takes by that route (called only by ``auto``, once per device, shape and ``k`` bucket)."""
    mode = exact_decode_mode()
    if mode == "integer":
        return "integer"
    if mode == "float64":
        return float_route
    key = (str(device_key(device)), tuple(dims), _k_bucket(k), float_route)
    got = _CHOICES.get(key)
    if got is None:
        timings = {float_route: _best_of(time_route, float_route)}
        try:
            timings["integer"] = _best_of(time_route, "integer")
        except RuntimeError:
            # A device without an int8 matrix product for these shapes (torch._int_mm is CUDA's and the
            # CPU's; an older GPU may lack the kernel): the float64 route, which every device has.
            timings["integer"] = float("inf")
        route = min(timings, key=timings.get)
        got = (route, timings)
        with _LOCK:
            _CHOICES[key] = got
    return got[0]


def _best_of(time_route: Callable[[str], float], route: str, tries: int = 3) -> float:
    time_route(route)  # warm up: kernels loaded, memory pooled
    return min(time_route(route) for _ in range(tries))


def choices() -> list[dict]:
    """What ``auto`` measured this process: one row per (device, chunk shape, k bucket), the milliseconds of
    each route and the route kept."""
    out = []
    for (device, dims, kb, _), (route, timings) in sorted(_CHOICES.items()):
        out.append(
            {
                "device": device,
                "chunk": "x".join(map(str, dims)),
                "k_bucket": kb,
                "route": route,
                **{f"{r}_ms": round(t * 1e3, 3) for r, t in timings.items()},
            }
        )
    return out


def kept_route(device, dims, k: int) -> str | None:
    """The route ``auto`` kept on ``device`` for ``k`` coefficients per chunk of shape ``dims``; ``None``
    if nothing was measured for them."""
    for (dev, d, kb, _), (route, _) in _CHOICES.items():
        if dev == str(device_key(device)) and d == tuple(dims) and kb == _k_bucket(k):
            return route
    return None


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes on ``device``, its queued kernels included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0
