//! Parsing a serialized codebook and decoding a stream with it never panic nor over-allocate; a
//! book that parses serializes to the same bytes, and an accepted stream re-encodes to itself.
#![no_main]

use gradwire_core::HuffmanBook;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [b, c0, c1, rest @ ..] = input else {
        return;
    };
    let (book, data) = rest.split_at(usize::from(*b).min(rest.len()));
    let count = usize::from(u16::from_le_bytes([*c0, *c1]));
    let Ok(parsed) = HuffmanBook::from_bytes(book) else {
        return;
    };
    assert_eq!(parsed.to_bytes(), book);
    if let Ok(symbols) = parsed.decode(data, count) {
        assert_eq!(symbols.len(), count);
        assert_eq!(parsed.encode(&symbols).ok().as_deref(), Some(data));
    }
});
