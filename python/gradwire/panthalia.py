"""The Panthalia description's functions, under their names and signatures.

Code written against Panthalia's reference (``dct_1d_naive`` … ``chunked_dct_decode_int8``) runs
unchanged on these; they are thin wrappers over :mod:`gradwire.dct`, the same math the DCT codec uses.

Differences from the published reference, all deliberate:

- ``dct_nd_naive``/``idct_nd_naive`` transform every dimension of *their argument*, as documented; but
  ``chunked_dct_encode_int8`` transforms each chunk along the chunk's own dimensions only (one published
  version also transformed across the chunk index, mixing chunks; that is not reproduced).
- Each chunk's top-k positions are returned ascending (the reference left them unordered); the set is
  the same up to ties.
- Half-precision inputs (float16/bfloat16) are computed in float32 and the residual is float32.
- ``norm`` must be ``"ortho"``; anything else raises ``ValueError`` rather than silently producing an
  unnormalized transform.

``chunk_shape`` and ``k`` may be ints/tuples or tensors. The returned ``pad_count`` mirrors them: a
Python ``int`` for int/tuple arguments, a 0-d int64 tensor (on ``x``'s device) when ``chunk_shape`` or
``k`` was a tensor, as in the two published reference versions. ``chunked_dct_decode_int8`` accepts
either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import dct as _dct

__all__ = [
    "chunked_dct_decode_int8",
    "chunked_dct_encode_int8",
    "dct_1d_naive",
    "dct_nd_naive",
    "float_to_int8",
    "idct_1d_naive",
    "idct_nd_naive",
    "int8_to_float",
]

IntLike = int | torch.Tensor
ShapeLike = int | Sequence[int] | torch.Size | torch.Tensor


def _check_norm(norm: str) -> None:
    if norm != "ortho":
        raise ValueError(f"only norm='ortho' is supported, got {norm!r}")


def _as_int(v: IntLike, what: str) -> int:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"{what} must be a single value, got a tensor of shape {tuple(v.shape)}")
        v = v.item()
    if isinstance(v, bool) or int(v) != v:
        raise ValueError(f"{what} must be an integer, got {v!r}")
    return int(v)


def _as_shape(s: ShapeLike, what: str) -> tuple[int, ...]:
    if isinstance(s, torch.Tensor):
        s = s.reshape(-1).tolist()
    elif isinstance(s, int):
        s = (s,)
    return tuple(_as_int(d, what) for d in s)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


# ---------------------------------------------------------------------------------------------
# 1) DCT-II / DCT-III, orthonormal


def dct_1d_naive(x: torch.Tensor, norm: str = "ortho", dim: int = -1) -> torch.Tensor:
    """Orthonormal DCT-II of ``x`` along ``dim`` (by a cached basis matrix)."""
    _check_norm(norm)
    return _dct.dct(x, dim)


def idct_1d_naive(X: torch.Tensor, norm: str = "ortho", dim: int = -1) -> torch.Tensor:
    """Orthonormal inverse DCT (DCT-III) of ``X`` along ``dim``."""
    _check_norm(norm)
    return _dct.idct(X, dim)


def dct_nd_naive(x: torch.Tensor, norm: str = "ortho") -> torch.Tensor:
    """Orthonormal DCT-II along every dimension of ``x`` in turn."""
    _check_norm(norm)
    return _dct.dct_nd(x)


def idct_nd_naive(X: torch.Tensor, norm: str = "ortho") -> torch.Tensor:
    """Orthonormal inverse DCT along every dimension of ``X`` in turn."""
    _check_norm(norm)
    return _dct.idct_nd(X)


# ---------------------------------------------------------------------------------------------
# 2) Per-row int8 quantization


def float_to_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize each row of ``values`` ``(batch, k)`` linearly from ``[min, max]`` to int8.

    Returns ``(q, scales, min_vals)``: ``q`` int8 ``(batch, k)``, ``scales`` and ``min_vals``
    ``(batch,)``, with ``scale = max(max - min, 1e-8) / 255`` and
    ``q = clamp(round((v - min) / scale) - 128, -128, 127)`` (round half to even).
    """
    return _dct.quantize_int8(values)


def int8_to_float(q: torch.Tensor, scales: torch.Tensor, min_vals: torch.Tensor) -> torch.Tensor:
    """Dequantize each row: ``(q + 128) * scale + min``."""
    return _dct.dequantize_int8(q, scales, min_vals)


# ---------------------------------------------------------------------------------------------
# 3) Chunked DCT encode/decode with top-k and int8 quantization


def chunked_dct_encode_int8(
    x: torch.Tensor,
    chunk_shape: ShapeLike,
    k: IntLike,
    prev_error: torch.Tensor | None = None,
    norm: str = "ortho",
):
    """Compress ``x`` (plus ``prev_error``) chunk by chunk.

    Returns ``(freq_idxs, freq_vals_int8, scales, min_vals, new_error, pad_count)``: ``freq_idxs``
    int64 and ``freq_vals_int8`` int8, both ``(num_chunks, k)``; ``scales`` and ``min_vals``
    ``(num_chunks,)``; ``new_error`` of ``x``'s shape, the input (with ``prev_error``) minus what
    :func:`chunked_dct_decode_int8` reconstructs; ``pad_count`` the zeros appended to the flattened
    tensor to fill the last chunk.
    """
    _check_norm(norm)
    tensor_args = isinstance(chunk_shape, torch.Tensor) or isinstance(k, torch.Tensor)
    cshape = _as_shape(chunk_shape, "chunk_shape")
    kk = _as_int(k, "k")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    if prev_error is not None:
        x = x + prev_error
    xw = x.to(_work_dtype(x.dtype))
    plan = _dct.plan_flat(xw.shape, cshape)
    if not 1 <= kk <= plan.chunk_numel:
        raise ValueError(f"k must lie in [1, {plan.chunk_numel}] (the chunk size), got {kk}")

    coeffs = _dct.encode_chunks(xw, plan)
    freq_idxs, top = _dct.select_topk(coeffs, kk)
    q, scales, min_vals = _dct.quantize_int8(top)
    recon = _dct.decode_chunks(freq_idxs, _dct.dequantize_int8(q, scales, min_vals), plan)
    new_error = xw - recon.to(xw.dtype)

    pad_count: IntLike = plan.pad_count
    if tensor_args:
        pad_count = torch.tensor(plan.pad_count, dtype=torch.int64, device=x.device)
    return freq_idxs, q, scales, min_vals, new_error, pad_count


def chunked_dct_decode_int8(
    freq_idxs: torch.Tensor,
    freq_vals_int8: torch.Tensor,
    scales: torch.Tensor,
    min_vals: torch.Tensor,
    x_shape: ShapeLike,
    chunk_shape: ShapeLike,
    norm: str = "ortho",
    pad_count: IntLike = 0,
) -> torch.Tensor:
    """Inverse of :func:`chunked_dct_encode_int8`: a tensor of ``x_shape`` on ``freq_vals_int8``'s device.

    ``pad_count`` must be the value the encoder returned (it is implied by ``x_shape`` and
    ``chunk_shape``; a different value raises ``ValueError``).
    """
    _check_norm(norm)
    plan = _dct.plan_flat(_as_shape(x_shape, "x_shape"), _as_shape(chunk_shape, "chunk_shape"))
    pad = _as_int(pad_count, "pad_count")
    if pad != plan.pad_count:
        raise ValueError(
            f"pad_count {pad} does not match x_shape {plan.shape} and chunk_shape {plan.chunk_shape}"
            f" (expected {plan.pad_count})"
        )
    if freq_idxs.ndim != 2 or freq_idxs.shape[0] != plan.num_chunks:
        raise ValueError(f"expected freq_idxs of shape ({plan.num_chunks}, k), got {tuple(freq_idxs.shape)}")
    if freq_idxs.numel() and (int(freq_idxs.min()) < 0 or int(freq_idxs.max()) >= plan.chunk_numel):
        raise ValueError(f"freq_idxs must lie in [0, {plan.chunk_numel})")
    values = _dct.dequantize_int8(freq_vals_int8, scales.to(freq_vals_int8.device), min_vals.to(freq_vals_int8.device))
    return _dct.decode_chunks(freq_idxs, values, plan)
