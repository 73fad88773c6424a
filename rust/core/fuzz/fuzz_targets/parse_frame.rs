//! parse_frame never panics; a frame it accepts is rewritten byte for byte by write_frame.
//!
//! Arbitrary bytes almost never pass the CRC, so half the inputs get a valid envelope
//! (magic, version, total_len, CRC fixed up) around fuzzed records.
#![no_main]

use gradwire_core::{crc32c, parse_frame, write_frame, EntrySpec, Limits};
use libfuzzer_sys::fuzz_target;

fn with_envelope(input: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(input.len() + 36);
    f.extend_from_slice(b"GWIR");
    f.extend_from_slice(&1u16.to_le_bytes());
    let (head, records) = input.split_at(input.len().min(26));
    f.extend_from_slice(head); // flags, total_len (overwritten), round, sender, entry_count
    f.resize(32, 0);
    f[6] &= 1; // keep the reserved flag bits clear
    f[7] = 0;
    f.extend_from_slice(records);
    f.extend_from_slice(&[0; 4]);
    let n = f.len();
    f[8..16].copy_from_slice(&(n as u64).to_le_bytes());
    let crc = crc32c(&f[..n - 4], 0);
    f[n - 4..].copy_from_slice(&crc.to_le_bytes());
    f
}

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
        Some((m, rest)) if m % 2 == 1 => check(&with_envelope(rest)),
        Some((_, rest)) => check(rest),
        None => {}
    }
});
