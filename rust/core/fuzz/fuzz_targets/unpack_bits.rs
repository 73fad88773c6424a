//! Lenient and strict unpacking never panic; a strict decode re-packs to the same bytes.
#![no_main]

use gradwire_core::{pack_bits, unpack_bits, unpack_bits_exact};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [b, c0, c1, data @ ..] = input else { return };
    let bits = u32::from(*b % 34); // 0 and 33 exercise the width check
    let count = usize::from(u16::from_le_bytes([*c0, *c1]));
    let lenient = unpack_bits(data, bits, count);
    if let Ok(values) = unpack_bits_exact(data, bits, count) {
        assert_eq!(pack_bits(&values, bits).ok().as_deref(), Some(data));
        assert_eq!(lenient.ok(), Some(values));
    }
});
