//! `gradwire._native`: thin PyO3 glue over gradwire-core.
//!
//! Byte inputs arrive as 1-D contiguous numpy arrays (the Python wrapper views any bytes-like
//! object with `np.frombuffer`; the abi3 build has no buffer protocol). Every kernel runs with
//! the GIL released. Errors from the core become `FrameError` (frame rules) or `WireError`
//! (everything else), both `ValueError`s, with the core's message and its stable kind as the
//! `kind` attribute. The frame constants (`FRAME_HEADER_BYTES`, `ELEM_CODES`, ...) are the
//! core's, so Python never restates them. `python/gradwire/_native.pyi` is the stub, checked
//! against the built module by `tests/test_native_stub.py`.

use gradwire_core as gw;
use numpy::{
    Element, PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1, PyUntypedArrayMethods,
};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

create_exception!(
    gradwire._native,
    WireError,
    PyValueError,
    "Input a gradwire kernel cannot encode or decode (a ValueError).\n\n\
     `kind` names the problem with a stable snake_case string (docs/FORMAT.md section 7.1); \
     raised from Python code without a native origin it is the class default 'invalid_input'."
);
create_exception!(
    gradwire._native,
    FrameError,
    WireError,
    "A frame, or one of its records, breaks a rule of docs/FORMAT.md (a WireError).\n\n\
     `kind` names the broken rule (docs/FORMAT.md section 7.1); raised by a codec's decoder \
     for a section 5 rule it is the class default 'invalid_record'."
);

/// `kind` of a `WireError` raised from Python, not from the core.
const PY_WIRE_ERROR_KIND: &str = "invalid_input";
/// `kind` of a `FrameError` raised from Python: a codec's record rule (FORMAT.md section 5).
const PY_FRAME_ERROR_KIND: &str = "invalid_record";

/// Maps a core error onto the Python exception classes: the core's message, and its stable
/// kind as the instance's `kind` attribute.
fn py_err(py: Python<'_>, e: gw::WireError) -> PyErr {
    let err = if e.is_frame_error() {
        FrameError::new_err(e.to_string())
    } else {
        WireError::new_err(e.to_string())
    };
    match err.value(py).setattr(intern!(py, "kind"), e.kind()) {
        Ok(()) => err,
        Err(failed) => failed,
    }
}

/// `.raise_in(py)`: a core result as a Python result, the error raised by [`py_err`].
trait RaiseIn<T> {
    fn raise_in(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> RaiseIn<T> for gw::Result<T> {
    fn raise_in(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| py_err(py, e))
    }
}

/// Runs a core kernel with the GIL released.
fn nogil<T, F>(py: Python<'_>, kernel: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> gw::Result<T> + Send,
{
    py.detach(kernel).raise_in(py)
}

/// The contiguous data of a 1-D numpy array.
fn slice<'a, T: Element>(arr: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    arr.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{what} must be a contiguous 1-D array")))
}

/// A kernel's output bytes (computed with the GIL released) as Python `bytes`.
fn bytes_of<'py, F>(py: Python<'py>, kernel: F) -> PyResult<Bound<'py, PyBytes>>
where
    F: FnOnce() -> gw::Result<Vec<u8>> + Send,
{
    Ok(PyBytes::new(py, &nogil(py, kernel)?))
}

/// Python `bytes` of `len` bytes written in place by `kernel` (GIL released): no copy.
fn bytes_filled<'py, F>(py: Python<'py>, len: usize, kernel: F) -> PyResult<Bound<'py, PyBytes>>
where
    F: FnOnce(&mut [u8]) -> gw::Result<()> + Send,
{
    PyBytes::new_with(py, len, |buf| nogil(py, || kernel(buf)))
}

/// A kernel's output vector (computed with the GIL released) as a numpy array, without a copy.
fn array_of<'py, T, F>(py: Python<'py>, kernel: F) -> PyResult<Bound<'py, PyArray1<T>>>
where
    T: Element + Send,
    F: FnOnce() -> gw::Result<Vec<T>> + Send,
{
    Ok(PyArray1::from_vec(py, nogil(py, kernel)?))
}

/// Runs a decoding kernel straight into the caller's array `out` (exactly `len` elements), GIL
/// released: a caller that decodes every step reuses one buffer instead of faulting in a new one.
fn decode_into<'py, T, F>(
    py: Python<'py>,
    out: Bound<'py, PyArray1<T>>,
    len: usize,
    kernel: F,
) -> PyResult<Bound<'py, PyArray1<T>>>
where
    T: Element + Send,
    F: FnOnce(&mut [T]) -> gw::Result<()> + Send,
{
    {
        let mut rw = out.try_readwrite().map_err(|_| {
            PyValueError::new_err("out must be a writeable array not borrowed elsewhere")
        })?;
        let s = rw
            .as_slice_mut()
            .map_err(|_| PyValueError::new_err("out must be a contiguous 1-D array"))?;
        if s.len() != len {
            return Err(PyValueError::new_err(format!(
                "out holds {} elements, the result needs {len}",
                s.len()
            )));
        }
        nogil(py, || kernel(s))?;
    }
    Ok(out)
}

/// The `out=` convention of the decoders: with the caller's array `out` (writeable,
/// contiguous, exactly `len` elements) `into` decodes there and `out` is returned; without it
/// `alloc` returns a new array (the core checks what the input announces before allocating).
/// Either runs with the GIL released.
fn decode_out<'py, T, I, A>(
    py: Python<'py>,
    out: Option<Bound<'py, PyArray1<T>>>,
    len: usize,
    into: I,
    alloc: A,
) -> PyResult<Bound<'py, PyArray1<T>>>
where
    T: Element + Send,
    I: FnOnce(&mut [T]) -> gw::Result<()> + Send,
    A: FnOnce() -> gw::Result<Vec<T>> + Send,
{
    match out {
        Some(out) => decode_into(py, out, len, into),
        None => array_of(py, alloc),
    }
}

/// Pack `values` at `bits` bits each (1..32) into an LSB-first bit stream.
#[pyfunction]
fn pack_bits<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, u32>,
    bits: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let v = slice(&values, "values")?;
    let len = gw::packed_len(v.len(), bits).raise_in(py)?;
    bytes_filled(py, len, |buf| gw::pack_bits_into(v, bits, buf))
}

/// The two unpackers: the same signature and `out=` handling, lenient or strict kernels.
macro_rules! unpacker {
    ($(#[doc = $doc:literal])* $name:ident, $into:path, $alloc:path) => {
        $(#[doc = $doc])*
        #[pyfunction]
        #[pyo3(signature = (data, bits, count, out = None))]
        fn $name<'py>(
            py: Python<'py>,
            data: PyReadonlyArray1<'py, u8>,
            bits: u32,
            count: usize,
            out: Option<Bound<'py, PyArray1<u32>>>,
        ) -> PyResult<Bound<'py, PyArray1<u32>>> {
            let d = slice(&data, "data")?;
            decode_out(py, out, count, |o| $into(d, bits, o), || $alloc(d, bits, count))
        }
    };
}

unpacker!(
    /// Unpack `count` values of `bits` bits from an LSB-first bit stream; `data` may be longer
    /// than needed and padding bits are ignored. Returns a uint32 array.
    unpack_bits,
    gw::unpack_bits_into,
    gw::unpack_bits
);

unpacker!(
    /// Strict unpack_bits: `data` must be exactly ceil(count*bits/8) bytes with zero padding
    /// bits.
    unpack_bits_exact,
    gw::unpack_bits_exact_into,
    gw::unpack_bits_exact
);

/// 3LC quartic encoding of int8 trits (-1, 0, 1): five per byte, ceil(n/5) bytes <= 242.
#[pyfunction]
fn quartic_encode<'py>(
    py: Python<'py>,
    trits: PyReadonlyArray1<'py, i8>,
) -> PyResult<Bound<'py, PyBytes>> {
    let t = slice(&trits, "trits")?;
    bytes_filled(py, gw::quartic_len(t.len()), |buf| {
        gw::quartic_encode_into(t, buf)
    })
}

/// Decode `count` trits from exactly ceil(count/5) quartic bytes (strict: bytes <= 242,
/// zero padding digits). Returns an int8 array.
#[pyfunction]
#[pyo3(signature = (data, count, out = None))]
fn quartic_decode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    count: usize,
    out: Option<Bound<'py, PyArray1<i8>>>,
) -> PyResult<Bound<'py, PyArray1<i8>>> {
    let d = slice(&data, "data")?;
    decode_out(
        py,
        out,
        count,
        |o| gw::quartic_decode_into(d, o),
        || gw::quartic_decode(d, count),
    )
}

/// 3LC zero-run encoding of quartic bytes (runs of 121 become codes 243..255).
#[pyfunction]
fn zero_run_encode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, PyBytes>> {
    let d = slice(&data, "data")?;
    bytes_of(py, || gw::zero_run_encode(d))
}

/// Invert zero_run_encode; with `expected_len` a different decoded length raises WireError
/// before anything is allocated.
#[pyfunction]
#[pyo3(signature = (data, expected_len = None))]
fn zero_run_decode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    expected_len: Option<usize>,
) -> PyResult<Bound<'py, PyBytes>> {
    let d = slice(&data, "data")?;
    // The length is checked against expected_len before the output is allocated.
    let len = nogil(py, || gw::zero_run_output_len(d, expected_len))?;
    bytes_filled(py, len, |buf| gw::zero_run_decode_into(d, buf))
}

/// zero_run_decode into the caller's uint8 array `out`, whose length is the expected decoded
/// length (a different decoded length raises WireError). Returns `out`.
#[pyfunction]
fn zero_run_decode_into<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    out: Bound<'py, PyArray1<u8>>,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let d = slice(&data, "data")?;
    let len = out.len();
    decode_into(py, out, len, |o| {
        gw::zero_run_output_len(d, Some(o.len()))?;
        gw::zero_run_decode_into(d, o)
    })
}

/// Stage one of the exact DCT decode: for `k` coefficients per chunk, write each one's integer basis
/// row into `out` (float64, laid out (rows, chunks, 2, last), overwritten), channel 0 the sum of
/// levels times the row, channel 1 the sum of rows. `positions` (int64, below rows·last) and
/// `levels` (int16) hold `k` entries per chunk; up to `threads` threads share the rows. Returns `out`.
#[pyfunction]
#[pyo3(signature = (positions, levels, k, rows, last, basis, out, threads = 1))]
#[allow(clippy::too_many_arguments)]
fn dct_scatter_basis_rows<'py>(
    py: Python<'py>,
    positions: PyReadonlyArray1<'py, i64>,
    levels: PyReadonlyArray1<'py, i16>,
    k: usize,
    rows: usize,
    last: usize,
    basis: PyReadonlyArray1<'py, f64>,
    out: Bound<'py, PyArray1<f64>>,
    threads: usize,
) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let p = slice(&positions, "positions")?;
    let l = slice(&levels, "levels")?;
    let b = slice(&basis, "basis")?;
    let len = out.len();
    decode_into(py, out, len, |o| {
        gw::scatter_basis_rows(p, l, k, rows, last, b, threads, o)
    })
}

/// The exact DCT decode of 2-D chunks in one pass, the basis folded in half (half the work of the
/// rows route, the same bits): `out` (float32, flat: the whole tensor as a grid of `grid_cols` tiles
/// of rows × last per tile row) gets `float32(L·scale + O·min)` for every chunk. `scales` and `mins`
/// (float64) carry the fixed point's power of two. Up to `threads` threads share the chunks.
/// Returns `out`.
#[pyfunction]
#[pyo3(signature = (positions, levels, k, rows, last, row_basis, col_basis, scales, mins, out, threads = 1, grid_cols = 1))]
#[allow(clippy::too_many_arguments)]
fn dct_decode_folded<'py>(
    py: Python<'py>,
    positions: PyReadonlyArray1<'py, i64>,
    levels: PyReadonlyArray1<'py, i16>,
    k: usize,
    rows: usize,
    last: usize,
    row_basis: PyReadonlyArray1<'py, f64>,
    col_basis: PyReadonlyArray1<'py, f64>,
    scales: PyReadonlyArray1<'py, f64>,
    mins: PyReadonlyArray1<'py, f64>,
    out: Bound<'py, PyArray1<f32>>,
    threads: usize,
    grid_cols: usize,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let p = slice(&positions, "positions")?;
    let l = slice(&levels, "levels")?;
    let rb = slice(&row_basis, "row_basis")?;
    let cb = slice(&col_basis, "col_basis")?;
    let sc = slice(&scales, "scales")?;
    let mn = slice(&mins, "mins")?;
    let len = out.len();
    decode_into(py, out, len, |o| {
        gw::decode_folded(p, l, k, rows, last, rb, cb, sc, mn, grid_cols, threads, o)
    })
}

/// One sender's arrays for [`dct_decode_folded_mean`]: `(positions, levels, k, scales, mins)`.
type SenderArrays<'py> = (
    PyReadonlyArray1<'py, i64>,
    PyReadonlyArray1<'py, i16>,
    usize,
    PyReadonlyArray1<'py, f64>,
    PyReadonlyArray1<'py, f64>,
);

/// The weighted mean of several senders' records of one tensor, each decoded as
/// [`dct_decode_folded`] decodes it, into `out` (float32, flat): `out = d_0 · w_0`, then `out = out +
/// d_i · w_i` per sender in order, each a correctly rounded float32 operation — the bits of
/// decoding every record and combining the tensors, without writing the decoded tensors out.
/// `senders` is a list of `(positions, levels, k, scales, mins)`, every sender with the same number
/// of chunks; `weights` one float32 per sender. `accumulate`: added onto what `out` holds (`out = out
/// + d_i · w_i` from the first sender on; one sender at weight −1 subtracts its decode, the bits of
/// `out − d`). GIL released. Returns `out`.
#[pyfunction]
#[pyo3(signature = (senders, weights, rows, last, row_basis, col_basis, out, threads = 1, grid_cols = 1, accumulate = false))]
#[allow(clippy::too_many_arguments)]
fn dct_decode_folded_mean<'py>(
    py: Python<'py>,
    senders: Vec<SenderArrays<'py>>,
    weights: PyReadonlyArray1<'py, f32>,
    rows: usize,
    last: usize,
    row_basis: PyReadonlyArray1<'py, f64>,
    col_basis: PyReadonlyArray1<'py, f64>,
    out: Bound<'py, PyArray1<f32>>,
    threads: usize,
    grid_cols: usize,
    accumulate: bool,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let views = senders
        .iter()
        .map(|(p, l, k, sc, mn)| {
            Ok(gw::SenderLevels {
                positions: slice(p, "positions")?,
                levels: slice(l, "levels")?,
                k: *k,
                scales: slice(sc, "scales")?,
                mins: slice(mn, "mins")?,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let w = slice(&weights, "weights")?;
    let rb = slice(&row_basis, "row_basis")?;
    let cb = slice(&col_basis, "col_basis")?;
    let len = out.len();
    decode_into(py, out, len, |o| {
        if accumulate {
            gw::decode_folded_mean_accumulate(&views, w, rows, last, rb, cb, grid_cols, threads, o)
        } else {
            gw::decode_folded_mean(&views, w, rows, last, rb, cb, grid_cols, threads, o)
        }
    })
}

/// For each row `r`, `out[r · row_len + p] += values[j] · weight` over the row's `k` entries
/// (float32, one rounded multiply and one rounded add each, in order): sparse rows added into a
/// dense buffer in place. Bad input raises `WireError` and writes nothing. GIL released. Returns
/// `out`.
#[pyfunction]
#[pyo3(signature = (positions, values, k, row_len, weight, out))]
fn scatter_add_rows<'py>(
    py: Python<'py>,
    positions: PyReadonlyArray1<'py, i64>,
    values: PyReadonlyArray1<'py, f32>,
    k: usize,
    row_len: usize,
    weight: f32,
    out: Bound<'py, PyArray1<f32>>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let p = slice(&positions, "positions")?;
    let v = slice(&values, "values")?;
    let len = out.len();
    decode_into(py, out, len, |o| {
        gw::scatter_add_rows(p, v, k, row_len, weight, o)
    })
}

/// The orthonormal 2-D DCT-II (`inverse` false) or DCT-III (`inverse` true) of every chunk of
/// `data` (float32, flat, whole chunks of `rows × cols` row-major, each side a power of two up to
/// 1024), in place, by Lee's recursion. Up to `threads` threads share the chunks, GIL released. A
/// shape it cannot transform raises `WireError` (`transform_shape`) and writes nothing. Returns `data`.
#[pyfunction]
#[pyo3(signature = (data, rows, cols, inverse = false, threads = 1))]
fn dct2_chunks<'py>(
    py: Python<'py>,
    data: Bound<'py, PyArray1<f32>>,
    rows: usize,
    cols: usize,
    inverse: bool,
    threads: usize,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let len = data.len();
    decode_into(py, data, len, |d| {
        gw::dct2_chunks(d, rows, cols, inverse, threads)
    })
}

/// A writeable contiguous float32 view of `arr` for a kernel that updates it in place.
fn writeable<'a>(arr: &'a mut PyReadwriteArray1<'_, f32>, what: &str) -> PyResult<&'a mut [f32]> {
    arr.as_slice_mut()
        .map_err(|_| PyValueError::new_err(format!("{what} must be a contiguous 1-D array")))
}

/// One outer step (SparseLoCo's, DiLoCo's) of `anchor` by the mean pseudo-gradient `delta`, in
/// place, with the momentum buffer `buffer` (float32, all three flat and as long as `anchor`;
/// `None` without momentum): `b = μ·b + d` (`b = d` when `fresh`), the step `b`, or
/// `μ·b + d` with `nesterov`, or `d` without momentum, times `lr` unless 1, subtracted from
/// `anchor`. Each operation one rounded float32 multiply or add, in that order: the bits of the same
/// torch operations. `operand_length` for an operand of another length, nothing written. Up to
/// `threads` threads, GIL released.
#[pyfunction]
#[pyo3(signature = (anchor, buffer, delta, momentum, nesterov, lr, fresh, threads = 1))]
#[allow(clippy::too_many_arguments)]
fn outer_step<'py>(
    py: Python<'py>,
    anchor: Bound<'py, PyArray1<f32>>,
    buffer: Option<Bound<'py, PyArray1<f32>>>,
    delta: PyReadonlyArray1<'py, f32>,
    momentum: f32,
    nesterov: bool,
    lr: f32,
    fresh: bool,
    threads: usize,
) -> PyResult<()> {
    let busy = |_| {
        PyValueError::new_err("anchor and buffer must be writeable arrays not borrowed elsewhere")
    };
    let mut a = anchor.try_readwrite().map_err(busy)?;
    let mut b = buffer
        .as_ref()
        .map(|b| b.try_readwrite())
        .transpose()
        .map_err(busy)?;
    let d = slice(&delta, "delta")?;
    let a = writeable(&mut a, "anchor")?;
    let b: &mut [f32] = match b.as_mut() {
        Some(b) => writeable(b, "buffer")?,
        None => &mut [],
    };
    let rule = gw::OuterStepRule {
        momentum,
        nesterov,
        lr,
    };
    nogil(py, || gw::outer_step(a, b, d, rule, fresh, threads))
}

/// For each sparse vector `i` of `vectors` (`(positions int64 strictly ascending below size,
/// values float64)` each): `(dots, squares)` with `dots[i] = ⟨uᵢ, Σⱼ weights[j] · uⱼ⟩` and
/// `squares[i] = |uᵢ|²`, in float64, the same bits on every machine. Bad vectors raise `WireError`
/// (`sparse_length_mismatch`, `index_out_of_range`, `not_strictly_ascending`, `operand_length`).
/// GIL released.
#[pyfunction]
fn sparse_alignment<'py>(
    py: Python<'py>,
    vectors: Vec<(PyReadonlyArray1<'py, i64>, PyReadonlyArray1<'py, f64>)>,
    weights: PyReadonlyArray1<'py, f64>,
    size: usize,
) -> PyResult<(Vec<f64>, Vec<f64>)> {
    let views = vectors
        .iter()
        .map(|(p, v)| {
            Ok(gw::SparseVector {
                positions: slice(p, "positions")?,
                values: slice(v, "values")?,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let w = slice(&weights, "weights")?;
    nogil(py, || gw::sparse_alignment(&views, w, size))
}

/// `(positions, kept)` of [`select_topk_rows`].
type TopkArrays<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<f32>>);

/// The `k` values of largest magnitude of each row of `values` (float32, flat, rows of `cols`):
/// `(positions, kept)`, `k` per row, positions (int64) ascending within each row, ties to the lowest
/// positions, NaN the largest. Up to `threads` threads share the rows, GIL released.
#[pyfunction]
#[pyo3(signature = (values, cols, k, threads = 1))]
fn select_topk_rows<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, f32>,
    cols: usize,
    k: usize,
    threads: usize,
) -> PyResult<TopkArrays<'py>> {
    let v = slice(&values, "values")?;
    // rows · k ≤ the input's length (the core refuses k > cols), so nothing here outgrows the input.
    let (positions, kept) = nogil(py, || {
        let n = if cols == 0 || k > cols {
            0
        } else {
            v.len() / cols * k
        };
        let (mut p, mut o) = (vec![0i64; n], vec![0f32; n]);
        gw::select_topk_rows(v, cols, k, threads, &mut p, &mut o)?;
        Ok((p, o))
    })?;
    Ok((
        PyArray1::from_vec(py, positions),
        PyArray1::from_vec(py, kept),
    ))
}

/// One record's coded sections: `(index_coding, its parameter, idx section, packed val section or None)`.
type RecordPayloadTuple<'py> = (u8, u32, Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>);

/// The coded sections of every DCT record of a step in one call, GIL released (docs/FORMAT.md §5.2):
/// `positions` (uint32) holds each record's `rows · k` positions one record after another, `levels`
/// (uint32) its quantized values likewise when `value_bits` < 8 (else empty), `layouts` (uint64) three
/// numbers a record: `rows, k, C`. `index_coding`: 0 packed, 1 Rice, 2 the smaller. Returns one
/// `(index_coding, parameter, idx, val or None)` per record.
#[pyfunction]
fn dct_payloads<'py>(
    py: Python<'py>,
    positions: PyReadonlyArray1<'py, u32>,
    levels: PyReadonlyArray1<'py, u32>,
    layouts: PyReadonlyArray1<'py, u64>,
    index_coding: u8,
    value_bits: u32,
) -> PyResult<Vec<RecordPayloadTuple<'py>>> {
    let (p, l, lay) = (
        slice(&positions, "positions")?,
        slice(&levels, "levels")?,
        slice(&layouts, "layouts")?,
    );
    if lay.len() % 3 != 0 {
        return Err(PyValueError::new_err(format!(
            "layouts must hold 3 numbers a record, got {}",
            lay.len()
        )));
    }
    let choice = match index_coding {
        0 => gw::IndexCodingChoice::Fixed,
        1 => gw::IndexCodingChoice::Rice,
        2 => gw::IndexCodingChoice::Auto,
        other => {
            return Err(PyValueError::new_err(format!(
                "index_coding must be 0, 1 or 2, got {other}"
            )))
        }
    };
    let records: Vec<gw::RecordLayout> = lay
        .chunks_exact(3)
        .map(|r| gw::RecordLayout {
            rows: r[0] as usize,
            k: r[1] as usize,
            universe: r[2],
        })
        .collect();
    let done = nogil(py, || gw::dct_payloads(p, l, &records, choice, value_bits))?;
    Ok(done
        .into_iter()
        .map(|r| {
            (
                r.coding,
                r.param,
                PyBytes::new(py, &r.idx),
                r.val.map(|v| PyBytes::new(py, &v)),
            )
        })
        .collect())
}

/// Whether a `side × side` integer DCT basis (float64, flat) folds exactly:
/// `B[f, side-1-i] == (-1)^f · B[f, i]` with `side` even.
#[pyfunction]
fn dct_basis_folds(basis: PyReadonlyArray1<'_, f64>, side: usize) -> PyResult<bool> {
    Ok(gw::fold_basis_is_exact(slice(&basis, "basis")?, side))
}

/// Stage three of the exact DCT decode: `float32(L·scale + O·min)` per value from the two float64
/// channels of `sums` (laid out (rows, chunks, 2, last)) with `scales` and `mins` per chunk (float64,
/// the fixed point's power of two already applied). `out` (float32, flat) is the whole decoded
/// tensor: a grid of `grid_cols` tiles of rows × last per tile row (1: chunk-major); the call writes
/// its chunks `first ..`. Up to `threads` threads share the chunks. Returns `out`.
#[pyfunction]
#[pyo3(signature = (sums, scales, mins, rows, last, out, threads = 1, first = 0, grid_cols = 1))]
#[allow(clippy::too_many_arguments)]
fn dct_combine_level_sums<'py>(
    py: Python<'py>,
    sums: PyReadonlyArray1<'py, f64>,
    scales: PyReadonlyArray1<'py, f64>,
    mins: PyReadonlyArray1<'py, f64>,
    rows: usize,
    last: usize,
    out: Bound<'py, PyArray1<f32>>,
    threads: usize,
    first: usize,
    grid_cols: usize,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let s = slice(&sums, "sums")?;
    let sc = slice(&scales, "scales")?;
    let mn = slice(&mins, "mins")?;
    let len = out.len();
    decode_into(py, out, len, |o| {
        gw::combine_level_sums(s, sc, mn, rows, last, first, grid_cols, threads, o)
    })
}

/// CRC-32C of `data`, continuing the running checksum `value`.
#[pyfunction]
#[pyo3(signature = (data, value = 0))]
fn crc32c(py: Python<'_>, data: PyReadonlyArray1<'_, u8>, value: u32) -> PyResult<u32> {
    let d = slice(&data, "data")?;
    Ok(py.detach(|| gw::crc32c(d, value)))
}

type SectionIn<'py> = (String, u8, PyReadonlyArray1<'py, u8>);
type EntryIn<'py> = (
    String,
    u16,
    u8,
    Vec<u64>,
    PyReadonlyArray1<'py, u8>,
    Vec<SectionIn<'py>>,
);

/// The core's view of the entries Python passed (borrowed, nothing copied).
fn entry_specs<'a>(entries: &'a [EntryIn<'_>]) -> PyResult<Vec<gw::EntrySpec<'a>>> {
    let mut specs = Vec::with_capacity(entries.len());
    for (name, codec, dtype, shape, params, sections) in entries {
        let mut secs = Vec::with_capacity(sections.len());
        for (sname, elem, payload) in sections {
            secs.push((sname.as_str(), *elem, slice(payload, "section payload")?));
        }
        specs.push(gw::EntrySpec {
            name,
            codec: *codec,
            dtype: *dtype,
            shape,
            params: slice(params, "params")?,
            sections: secs,
        });
    }
    Ok(specs)
}

/// Write a version-1 frame. Each entry is (name, codec, dtype, shape, params, sections) with
/// sections a list of (name, elem, payload). Raises FrameError for anything the reader would
/// reject.
#[pyfunction]
fn encode_frame<'py>(
    py: Python<'py>,
    round: u64,
    sender: u32,
    bundle: bool,
    entries: Vec<EntryIn<'py>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let specs = entry_specs(&entries)?;
    let header = gw::FrameHeader::new(bundle, round, sender);
    let limits = gw::Limits::default();
    let len = nogil(py, || gw::frame_len(&header, &specs, &limits))?;
    bytes_filled(py, len, |buf| {
        gw::write_frame_into(&header, &specs, &limits, buf)
    })
}

type SectionOut<'a> = (&'a str, u8, usize, usize);
type EntryOut<'a, 'py> = (
    &'a str,
    u16,
    u8,
    Bound<'py, PyTuple>,
    (usize, usize),
    Vec<SectionOut<'a>>,
);

/// The length of the frame at the start of `data`, which may run on into further frames.
/// Raises FrameError when `data` cannot start a frame (short, magic, version, total_len).
#[pyfunction]
fn frame_length(py: Python<'_>, data: PyReadonlyArray1<'_, u8>) -> PyResult<usize> {
    gw::frame_len_at_start(slice(&data, "data")?).raise_in(py)
}

/// Parse and validate a version-1 frame. Returns (round, sender, bundle, entries), each entry
/// (name, codec, dtype, shape, (params_start, params_end), [(section, elem, start, end), ...])
/// with byte offsets into `data`. Raises FrameError naming the broken rule.
#[pyfunction]
// The defaults as plain integers: `inspect.signature` reads only literals.
#[pyo3(
    text_signature = "(data, max_frame_bytes=2147483648, max_entries=1048576, max_tensor_elements=2147483648)"
)]
#[pyo3(signature = (data, max_frame_bytes = 1u64 << 31, max_entries = 1u32 << 20, max_tensor_elements = 1u64 << 31))]
fn decode_frame<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    max_frame_bytes: u64,
    max_entries: u32,
    max_tensor_elements: u64,
) -> PyResult<Bound<'py, PyTuple>> {
    let d = slice(&data, "data")?;
    let limits = gw::Limits {
        max_frame_bytes,
        max_entries,
        max_tensor_elements,
    };
    let view = nogil(py, || gw::parse_frame(d, &limits))?;
    let mut entries: Vec<EntryOut<'_, 'py>> = Vec::with_capacity(view.entries.len());
    for e in &view.entries {
        let shape = PyTuple::new(py, &e.shape)?;
        let sections = e
            .sections
            .iter()
            .map(|s| (s.name, s.elem, s.range.start, s.range.end))
            .collect();
        entries.push((
            e.name,
            e.codec,
            e.dtype,
            shape,
            (e.params.start, e.params.end),
            sections,
        ));
    }
    let h = view.header;
    (h.round, h.sender, h.bundle, entries).into_pyobject(py)
}

/// A record template: (name, codec, dtype, shape, params, [(section, elem), ...]).
type TemplateIn = (String, u16, u8, Vec<u64>, Vec<u8>, Vec<(String, u8)>);

fn templates_of(templates: &[TemplateIn]) -> Vec<gw::RecordTemplate<'_>> {
    templates
        .iter()
        .map(
            |(name, codec, dtype, shape, params, sections)| gw::RecordTemplate {
                name,
                codec: *codec,
                dtype: *dtype,
                shape,
                params,
                sections: sections.iter().map(|(n, e)| (n.as_str(), *e)).collect(),
            },
        )
        .collect()
}

/// Write a layout frame (docs/FORMAT.md section 12): a bundle whose records matching one of
/// `templates` (by name, codec, dtype, shape and sections) are written compact. Entries as for
/// `encode_frame`. Raises FrameError for anything the reader would reject.
#[pyfunction]
fn encode_layout_frame<'py>(
    py: Python<'py>,
    round: u64,
    sender: u32,
    entries: Vec<EntryIn<'py>>,
    templates: Vec<TemplateIn>,
) -> PyResult<Bound<'py, PyBytes>> {
    let specs = entry_specs(&entries)?;
    let t = templates_of(&templates);
    let header = gw::FrameHeader::new(true, round, sender);
    let limits = gw::Limits::default();
    let len = nogil(py, || gw::layout_frame_len(&header, &specs, &t, &limits))?;
    bytes_filled(py, len, |buf| {
        gw::write_layout_frame_into(&header, &specs, &t, &limits, buf)
    })
}

/// Parse and validate a frame that may be a layout frame, with the reader's `templates`. Returns
/// what `decode_frame` returns, except that a compact record's params are None when they are its
/// template's (its name, codec, dtype, shape and sections' names and elements are the template's).
/// Raises FrameError naming the broken rule (`unknown_template` for a template not held).
#[pyfunction]
#[pyo3(
    text_signature = "(data, templates, max_frame_bytes=2147483648, max_entries=1048576, max_tensor_elements=2147483648)"
)]
#[pyo3(signature = (data, templates, max_frame_bytes = 1u64 << 31, max_entries = 1u32 << 20, max_tensor_elements = 1u64 << 31))]
fn decode_layout_frame<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    templates: Vec<TemplateIn>,
    max_frame_bytes: u64,
    max_entries: u32,
    max_tensor_elements: u64,
) -> PyResult<Bound<'py, PyTuple>> {
    let d = slice(&data, "data")?;
    let limits = gw::Limits {
        max_frame_bytes,
        max_entries,
        max_tensor_elements,
    };
    let t = templates_of(&templates);
    let view = nogil(py, || gw::parse_layout_frame(d, &limits, &t))?;
    type Out<'a, 'py> = (
        &'a str,
        u16,
        u8,
        Bound<'py, PyTuple>,
        Option<(usize, usize)>,
        Vec<SectionOut<'a>>,
    );
    let mut entries: Vec<Out<'_, 'py>> = Vec::with_capacity(view.entries.len());
    for e in &view.entries {
        entries.push(match e {
            gw::LayoutEntry::Full(e) => (
                e.name,
                e.codec,
                e.dtype,
                PyTuple::new(py, &e.shape)?,
                Some((e.params.start, e.params.end)),
                e.sections
                    .iter()
                    .map(|s| (s.name, s.elem, s.range.start, s.range.end))
                    .collect(),
            ),
            gw::LayoutEntry::Compact {
                template,
                params,
                sections,
            } => {
                let tm = &t[*template];
                (
                    tm.name,
                    tm.codec,
                    tm.dtype,
                    PyTuple::new(py, tm.shape)?,
                    params.as_ref().map(|r| (r.start, r.end)),
                    tm.sections
                        .iter()
                        .zip(sections)
                        .map(|(&(n, elem), r)| (n, elem, r.start, r.end))
                        .collect(),
                )
            }
        });
    }
    let h = view.header;
    (h.round, h.sender, h.bundle, entries).into_pyobject(py)
}

// ------------------------------------------------------------------------------ entropy coders

fn elias_kind(kind: &str) -> PyResult<gw::EliasKind> {
    match kind {
        "gamma" => Ok(gw::EliasKind::Gamma),
        "omega" => Ok(gw::EliasKind::Omega),
        _ => Err(PyValueError::new_err(format!(
            "kind must be 'gamma' or 'omega', got {kind:?}"
        ))),
    }
}

fn huffman_book_of(py: Python<'_>, book: &PyReadonlyArray1<'_, u8>) -> PyResult<gw::HuffmanBook> {
    gw::HuffmanBook::from_bytes(slice(book, "book")?).raise_in(py)
}

/// The Rice parameter (0..31) that codes sets of `set_len` sorted indices below `universe` in
/// the fewest bits, and the stream's length in bytes at that parameter.
#[pyfunction]
fn rice_param<'py>(
    py: Python<'py>,
    indices: PyReadonlyArray1<'py, u32>,
    set_len: usize,
    universe: u64,
) -> PyResult<(u32, usize)> {
    let i = slice(&indices, "indices")?;
    nogil(py, || gw::rice_param(i, set_len, universe))
}

/// A Rice parameter for sets of `set_len` random indices below `universe`, from the two numbers.
#[pyfunction]
fn rice_param_estimate(set_len: usize, universe: u64) -> u32 {
    gw::rice_param_estimate(set_len, universe)
}

/// Rice-code sets of `set_len` strictly ascending uint32 indices below `universe` with
/// parameter `param` (docs/FORMAT.md section 6.2).
#[pyfunction]
fn rice_encode<'py>(
    py: Python<'py>,
    indices: PyReadonlyArray1<'py, u32>,
    set_len: usize,
    universe: u64,
    param: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let i = slice(&indices, "indices")?;
    bytes_of(py, || gw::rice_encode(i, set_len, universe, param))
}

/// Decode `count` indices in sets of `set_len` from a Rice stream; the stream must be exact.
#[pyfunction]
#[pyo3(signature = (data, count, set_len, universe, param, out = None))]
fn rice_decode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    count: usize,
    set_len: usize,
    universe: u64,
    param: u32,
    out: Option<Bound<'py, PyArray1<u32>>>,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let d = slice(&data, "data")?;
    decode_out(
        py,
        out,
        count,
        |o| gw::rice_decode_into(d, set_len, universe, param, o),
        || gw::rice_decode(d, count, set_len, universe, param),
    )
}

/// Elias codes (`kind` 'gamma' or 'omega') of positive uint64 `values` (section 6.3).
#[pyfunction]
fn elias_encode<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, u64>,
    kind: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let v = slice(&values, "values")?;
    let k = elias_kind(kind)?;
    bytes_of(py, || gw::elias_encode(v, k))
}

/// Decode exactly `count` Elias codes; the stream must end with the last one.
#[pyfunction]
fn elias_decode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    count: usize,
    kind: &str,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let d = slice(&data, "data")?;
    let k = elias_kind(kind)?;
    array_of(py, || gw::elias_decode(d, count, k))
}

/// QSGD's sparse stream of nonzero int32 `levels` at strictly ascending uint64 `positions`.
#[pyfunction]
fn sparse_levels_encode<'py>(
    py: Python<'py>,
    positions: PyReadonlyArray1<'py, u64>,
    levels: PyReadonlyArray1<'py, i32>,
    kind: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let p = slice(&positions, "positions")?;
    let l = slice(&levels, "levels")?;
    let k = elias_kind(kind)?;
    bytes_of(py, || gw::sparse_levels_encode(p, l, k))
}

type SparseLevels<'py> = (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<i32>>);

/// Decode `count` entries of a sparse level stream: (uint64 positions < universe, int32 levels
/// with 1 <= |level| <= max_level).
#[pyfunction]
fn sparse_levels_decode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    count: usize,
    universe: u64,
    max_level: u32,
    kind: &str,
) -> PyResult<SparseLevels<'py>> {
    let d = slice(&data, "data")?;
    let k = elias_kind(kind)?;
    let (p, l) = nogil(py, || {
        gw::sparse_levels_decode(d, count, universe, max_level, k)
    })?;
    Ok((PyArray1::from_vec(py, p), PyArray1::from_vec(py, l)))
}

/// The serialized capped Huffman codebook (section 6.4) of 256 uint64 byte `counts`.
#[pyfunction]
fn huffman_book<'py>(
    py: Python<'py>,
    counts: PyReadonlyArray1<'py, u64>,
    cap: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let c = slice(&counts, "counts")?;
    let c: &[u64; 256] = c.try_into().map_err(|_| {
        PyValueError::new_err(format!("counts must hold 256 values, got {}", c.len()))
    })?;
    let book = nogil(py, || gw::HuffmanBook::from_counts(c, cap))?;
    Ok(PyBytes::new(py, &book.to_bytes()))
}

/// Validate a serialized codebook; returns (cap, code lengths of the 256 symbols then the
/// escape, 0 = no codeword).
#[pyfunction]
fn huffman_book_lengths<'py>(
    py: Python<'py>,
    book: PyReadonlyArray1<'py, u8>,
) -> PyResult<(u32, Bound<'py, PyArray1<u8>>)> {
    let b = huffman_book_of(py, &book)?;
    Ok((b.cap(), PyArray1::from_slice(py, b.lengths())))
}

/// Huffman-code uint8 `symbols` with a serialized codebook.
#[pyfunction]
fn huffman_encode<'py>(
    py: Python<'py>,
    symbols: PyReadonlyArray1<'py, u8>,
    book: PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, PyBytes>> {
    let s = slice(&symbols, "symbols")?;
    let b = huffman_book_of(py, &book)?;
    bytes_of(py, || b.encode(s))
}

/// Decode exactly `count` symbols with a serialized codebook (table lookup on `cap` bits).
#[pyfunction]
fn huffman_decode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    count: usize,
    book: PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let d = slice(&data, "data")?;
    let b = huffman_book_of(py, &book)?;
    array_of(py, || b.decode(d, count))
}

// ------------------------------------------------------------------------------------ GComp

/// Histogram of the biased f32 exponents of the bit patterns `bits` (256 uint64 counts; index 0
/// counts zeros and denormals, 255 infinities and NaNs).
#[pyfunction]
fn gcomp_exponent_counts<'py>(
    py: Python<'py>,
    bits: PyReadonlyArray1<'py, u32>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let b = slice(&bits, "bits")?;
    array_of(py, || Ok(gw::gcomp::exponent_counts(b).to_vec()))
}

/// The metric of optimizer `kind` (one of Table 2's seven) with its hyperparameters.
#[allow(clippy::too_many_arguments)]
fn gcomp_metric_of(
    kind: &str,
    lr: f64,
    weight_decay: f64,
    momentum: f64,
    dampening: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    alpha: f64,
    bias_correction1: f64,
) -> PyResult<gw::gcomp::Metric> {
    use gw::gcomp::Metric;
    Ok(match kind {
        "sgd" => Metric::Sgd { lr, weight_decay },
        "momentum" => Metric::Momentum {
            lr,
            weight_decay,
            momentum,
            dampening,
        },
        "nesterov" => Metric::Nesterov {
            lr,
            weight_decay,
            momentum,
        },
        "adagrad" => Metric::Adagrad {
            lr,
            weight_decay,
            eps,
        },
        "rmsprop" => Metric::Rmsprop {
            lr,
            weight_decay,
            alpha,
            eps,
        },
        "adam" => Metric::Adam {
            lr,
            weight_decay,
            beta1,
            beta2,
            eps,
            bias_correction1,
        },
        "adamw" => Metric::Adamw {
            lr,
            weight_decay,
            beta1,
            beta2,
            eps,
            bias_correction1,
        },
        _ => {
            return Err(PyValueError::new_err(format!(
                "kind must be one of sgd, momentum, nesterov, adagrad, rmsprop, adam, adamw; got {kind:?}"
            )))
        }
    })
}

/// The optional state operand `what` as a slice.
fn optional_slice<'a>(
    arr: &'a Option<PyReadonlyArray1<'_, f32>>,
    what: &str,
) -> PyResult<Option<&'a [f32]>> {
    arr.as_ref().map(|a| slice(a, what)).transpose()
}

/// The quantization metric δ (the paper's Table 2) of every element in f64: `grad` as f32 bit
/// patterns, `param` and the optimizer state (`first`: momentum_buffer, sum, square_avg or
/// exp_avg; `second`: exp_avg_sq; None = zeros) as float32. `bias_correction1` is `1 - beta1**t`
/// and Adagrad's `lr` the decayed one.
#[pyfunction]
#[pyo3(signature = (kind, grad, param, first = None, second = None, *, lr, weight_decay = 0.0, momentum = 0.0, dampening = 0.0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, alpha = 0.99, bias_correction1 = 1.0))]
#[allow(clippy::too_many_arguments)]
fn gcomp_metric<'py>(
    py: Python<'py>,
    kind: &str,
    grad: PyReadonlyArray1<'py, u32>,
    param: PyReadonlyArray1<'py, f32>,
    first: Option<PyReadonlyArray1<'py, f32>>,
    second: Option<PyReadonlyArray1<'py, f32>>,
    lr: f64,
    weight_decay: f64,
    momentum: f64,
    dampening: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    alpha: f64,
    bias_correction1: f64,
) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let m = gcomp_metric_of(
        kind,
        lr,
        weight_decay,
        momentum,
        dampening,
        beta1,
        beta2,
        eps,
        alpha,
        bias_correction1,
    )?;
    let (g, p) = (slice(&grad, "grad")?, slice(&param, "param")?);
    let (a, b) = (
        optional_slice(&first, "first")?,
        optional_slice(&second, "second")?,
    );
    array_of(py, || {
        let mut out = vec![0.0; g.len()];
        gw::gcomp::metric_into(&m, g, p, a, b, &mut out)?;
        Ok(out)
    })
}

/// Per block of `block` elements, the largest level whose threshold (`thresholds`, levels 1..3)
/// the block's smallest |δ| over its nonzero elements reaches (uint8, 0..3); arguments as for
/// gcomp_metric.
#[pyfunction]
#[pyo3(signature = (kind, grad, param, first = None, second = None, *, block, thresholds, lr, weight_decay = 0.0, momentum = 0.0, dampening = 0.0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, alpha = 0.99, bias_correction1 = 1.0))]
#[allow(clippy::too_many_arguments)]
fn gcomp_block_levels<'py>(
    py: Python<'py>,
    kind: &str,
    grad: PyReadonlyArray1<'py, u32>,
    param: PyReadonlyArray1<'py, f32>,
    first: Option<PyReadonlyArray1<'py, f32>>,
    second: Option<PyReadonlyArray1<'py, f32>>,
    block: usize,
    thresholds: [f64; 3],
    lr: f64,
    weight_decay: f64,
    momentum: f64,
    dampening: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    alpha: f64,
    bias_correction1: f64,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let m = gcomp_metric_of(
        kind,
        lr,
        weight_decay,
        momentum,
        dampening,
        beta1,
        beta2,
        eps,
        alpha,
        bias_correction1,
    )?;
    let (g, p) = (slice(&grad, "grad")?, slice(&param, "param")?);
    let (a, b) = (
        optional_slice(&first, "first")?,
        optional_slice(&second, "second")?,
    );
    array_of(py, || {
        gw::gcomp::block_levels(&m, g, p, a, b, block, &thresholds)
    })
}

type GcompSectionsOut<'py> = (
    Bound<'py, PyArray1<u8>>,
    Bound<'py, PyArray1<u8>>,
    Bound<'py, PyArray1<u8>>,
    Bound<'py, PyArray1<u8>>,
    Bound<'py, PyArray1<u32>>,
);

/// GComp's `exp`, `level`, `sign` and `mant` sections (uint8 arrays, written in place: no copy)
/// of the f32 bit patterns `bits` (format 0 or 1, one uint8 level per block of `block`, the
/// serialized exponent codebook `book`) and the bit patterns a receiver decodes (uint32).
#[pyfunction]
fn gcomp_encode<'py>(
    py: Python<'py>,
    bits: PyReadonlyArray1<'py, u32>,
    format: u8,
    block: usize,
    levels: PyReadonlyArray1<'py, u8>,
    book: PyReadonlyArray1<'py, u8>,
) -> PyResult<GcompSectionsOut<'py>> {
    let (x, l) = (slice(&bits, "bits")?, slice(&levels, "levels")?);
    let b = huffman_book_of(py, &book)?;
    let (s, recon) = nogil(py, || {
        let format = gw::gcomp::FieldFormat::from_code(format)?;
        let mut recon = vec![0u32; x.len()];
        let s = gw::gcomp::encode(x, format, block, l, &b, &mut recon)?;
        Ok((s, recon))
    })?;
    Ok((
        PyArray1::from_vec(py, s.exp),
        PyArray1::from_vec(py, s.level),
        PyArray1::from_vec(py, s.sign),
        PyArray1::from_vec(py, s.mant),
        PyArray1::from_vec(py, recon),
    ))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let wire_error = py.get_type::<WireError>();
    let frame_error = py.get_type::<FrameError>();
    // Class defaults for instances raised from Python; a core error sets its own on the instance.
    wire_error.setattr("kind", PY_WIRE_ERROR_KIND)?;
    frame_error.setattr("kind", PY_FRAME_ERROR_KIND)?;
    let kinds = PyDict::new(py);
    for &kind in gw::WireError::KERNEL_KINDS {
        kinds.set_item(kind, &wire_error)?;
    }
    for &kind in gw::WireError::FRAME_KINDS {
        kinds.set_item(kind, &frame_error)?;
    }
    m.add("WireError", wire_error)?;
    m.add("FrameError", frame_error)?;
    m.add("ERROR_KINDS", kinds)?;

    // Frame constants of docs/FORMAT.md, from the core's own.
    m.add("FORMAT_VERSION", gw::frame::VERSION)?;
    m.add("FRAME_MAGIC", PyBytes::new(py, &gw::frame::MAGIC))?;
    m.add("FRAME_HEADER_BYTES", gw::frame::HEADER_LEN)?;
    m.add("MIN_FRAME_BYTES", gw::frame::MIN_FRAME_LEN)?;
    m.add("MAX_NAME_BYTES", gw::frame::MAX_NAME_LEN)?;
    let elem_codes = PyDict::new(py);
    for (name, code) in gw::frame::codes::ALL {
        elem_codes.set_item(name, code)?;
    }
    m.add("ELEM_CODES", elem_codes)?;

    m.add_function(wrap_pyfunction!(pack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_bits_exact, m)?)?;
    m.add_function(wrap_pyfunction!(quartic_encode, m)?)?;
    m.add_function(wrap_pyfunction!(quartic_decode, m)?)?;
    m.add_function(wrap_pyfunction!(zero_run_encode, m)?)?;
    m.add_function(wrap_pyfunction!(zero_run_decode, m)?)?;
    m.add_function(wrap_pyfunction!(zero_run_decode_into, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(dct_scatter_basis_rows, m)?)?;
    m.add_function(wrap_pyfunction!(dct_combine_level_sums, m)?)?;
    m.add_function(wrap_pyfunction!(dct_decode_folded, m)?)?;
    m.add_function(wrap_pyfunction!(dct_decode_folded_mean, m)?)?;
    m.add_function(wrap_pyfunction!(dct_basis_folds, m)?)?;
    m.add_function(wrap_pyfunction!(select_topk_rows, m)?)?;
    m.add_function(wrap_pyfunction!(scatter_add_rows, m)?)?;
    m.add_function(wrap_pyfunction!(dct2_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_alignment, m)?)?;
    m.add_function(wrap_pyfunction!(outer_step, m)?)?;
    m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
    m.add_function(wrap_pyfunction!(decode_frame, m)?)?;
    m.add_function(wrap_pyfunction!(encode_layout_frame, m)?)?;
    m.add_function(wrap_pyfunction!(decode_layout_frame, m)?)?;
    m.add_function(wrap_pyfunction!(frame_length, m)?)?;
    m.add_function(wrap_pyfunction!(rice_param, m)?)?;
    m.add_function(wrap_pyfunction!(rice_param_estimate, m)?)?;
    m.add_function(wrap_pyfunction!(rice_encode, m)?)?;
    m.add_function(wrap_pyfunction!(dct_payloads, m)?)?;
    m.add_function(wrap_pyfunction!(rice_decode, m)?)?;
    m.add_function(wrap_pyfunction!(elias_encode, m)?)?;
    m.add_function(wrap_pyfunction!(elias_decode, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_levels_encode, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_levels_decode, m)?)?;
    m.add_function(wrap_pyfunction!(huffman_book, m)?)?;
    m.add_function(wrap_pyfunction!(huffman_book_lengths, m)?)?;
    m.add_function(wrap_pyfunction!(huffman_encode, m)?)?;
    m.add_function(wrap_pyfunction!(huffman_decode, m)?)?;
    m.add_function(wrap_pyfunction!(gcomp_exponent_counts, m)?)?;
    m.add_function(wrap_pyfunction!(gcomp_metric, m)?)?;
    m.add_function(wrap_pyfunction!(gcomp_block_levels, m)?)?;
    m.add_function(wrap_pyfunction!(gcomp_encode, m)?)?;
    Ok(())
}
