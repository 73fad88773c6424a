//! bitmap_decode never panics nor over-allocates; what it accepts re-encodes to the same bytes.
#![no_main]

use gradwire_core::{bitmap_decode, bitmap_encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [c0, s0, u0, u1, data @ ..] = input else {
        return;
    };
    let set_len = usize::from(*s0).max(1);
    let count = usize::from(*c0) / set_len * set_len;
    let universe = u64::from(u16::from_le_bytes([*u0, *u1])) + 1;
    if let Ok(idx) = bitmap_decode(data, count, set_len, universe) {
        assert_eq!(idx.len(), count);
        assert_eq!(
            bitmap_encode(&idx, set_len, universe).ok().as_deref(),
            Some(data)
        );
    }
});
