//! Layout frames (docs/FORMAT.md section 12): bundle frames whose records of a layout both sides
//! hold travel without their headers.
//!
//! A full record spends about 120 bytes on its name, codec, dtype, shape, params and four section
//! headers (the DCT codec). Between ranks that cut the same model into the same pieces (the torch
//! sharded exchange) all of that but the section lengths, and usually the params, is known to the
//! receiver before the bytes arrive: a step of a small model is about 3 KB, and those headers were a
//! third of it at 8 ranks. A layout frame (flag bits 0 and 1) therefore writes each record as a
//! LEB128 `tag`: 0 and a full record (section 3) follows; `1 + 2·i + p` and the record is
//! *compact*, of template `i` of the receiver's list: its name, codec, dtype, shape and sections'
//! names and element types are the template's, its params the template's (`p` = 0) or a LEB128
//! length and the bytes that follow (`p` = 1), and then, for each of the template's sections in
//! order, a LEB128 byte length and the payload.
//!
//! Templates are the caller's (trusted, its own layout); everything else is read as hostile input,
//! with the checks of [`crate::frame`]. The writer picks the compact form for every record whose
//! name is a template's and whose codec, dtype, shape and sections' names and element types are the
//! template's; any other record is written full.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use crate::error::{Result, WireError};
use crate::frame::{
    elem_size, emit_crc, emit_entry, emit_header, numel_of, parse_entry, parse_header, too_large,
    validate, Cursor, EntrySpec, EntryView, FrameHeader, FrameView, Limits, Out, CRC_LEN,
    FLAG_BUNDLE, FLAG_LAYOUT, HEADER_LEN, MAX_PARAMS_LEN, MIN_FRAME_LEN,
};

/// What the receiver knows of a record before it arrives: everything but its payloads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordTemplate<'t> {
    pub name: &'t str,
    pub codec: u16,
    pub dtype: u8,
    pub shape: &'t [u64],
    pub params: &'t [u8],
    /// `(name, element type code)` of each section, in the record's order.
    pub sections: Vec<(&'t str, u8)>,
}

/// Records a parse reserves room for before any has parsed.
const RESERVED_ENTRIES: usize = 1024;

/// One record of a parsed layout frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutEntry<'a> {
    /// A full record (tag 0).
    Full(EntryView<'a>),
    /// A compact record of template `template`: its own params' position, if it carried them, and
    /// the positions of its sections' payloads in the template's order.
    Compact {
        template: usize,
        params: Option<Range<usize>>,
        sections: Vec<Range<usize>>,
    },
}

/// A parsed layout frame, borrowing from the bytes it was parsed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutFrameView<'a> {
    pub header: FrameHeader,
    pub entries: Vec<LayoutEntry<'a>>,
}

impl<'a> LayoutFrameView<'a> {
    /// The frame as a [`FrameView`] when every record is a full one (what a reader without templates
    /// can read); a compact record is [`WireError::UnknownTemplate`].
    pub fn into_full(self) -> Result<FrameView<'a>> {
        let mut entries = Vec::with_capacity(self.entries.len());
        for (e, entry) in self.entries.into_iter().enumerate() {
            match entry {
                LayoutEntry::Full(v) => entries.push(v),
                LayoutEntry::Compact { template, .. } => {
                    return Err(WireError::UnknownTemplate {
                        entry: e,
                        index: template as u64,
                        count: 0,
                    })
                }
            }
        }
        Ok(FrameView {
            header: self.header,
            entries,
        })
    }
}

/// Most bytes of a LEB128 number of 64 bits.
const MAX_VARINT_LEN: usize = 10;

fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

fn put_varint(o: &mut Out<'_>, mut v: u64) -> Result<()> {
    let mut buf = [0u8; MAX_VARINT_LEN];
    let mut n = 0;
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            buf[n] = byte;
            n += 1;
            break;
        }
        buf[n] = byte | 0x80;
        n += 1;
    }
    o.put(&buf[..n])
}

/// A minimal LEB128 number of at most 64 bits.
fn read_varint(cur: &mut Cursor<'_>, entry: usize, field: &'static str) -> Result<u64> {
    let offset = cur.pos;
    let bad = || WireError::InvalidVarint {
        entry,
        field,
        offset,
    };
    let mut value = 0u64;
    for i in 0..MAX_VARINT_LEN {
        let byte = cur.u8(field)?;
        let low = u64::from(byte & 0x7f);
        if i == MAX_VARINT_LEN - 1 && low > 1 {
            return Err(bad()); // past 64 bits
        }
        value |= low << (7 * i);
        if byte & 0x80 == 0 {
            if i > 0 && byte == 0 {
                return Err(bad()); // not minimal: a trailing zero group
            }
            return Ok(value);
        }
    }
    Err(bad())
}

/// Parses and validates a layout frame (or, with flag bit 1 clear, rejects nothing a plain bundle
/// would not: every record is then read as a full record, without tags). The templates are the
/// reader's; a compact record naming any other is [`WireError::UnknownTemplate`].
pub fn parse_layout_frame<'a>(
    data: &'a [u8],
    limits: &Limits,
    templates: &[RecordTemplate<'_>],
) -> Result<LayoutFrameView<'a>> {
    let (header, entry_count) = parse_header(data, limits)?;
    if !crate::frame::is_layout(data) {
        let view = crate::frame::parse_frame(data, limits)?;
        let entries = view.entries.into_iter().map(LayoutEntry::Full).collect();
        return Ok(LayoutFrameView {
            header: view.header,
            entries,
        });
    }
    parse_layout_records(data, header, entry_count, limits, templates)
}

/// The records of a layout frame whose envelope [`parse_header`] checked.
pub(crate) fn parse_layout_records<'a>(
    data: &'a [u8],
    header: FrameHeader,
    entry_count: u32,
    limits: &Limits,
    templates: &[RecordTemplate<'_>],
) -> Result<LayoutFrameView<'a>> {
    if entry_count > limits.max_entries {
        return Err(WireError::TooManyEntries {
            count: entry_count,
            limit: limits.max_entries,
        });
    }
    for (i, t) in templates.iter().enumerate() {
        numel_of(i, t.shape, limits)?;
    }
    let body_end = data.len() - CRC_LEN;
    let mut cur = Cursor {
        buf: &data[..body_end],
        pos: HEADER_LEN,
    };
    // Never trust entry_count for the allocation. A compact record may take a single byte, so the
    // bytes bound the count only loosely (a parsed record is ~100 bytes of view): reserve a little and
    // grow with the records that actually parse.
    let cap = (entry_count as usize)
        .min(cur.remaining())
        .min(RESERVED_ENTRIES);
    let mut entries = Vec::with_capacity(cap);
    let mut names: HashSet<&str> = HashSet::new();
    for e in 0..entry_count as usize {
        let tag = read_varint(&mut cur, e, "tag")?;
        let entry = if tag == 0 {
            let v = parse_entry(&mut cur, e, true, limits)?;
            if !names.insert(v.name) {
                return Err(WireError::DuplicateName {
                    entry: e,
                    name: v.name.to_owned(),
                });
            }
            LayoutEntry::Full(v)
        } else {
            let index = (tag - 1) >> 1;
            let t = usize::try_from(index)
                .ok()
                .and_then(|i| templates.get(i))
                .ok_or(WireError::UnknownTemplate {
                    entry: e,
                    index,
                    count: templates.len(),
                })?;
            if !names.insert(t.name) {
                return Err(WireError::DuplicateName {
                    entry: e,
                    name: t.name.to_owned(),
                });
            }
            let params = if (tag - 1) & 1 == 1 {
                let len = read_varint(&mut cur, e, "params_len")?;
                if len > MAX_PARAMS_LEN as u64 {
                    return Err(WireError::ParamsTooLong { entry: e, len });
                }
                Some(cur.take(len, "params")?)
            } else {
                None
            };
            let mut sections = Vec::with_capacity(t.sections.len());
            for (s, &(_, elem)) in t.sections.iter().enumerate() {
                let byte_len = read_varint(&mut cur, e, "byte_len")?;
                let size = elem_size(elem).ok_or(WireError::UnknownElemType {
                    entry: e,
                    section: s,
                    code: elem,
                })?;
                if byte_len % u64::from(size) != 0 {
                    return Err(WireError::SectionLength {
                        entry: e,
                        section: s,
                        byte_len,
                        elem_size: size,
                    });
                }
                sections.push(cur.take(byte_len, "payload")?);
            }
            LayoutEntry::Compact {
                template: index as usize,
                params,
                sections,
            }
        };
        entries.push(entry);
    }
    if cur.remaining() != 0 {
        return Err(WireError::LeftoverBytes {
            count: cur.remaining(),
        });
    }
    Ok(LayoutFrameView { header, entries })
}

/// How the writer writes one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Full,
    Compact { template: usize, own_params: bool },
}

fn form_of(
    entry: &EntrySpec<'_>,
    by_name: &HashMap<&str, usize>,
    templates: &[RecordTemplate<'_>],
) -> Form {
    let Some(&i) = by_name.get(entry.name) else {
        return Form::Full;
    };
    let t = &templates[i];
    let same_sections = t.sections.len() == entry.sections.len()
        && t.sections
            .iter()
            .zip(&entry.sections)
            .all(|(&(tn, te), &(n, e, _))| tn == n && te == e);
    if t.codec != entry.codec || t.dtype != entry.dtype || t.shape != entry.shape || !same_sections
    {
        return Form::Full;
    }
    Form::Compact {
        template: i,
        own_params: t.params != entry.params,
    }
}

fn full_record_len(entry: &EntrySpec<'_>) -> u64 {
    let fixed = 2 + 2 + 1 + 1 + 4 + 1;
    let mut n = (fixed + entry.name.len() + 8 * entry.shape.len() + entry.params.len()) as u64;
    for &(name, _, payload) in &entry.sections {
        n += 1 + name.len() as u64 + 1 + 8 + payload.len() as u64;
    }
    n
}

/// The forms of the records and the frame's length; every rule a reader applies is checked.
fn plan(
    header: &FrameHeader,
    entries: &[EntrySpec<'_>],
    templates: &[RecordTemplate<'_>],
    limits: &Limits,
) -> Result<(Vec<Form>, usize)> {
    // Every record must be one a plain bundle could hold (the layout form only drops headers); the
    // frame limit applies to the layout frame's own length, below.
    let unlimited = Limits {
        max_frame_bytes: u64::MAX,
        ..*limits
    };
    validate(
        &FrameHeader {
            bundle: true,
            ..*header
        },
        entries,
        &unlimited,
    )?;
    let mut by_name = HashMap::with_capacity(templates.len());
    for (i, t) in templates.iter().enumerate() {
        by_name.entry(t.name).or_insert(i);
    }
    let mut total = MIN_FRAME_LEN as u64;
    let mut forms = Vec::with_capacity(entries.len());
    for entry in entries {
        let form = form_of(entry, &by_name, templates);
        let size = match form {
            Form::Full => 1 + full_record_len(entry),
            Form::Compact {
                template,
                own_params,
            } => {
                let tag = 1 + 2 * template as u64 + u64::from(own_params);
                let mut n = varint_len(tag) as u64;
                if own_params {
                    n += (varint_len(entry.params.len() as u64) + entry.params.len()) as u64;
                }
                for &(_, _, payload) in &entry.sections {
                    n += (varint_len(payload.len() as u64) + payload.len()) as u64;
                }
                n
            }
        };
        total = total
            .checked_add(size)
            .ok_or_else(|| too_large(u64::MAX, limits))?;
        forms.push(form);
    }
    if total > limits.max_frame_bytes {
        return Err(too_large(total, limits));
    }
    let len = usize::try_from(total).map_err(|_| too_large(total, limits))?;
    Ok((forms, len))
}

/// The exact length of the layout frame [`write_layout_frame_into`] writes.
pub fn layout_frame_len(
    header: &FrameHeader,
    entries: &[EntrySpec<'_>],
    templates: &[RecordTemplate<'_>],
    limits: &Limits,
) -> Result<usize> {
    plan(header, entries, templates, limits).map(|(_, len)| len)
}

/// Writes a layout frame (always a bundle) into `out`, exactly [`layout_frame_len`] bytes.
pub fn write_layout_frame_into(
    header: &FrameHeader,
    entries: &[EntrySpec<'_>],
    templates: &[RecordTemplate<'_>],
    limits: &Limits,
    out: &mut [u8],
) -> Result<()> {
    let (forms, len) = plan(header, entries, templates, limits)?;
    if out.len() != len {
        return Err(WireError::OutputSizeMismatch {
            needed: len,
            got: out.len(),
        });
    }
    let mut o = Out { buf: out, pos: 0 };
    emit_header(
        &mut o,
        header,
        FLAG_BUNDLE | FLAG_LAYOUT,
        len,
        entries.len(),
    )?;
    for (entry, form) in entries.iter().zip(forms) {
        match form {
            Form::Full => {
                put_varint(&mut o, 0)?;
                emit_entry(&mut o, entry)?;
            }
            Form::Compact {
                template,
                own_params,
            } => {
                put_varint(&mut o, 1 + 2 * template as u64 + u64::from(own_params))?;
                if own_params {
                    put_varint(&mut o, entry.params.len() as u64)?;
                    o.put(entry.params)?;
                }
                for &(_, _, payload) in &entry.sections {
                    put_varint(&mut o, payload.len() as u64)?;
                    o.put(payload)?;
                }
            }
        }
    }
    emit_crc(o, len)
}

/// Writes a layout frame into a new vector under `limits`.
pub fn write_layout_frame(
    header: &FrameHeader,
    entries: &[EntrySpec<'_>],
    templates: &[RecordTemplate<'_>],
    limits: &Limits,
) -> Result<Vec<u8>> {
    let len = layout_frame_len(header, entries, templates, limits)?;
    let mut out = vec![0u8; len];
    write_layout_frame_into(header, entries, templates, limits, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::crc32c;
    use crate::frame::{codes, write_frame};
    use proptest::prelude::*;

    const SHAPE: [u64; 2] = [4, 8];

    fn template(name: &str) -> RecordTemplate<'_> {
        RecordTemplate {
            name,
            codec: 1,
            dtype: codes::F32,
            shape: &SHAPE,
            params: b"pp",
            sections: vec![("idx", codes::U8), ("scale", codes::F32)],
        }
    }

    fn entry<'a>(name: &'a str, params: &'a [u8], idx: &'a [u8], scale: &'a [u8]) -> EntrySpec<'a> {
        EntrySpec {
            name,
            codec: 1,
            dtype: codes::F32,
            shape: &SHAPE,
            params,
            sections: vec![("idx", codes::U8, idx), ("scale", codes::F32, scale)],
        }
    }

    fn header() -> FrameHeader {
        FrameHeader::new(true, 7, 3)
    }

    /// Re-seals a frame whose bytes a test changed.
    fn reseal(f: &mut [u8]) {
        let end = f.len() - CRC_LEN;
        let crc = crc32c(&f[..end], 0);
        f[end..].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn compact_records_carry_only_their_payload_lengths_and_read_back() {
        let templates = [template("a"), template("b")];
        let scale = 1.5f32.to_le_bytes();
        let entries = [
            entry("b", b"pp", &[1, 2, 3], &scale),
            entry("a", b"qqq", &[9], &scale),
            entry("c", b"pp", &[], &scale),
        ];
        let limits = Limits::default();
        let f = write_layout_frame(&header(), &entries, &templates, &limits).unwrap();
        let plain = write_frame(&header(), &entries).unwrap();
        // b: tag + 2 lengths + 7 payload bytes; a: tag + params + 2 lengths + 5; c: tag + full record.
        assert_eq!(
            f.len(),
            36 + (1 + 2 + 7) + (1 + 4 + 2 + 5) + (1 + full_record_len(&entries[2]) as usize)
        );
        assert!(f.len() < plain.len());
        let v = parse_layout_frame(&f, &limits, &templates).unwrap();
        assert_eq!(
            (v.header.round, v.header.sender, v.header.bundle),
            (7, 3, true)
        );
        match &v.entries[0] {
            LayoutEntry::Compact {
                template,
                params,
                sections,
            } => {
                assert_eq!((*template, params.clone()), (1, None));
                assert_eq!(&f[sections[0].clone()], &[1, 2, 3]);
                assert_eq!(&f[sections[1].clone()], &scale);
            }
            other => panic!("expected a compact record, got {other:?}"),
        }
        match &v.entries[1] {
            LayoutEntry::Compact {
                template, params, ..
            } => {
                assert_eq!(*template, 0);
                assert_eq!(&f[params.clone().unwrap()], b"qqq");
            }
            other => panic!("expected a compact record, got {other:?}"),
        }
        assert!(matches!(&v.entries[2], LayoutEntry::Full(e) if e.name == "c"));
    }

    #[test]
    fn a_reader_without_the_templates_names_the_unknown_one() {
        let templates = [template("a")];
        let scale = 1.0f32.to_le_bytes();
        let f = write_layout_frame(
            &header(),
            &[entry("a", b"pp", &[1], &scale)],
            &templates,
            &Limits::default(),
        )
        .unwrap();
        assert_eq!(
            crate::frame::parse_frame(&f, &Limits::default()),
            Err(WireError::ReservedFlags { flags: 3 })
        );
        let err = parse_layout_frame(&f, &Limits::default(), &[])
            .and_then(LayoutFrameView::into_full)
            .unwrap_err();
        assert_eq!(
            err,
            WireError::UnknownTemplate {
                entry: 0,
                index: 0,
                count: 0
            }
        );
        assert_eq!(err.kind(), "unknown_template");
        assert!(err.is_frame_error());
    }

    #[test]
    fn full_records_only_read_without_templates() {
        let scale = 1.0f32.to_le_bytes();
        let entries = [entry("x", b"pp", &[1, 2], &scale)];
        let f = write_layout_frame(&header(), &entries, &[], &Limits::default()).unwrap();
        let v = parse_layout_frame(&f, &Limits::default(), &[])
            .and_then(LayoutFrameView::into_full)
            .unwrap();
        assert_eq!(v.entries[0].name, "x");
        assert_eq!(v.entries[0].sections.len(), 2);
    }

    #[test]
    fn hostile_tags_and_lengths_are_named_errors() {
        let templates = [template("a")];
        let scale = 1.0f32.to_le_bytes();
        let entries = [entry("a", b"pp", &[1, 2], &scale)];
        let limits = Limits::default();
        let good = write_layout_frame(&header(), &entries, &templates, &limits).unwrap();
        // The tag byte at 32 names template 5.
        let mut f = good.clone();
        f[32] = 11;
        reseal(&mut f);
        assert_eq!(
            parse_layout_frame(&f, &limits, &templates),
            Err(WireError::UnknownTemplate {
                entry: 0,
                index: 5,
                count: 1
            })
        );
        // A scale section of 3 bytes is not whole f32s (idx 2 bytes at 33..36, scale length at 36).
        let mut f = good.clone();
        f[36] = 3;
        reseal(&mut f);
        assert!(matches!(
            parse_layout_frame(&f, &limits, &templates),
            Err(WireError::SectionLength {
                entry: 0,
                section: 1,
                byte_len: 3,
                elem_size: 4
            })
        ));
        // A length past the frame's end.
        let mut f = good.clone();
        f[33] = 100;
        reseal(&mut f);
        assert!(matches!(
            parse_layout_frame(&f, &limits, &templates),
            Err(WireError::FieldOverrun {
                field: "payload",
                ..
            })
        ));
        // A non-minimal tag (0x81 0x00 for 1).
        let mut f = good[..32].to_vec();
        f.extend_from_slice(&[0x81, 0x00]);
        f.extend_from_slice(&good[33..]);
        let n = f.len() as u64;
        f[8..16].copy_from_slice(&n.to_le_bytes());
        reseal(&mut f);
        assert_eq!(
            parse_layout_frame(&f, &limits, &templates),
            Err(WireError::InvalidVarint {
                entry: 0,
                field: "tag",
                offset: 32
            })
        );
        // Bit 1 on a tensor frame is reserved.
        let mut f = good.clone();
        f[6] = 2;
        reseal(&mut f);
        assert_eq!(
            parse_layout_frame(&f, &limits, &templates),
            Err(WireError::ReservedFlags { flags: 2 })
        );
    }

    #[test]
    fn two_records_of_one_template_are_a_duplicate_name() {
        let templates = [template("a")];
        let scale = 1.0f32.to_le_bytes();
        let entries = [entry("a", b"pp", &[1], &scale)];
        let limits = Limits::default();
        let one = write_layout_frame(&header(), &entries, &templates, &limits).unwrap();
        let record = one[32..one.len() - 4].to_vec();
        let mut f = one[..32].to_vec();
        f.extend_from_slice(&record);
        f.extend_from_slice(&record);
        f.extend_from_slice(&[0; 4]);
        let n = f.len() as u64;
        f[8..16].copy_from_slice(&n.to_le_bytes());
        f[28..32].copy_from_slice(&2u32.to_le_bytes());
        reseal(&mut f);
        assert_eq!(
            parse_layout_frame(&f, &limits, &templates),
            Err(WireError::DuplicateName {
                entry: 1,
                name: "a".into()
            })
        );
    }

    #[test]
    fn the_frame_limit_applies_to_the_layout_frames_own_length() {
        let templates = [template("a")];
        let idx = vec![7u8; 200];
        let scale = 1.0f32.to_le_bytes();
        let entries = [entry("a", b"pp", &idx, &scale)];
        let len = layout_frame_len(&header(), &entries, &templates, &Limits::default()).unwrap();
        let tight = Limits {
            max_frame_bytes: len as u64,
            ..Limits::default()
        };
        assert!(write_frame(&header(), &entries).unwrap().len() > len);
        let f = write_layout_frame(&header(), &entries, &templates, &tight).unwrap();
        assert!(parse_layout_frame(&f, &tight, &templates).is_ok());
        let tighter = Limits {
            max_frame_bytes: len as u64 - 1,
            ..Limits::default()
        };
        assert!(matches!(
            parse_layout_frame(&f, &tighter, &templates),
            Err(WireError::FrameTooLarge { .. })
        ));
    }

    proptest! {
        #[test]
        fn prop_varints_round_trip_minimally(v in any::<u64>()) {
            let mut buf = [0u8; MAX_VARINT_LEN];
            let mut o = Out { buf: &mut buf, pos: 0 };
            put_varint(&mut o, v).unwrap();
            let n = o.pos;
            prop_assert_eq!(n, varint_len(v));
            let mut cur = Cursor { buf: &buf[..n], pos: 0 };
            prop_assert_eq!(read_varint(&mut cur, 0, "tag").unwrap(), v);
            prop_assert_eq!(cur.pos, n);
        }

        #[test]
        fn prop_any_bytes_after_a_layout_header_never_panic(body in proptest::collection::vec(any::<u8>(), 0..200), count in 0u32..6) {
            let mut f = vec![0u8; 32];
            f[0..4].copy_from_slice(b"GWIR");
            f[4..6].copy_from_slice(&1u16.to_le_bytes());
            f[6..8].copy_from_slice(&3u16.to_le_bytes());
            f[28..32].copy_from_slice(&count.to_le_bytes());
            f.extend_from_slice(&body);
            f.extend_from_slice(&[0; 4]);
            let n = f.len() as u64;
            f[8..16].copy_from_slice(&n.to_le_bytes());
            reseal(&mut f);
            let templates = [template("a"), template("b")];
            let _ = parse_layout_frame(&f, &Limits::default(), &templates);
        }
    }
}
