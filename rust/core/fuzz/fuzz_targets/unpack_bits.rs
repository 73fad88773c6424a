//! Lenient and strict unpacking, into a new vector or the caller's buffer, never panic and agree;
//! a strict decode re-packs to the same bytes.
#![no_main]

use gradwire_core::{
    pack_bits, unpack_bits, unpack_bits_exact, unpack_bits_exact_into, unpack_bits_into,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [b, c0, c1, data @ ..] = input else {
        return;
    };
    let bits = u32::from(*b % 34); // 0 and 33 exercise the width check
    let count = usize::from(u16::from_le_bytes([*c0, *c1]));
    let lenient = unpack_bits(data, bits, count);
    let mut into = vec![0u32; count];
    let lenient_into = unpack_bits_into(data, bits, &mut into);
    assert_eq!(lenient_into.is_ok(), lenient.is_ok());
    if let Ok(values) = &lenient {
        assert_eq!(&into, values);
    }
    let exact_into = unpack_bits_exact_into(data, bits, &mut into);
    assert_eq!(
        exact_into.is_ok(),
        unpack_bits_exact(data, bits, count).is_ok()
    );
    if let Ok(values) = unpack_bits_exact(data, bits, count) {
        assert_eq!(pack_bits(&values, bits).ok().as_deref(), Some(data));
        assert_eq!(lenient.ok(), Some(values));
    }
});
