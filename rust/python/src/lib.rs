//! `gradwire._native`: thin PyO3 glue over gradwire-core.
//!
//! Byte inputs arrive as 1-D contiguous numpy arrays (the Python wrapper views any bytes-like
//! object with `np.frombuffer`; the abi3 build has no buffer protocol). Every kernel runs with
//! the GIL released. Errors from the core become `FrameError` (frame rules) or `WireError`
//! (everything else), both `ValueError`s, with the core's message.

use gradwire_core as gw;
use numpy::{Element, PyArray1, PyReadonlyArray1};
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

/// pack_bits(values, bits) -> bytes
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

/// unpack_bits(data, bits, count) -> ndarray[uint32]
#[pyfunction]
fn unpack_bits<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    bits: u32,
    count: usize,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let d = slice(&data, "data")?;
    let out = py
        .detach(|| gw::unpack_bits(d, bits, count))
        .map_err(py_err)?;
    Ok(PyArray1::from_vec(py, out))
}

/// unpack_bits_exact(data, bits, count) -> ndarray[uint32]
#[pyfunction]
fn unpack_bits_exact<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    bits: u32,
    count: usize,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let d = slice(&data, "data")?;
    let out = py
        .detach(|| gw::unpack_bits_exact(d, bits, count))
        .map_err(py_err)?;
    Ok(PyArray1::from_vec(py, out))
}

/// quartic_encode(trits) -> bytes
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

/// quartic_decode(data, count) -> ndarray[int8]
#[pyfunction]
fn quartic_decode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    count: usize,
) -> PyResult<Bound<'py, PyArray1<i8>>> {
    let d = slice(&data, "data")?;
    let out = py.detach(|| gw::quartic_decode(d, count)).map_err(py_err)?;
    Ok(PyArray1::from_vec(py, out))
}

/// zero_run_encode(data) -> bytes
#[pyfunction]
fn zero_run_encode<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, PyBytes>> {
    let d = slice(&data, "data")?;
    let out = py.detach(|| gw::zero_run_encode(d)).map_err(py_err)?;
    Ok(PyBytes::new(py, &out))
}

/// zero_run_decode(data, expected_len=None) -> bytes
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

/// crc32c(data, value=0) -> int
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

/// encode_frame(round, sender, bundle, entries) -> bytes
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

/// decode_frame(data, max_frame_bytes=2**31, max_entries=2**20, max_tensor_elements=2**31)
///     -> (round, sender, bundle, entries)
#[pyfunction]
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
    m.add_function(wrap_pyfunction!(crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
    m.add_function(wrap_pyfunction!(decode_frame, m)?)?;
    Ok(())
}
