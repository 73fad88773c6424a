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

/// Pack uint32 `values` at `bits` bits each (1..32) into an LSB-first bit stream of
/// ceil(n*bits/8) bytes (docs/FORMAT.md section 6). Raises WireError naming the first value
/// that does not fit.
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
        let mut rw = out
            .try_readwrite()
            .map_err(|_| PyValueError::new_err("out must be a writeable array not borrowed elsewhere"))?;
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
    Ok(())
}
