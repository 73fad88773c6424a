//! rice_decode (into a new vector or the caller's buffer) never panics nor over-allocates, both
//! agree, and what it accepts re-encodes to the same bytes.
#![no_main]

use gradwire_core::{rice_decode, rice_decode_into, rice_encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [p, c0, c1, s0, u0, u1, u2, data @ ..] = input else {
        return;
    };
    let param = u32::from(*p % 34); // 32 and 33 exercise the parameter check
    let count = usize::from(u16::from_le_bytes([*c0, *c1]));
    let set_len = usize::from(*s0).max(1);
    let count = count - count % set_len;
    let universe = u64::from(u32::from_le_bytes([*u0, *u1, *u2, 0])) + 1;
    let decoded = rice_decode(data, count, set_len, universe, param);
    let mut into = vec![0u32; count];
    let into_ok = rice_decode_into(data, set_len, universe, param, &mut into).is_ok();
    assert_eq!(into_ok, decoded.is_ok());
    if let Ok(idx) = decoded {
        assert_eq!(into, idx);
        assert_eq!(idx.len(), count);
        assert!(idx.iter().all(|&v| u64::from(v) < universe));
        assert_eq!(
            rice_encode(&idx, set_len, universe, param).ok().as_deref(),
            Some(data)
        );
    }
});
