//! A body of concatenated frames (a published version, a catch-up) walked as the readers walk it:
//! `frame_len_at_start` never panics and never claims more bytes than remain or fewer than the
//! shortest frame, and each frame it delimits is parsed by `parse_frame` over exactly those bytes;
//! a frame that parses is rewritten byte for byte by `write_frame` and delimits itself.
//!
//! Arbitrary bytes almost never pass the CRC, so when the first byte is odd each delimited frame gets
//! its CRC fixed up before it is parsed, and the fuzzer reaches the records of every frame.
#![no_main]

use gradwire_core::frame::MIN_FRAME_LEN;
use gradwire_core::{crc32c, frame_len_at_start, parse_frame, write_frame, EntrySpec, Limits};
use libfuzzer_sys::fuzz_target;

fn check(frame: &[u8]) {
    let Ok(view) = parse_frame(frame, &Limits::default()) else {
        return;
    };
    assert_eq!(frame_len_at_start(frame).ok(), Some(frame.len()));
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
    let Some((mode, mut rest)) = input.split_first() else {
        return;
    };
    let fix_crc = mode % 2 == 1;
    while !rest.is_empty() {
        let Ok(n) = frame_len_at_start(rest) else {
            return;
        };
        assert!(
            (MIN_FRAME_LEN..=rest.len()).contains(&n),
            "delimited {n} of {} bytes",
            rest.len()
        );
        let (frame, tail) = rest.split_at(n);
        if fix_crc {
            let mut fixed = frame.to_vec();
            let crc = crc32c(&fixed[..n - 4], 0);
            fixed[n - 4..].copy_from_slice(&crc.to_le_bytes());
            check(&fixed);
        } else {
            check(frame);
        }
        rest = tail;
    }
});
