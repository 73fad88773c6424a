//! `gradwire._native`: thin PyO3 glue over gradwire-core.
//!
//! Byte inputs arrive as 1-D contiguous numpy arrays (the Python wrapper views any bytes-like
//! object with `np.frombuffer`; the abi3 build has no buffer protocol). Every kernel runs with
//! the GIL released. Errors from the core become `FrameError` (frame rules) or `WireError`
//! (everything else), both `ValueError`s, with the core's message.

use gradwire_core as gw;
use numpy::{Element, PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

create_exception!(
    gradwire._native,
    WireError,
    PyValueError,
    "Input a gradwire kernel cannot encode or decode (a ValueError)."
);
create_exception!(
    gradwire._native,
    FrameError,
    WireError,
    "A frame, or one of its records, breaks a rule of docs/FORMAT.md (a WireError)."
);

/// Maps a core error onto the Python exception classes.
fn py_err(e: gw::WireError) -> PyErr {
    if e.is_frame_error() {
        FrameError::new_err(e.to_string())
    } else {
        WireError::new_err(e.to_string())
    }
}

/// The contiguous data of a 1-D numpy array.
fn slice<'a, T: Element>(arr: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    arr.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{what} must be a contiguous 1-D array")))
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
        py.detach(|| kernel(s)).map_err(py_err)?;
    }
    Ok(out)
}

#[pyfunction]
fn pack_bits<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, u32>,
    bits: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let v = slice(&values, "values")?;
    let len = gw::packed_len(v.len(), bits).map_err(py_err)?;
    PyBytes::new_with(py, len, |buf| {
        py.detach(|| gw::pack_bits_into(v, bits, buf))
            .map_err(py_err)
    })
}

/// Unpack `count` values of `bits` bits from an LSB-first bit stream; `data` may be longer
/// than needed and padding bits are ignored. Returns a uint32 array.
#[pyfunction]
#[pyo3(signature = (data, bits, count, out = None))]
fn unpack_bits<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    bits: u32,
    count: usize,
    out: Option<Bound<'py, PyArray1<u32>>>,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let d = slice(&data, "data")?;
    if let Some(out) = out {
        return decode_into(py, out, count, |o| gw::unpack_bits_into(d, bits, o));
    }
    let out = py
        .detach(|| gw::unpack_bits(d, bits, count))
        .map_err(py_err)?;
    Ok(PyArray1::from_vec(py, out))
}

/// Strict unpack_bits: `data` must be exactly ceil(count*bits/8) bytes with zero padding bits.
#[pyfunction]
#[pyo3(signature = (data, bits, count, out = None))]
fn unpack_bits_exact<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    bits: u32,
    count: usize,
    out: Option<Bound<'py, PyArray1<u32>>>,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let d = slice(&data, "data")?;
    if let Some(out) = out {
        return decode_into(py, out, count, |o| gw::unpack_bits_exact_into(d, bits, o));
    }
    let out = py
        .detach(|| gw::unpack_bits_exact(d, bits, count))
        .map_err(py_err)?;
    Ok(PyArray1::from_vec(py, out))
}

/// 3LC quartic encoding of int8 trits (-1, 0, 1): five per byte, ceil(n/5) bytes <= 242.
#[pyfunction]
fn quartic_encode<'py>(
    py: Python<'py>,
    trits: PyReadonlyArray1<'py, i8>,
) -> PyResult<Bound<'py, PyBytes>> {
    let t = slice(&trits, "trits")?;
    PyBytes::new_with(py, gw::quartic_len(t.len()), |buf| {
        py.detach(|| gw::quartic_encode_into(t, buf))
            .map_err(py_err)
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
    if let Some(out) = out {
        return decode_into(py, out, count, |o| gw::quartic_decode_into(d, o));
    }
    let out = py.detach(|| gw::quartic_decode(d, count)).map_err(py_err)?;
    Ok(PyArray1::from_vec(py, out))
}

/// 3LC zero-run encoding of quartic bytes (runs of 121 become codes 243..255).
#[pyfunction]
fn zero_run_encode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, PyBytes>> {
    let d = slice(&data, "data")?;
    let out = py.detach(|| gw::zero_run_encode(d)).map_err(py_err)?;
    Ok(PyBytes::new(py, &out))
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
    let len = py
        .detach(|| gw::zero_run_output_len(d, expected_len))
        .map_err(py_err)?;
    PyBytes::new_with(py, len, |buf| {
        py.detach(|| gw::zero_run_decode_into(d, buf))
            .map_err(py_err)
    })
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
    let mut specs = Vec::with_capacity(entries.len());
    for (name, codec, dtype, shape, params, sections) in &entries {
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
    let header = gw::FrameHeader::new(bundle, round, sender);
    let limits = gw::Limits::default();
    let len = py
        .detach(|| gw::frame_len(&header, &specs, &limits))
        .map_err(py_err)?;
    PyBytes::new_with(py, len, |buf| {
        py.detach(|| gw::write_frame_into(&header, &specs, &limits, buf))
            .map_err(py_err)
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

/// Parse and validate a version-1 frame. Returns (round, sender, bundle, entries), each entry
/// (name, codec, dtype, shape, (params_start, params_end), [(section, elem, start, end), ...])
/// with byte offsets into `data`. Raises FrameError naming the broken rule.
#[pyfunction]
#[pyo3(
    text_signature = "(data, max_frame_bytes=2**31, max_entries=2**20, max_tensor_elements=2**31)"
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
    let view = py.detach(|| gw::parse_frame(d, &limits)).map_err(py_err)?;
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

fn huffman_book_of(book: &PyReadonlyArray1<'_, u8>) -> PyResult<gw::HuffmanBook> {
    gw::HuffmanBook::from_bytes(slice(book, "book")?).map_err(py_err)
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
    py.detach(|| gw::rice_param(i, set_len, universe))
        .map_err(py_err)
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
    let out = py
        .detach(|| gw::rice_encode(i, set_len, universe, param))
        .map_err(py_err)?;
    Ok(PyBytes::new(py, &out))
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
    if let Some(out) = out {
        return decode_into(py, out, count, |o| {
            gw::rice_decode_into(d, set_len, universe, param, o)
        });
    }
    let out = py
        .detach(|| gw::rice_decode(d, count, set_len, universe, param))
        .map_err(py_err)?;
    Ok(PyArray1::from_vec(py, out))
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
    let out = py.detach(|| gw::elias_encode(v, k)).map_err(py_err)?;
    Ok(PyBytes::new(py, &out))
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
    let out = py
        .detach(|| gw::elias_decode(d, count, k))
        .map_err(py_err)?;
    Ok(PyArray1::from_vec(py, out))
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
    let out = py
        .detach(|| gw::sparse_levels_encode(p, l, k))
        .map_err(py_err)?;
    Ok(PyBytes::new(py, &out))
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
    let (p, l) = py
        .detach(|| gw::sparse_levels_decode(d, count, universe, max_level, k))
        .map_err(py_err)?;
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
    let book = py
        .detach(|| gw::HuffmanBook::from_counts(c, cap))
        .map_err(py_err)?;
    Ok(PyBytes::new(py, &book.to_bytes()))
}

/// Validate a serialized codebook; returns (cap, code lengths of the 256 symbols then the
/// escape, 0 = no codeword).
#[pyfunction]
fn huffman_book_lengths<'py>(
    py: Python<'py>,
    book: PyReadonlyArray1<'py, u8>,
) -> PyResult<(u32, Bound<'py, PyArray1<u8>>)> {
    let b = huffman_book_of(&book)?;
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
    let b = huffman_book_of(&book)?;
    let out = py.detach(|| b.encode(s)).map_err(py_err)?;
    Ok(PyBytes::new(py, &out))
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
    let b = huffman_book_of(&book)?;
    let out = py.detach(|| b.decode(d, count)).map_err(py_err)?;
    Ok(PyArray1::from_vec(py, out))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("WireError", py.get_type::<WireError>())?;
    m.add("FrameError", py.get_type::<FrameError>())?;
    m.add_function(wrap_pyfunction!(pack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_bits_exact, m)?)?;
    m.add_function(wrap_pyfunction!(quartic_encode, m)?)?;
    m.add_function(wrap_pyfunction!(quartic_decode, m)?)?;
    m.add_function(wrap_pyfunction!(zero_run_encode, m)?)?;
    m.add_function(wrap_pyfunction!(zero_run_decode, m)?)?;
    m.add_function(wrap_pyfunction!(zero_run_decode_into, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
    m.add_function(wrap_pyfunction!(decode_frame, m)?)?;
    m.add_function(wrap_pyfunction!(rice_param, m)?)?;
    m.add_function(wrap_pyfunction!(rice_param_estimate, m)?)?;
    m.add_function(wrap_pyfunction!(rice_encode, m)?)?;
    m.add_function(wrap_pyfunction!(rice_decode, m)?)?;
    m.add_function(wrap_pyfunction!(elias_encode, m)?)?;
    m.add_function(wrap_pyfunction!(elias_decode, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_levels_encode, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_levels_decode, m)?)?;
    m.add_function(wrap_pyfunction!(huffman_book, m)?)?;
    m.add_function(wrap_pyfunction!(huffman_book_lengths, m)?)?;
    m.add_function(wrap_pyfunction!(huffman_encode, m)?)?;
    m.add_function(wrap_pyfunction!(huffman_decode, m)?)?;
    Ok(())
}
