//! parse_layout_frame (FORMAT.md section 12), given a fixed list of three templates, never panics; what
//! it accepts is what the bytes hold, and write_layout_frame writes it back:
//!
//! * the records are exactly `entry_count`, and walking the bytes by the format's rules (a LEB128 tag,
//!   then a full record of section 3 or a compact record's params and section lengths) puts every
//!   params and payload range where the parser put it and ends at the CRC: no record is claimed that
//!   the bytes do not hold;
//! * `into_full` is the frame itself when every record is full, and otherwise `unknown_template` for
//!   the first compact record, which is also what a reader holding no templates answers for the frame;
//!   a frame of full records only reads the same without templates;
//! * `write_layout_frame` (and `layout_frame_len`, `write_layout_frame_into`) rewrite the records from
//!   the parsed views and the same templates byte for byte when the frame is in the writer's form.
//!   The writer writes a record compact exactly when it matches a template (name, codec, dtype, shape,
//!   sections' names and elements), with its own params only where they differ from the template's;
//!   a frame with a full record that matches a template, or a compact one carrying its template's
//!   params, is rewritten shorter, and then the rewrite reads back to the same records and rewrites
//!   to itself;
//! * the records also go into a plain bundle (`write_frame`) that `parse_frame` reads back to them.
//!
//! A frame with flag bit 1 clear is read as a plain frame: then it must equal `parse_frame`'s reading
//! and `write_frame` rewrites it byte for byte.
//!
//! The first byte of the input picks the mode. Even: the rest is the frame. Arbitrary bytes almost never
//! pass the CRC, so an odd first byte gives the rest a valid envelope (magic, version, total_len, CRC
//! fixed up) around fuzzed records, with the flags of a layout bundle (bits 0 and 1), or, for a first
//! byte of 7 mod 8, the input's own flag bits 0 and 1 (a plain bundle, a tensor frame, bit 1 alone).
#![no_main]

use std::collections::HashSet;
use std::ops::Range;
use std::sync::OnceLock;

use gradwire_core::frame::{codes, is_layout, CRC_LEN, HEADER_LEN};
use gradwire_core::{
    elem_size, layout_frame_len, parse_frame, parse_layout_frame, write_frame, write_layout_frame,
    write_layout_frame_into, EntrySpec, EntryView, LayoutEntry, LayoutFrameView, Limits,
    RecordTemplate, WireError,
};
use libfuzzer_sys::fuzz_target;

#[path = "envelope.rs"]
mod envelope;
use envelope::with_envelope;

/// A DCT record's params (mode 0, 64×64 chunks, k = 32, 12 index bits, 8 value bits, packed indices)
/// of a 24×20 tensor (pad 3616) and of a 37-element one (pad 4059), as gradwire's DCT codec writes them.
const WEIGHT_PARAMS: [u8; 25] = [
    0x00, 0x02, 0x40, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x00, 0x20, 0x00, 0x00, 0x00, 0x0c, 0x08,
    0x00, 0x20, 0x0e, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
];
const BIAS_PARAMS: [u8; 25] = [
    0x00, 0x02, 0x40, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x00, 0x20, 0x00, 0x00, 0x00, 0x0c, 0x08,
    0x00, 0xdb, 0x0f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
];
const DCT_SECTIONS: [(&str, u8); 4] = [
    ("idx", codes::U8),
    ("val", codes::I8),
    ("scale", codes::F32),
    ("min", codes::F32),
];

/// The reader's layout (make_corpus.py seeds frames of the same templates): two DCT records, one 2-D,
/// and an identity record of bf16 values without params.
fn templates() -> &'static [RecordTemplate<'static>] {
    static TEMPLATES: OnceLock<Vec<RecordTemplate<'static>>> = OnceLock::new();
    TEMPLATES.get_or_init(|| {
        vec![
            RecordTemplate {
                name: "layers.0.weight",
                codec: 1,
                dtype: codes::F32,
                shape: &[24, 20],
                params: &WEIGHT_PARAMS,
                sections: DCT_SECTIONS.to_vec(),
            },
            RecordTemplate {
                name: "layers.0.bias",
                codec: 1,
                dtype: codes::F32,
                shape: &[37],
                params: &BIAS_PARAMS,
                sections: DCT_SECTIONS.to_vec(),
            },
            RecordTemplate {
                name: "embed",
                codec: 0,
                dtype: codes::BF16,
                shape: &[8, 4],
                params: &[],
                sections: vec![("data", codes::BF16)],
            },
        ]
    })
}

fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

/// A full record's bytes before its params and, per section, before its payload (section 3).
fn check_full_positions(e: &EntryView<'_>, mut pos: usize) -> usize {
    pos += 2 + e.name.len() + 2 + 1 + 1 + 8 * e.shape.len() + 4;
    assert_eq!(e.params.start, pos, "params of {:?}", e.name);
    pos = e.params.end + 1;
    for s in &e.sections {
        pos += 1 + s.name.len() + 1 + 8;
        assert_eq!(s.range.start, pos, "section {:?} of {:?}", s.name, e.name);
        pos = s.range.end;
    }
    pos
}

/// Walks the frame by the format's rules from the parsed records' lengths: every range must be where
/// the bytes put it, and the last record must end at the CRC.
fn check_positions(frame: &[u8], view: &LayoutFrameView<'_>, layout: bool) {
    let count = u32::from_le_bytes(frame[28..32].try_into().unwrap());
    assert_eq!(view.entries.len(), count as usize);
    let body_end = frame.len() - CRC_LEN;
    let mut pos = HEADER_LEN;
    for entry in &view.entries {
        match entry {
            LayoutEntry::Full(e) => {
                assert!(
                    !layout || frame.get(pos) == Some(&0),
                    "a full record's tag is 0"
                );
                pos = check_full_positions(e, pos + usize::from(layout));
            }
            LayoutEntry::Compact {
                template,
                params,
                sections,
            } => {
                assert!(layout, "a compact record in a plain frame");
                let t = &templates()[*template];
                let tag = 1 + 2 * *template as u64 + u64::from(params.is_some());
                pos += varint_len(tag);
                if let Some(p) = params {
                    pos += varint_len(p.len() as u64);
                    assert_eq!(p.start, pos, "own params of {:?}", t.name);
                    assert!(p.len() <= 4096);
                    pos = p.end;
                }
                assert_eq!(sections.len(), t.sections.len());
                for (r, &(name, elem)) in sections.iter().zip(&t.sections) {
                    pos += varint_len(r.len() as u64);
                    assert_eq!(r.start, pos, "section {name:?} of {:?}", t.name);
                    assert!(r.start <= r.end);
                    assert_eq!(r.len() % usize::from(elem_size(elem).unwrap()), 0);
                    pos = r.end;
                }
            }
        }
        assert!(pos <= body_end, "a record past the CRC");
    }
    assert_eq!(
        pos, body_end,
        "bytes left between the last record and the CRC"
    );
}

/// The record a parsed entry stands for, its borrowed bytes from the frame or its template.
fn spec_of<'a>(frame: &'a [u8], entry: &'a LayoutEntry<'a>) -> EntrySpec<'a> {
    let bytes = |r: &Range<usize>| &frame[r.clone()];
    match entry {
        LayoutEntry::Full(e) => e
            .spec(frame)
            .expect("a parsed record lies within its frame"),
        LayoutEntry::Compact {
            template,
            params,
            sections,
        } => {
            let t = &templates()[*template];
            EntrySpec {
                name: t.name,
                codec: t.codec,
                dtype: t.dtype,
                shape: t.shape,
                params: params.as_ref().map_or(t.params, bytes),
                sections: t
                    .sections
                    .iter()
                    .zip(sections)
                    .map(|(&(name, elem), r)| (name, elem, bytes(r)))
                    .collect(),
            }
        }
    }
}

/// Whether a record matches a template by FORMAT.md section 12's rule (name, codec, dtype, shape and
/// sections' names and elements; not params).
fn matches_template(spec: &EntrySpec<'_>) -> bool {
    templates().iter().any(|t| {
        t.name == spec.name
            && t.codec == spec.codec
            && t.dtype == spec.dtype
            && t.shape == spec.shape
            && t.sections.len() == spec.sections.len()
            && t.sections
                .iter()
                .zip(&spec.sections)
                .all(|(&(n, e), &(sn, se, _))| n == sn && e == se)
    })
}

/// Whether the writer writes this record exactly as the frame holds it.
fn in_writer_form(frame: &[u8], entry: &LayoutEntry<'_>, spec: &EntrySpec<'_>) -> bool {
    match entry {
        LayoutEntry::Full(_) => !matches_template(spec),
        LayoutEntry::Compact {
            template, params, ..
        } => !matches!(params, Some(p) if &frame[p.clone()] == templates()[*template].params),
    }
}

fn check_into_full(frame: &[u8], view: &LayoutFrameView<'_>, limits: &Limits) {
    let bare = parse_layout_frame(frame, limits, &[]);
    let full = view.clone().into_full();
    match view.entries.iter().enumerate().find_map(|(e, x)| match x {
        LayoutEntry::Compact { template, .. } => Some((e, *template)),
        LayoutEntry::Full(_) => None,
    }) {
        None => {
            let full = full.expect("into_full of full records only");
            assert_eq!(full.header, view.header);
            let expected: Vec<&EntryView> = view
                .entries
                .iter()
                .map(|x| match x {
                    LayoutEntry::Full(e) => e,
                    LayoutEntry::Compact { .. } => unreachable!(),
                })
                .collect();
            assert_eq!(full.entries.iter().collect::<Vec<_>>(), expected);
            assert_eq!(
                bare.as_ref(),
                Ok(view),
                "full records read without templates"
            );
        }
        Some((entry, template)) => {
            let err = WireError::UnknownTemplate {
                entry,
                index: template as u64,
                count: 0,
            };
            assert_eq!(full, Err(err.clone()));
            assert_eq!(bare, Err(err), "a reader without templates");
        }
    }
}

fn check(frame: &[u8]) {
    let limits = Limits::default();
    let Ok(view) = parse_layout_frame(frame, &limits, templates()) else {
        // What the templates' reader refuses, one without templates refuses too.
        assert!(parse_layout_frame(frame, &limits, &[]).is_err());
        return;
    };
    let layout = is_layout(frame);
    check_positions(frame, &view, layout);
    check_into_full(frame, &view, &limits);
    let specs: Vec<EntrySpec> = view.entries.iter().map(|e| spec_of(frame, e)).collect();
    let names: HashSet<&str> = specs.iter().map(|s| s.name).collect();
    assert!(
        !view.header.bundle || names.len() == specs.len(),
        "names unique"
    );

    if !layout {
        let plain = parse_frame(frame, &limits).expect("a plain frame parse_layout_frame accepted");
        assert_eq!(view.clone().into_full().as_ref(), Ok(&plain));
        assert_eq!(
            write_frame(&view.header, &specs).ok().as_deref(),
            Some(frame)
        );
        if !view.header.bundle {
            return;
        }
    }

    // Into a layout frame with the same templates.
    let header = view.header;
    let rewritten = write_layout_frame(&header, &specs, templates(), &limits)
        .expect("a record the reader accepted is one the writer writes");
    assert_eq!(
        layout_frame_len(&header, &specs, templates(), &limits),
        Ok(rewritten.len())
    );
    let mut into = vec![0xa5; rewritten.len()];
    write_layout_frame_into(&header, &specs, templates(), &limits, &mut into).unwrap();
    assert_eq!(into, rewritten);
    let writer_form = layout
        && view
            .entries
            .iter()
            .zip(&specs)
            .all(|(e, s)| in_writer_form(frame, e, s));
    if writer_form {
        assert_eq!(rewritten.as_slice(), frame, "rewritten byte for byte");
    } else {
        if layout {
            assert!(
                rewritten.len() < frame.len(),
                "the writer's form is shorter"
            );
        }
        let again = parse_layout_frame(&rewritten, &limits, templates())
            .expect("the writer's frame reads back");
        assert_eq!(again.header, header);
        let again_specs: Vec<EntrySpec> = again
            .entries
            .iter()
            .map(|e| spec_of(&rewritten, e))
            .collect();
        assert_eq!(again_specs, specs, "the rewrite holds the same records");
        assert!(again
            .entries
            .iter()
            .zip(&again_specs)
            .all(|(e, s)| in_writer_form(&rewritten, e, s)));
        assert_eq!(
            write_layout_frame(&header, &again_specs, templates(), &limits).as_ref(),
            Ok(&rewritten),
            "the writer's frame rewrites to itself"
        );
    }

    // And into a plain bundle: the layout form only drops headers.
    if layout {
        let plain = write_frame(&header, &specs).expect("the records as a plain bundle");
        let back = parse_frame(&plain, &limits).expect("the plain bundle reads back");
        let back_specs: Vec<EntrySpec> = back
            .entries
            .iter()
            .map(|e| {
                e.spec(&plain)
                    .expect("a parsed record lies within its frame")
            })
            .collect();
        assert_eq!(back_specs, specs);
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((mode, rest)) = input.split_first() else {
        return;
    };
    if mode % 2 == 1 {
        let keep = mode % 8 == 7;
        check(&with_envelope(
            rest,
            |flags| if keep { flags & 3 } else { 3 },
        ));
    } else {
        check(rest);
    }
});
