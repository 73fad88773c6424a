"""Top-k selection and per-chunk quantization: the math the DCT codec and the Panthalia API share.

:func:`select_topk` keeps each chunk's ``k`` largest-magnitude coefficients (ascending positions);
:func:`quantize_int8` / :func:`dequantize_int8` map a row of values to int8 on a per-row linear grid
(Panthalia's), and :func:`quantize_levels` / :func:`dequantize_levels` to the ``2^b`` levels of a DCT
record's values (8, 4, 2 or 1 bits; at 8 bits the int8 grid).
"""

from __future__ import annotations

import torch

from .. import _native

__all__ = [
    "MIN_RANGE",
    "dequantize_int8",
    "dequantize_levels",
    "quantize_int8",
    "quantize_levels",
    "select_topk",
]

#: Floor of a chunk's value range before it is divided into 255 steps.
MIN_RANGE = 1e-8


def select_topk(coeffs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of largest magnitude of each row of ``coeffs`` ``(num_chunks, C)``.

    Returns ``(idx, vals)``, both ``(num_chunks, k)``: ``idx`` (int64) ascending within each row, so the
    index set is canonical and decoding is deterministic, and ``vals`` the coefficients at ``idx``.
    Float32 rows on the CPU go through one Rust pass (a select on the magnitudes' bits, then an ascending
    scan: no sort, no abs copy), where ties at the threshold go to the lowest positions; elsewhere
    ``torch.topk`` picks among ties as it likes. NaN counts as the largest magnitude in both.
    """
    if coeffs.ndim != 2:
        raise ValueError(f"expected (num_chunks, C) coefficients, got shape {tuple(coeffs.shape)}")
    k = int(k)
    if not 1 <= k <= coeffs.shape[1]:
        raise ValueError(f"k must lie in [1, {coeffs.shape[1]}] (the chunk size), got {k}")
    if coeffs.device.type == "cpu" and coeffs.dtype == torch.float32:
        n, c = coeffs.shape
        pos, kept = _native.select_topk_rows(
            coeffs.detach().contiguous().reshape(-1).numpy(), c, k, torch.get_num_threads()
        )
        return torch.from_numpy(pos).reshape(n, k), torch.from_numpy(kept).reshape(n, k)
    _, idx = torch.topk(coeffs.abs(), k, dim=1, largest=True, sorted=False)
    idx, _ = torch.sort(idx, dim=1)
    return idx, torch.gather(coeffs, 1, idx)


def _quant_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def quantize_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row linear int8 quantization of ``values`` ``(batch, k)``.

    ``scale = max(max - min, 1e-8) / 255`` and ``q = clamp(round((v - min) / scale) - 128, -128, 127)``
    with round-half-even, computed in float32 (float64 input stays float64). Returns
    ``(q int8 (batch, k), scales (batch,), mins (batch,))``.
    """
    if values.ndim != 2:
        raise ValueError(f"expected (batch, k) values, got shape {tuple(values.shape)}")
    if values.shape[1] < 1:
        raise ValueError("cannot quantize rows of zero values")
    v = values.to(_quant_dtype(values.dtype))
    mins = v.amin(dim=1)
    maxs = v.amax(dim=1)
    scales = (maxs - mins).clamp_min(MIN_RANGE) / 255.0
    q = torch.round((v - mins[:, None]) / scales[:, None]) - 128.0
    return q.clamp_(-128.0, 127.0).to(torch.int8), scales, mins


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: ``(q + 128) * scale + min`` per row.

    Computed in the dtype of ``scales`` (float32 on the wire). ``scales``/``mins`` may be ``(batch,)``
    or ``(batch, 1)``.
    """
    dtype = _quant_dtype(scales.dtype)
    s = scales.to(dtype).reshape(-1, 1)
    m = mins.to(dtype).reshape(-1, 1)
    return (q.to(dtype) + 128.0) * s + m


def quantize_levels(values: torch.Tensor, value_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-chunk linear quantization of ``values`` ``(num_chunks, k)`` to ``L = 2^value_bits − 1`` steps.

    ``scale = max(max − min, 1e-8) / L`` and ``level = clamp(round_half_even((v − min) / scale), 0, L)``
    in float32; at 8 bits exactly :func:`quantize_int8` (``level = q + 128``), so 8-bit records are
    unchanged byte for byte. Returns ``(levels int16, scales, mins)``.
    """
    if value_bits == 8:
        q, scales, mins = quantize_int8(values)
        return q.to(torch.int16) + 128, scales, mins
    top = float((1 << value_bits) - 1)
    v = values.to(torch.float32)
    mins = v.amin(dim=1)
    scales = (v.amax(dim=1) - mins).clamp_min(MIN_RANGE) / top
    levels = torch.round((v - mins[:, None]) / scales[:, None]).clamp_(0.0, top)
    return levels.to(torch.int16), scales, mins


def dequantize_levels(levels: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``level · scale + min`` per chunk in float32 (at 8 bits the same numbers as ``dequantize_int8``)."""
    return levels.to(torch.float32) * scales.to(torch.float32).reshape(-1, 1) + mins.to(torch.float32).reshape(-1, 1)
