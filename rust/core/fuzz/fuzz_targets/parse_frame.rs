//! parse_frame never panics; a frame it accepts is rewritten byte for byte by write_frame.
//!
//! Arbitrary bytes almost never pass the CRC, so half the inputs get a valid envelope
//! (magic, version, total_len, CRC fixed up) around fuzzed records.
#![no_main]

use gradwire_core::{parse_frame, write_frame, EntrySpec, Limits};
use libfuzzer_sys::fuzz_target;

#[path = "envelope.rs"]
mod envelope;
use envelope::with_envelope;

fn check(frame: &[u8]) {
    let Ok(view) = parse_frame(frame, &Limits::default()) else {
        return;
    };
    let specs: Vec<EntrySpec> = view
        .entries
        .iter()
        .map(|e| {
            e.spec(frame)
                .expect("a parsed record lies within its frame")
        })
        .collect();
    assert_eq!(
        write_frame(&view.header, &specs).ok().as_deref(),
        Some(frame)
    );
}

fuzz_target!(|input: &[u8]| {
    match input.split_first() {
        Some((m, rest)) if m % 2 == 1 => check(&with_envelope(rest, |flags| flags & 1)),
        Some((_, rest)) => check(rest),
        None => {}
    }
});
