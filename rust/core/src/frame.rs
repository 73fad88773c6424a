//! Frame format version 1 (docs/FORMAT.md), reader and writer.
//!
//! The reader, [`parse_frame`], checks in the order the format prescribes — size, magic,
//! version, `total_len`, limit, CRC, reserved flags — and only then walks the records, checking
//! every structural rule of section 7. It allocates nothing whose size comes from the frame
//! before checking that size against the bytes actually present. It returns borrowed views
//! with byte ranges into the frame so callers can slice their own buffer without copying.
//!
//! The writer, [`write_frame`] / [`FrameWriter`], validates the same rules (it never writes a
//! frame the reader would reject under the same limits), computes the frame length up front and
//! fills a single allocation.
//!
//! Codec-specific rules (section 5: parameter layouts, required sections, index order …) are the
//! codec layer's business; this module treats `codec` and `params` as opaque.

use std::collections::HashSet;
use std::ops::Range;

use crate::checksum::crc32c;
use crate::error::{Result, WireError};

/// `GWIR`.
pub const MAGIC: [u8; 4] = *b"GWIR";
/// The only version this module reads and writes.
pub const VERSION: u16 = 1;
/// Header bytes.
pub const HEADER_LEN: usize = 32;
/// Checksum bytes.
pub const CRC_LEN: usize = 4;
/// The smallest frame: a bundle with no entries.
pub const MIN_FRAME_LEN: usize = HEADER_LEN + CRC_LEN;
/// Flag bit 0: bundle frame.
pub const FLAG_BUNDLE: u16 = 1;
/// Flag bit 1 (bundle frames only): a layout frame, whose records may be compact
/// (docs/FORMAT.md section 12, [`crate::layout_frame`]).
pub const FLAG_LAYOUT: u16 = 2;
/// Longest tensor name, in bytes.
pub const MAX_NAME_LEN: usize = 1024;
/// Most dimensions.
pub const MAX_NDIM: usize = 8;
/// Longest `params`.
pub const MAX_PARAMS_LEN: usize = 4096;
/// Most sections per record.
pub const MAX_SECTIONS: usize = 32;
/// Longest section name.
pub const MAX_SECTION_NAME_LEN: usize = 32;
/// Smallest record: name_len, codec, dtype, ndim, params_len, section_count.
const MIN_ENTRY_LEN: usize = 2 + 2 + 1 + 1 + 4 + 1;

/// Element and dtype codes of FORMAT.md table 4.1.
pub mod codes {
    pub const U8: u8 = 0;
    pub const I8: u8 = 1;
    pub const U16: u8 = 2;
    pub const I16: u8 = 3;
    pub const U32: u8 = 4;
    pub const I32: u8 = 5;
    pub const U64: u8 = 6;
    pub const I64: u8 = 7;
    pub const F16: u8 = 8;
    pub const BF16: u8 = 9;
    pub const F32: u8 = 10;
    pub const F64: u8 = 11;

    /// Every code with its lowercase type name, in code order (`("bf16", BF16)` …).
    pub const ALL: [(&str, u8); 12] = [
        ("u8", U8),
        ("i8", I8),
        ("u16", U16),
        ("i16", I16),
        ("u32", U32),
        ("i32", I32),
        ("u64", U64),
        ("i64", I64),
        ("f16", F16),
        ("bf16", BF16),
        ("f32", F32),
        ("f64", F64),
    ];
}

/// Size in bytes of an element type code, `None` for reserved codes (12–255).
pub const fn elem_size(code: u8) -> Option<u8> {
    match code {
        0 | 1 => Some(1),
        2 | 3 | 8 | 9 => Some(2),
        4 | 5 | 10 => Some(4),
        6 | 7 | 11 => Some(8),
        _ => None,
    }
}

/// True for the floating point codes (8, 9, 10, 11), the only valid `dtype` values.
pub const fn is_float_dtype(code: u8) -> bool {
    matches!(code, 8..=11)
}

/// A reader's (or writer's) limits. Each is checked before memory is allocated for what it
/// bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Largest frame, in bytes (default 2 GiB).
    pub max_frame_bytes: u64,
    /// Most records in a bundle (default 2^20).
    pub max_entries: u32,
    /// Most elements per tensor (default 2^31).
    pub max_tensor_elements: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: 1 << 31,
            max_entries: 1 << 20,
            max_tensor_elements: 1 << 31,
        }
    }
}

/// The header fields a caller cares about (`total_len` and `entry_count` are derived).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FrameHeader {
    pub version: u16,
    pub bundle: bool,
    pub round: u64,
    pub sender: u32,
}

impl FrameHeader {
    /// A version-1 header.
    pub fn new(bundle: bool, round: u64, sender: u32) -> Self {
        FrameHeader {
            version: VERSION,
            bundle,
            round,
            sender,
        }
    }
}

/// One section of a parsed record; `range` is the payload's position in the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionView<'a> {
    pub name: &'a str,
    pub elem: u8,
    pub range: Range<usize>,
}

/// One parsed tensor record; `params` is the position of the params bytes in the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryView<'a> {
    pub name: &'a str,
    pub codec: u16,
    pub dtype: u8,
    pub shape: Vec<u64>,
    /// Product of `shape` (1 for a scalar), already checked against the limit.
    pub numel: u64,
    pub params: Range<usize>,
    pub sections: Vec<SectionView<'a>>,
}

impl<'a> EntryView<'a> {
    /// The section called `name`, if present.
    pub fn section(&self, name: &str) -> Option<&SectionView<'a>> {
        self.sections.iter().find(|s| s.name == name)
    }

    /// The record as a writer takes it, its params and payloads borrowed from `frame`, the bytes it was
    /// parsed from (what rewriting a parsed frame needs); `None` if `frame` does not hold those ranges.
    pub fn spec<'f>(&'f self, frame: &'f [u8]) -> Option<EntrySpec<'f>>
    where
        'a: 'f,
    {
        let sections = self
            .sections
            .iter()
            .map(|s| Some((s.name, s.elem, frame.get(s.range.clone())?)))
            .collect::<Option<Vec<_>>>()?;
        Some(EntrySpec {
            name: self.name,
            codec: self.codec,
            dtype: self.dtype,
            shape: &self.shape,
            params: frame.get(self.params.clone())?,
            sections,
        })
    }
}

/// A parsed frame, borrowing from the bytes it was parsed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameView<'a> {
    pub header: FrameHeader,
    pub entries: Vec<EntryView<'a>>,
}

// ------------------------------------------------------------------------------------ reader

/// Bounds-checked little-endian reader over the record area (header end to CRC start).
pub(crate) struct Cursor<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    pub(crate) fn take(&mut self, n: u64, field: &'static str) -> Result<Range<usize>> {
        let available = self.remaining();
        let overrun = || WireError::FieldOverrun {
            field,
            offset: self.pos,
            needed: n,
            available,
        };
        let n_usize = usize::try_from(n).map_err(|_| overrun())?;
        if n_usize > available {
            return Err(overrun());
        }
        let start = self.pos;
        self.pos = start + n_usize;
        Ok(start..self.pos)
    }

    pub(crate) fn bytes(&mut self, n: u64, field: &'static str) -> Result<&'a [u8]> {
        let r = self.take(n, field)?;
        let buf: &'a [u8] = self.buf;
        buf.get(r.clone()).ok_or(WireError::FieldOverrun {
            field,
            offset: r.start,
            needed: n,
            available: 0,
        })
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N]> {
        let s = self.bytes(N as u64, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8> {
        Ok(self.array::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16> {
        self.array(field).map(u16::from_le_bytes)
    }
    fn u32(&mut self, field: &'static str) -> Result<u32> {
        self.array(field).map(u32::from_le_bytes)
    }
    fn u64(&mut self, field: &'static str) -> Result<u64> {
        self.array(field).map(u64::from_le_bytes)
    }
}

fn le_u16(data: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    if let Some(s) = data.get(at..at + 2) {
        a.copy_from_slice(s);
    }
    u16::from_le_bytes(a)
}

fn le_u32(data: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = data.get(at..at + 4) {
        a.copy_from_slice(s);
    }
    u32::from_le_bytes(a)
}

fn le_u64(data: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = data.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

/// The first checks of every frame: room for a header and trailer, the magic, the version (returned).
fn check_start(data: &[u8]) -> Result<u16> {
    if data.len() < MIN_FRAME_LEN {
        return Err(WireError::FrameTooShort { got: data.len() });
    }
    let mut magic = [0u8; 4];
    magic.copy_from_slice(&data[0..4]);
    if magic != MAGIC {
        return Err(WireError::BadMagic { found: magic });
    }
    let version = le_u16(data, 4);
    if version != VERSION {
        return Err(WireError::UnsupportedVersion { version });
    }
    Ok(version)
}

/// Checks the envelope of a frame (size, magic, version, `total_len`, limit, CRC, reserved
/// flags) and returns the header and `entry_count`, without looking at the records.
pub fn parse_header(data: &[u8], limits: &Limits) -> Result<(FrameHeader, u32)> {
    let version = check_start(data)?;
    let declared = le_u64(data, 8);
    let got = data.len();
    match u64::try_from(got) {
        Ok(g) if declared > g => return Err(WireError::FrameTruncated { declared, got }),
        Ok(g) if declared < g => return Err(WireError::FrameTrailingBytes { declared, got }),
        Ok(_) => {}
        Err(_) => return Err(WireError::FrameTrailingBytes { declared, got }),
    }
    if declared > limits.max_frame_bytes {
        return Err(WireError::FrameTooLarge {
            len: declared,
            limit: limits.max_frame_bytes,
        });
    }
    let body_end = got - CRC_LEN;
    let stored = le_u32(data, body_end);
    let computed = crc32c(&data[..body_end], 0);
    if stored != computed {
        return Err(WireError::ChecksumMismatch { stored, computed });
    }
    let flags = le_u16(data, 6);
    // Bit 1 (a layout frame, crate::layout_frame) is defined for bundle frames only.
    let known = if flags & FLAG_BUNDLE != 0 {
        FLAG_BUNDLE | FLAG_LAYOUT
    } else {
        0
    };
    if flags & !known != 0 {
        return Err(WireError::ReservedFlags { flags });
    }
    let header = FrameHeader {
        version,
        bundle: flags & FLAG_BUNDLE != 0,
        round: le_u64(data, 16),
        sender: le_u32(data, 24),
    };
    Ok((header, le_u32(data, 28)))
}

/// Whether a frame whose header [`parse_header`] accepted is a layout frame (flag bit 1).
pub fn is_layout(data: &[u8]) -> bool {
    le_u16(data, 6) & FLAG_LAYOUT != 0
}

/// The length of the frame that starts `data`, which may run on into further frames (the
/// downlink concatenates them): checks the magic, the version and that `total_len` is at least
/// [`MIN_FRAME_LEN`] and no more than `data` holds. The frame itself is not checked: parse it
/// with [`parse_frame`] over exactly that many bytes.
pub fn frame_len_at_start(data: &[u8]) -> Result<usize> {
    check_start(data)?;
    let declared = le_u64(data, 8);
    let got = data.len();
    match usize::try_from(declared) {
        Ok(n) if n < MIN_FRAME_LEN => Err(WireError::FrameTooShort { got: n }),
        Ok(n) if n <= got => Ok(n),
        _ => Err(WireError::FrameTruncated { declared, got }),
    }
}

/// Parses and validates a whole frame. See the module docs for what is checked and in which
/// order.
pub fn parse_frame<'a>(data: &'a [u8], limits: &Limits) -> Result<FrameView<'a>> {
    let (header, entry_count) = parse_header(data, limits)?;
    if is_layout(data) {
        // A layout frame is read by crate::layout_frame::parse_layout_frame only: read here as a plain
        // bundle it would not write back to its own bytes.
        return Err(WireError::ReservedFlags {
            flags: le_u16(data, 6),
        });
    }
    if !header.bundle && entry_count != 1 {
        return Err(WireError::TensorFrameEntryCount { count: entry_count });
    }
    if entry_count > limits.max_entries {
        return Err(WireError::TooManyEntries {
            count: entry_count,
            limit: limits.max_entries,
        });
    }
    let body_end = data.len() - CRC_LEN;
    let mut cur = Cursor {
        buf: &data[..body_end],
        pos: HEADER_LEN,
    };
    // Never trust entry_count for the allocation: cap it by what the bytes can hold.
    let cap = (entry_count as usize).min(cur.remaining() / MIN_ENTRY_LEN);
    let mut entries = Vec::with_capacity(cap);
    let mut names: HashSet<&'a str> = HashSet::new();
    for e in 0..entry_count as usize {
        let entry = parse_entry(&mut cur, e, header.bundle, limits)?;
        if header.bundle && !names.insert(entry.name) {
            return Err(WireError::DuplicateName {
                entry: e,
                name: entry.name.to_owned(),
            });
        }
        entries.push(entry);
    }
    if cur.remaining() != 0 {
        return Err(WireError::LeftoverBytes {
            count: cur.remaining(),
        });
    }
    Ok(FrameView { header, entries })
}

pub(crate) fn parse_entry<'a>(
    cur: &mut Cursor<'a>,
    e: usize,
    bundle: bool,
    limits: &Limits,
) -> Result<EntryView<'a>> {
    let name_len = cur.u16("name_len")? as usize;
    if name_len > MAX_NAME_LEN {
        return Err(WireError::NameTooLong {
            entry: e,
            len: name_len,
        });
    }
    let name_offset = cur.pos;
    let name_bytes = cur.bytes(name_len as u64, "name")?;
    let name = std::str::from_utf8(name_bytes).map_err(|_| WireError::NameNotUtf8 {
        entry: e,
        offset: name_offset,
    })?;
    if bundle && name.is_empty() {
        return Err(WireError::EmptyName { entry: e });
    }
    let codec = cur.u16("codec")?;
    let dtype = cur.u8("dtype")?;
    if !is_float_dtype(dtype) {
        return Err(WireError::InvalidDtype {
            entry: e,
            code: dtype,
        });
    }
    let ndim = cur.u8("ndim")?;
    if ndim as usize > MAX_NDIM {
        return Err(WireError::TooManyDims { entry: e, ndim });
    }
    let mut shape = Vec::with_capacity(ndim as usize);
    for _ in 0..ndim {
        shape.push(cur.u64("shape")?);
    }
    let numel = numel_of(e, &shape, limits)?;
    let params_len = cur.u32("params_len")?;
    if params_len as usize > MAX_PARAMS_LEN {
        return Err(WireError::ParamsTooLong {
            entry: e,
            len: u64::from(params_len),
        });
    }
    let params = cur.take(u64::from(params_len), "params")?;
    let section_count = cur.u8("section_count")? as usize;
    if section_count > MAX_SECTIONS {
        return Err(WireError::TooManySections {
            entry: e,
            count: section_count,
        });
    }
    let mut sections: Vec<SectionView<'a>> = Vec::with_capacity(section_count);
    for s in 0..section_count {
        let len = cur.u8("section name_len")? as usize;
        if len == 0 || len > MAX_SECTION_NAME_LEN {
            return Err(WireError::SectionNameLength {
                entry: e,
                section: s,
                len,
            });
        }
        let raw = cur.bytes(len as u64, "section name")?;
        let name = section_name(e, s, raw)?;
        if sections.iter().any(|x| x.name == name) {
            return Err(WireError::DuplicateSection {
                entry: e,
                section: s,
                name: name.to_owned(),
            });
        }
        let elem = cur.u8("elem")?;
        let size = elem_size(elem).ok_or(WireError::UnknownElemType {
            entry: e,
            section: s,
            code: elem,
        })?;
        let byte_len = cur.u64("byte_len")?;
        if byte_len % u64::from(size) != 0 {
            return Err(WireError::SectionLength {
                entry: e,
                section: s,
                byte_len,
                elem_size: size,
            });
        }
        let range = cur.take(byte_len, "payload")?;
        sections.push(SectionView { name, elem, range });
    }
    Ok(EntryView {
        name,
        codec,
        dtype,
        shape,
        numel,
        params,
        sections,
    })
}

pub(crate) fn numel_of(e: usize, shape: &[u64], limits: &Limits) -> Result<u64> {
    let numel = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| WireError::NumelOverflow {
            entry: e,
            shape: shape.to_vec(),
        })?;
    if numel > limits.max_tensor_elements {
        return Err(WireError::TooManyElements {
            entry: e,
            numel,
            limit: limits.max_tensor_elements,
        });
    }
    Ok(numel)
}

fn section_name(e: usize, s: usize, raw: &[u8]) -> Result<&str> {
    let ok = raw
        .iter()
        .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    match std::str::from_utf8(raw) {
        Ok(name) if ok => Ok(name),
        _ => Err(WireError::SectionNameInvalid {
            entry: e,
            section: s,
            name: String::from_utf8_lossy(raw).into_owned(),
        }),
    }
}

// ------------------------------------------------------------------------------------ writer

/// One record to write. Borrows everything; sections are `(name, elem code, payload bytes)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntrySpec<'a> {
    pub name: &'a str,
    pub codec: u16,
    pub dtype: u8,
    pub shape: &'a [u64],
    pub params: &'a [u8],
    pub sections: Vec<(&'a str, u8, &'a [u8])>,
}

/// Writes frames under given limits (the same the reader applies).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrameWriter {
    pub limits: Limits,
}

impl FrameWriter {
    pub fn new(limits: Limits) -> Self {
        FrameWriter { limits }
    }

    /// Validates and returns the exact frame length.
    pub fn frame_len(&self, header: &FrameHeader, entries: &[EntrySpec<'_>]) -> Result<usize> {
        validate(header, entries, &self.limits)
    }

    /// Validates and writes a frame into a new vector (one allocation of the exact size).
    pub fn write(&self, header: &FrameHeader, entries: &[EntrySpec<'_>]) -> Result<Vec<u8>> {
        let len = validate(header, entries, &self.limits)?;
        let mut out = vec![0u8; len];
        emit(header, entries, &mut out)?;
        Ok(out)
    }

    /// Validates and writes a frame into `out`, which must be exactly [`FrameWriter::frame_len`] bytes.
    pub fn write_into(
        &self,
        header: &FrameHeader,
        entries: &[EntrySpec<'_>],
        out: &mut [u8],
    ) -> Result<()> {
        let len = validate(header, entries, &self.limits)?;
        if out.len() != len {
            return Err(WireError::OutputSizeMismatch {
                needed: len,
                got: out.len(),
            });
        }
        emit(header, entries, out)
    }
}

/// Validates and writes a frame under the default limits.
pub fn write_frame(header: &FrameHeader, entries: &[EntrySpec<'_>]) -> Result<Vec<u8>> {
    FrameWriter::default().write(header, entries)
}

/// Validates and returns the exact length of the frame `write_frame` would produce.
pub fn frame_len(
    header: &FrameHeader,
    entries: &[EntrySpec<'_>],
    limits: &Limits,
) -> Result<usize> {
    validate(header, entries, limits)
}

/// Validates and writes into `out` (exactly `frame_len` bytes) under `limits`.
pub fn write_frame_into(
    header: &FrameHeader,
    entries: &[EntrySpec<'_>],
    limits: &Limits,
    out: &mut [u8],
) -> Result<()> {
    FrameWriter::new(*limits).write_into(header, entries, out)
}

pub(crate) fn too_large(total: u64, limits: &Limits) -> WireError {
    WireError::FrameTooLarge {
        len: total,
        limit: limits.max_frame_bytes,
    }
}

/// Applies every reader rule to the input and returns the frame length.
pub(crate) fn validate(
    header: &FrameHeader,
    entries: &[EntrySpec<'_>],
    limits: &Limits,
) -> Result<usize> {
    if header.version != VERSION {
        return Err(WireError::UnsupportedVersion {
            version: header.version,
        });
    }
    // More than u32::MAX records cannot be written at all (entry_count is a u32).
    let count = u32::try_from(entries.len()).map_err(|_| WireError::TooManyEntries {
        count: u32::MAX,
        limit: limits.max_entries,
    })?;
    if !header.bundle && count != 1 {
        return Err(WireError::TensorFrameEntryCount { count });
    }
    if count > limits.max_entries {
        return Err(WireError::TooManyEntries {
            count,
            limit: limits.max_entries,
        });
    }
    let mut total = MIN_FRAME_LEN as u64;
    let mut names: HashSet<&str> =
        HashSet::with_capacity(if header.bundle { entries.len() } else { 0 });
    for (e, entry) in entries.iter().enumerate() {
        if entry.name.len() > MAX_NAME_LEN {
            return Err(WireError::NameTooLong {
                entry: e,
                len: entry.name.len(),
            });
        }
        if header.bundle {
            if entry.name.is_empty() {
                return Err(WireError::EmptyName { entry: e });
            }
            if !names.insert(entry.name) {
                return Err(WireError::DuplicateName {
                    entry: e,
                    name: entry.name.to_owned(),
                });
            }
        }
        if !is_float_dtype(entry.dtype) {
            return Err(WireError::InvalidDtype {
                entry: e,
                code: entry.dtype,
            });
        }
        if entry.shape.len() > MAX_NDIM {
            let ndim = u8::try_from(entry.shape.len()).unwrap_or(u8::MAX);
            return Err(WireError::TooManyDims { entry: e, ndim });
        }
        numel_of(e, entry.shape, limits)?;
        if entry.params.len() > MAX_PARAMS_LEN {
            return Err(WireError::ParamsTooLong {
                entry: e,
                len: entry.params.len() as u64,
            });
        }
        if entry.sections.len() > MAX_SECTIONS {
            return Err(WireError::TooManySections {
                entry: e,
                count: entry.sections.len(),
            });
        }
        let mut size =
            (MIN_ENTRY_LEN + entry.name.len() + 8 * entry.shape.len() + entry.params.len()) as u64;
        for (s, &(name, elem, payload)) in entry.sections.iter().enumerate() {
            if name.is_empty() || name.len() > MAX_SECTION_NAME_LEN {
                return Err(WireError::SectionNameLength {
                    entry: e,
                    section: s,
                    len: name.len(),
                });
            }
            section_name(e, s, name.as_bytes())?;
            if entry.sections[..s].iter().any(|x| x.0 == name) {
                return Err(WireError::DuplicateSection {
                    entry: e,
                    section: s,
                    name: name.to_owned(),
                });
            }
            let esize = elem_size(elem).ok_or(WireError::UnknownElemType {
                entry: e,
                section: s,
                code: elem,
            })?;
            let byte_len = payload.len() as u64;
            if byte_len % u64::from(esize) != 0 {
                return Err(WireError::SectionLength {
                    entry: e,
                    section: s,
                    byte_len,
                    elem_size: esize,
                });
            }
            size = size
                .checked_add(1 + name.len() as u64 + 1 + 8)
                .and_then(|x| x.checked_add(byte_len))
                .ok_or_else(|| too_large(u64::MAX, limits))?;
        }
        total = total
            .checked_add(size)
            .ok_or_else(|| too_large(u64::MAX, limits))?;
        if total > limits.max_frame_bytes {
            return Err(too_large(total, limits));
        }
    }
    if total > limits.max_frame_bytes {
        return Err(too_large(total, limits));
    }
    usize::try_from(total).map_err(|_| too_large(total, limits))
}

/// Sequential writer into a pre-sized buffer.
pub(crate) struct Out<'b> {
    pub(crate) buf: &'b mut [u8],
    pub(crate) pos: usize,
}

impl Out<'_> {
    pub(crate) fn put(&mut self, bytes: &[u8]) -> Result<()> {
        let end = self.pos + bytes.len();
        let needed = end;
        let got = self.buf.len();
        let dst = self
            .buf
            .get_mut(self.pos..end)
            .ok_or(WireError::OutputSizeMismatch { needed, got })?;
        dst.copy_from_slice(bytes);
        self.pos = end;
        Ok(())
    }
}

/// Writes an already validated frame into `buf` of exactly the validated length.
fn emit(header: &FrameHeader, entries: &[EntrySpec<'_>], buf: &mut [u8]) -> Result<()> {
    let total = buf.len();
    let mut o = Out { buf, pos: 0 };
    let flags = if header.bundle { FLAG_BUNDLE } else { 0 };
    emit_header(&mut o, header, flags, total, entries.len())?;
    for entry in entries {
        emit_entry(&mut o, entry)?;
    }
    emit_crc(o, total)
}

/// The 32 header bytes (the counts were validated).
pub(crate) fn emit_header(
    o: &mut Out<'_>,
    header: &FrameHeader,
    flags: u16,
    total: usize,
    count: usize,
) -> Result<()> {
    o.put(&MAGIC)?;
    o.put(&header.version.to_le_bytes())?;
    o.put(&flags.to_le_bytes())?;
    o.put(&(total as u64).to_le_bytes())?;
    o.put(&header.round.to_le_bytes())?;
    o.put(&header.sender.to_le_bytes())?;
    o.put(&(count as u32).to_le_bytes())
}

/// One full record (section 3) of a validated entry.
pub(crate) fn emit_entry(o: &mut Out<'_>, entry: &EntrySpec<'_>) -> Result<()> {
    // Lengths were validated: the casts below cannot truncate.
    o.put(&(entry.name.len() as u16).to_le_bytes())?;
    o.put(entry.name.as_bytes())?;
    o.put(&entry.codec.to_le_bytes())?;
    o.put(&[entry.dtype, entry.shape.len() as u8])?;
    for d in entry.shape {
        o.put(&d.to_le_bytes())?;
    }
    o.put(&(entry.params.len() as u32).to_le_bytes())?;
    o.put(entry.params)?;
    o.put(&[entry.sections.len() as u8])?;
    for &(name, elem, payload) in &entry.sections {
        o.put(&[name.len() as u8])?;
        o.put(name.as_bytes())?;
        o.put(&[elem])?;
        o.put(&(payload.len() as u64).to_le_bytes())?;
        o.put(payload)?;
    }
    Ok(())
}

/// The CRC over everything written, which must end exactly 4 bytes before `total`.
pub(crate) fn emit_crc(mut o: Out<'_>, total: usize) -> Result<()> {
    let body_end = o.pos;
    if body_end + CRC_LEN != total {
        return Err(WireError::OutputSizeMismatch {
            needed: body_end + CRC_LEN,
            got: total,
        });
    }
    let crc = crc32c(&o.buf[..body_end], 0);
    o.put(&crc.to_le_bytes())
}

#[cfg(test)]
mod tests {

    #[test]
    fn frame_len_at_start_delimits_concatenated_frames() {
        // Only the envelope is read: a header-sized frame with a zero CRC is enough.
        let mut f = vec![0u8; MIN_FRAME_LEN];
        f[0..4].copy_from_slice(&MAGIC);
        f[4..6].copy_from_slice(&VERSION.to_le_bytes());
        f[8..16].copy_from_slice(&(MIN_FRAME_LEN as u64).to_le_bytes());
        let mut joined = f.clone();
        joined.extend_from_slice(&f);
        assert_eq!(frame_len_at_start(&joined).ok(), Some(MIN_FRAME_LEN));
        assert!(matches!(
            frame_len_at_start(&f[..10]),
            Err(WireError::FrameTooShort { got: 10 })
        ));
        let mut long = f.clone();
        long[8..16].copy_from_slice(&1000u64.to_le_bytes());
        assert!(matches!(
            frame_len_at_start(&long),
            Err(WireError::FrameTruncated {
                declared: 1000,
                got: 36
            })
        ));
        let mut small = f.clone();
        small[8..16].copy_from_slice(&5u64.to_le_bytes());
        assert!(matches!(
            frame_len_at_start(&small),
            Err(WireError::FrameTooShort { got: 5 })
        ));
        let mut magic = f.clone();
        magic[0] = b'X';
        assert!(matches!(
            frame_len_at_start(&magic),
            Err(WireError::BadMagic { .. })
        ));
        let mut huge = f;
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            frame_len_at_start(&huge),
            Err(WireError::FrameTruncated { .. })
        ));
    }

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn code_table_lists_every_code_once_in_order() {
        for (i, &(name, code)) in codes::ALL.iter().enumerate() {
            assert_eq!(usize::from(code), i, "{name}");
            assert!(elem_size(code).is_some(), "{name}");
            assert_eq!(
                is_float_dtype(code),
                name.starts_with('f') || name == "bf16"
            );
        }
        assert_eq!(elem_size(codes::ALL.len() as u8), None);
    }

    /// Hand-built frames, able to express every violation. `finish` fixes up `total_len` and
    /// the CRC so that the structure check is what fails.
    struct Raw(Vec<u8>);

    impl Raw {
        fn new(flags: u16, entry_count: u32) -> Raw {
            let mut v = Vec::new();
            v.extend_from_slice(b"GWIR");
            v.extend_from_slice(&1u16.to_le_bytes());
            v.extend_from_slice(&flags.to_le_bytes());
            v.extend_from_slice(&0u64.to_le_bytes());
            v.extend_from_slice(&7u64.to_le_bytes());
            v.extend_from_slice(&3u32.to_le_bytes());
            v.extend_from_slice(&entry_count.to_le_bytes());
            Raw(v)
        }
        fn b(mut self, bytes: &[u8]) -> Raw {
            self.0.extend_from_slice(bytes);
            self
        }
        fn u8(self, v: u8) -> Raw {
            self.b(&[v])
        }
        fn u16(self, v: u16) -> Raw {
            self.b(&v.to_le_bytes())
        }
        fn u32(self, v: u32) -> Raw {
            self.b(&v.to_le_bytes())
        }
        fn u64(self, v: u64) -> Raw {
            self.b(&v.to_le_bytes())
        }
        /// A codec-0 record with fields as given (lengths from the slices).
        fn entry(
            self,
            name: &[u8],
            dtype: u8,
            shape: &[u64],
            params: &[u8],
            sections: &[(&[u8], u8, &[u8])],
        ) -> Raw {
            self.entry_codec(name, 0, dtype, shape, params, sections)
        }
        fn entry_codec(
            self,
            name: &[u8],
            codec: u16,
            dtype: u8,
            shape: &[u64],
            params: &[u8],
            sections: &[(&[u8], u8, &[u8])],
        ) -> Raw {
            let mut r = self
                .u16(name.len() as u16)
                .b(name)
                .u16(codec)
                .u8(dtype)
                .u8(shape.len() as u8);
            for &d in shape {
                r = r.u64(d);
            }
            r = r
                .u32(params.len() as u32)
                .b(params)
                .u8(sections.len() as u8);
            for &(n, elem, p) in sections {
                r = r.u8(n.len() as u8).b(n).u8(elem).u64(p.len() as u64).b(p);
            }
            r
        }
        fn finish(self) -> Vec<u8> {
            let mut v = self.0;
            v.extend_from_slice(&[0; 4]);
            fix(&mut v);
            v
        }
    }

    /// Rewrites `total_len` and the CRC of a frame to match its bytes.
    fn fix(v: &mut [u8]) {
        let n = v.len();
        v[8..16].copy_from_slice(&(n as u64).to_le_bytes());
        let crc = crc32c(&v[..n - 4], 0);
        v[n - 4..].copy_from_slice(&crc.to_le_bytes());
    }

    fn parse(v: &[u8]) -> Result<FrameView<'_>> {
        parse_frame(v, &Limits::default())
    }

    fn data_section(payload: &[u8]) -> Vec<(&str, u8, &[u8])> {
        vec![("data", codes::F32, payload)]
    }

    fn sample() -> Vec<u8> {
        let payload: Vec<u8> = (0..24).collect();
        let idx = [1u8, 2, 3];
        let entries = vec![
            EntrySpec {
                name: "layer.0.w",
                codec: 0,
                dtype: codes::F32,
                shape: &[2, 3],
                params: &[],
                sections: data_section(&payload),
            },
            EntrySpec {
                name: "b",
                codec: 1,
                dtype: codes::BF16,
                shape: &[],
                params: &[9, 8, 7],
                sections: vec![("idx", codes::U8, &idx), ("val", codes::I8, &idx[..2])],
            },
        ];
        write_frame(&FrameHeader::new(true, 42, 0xFFFF_FFFF), &entries).unwrap()
    }

    #[test]
    fn round_trip_bundle() {
        let f = sample();
        let v = parse(&f).unwrap();
        assert_eq!(
            v.header,
            FrameHeader {
                version: 1,
                bundle: true,
                round: 42,
                sender: 0xFFFF_FFFF
            }
        );
        assert_eq!(v.entries.len(), 2);
        let e0 = &v.entries[0];
        assert_eq!(
            (e0.name, e0.codec, e0.dtype, e0.shape.as_slice(), e0.numel),
            ("layer.0.w", 0, 10, &[2u64, 3][..], 6)
        );
        assert!(e0.params.is_empty());
        let d = e0.section("data").unwrap();
        assert_eq!(&f[d.range.clone()], (0..24).collect::<Vec<u8>>().as_slice());
        let e1 = &v.entries[1];
        assert_eq!(e1.numel, 1);
        assert_eq!(&f[e1.params.clone()], &[9, 8, 7]);
        assert_eq!(&f[e1.section("val").unwrap().range.clone()], &[1, 2]);
        assert_eq!(e1.sections[0].elem, codes::U8);
        // Matches a hand-built frame byte for byte.
        let mut hand = Raw::new(1, 2)
            .entry(
                b"layer.0.w",
                10,
                &[2, 3],
                &[],
                &[(b"data", 10, &(0..24).collect::<Vec<u8>>())],
            )
            .entry_codec(
                b"b",
                1,
                9,
                &[],
                &[9, 8, 7],
                &[(b"idx", 0, &[1, 2, 3]), (b"val", 1, &[1, 2])],
            );
        hand.0[16..24].copy_from_slice(&42u64.to_le_bytes());
        hand.0[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(hand.finish(), f);
    }

    #[test]
    fn a_parsed_frames_specs_rewrite_it_and_a_short_buffer_gives_none() {
        let f = sample();
        let v = parse(&f).unwrap();
        let specs: Vec<EntrySpec> = v.entries.iter().map(|e| e.spec(&f).unwrap()).collect();
        assert_eq!(write_frame(&v.header, &specs).unwrap(), f);
        assert_eq!(v.entries[1].spec(&f[..40]), None);
    }

    #[test]
    fn smallest_frames() {
        let empty_bundle = write_frame(&FrameHeader::new(true, 0, 0), &[]).unwrap();
        assert_eq!(empty_bundle.len(), 36);
        assert_eq!(parse(&empty_bundle).unwrap().entries.len(), 0);
        // Tensor frame with an empty name, scalar shape, no sections.
        let e = EntrySpec {
            name: "",
            codec: 0,
            dtype: codes::F16,
            shape: &[],
            params: &[],
            sections: vec![],
        };
        let f = write_frame(&FrameHeader::new(false, 1, 2), &[e]).unwrap();
        assert_eq!(f.len(), 36 + 11);
        let v = parse(&f).unwrap();
        assert_eq!(v.entries[0].name, "");
        assert!(!v.header.bundle);
        // A zero-sized dimension is fine.
        let f = Raw::new(0, 1)
            .entry(b"x", 10, &[0, u64::MAX], &[], &[])
            .finish();
        assert_eq!(parse(&f).unwrap().entries[0].numel, 0);
    }

    #[test]
    fn every_single_bit_flip_is_rejected() {
        let f = sample();
        for bit in 0..f.len() * 8 {
            let mut g = f.clone();
            g[bit / 8] ^= 1 << (bit % 8);
            let err = parse(&g).expect_err("flip accepted");
            let byte = bit / 8;
            match byte {
                0..=3 => assert!(
                    matches!(err, WireError::BadMagic { .. }),
                    "bit {bit}: {err}"
                ),
                4..=5 => assert!(
                    matches!(err, WireError::UnsupportedVersion { .. }),
                    "bit {bit}: {err}"
                ),
                8..=15 => assert!(
                    matches!(
                        err,
                        WireError::FrameTruncated { .. } | WireError::FrameTrailingBytes { .. }
                    ),
                    "bit {bit}: {err}"
                ),
                _ => assert!(
                    matches!(err, WireError::ChecksumMismatch { .. }),
                    "bit {bit}: {err}"
                ),
            }
        }
    }

    #[test]
    fn every_truncation_is_rejected() {
        let f = sample();
        for n in 0..f.len() {
            let err = parse(&f[..n]).expect_err("truncation accepted");
            if n < 36 {
                assert_eq!(err, WireError::FrameTooShort { got: n });
            } else {
                assert_eq!(
                    err,
                    WireError::FrameTruncated {
                        declared: f.len() as u64,
                        got: n
                    }
                );
            }
        }
        let mut longer = f.clone();
        longer.push(0);
        assert_eq!(
            parse(&longer),
            Err(WireError::FrameTrailingBytes {
                declared: f.len() as u64,
                got: f.len() + 1
            })
        );
    }

    #[test]
    fn envelope_violations() {
        let ok = Raw::new(0, 1)
            .entry(b"t", 10, &[1], &[], &[(b"data", 10, &[0; 4])])
            .finish();
        assert!(parse(&ok).is_ok());

        let mut g = ok.clone();
        g[3] = b'X';
        assert_eq!(parse(&g), Err(WireError::BadMagic { found: *b"GWIX" }));
        let mut g = ok.clone();
        g[4] = 2;
        fix(&mut g);
        assert_eq!(parse(&g), Err(WireError::UnsupportedVersion { version: 2 }));
        let mut g = ok.clone();
        g[6] = 0b10;
        fix(&mut g);
        assert_eq!(parse(&g), Err(WireError::ReservedFlags { flags: 2 }));
        let mut g = ok.clone();
        g[7] = 0x80;
        fix(&mut g);
        assert_eq!(parse(&g), Err(WireError::ReservedFlags { flags: 0x8000 }));
        let mut g = ok.clone();
        let n = g.len();
        g[n - 1] ^= 0xFF;
        assert!(matches!(parse(&g), Err(WireError::ChecksumMismatch { .. })));
        let small = Limits {
            max_frame_bytes: ok.len() as u64 - 1,
            ..Limits::default()
        };
        assert_eq!(
            parse_frame(&ok, &small),
            Err(WireError::FrameTooLarge {
                len: ok.len() as u64,
                limit: ok.len() as u64 - 1
            })
        );
        // Limit is checked before the CRC.
        let mut g = ok.clone();
        g[n - 1] ^= 0xFF;
        assert!(matches!(
            parse_frame(&g, &small),
            Err(WireError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn structure_violations() {
        let d4: &[u8] = &[0; 4];
        let sec = [(b"data".as_slice(), 10u8, d4)];
        let cases: Vec<(Vec<u8>, WireError)> = vec![
            (
                Raw::new(0, 0).finish(),
                WireError::TensorFrameEntryCount { count: 0 },
            ),
            (
                Raw::new(0, 2)
                    .entry(b"a", 10, &[], &[], &[])
                    .entry(b"b", 10, &[], &[], &[])
                    .finish(),
                WireError::TensorFrameEntryCount { count: 2 },
            ),
            (
                Raw::new(1, 2).entry(b"a", 10, &[], &[], &[]).finish(),
                WireError::FieldOverrun {
                    field: "name_len",
                    offset: 44,
                    needed: 2,
                    available: 0,
                },
            ),
            (
                Raw::new(1, 1).u16(1025).b(&[b'a'; 1025]).finish(),
                WireError::NameTooLong {
                    entry: 0,
                    len: 1025,
                },
            ),
            (
                Raw::new(1, 1).u16(5).b(b"ab").finish(),
                WireError::FieldOverrun {
                    field: "name",
                    offset: 34,
                    needed: 5,
                    available: 2,
                },
            ),
            (
                Raw::new(1, 1)
                    .entry(&[0xC3, 0x28], 10, &[], &[], &[])
                    .finish(),
                WireError::NameNotUtf8 {
                    entry: 0,
                    offset: 34,
                },
            ),
            (
                Raw::new(1, 1).entry(b"", 10, &[], &[], &[]).finish(),
                WireError::EmptyName { entry: 0 },
            ),
            (
                Raw::new(1, 3)
                    .entry(b"a", 10, &[], &[], &[])
                    .entry(b"b", 10, &[], &[], &[])
                    .entry(b"a", 10, &[], &[], &[])
                    .finish(),
                WireError::DuplicateName {
                    entry: 2,
                    name: "a".into(),
                },
            ),
            (
                Raw::new(0, 1).entry(b"t", 4, &[], &[], &[]).finish(),
                WireError::InvalidDtype { entry: 0, code: 4 },
            ),
            (
                Raw::new(0, 1).entry(b"t", 12, &[], &[], &[]).finish(),
                WireError::InvalidDtype { entry: 0, code: 12 },
            ),
            (
                Raw::new(0, 1).entry(b"t", 10, &[1; 9], &[], &[]).finish(),
                WireError::TooManyDims { entry: 0, ndim: 9 },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[1 << 32, 1 << 32], &[], &[])
                    .finish(),
                WireError::NumelOverflow {
                    entry: 0,
                    shape: vec![1 << 32, 1 << 32],
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[1 << 16, (1 << 15) + 1], &[], &[])
                    .finish(),
                WireError::TooManyElements {
                    entry: 0,
                    numel: (1 << 31) + (1 << 16),
                    limit: 1 << 31,
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[], &[0; 4097], &[])
                    .finish(),
                WireError::ParamsTooLong {
                    entry: 0,
                    len: 4097,
                },
            ),
            (
                Raw::new(0, 1)
                    .u16(1)
                    .b(b"t")
                    .u16(0)
                    .u8(10)
                    .u8(0)
                    .u32(0)
                    .u8(33)
                    .finish(),
                WireError::TooManySections {
                    entry: 0,
                    count: 33,
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[], &[], &[(b"", 10, d4)])
                    .finish(),
                WireError::SectionNameLength {
                    entry: 0,
                    section: 0,
                    len: 0,
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[], &[], &[(&[b'a'; 33], 10, d4)])
                    .finish(),
                WireError::SectionNameLength {
                    entry: 0,
                    section: 0,
                    len: 33,
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[], &[], &[(b"data", 10, d4), (b"Idx", 0, d4)])
                    .finish(),
                WireError::SectionNameInvalid {
                    entry: 0,
                    section: 1,
                    name: "Idx".into(),
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[], &[], &[(b"a-b", 0, d4)])
                    .finish(),
                WireError::SectionNameInvalid {
                    entry: 0,
                    section: 0,
                    name: "a-b".into(),
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[], &[], &[(b"data", 10, d4), (b"data", 10, d4)])
                    .finish(),
                WireError::DuplicateSection {
                    entry: 0,
                    section: 1,
                    name: "data".into(),
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[], &[], &[(b"data", 12, d4)])
                    .finish(),
                WireError::UnknownElemType {
                    entry: 0,
                    section: 0,
                    code: 12,
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[], &[], &[(b"data", 10, &[0; 6])])
                    .finish(),
                WireError::SectionLength {
                    entry: 0,
                    section: 0,
                    byte_len: 6,
                    elem_size: 4,
                },
            ),
            (
                Raw::new(0, 1)
                    .u16(1)
                    .b(b"t")
                    .u16(0)
                    .u8(10)
                    .u8(0)
                    .u32(0)
                    .u8(1)
                    .u8(4)
                    .b(b"data")
                    .u8(0)
                    .u64(100)
                    .b(&[0; 10])
                    .finish(),
                WireError::FieldOverrun {
                    field: "payload",
                    offset: 58,
                    needed: 100,
                    available: 10,
                },
            ),
            (
                Raw::new(0, 1)
                    .u16(1)
                    .b(b"t")
                    .u16(0)
                    .u8(10)
                    .u8(0)
                    .u32(0)
                    .u8(1)
                    .u8(4)
                    .b(b"data")
                    .u8(0)
                    .u64(u64::MAX)
                    .finish(),
                WireError::FieldOverrun {
                    field: "payload",
                    offset: 58,
                    needed: u64::MAX,
                    available: 0,
                },
            ),
            (
                Raw::new(0, 1)
                    .entry(b"t", 10, &[4], &[], &sec)
                    .u8(0)
                    .finish(),
                WireError::LeftoverBytes { count: 1 },
            ),
            (
                Raw::new(1, 0).u32(0).finish(),
                WireError::LeftoverBytes { count: 4 },
            ),
        ];
        for (i, (frame, expected)) in cases.iter().enumerate() {
            assert_eq!(parse(frame).as_ref().map(|_| ()), Err(expected), "case {i}");
            assert!(expected.is_frame_error());
        }
        // Entry limit, checked before anything is read or allocated.
        let f = Raw::new(1, u32::MAX).finish();
        assert_eq!(
            parse(&f),
            Err(WireError::TooManyEntries {
                count: u32::MAX,
                limit: 1 << 20
            })
        );
        let lim = Limits {
            max_entries: 1,
            ..Limits::default()
        };
        let f = Raw::new(1, 2)
            .entry(b"a", 10, &[], &[], &[])
            .entry(b"b", 10, &[], &[], &[])
            .finish();
        assert_eq!(
            parse_frame(&f, &lim),
            Err(WireError::TooManyEntries { count: 2, limit: 1 })
        );
        // A huge declared count with no bytes is an overrun, not an allocation.
        let f = Raw::new(1, 1 << 20).finish();
        assert!(matches!(
            parse(&f),
            Err(WireError::FieldOverrun {
                field: "name_len",
                ..
            })
        ));
        // Element limit is configurable.
        let lim = Limits {
            max_tensor_elements: 5,
            ..Limits::default()
        };
        let f = Raw::new(0, 1).entry(b"t", 10, &[2, 3], &[], &[]).finish();
        assert_eq!(
            parse_frame(&f, &lim),
            Err(WireError::TooManyElements {
                entry: 0,
                numel: 6,
                limit: 5
            })
        );
        // Boundary values are accepted.
        let f = Raw::new(0, 1)
            .entry(
                &[b'n'; 1024],
                11,
                &[1; 8],
                &[0; 4096],
                &[(&[b'z'; 32], 7, &[0; 16]), (b"0_9", 6, &[])],
            )
            .finish();
        assert!(parse(&f).is_ok());
        let names: Vec<Vec<u8>> = (0..32).map(|i| format!("s{i}").into_bytes()).collect();
        let secs: Vec<(&[u8], u8, &[u8])> =
            names.iter().map(|n| (n.as_slice(), 0u8, &[][..])).collect();
        assert!(parse(&Raw::new(0, 1).entry(b"t", 8, &[], &[], &secs).finish()).is_ok());
    }

    #[test]
    fn writer_rejects_what_reader_rejects() {
        let h = FrameHeader::new(true, 0, 0);
        let ok = |name| EntrySpec {
            name,
            codec: 0,
            dtype: codes::F32,
            shape: &[],
            params: &[],
            sections: vec![],
        };
        let long = "x".repeat(1025);
        let cases: Vec<(FrameHeader, Vec<EntrySpec>, WireError)> = vec![
            (
                FrameHeader { version: 2, ..h },
                vec![],
                WireError::UnsupportedVersion { version: 2 },
            ),
            (
                FrameHeader::new(false, 0, 0),
                vec![],
                WireError::TensorFrameEntryCount { count: 0 },
            ),
            (
                FrameHeader::new(false, 0, 0),
                vec![ok("a"), ok("b")],
                WireError::TensorFrameEntryCount { count: 2 },
            ),
            (
                h,
                vec![ok(&long)],
                WireError::NameTooLong {
                    entry: 0,
                    len: 1025,
                },
            ),
            (h, vec![ok("")], WireError::EmptyName { entry: 0 }),
            (
                h,
                vec![ok("a"), ok("a")],
                WireError::DuplicateName {
                    entry: 1,
                    name: "a".into(),
                },
            ),
            (
                h,
                vec![EntrySpec {
                    dtype: 3,
                    ..ok("a")
                }],
                WireError::InvalidDtype { entry: 0, code: 3 },
            ),
            (
                h,
                vec![EntrySpec {
                    shape: &[1; 9],
                    ..ok("a")
                }],
                WireError::TooManyDims { entry: 0, ndim: 9 },
            ),
            (
                h,
                vec![EntrySpec {
                    shape: &[u64::MAX, 2],
                    ..ok("a")
                }],
                WireError::NumelOverflow {
                    entry: 0,
                    shape: vec![u64::MAX, 2],
                },
            ),
            (
                h,
                vec![EntrySpec {
                    shape: &[1 << 32],
                    ..ok("a")
                }],
                WireError::TooManyElements {
                    entry: 0,
                    numel: 1 << 32,
                    limit: 1 << 31,
                },
            ),
            (
                h,
                vec![EntrySpec {
                    params: &[0; 4097],
                    ..ok("a")
                }],
                WireError::ParamsTooLong {
                    entry: 0,
                    len: 4097,
                },
            ),
            (
                h,
                vec![EntrySpec {
                    sections: vec![("s", 0, &[]); 33],
                    ..ok("a")
                }],
                WireError::TooManySections {
                    entry: 0,
                    count: 33,
                },
            ),
            (
                h,
                vec![EntrySpec {
                    sections: vec![("", 0, &[])],
                    ..ok("a")
                }],
                WireError::SectionNameLength {
                    entry: 0,
                    section: 0,
                    len: 0,
                },
            ),
            (
                h,
                vec![EntrySpec {
                    sections: vec![("é", 0, &[])],
                    ..ok("a")
                }],
                WireError::SectionNameInvalid {
                    entry: 0,
                    section: 0,
                    name: "é".into(),
                },
            ),
            (
                h,
                vec![EntrySpec {
                    sections: vec![("s", 0, &[]), ("s", 0, &[])],
                    ..ok("a")
                }],
                WireError::DuplicateSection {
                    entry: 0,
                    section: 1,
                    name: "s".into(),
                },
            ),
            (
                h,
                vec![EntrySpec {
                    sections: vec![("s", 13, &[])],
                    ..ok("a")
                }],
                WireError::UnknownElemType {
                    entry: 0,
                    section: 0,
                    code: 13,
                },
            ),
            (
                h,
                vec![EntrySpec {
                    sections: vec![("s", 11, &[0; 12])],
                    ..ok("a")
                }],
                WireError::SectionLength {
                    entry: 0,
                    section: 0,
                    byte_len: 12,
                    elem_size: 8,
                },
            ),
        ];
        for (i, (hdr, entries, expected)) in cases.into_iter().enumerate() {
            assert_eq!(write_frame(&hdr, &entries), Err(expected), "case {i}");
        }
        let w = FrameWriter::new(Limits {
            max_frame_bytes: 40,
            ..Limits::default()
        });
        assert_eq!(
            w.write(&h, &[ok("abcdef")]),
            Err(WireError::FrameTooLarge { len: 53, limit: 40 })
        );
        let w = FrameWriter::new(Limits {
            max_entries: 1,
            ..Limits::default()
        });
        assert_eq!(
            w.write(&h, &[ok("a"), ok("b")]),
            Err(WireError::TooManyEntries { count: 2, limit: 1 })
        );
        // write_into needs the exact size.
        let entries = [ok("a")];
        let n = frame_len(&h, &entries, &Limits::default()).unwrap();
        let mut buf = vec![0u8; n + 1];
        assert_eq!(
            write_frame_into(&h, &entries, &Limits::default(), &mut buf),
            Err(WireError::OutputSizeMismatch {
                needed: n,
                got: n + 1
            })
        );
        write_frame_into(&h, &entries, &Limits::default(), &mut buf[..n]).unwrap();
        assert_eq!(&buf[..n], write_frame(&h, &entries).unwrap().as_slice());
    }

    // ------------------------------------------------------------------------ properties

    #[derive(Debug, Clone)]
    struct OwnedEntry {
        name: String,
        codec: u16,
        dtype: u8,
        shape: Vec<u64>,
        params: Vec<u8>,
        sections: Vec<(String, u8, Vec<u8>)>,
    }

    fn owned_entry() -> impl Strategy<Value = OwnedEntry> {
        let section = ("[a-z0-9_]{1,32}", 0u8..12, 0usize..6).prop_flat_map(|(n, elem, k)| {
            let size = elem_size(elem).unwrap_or(1) as usize;
            (
                Just(n),
                Just(elem),
                proptest::collection::vec(any::<u8>(), k * size..=k * size),
            )
        });
        (
            "\\PC{1,12}",
            any::<u16>(),
            8u8..12,
            proptest::collection::vec(0u64..6, 0..=8),
            proptest::collection::vec(any::<u8>(), 0..20),
            proptest::collection::vec(section, 0..5),
        )
            .prop_map(|(name, codec, dtype, shape, params, mut sections)| {
                let mut seen = HashSet::new();
                sections.retain(|s| seen.insert(s.0.clone()));
                OwnedEntry {
                    name,
                    codec,
                    dtype,
                    shape,
                    params,
                    sections,
                }
            })
    }

    proptest! {
        #[test]
        fn prop_round_trip(mut entries in proptest::collection::vec(owned_entry(), 0..6),
                           bundle in any::<bool>(), round in any::<u64>(), sender in any::<u32>()) {
            let mut seen = HashSet::new();
            entries.retain(|e| seen.insert(e.name.clone()));
            if !bundle {
                entries.truncate(1);
                prop_assume!(entries.len() == 1);
            }
            let specs: Vec<EntrySpec> = entries.iter().map(|e| EntrySpec {
                name: &e.name, codec: e.codec, dtype: e.dtype, shape: &e.shape, params: &e.params,
                sections: e.sections.iter().map(|(n, el, p)| (n.as_str(), *el, p.as_slice())).collect(),
            }).collect();
            let header = FrameHeader::new(bundle, round, sender);
            let frame = write_frame(&header, &specs).unwrap();
            prop_assert_eq!(frame.len(), frame_len(&header, &specs, &Limits::default()).unwrap());
            let view = parse(&frame).unwrap();
            prop_assert_eq!(view.header, header);
            prop_assert_eq!(view.entries.len(), entries.len());
            for (v, e) in view.entries.iter().zip(&entries) {
                prop_assert_eq!(v.name, e.name.as_str());
                prop_assert_eq!(v.codec, e.codec);
                prop_assert_eq!(v.dtype, e.dtype);
                prop_assert_eq!(&v.shape, &e.shape);
                prop_assert_eq!(&frame[v.params.clone()], e.params.as_slice());
                prop_assert_eq!(v.sections.len(), e.sections.len());
                for (s, (n, el, p)) in v.sections.iter().zip(&e.sections) {
                    prop_assert_eq!(s.name, n.as_str());
                    prop_assert_eq!(s.elem, *el);
                    prop_assert_eq!(&frame[s.range.clone()], p.as_slice());
                }
            }
        }

        #[test]
        fn prop_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse(&data);
        }

        #[test]
        fn prop_valid_envelope_arbitrary_body_never_panics(body in proptest::collection::vec(any::<u8>(), 0..300),
                                                           flags in 0u16..2, count in 0u32..5) {
            // Envelope right, CRC fixed: the structure walk itself must never panic, and
            // whatever it accepts the writer reproduces byte for byte.
            let f = Raw::new(flags, count).b(&body).finish();
            if let Ok(view) = parse(&f) {
                let specs: Vec<EntrySpec> = view.entries.iter().map(|e| EntrySpec {
                    name: e.name, codec: e.codec, dtype: e.dtype, shape: &e.shape, params: &f[e.params.clone()],
                    sections: e.sections.iter().map(|s| (s.name, s.elem, &f[s.range.clone()])).collect(),
                }).collect();
                let mut header = view.header;
                header.round = 7;
                header.sender = 3;
                prop_assert_eq!(write_frame(&header, &specs).unwrap(), f);
            }
        }

        #[test]
        fn prop_mutated_valid_frame_never_panics(pos in 32usize..200, val in any::<u8>(), cut in 0usize..8) {
            // Mutate one byte of the record area, fix total_len and CRC, maybe cut the end.
            let mut f = sample();
            let n = f.len() - 4;
            f[pos % n.max(33)] = val;
            let keep = f.len() - cut.min(f.len() - 36);
            f.truncate(keep);
            fix(&mut f);
            let _ = parse(&f);
        }
    }
}
