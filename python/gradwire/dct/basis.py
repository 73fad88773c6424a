"""The DCT's bases, and the one cache that holds every one of them.

Every basis the package uses comes from one float64 matrix (:func:`basis_f64`, built on the host) and is
kept in one cache per ``(kind, size, …, device, dtype)``, bounded in bytes (:data:`BASIS_CACHE_BYTES`,
least recently used evicted first) and emptied by :func:`clear_basis_cache`:

- ``"basis"``: :func:`dct_basis`, the orthonormal DCT-II matrix in a float dtype (the float transforms);
- ``"fixed_point"``: :func:`fixed_point_basis`, ``round(D·2^s)`` held exactly in float64 (the exact
  decode's float64 routes), and ``"folds"``: whether it is symmetric enough to fold in half
  (:func:`basis_folds`, the CPU's Rust decode);
- what other modules derive from these through :func:`cached`: the FFT's twiddles (``"twiddle"``,
  :mod:`.transform`) and the integer route's digit bases (``"integer"``, :func:`.integer.integer_basis`).

Transform (docs/FORMAT.md §5.2): ``D_N[f, n] = sqrt(2/N) cos(pi (2n + 1) f / (2N))`` for ``f >= 1`` and
``D_N[0, n] = sqrt(1/N)``. Building every basis from the same float64 matrix and casting it is what gives
every device and dtype the same rounded basis, and the exact decode the same integers everywhere.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from .. import _native

__all__ = [
    "BASIS_CACHE_BYTES",
    "basis_f64",
    "basis_folds",
    "cache_bytes",
    "cached",
    "clear_basis_cache",
    "dct_basis",
    "device_key",
    "fixed_point_basis",
]

#: Bytes of bases the cache keeps (least recently used evicted first). Bounded so that records with many
#: different chunk sizes cannot grow it without limit.
BASIS_CACHE_BYTES = 256 << 20

_CACHE: OrderedDict[Hashable, object] = OrderedDict()
_LOCK = threading.Lock()
_cache_bytes = 0


def basis_f64(n: int) -> torch.Tensor:
    """``D_n`` in float64 on the host, freshly built (every cached basis is derived from this)."""
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi * (2.0 * i[None, :] + 1.0) * i[:, None] / (2.0 * n))  # [f, n]
    d *= math.sqrt(2.0 / n)
    d[0] = math.sqrt(1.0 / n)
    return d


def device_key(device) -> torch.device:
    """``device`` as the cache names it: ``None`` is the CPU, and ``cuda`` the current CUDA device (so
    ``cuda`` and ``cuda:0`` share their bases when 0 is the current one)."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return int(getattr(value, "nbytes", 0))


def cached(key: Hashable, build: Callable[[], object]):
    """The cache's value under ``key`` (its first element names the kind), built by ``build()`` on a miss.

    The build runs outside the lock (a basis on a GPU takes a host-to-device copy); the first value stored
    under a key is the one every caller gets. A value larger than the whole budget is returned uncached."""
    global _cache_bytes
    with _LOCK:
        got = _CACHE.get(key)
        if got is not None:
            _CACHE.move_to_end(key)
            return got
    value = build()
    size = _nbytes(value)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        if size <= BASIS_CACHE_BYTES:
            _CACHE[key] = value
            _cache_bytes += size
            while _cache_bytes > BASIS_CACHE_BYTES:
                _, old = _CACHE.popitem(last=False)
                _cache_bytes -= _nbytes(old)
    return value


def cache_bytes() -> int:
    """Bytes the cache holds now."""
    return _cache_bytes


def clear_basis_cache() -> None:
    """Forget every cached basis, of every kind (frees their memory)."""
    global _cache_bytes
    with _LOCK:
        _CACHE.clear()
        _cache_bytes = 0


def dct_basis(n: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D_n`` (``X = D_n @ x``), cached per ``(n, device, dtype)``.

    Built in float64 on the CPU and cast, so every device and dtype holds the same rounded basis.
    The returned tensor is shared: do not modify it in place.
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"DCT size must be >= 1, got {n}")
    if not dtype.is_floating_point:
        raise ValueError(f"DCT basis dtype must be floating point, got {dtype}")
    dev = device_key(device)
    return cached(("basis", n, dev, dtype), lambda: basis_f64(n).to(device=dev, dtype=dtype))


def fixed_point_basis(n: int, s: int, device) -> torch.Tensor:
    """``round(D_n · 2^s)`` in float64 on ``device``: the exact decode's integer basis on the grid
    ``2^-s``, every entry an integer held exactly. Shared: do not modify it in place."""
    dev = device_key(device)
    return cached(("fixed_point", n, s, dev), lambda: torch.round(basis_f64(n) * float(2**s)).to(dev))


def basis_folds(n: int, s: int) -> bool:
    """Whether :func:`fixed_point_basis` ``(n, s)`` is exactly symmetric (``B[f, n-1-i] = (-1)^f B[f, i]``,
    ``n`` even), so the CPU's decode may fold it in half. Checked once per ``(n, s)``."""

    def check() -> bool:
        host = fixed_point_basis(n, s, "cpu")
        return bool(_native.dct_basis_folds(host.reshape(-1).numpy(), n))

    return cached(("folds", n, s), check)
