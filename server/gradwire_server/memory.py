"""The server process keeps the memory a round close frees, so the next close reuses pages already touched.

A close allocates model-sized temporaries (the decoded aggregate, the downlink's reconstruction, the
outer step) and frees them. glibc's malloc hands such blocks back to the kernel: a block above its mmap
threshold (128 KiB, raised as blocks are freed, up to 32 MiB) is unmapped when freed, the heap's top is
trimmed past the trim threshold, and each thread after the first gets an arena of its own whose empty
heaps are unmapped. The pages then come back one fault at a time, each zeroed by the kernel, at the next
close; a fresh process pays for all of a close's pages in its first one. Measured at 10 M parameters and
4 nodes (bench/close_vs_adamw.py, 2 cores): SparseLoCo's first close 0.19-0.21 s and the next ones
0.13-0.16 s; with the settings below and the heap touched when the run's state loads, 0.12-0.15 s from the
first close on.

- :func:`keep_freed_memory` (at process start, before threads): one malloc arena, the mmap threshold
  fixed at glibc's largest (32 MiB), and freed memory kept up to what :func:`reserve` asked for.
  Blocks over 32 MiB (tensors of over 8 M float32 values) are still mapped and unmapped per use.
- :func:`reserve` (when a run's state loads): the trim threshold raised to ``nbytes`` and ``nbytes`` of
  heap touched and freed, so the run's first close finds its pages mapped.

Both do nothing where the C library is not glibc, where another allocator is preloaded (its own policy
stands) or with ``GRADWIRE_KEEP_FREED_MEMORY=0`` in the environment. A process keeps at most what its
largest run reserved (at most :data:`RESERVE_MAX`) free and unreturned to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["keep_freed_memory", "reserve", "retained_bytes"]

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2); mallopt refuses more.
MMAP_THRESHOLD_MAX = 32 << 20
#: The blocks :func:`reserve` touches: under the mmap threshold, so they come from the heap.
_TOUCH_BLOCK = 16 << 20
#: Never touch more than this share of the memory the kernel says is available, nor more than
#: RESERVE_MAX: beyond it a model's tensors are mostly over the mmap threshold, which no reserve helps.
_AVAILABLE_SHARE = 0.25
RESERVE_MAX = 1 << 30

_state = {"libc": None, "kept": False, "retained": 0}


def _glibc() -> ctypes.CDLL | None:
    if _state["libc"] is None:
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or "LD_PRELOAD" in os.environ:
            _state["libc"] = False
        else:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                libc.mallopt.restype = ctypes.c_int
                _state["libc"] = libc
            except (OSError, AttributeError):
                _state["libc"] = False
    return _state["libc"] or None


def keep_freed_memory() -> bool:
    """Configure glibc's malloc for this process as the module docstring says (once; before threads
    start, so they share the one arena). ``True`` if it took effect."""
    libc = _glibc()
    if libc is None or os.environ.get("GRADWIRE_KEEP_FREED_MEMORY", "1").strip() == "0":
        return False
    if not _state["kept"]:
        ok = (
            libc.mallopt(_M_ARENA_MAX, 1) == 1
            and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
        )
        if not ok:
            return False
        _state["kept"] = True
        _state["retained"] = MMAP_THRESHOLD_MAX
    return True


def retained_bytes() -> int:
    """The free memory this process keeps rather than returning it (0 if :func:`keep_freed_memory` did
    not take effect)."""
    return _state["retained"] if _state["kept"] else 0


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reserve(nbytes: int) -> int:
    """Keep up to ``nbytes`` of freed memory from now on, and touch that much heap now (at most
    :data:`RESERVE_MAX` and a quarter of the memory available). Returns the bytes touched (0 where
    :func:`keep_freed_memory` did not take effect)."""
    if not _state["kept"] or nbytes <= 0:
        return 0
    libc = _glibc()
    assert libc is not None
    nbytes = min(nbytes, RESERVE_MAX)
    available = _available_bytes()
    if available is not None:
        nbytes = min(nbytes, int(available * _AVAILABLE_SHARE))
    if nbytes > _state["retained"] and libc.mallopt(_M_TRIM_THRESHOLD, nbytes) == 1:
        _state["retained"] = nbytes
    import torch  # the blocks come from the allocator torch's CPU tensors use

    blocks = [torch.ones(_TOUCH_BLOCK // 4, dtype=torch.float32) for _ in range(nbytes // _TOUCH_BLOCK)]
    touched = sum(b.numel() * 4 for b in blocks)
    del blocks
    return touched
