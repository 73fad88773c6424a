//! quartic_decode (into a new vector or the caller's buffer) never panics, both agree, and whatever
//! it accepts re-encodes to the same bytes.
#![no_main]

use gradwire_core::{quartic_decode, quartic_decode_into, quartic_encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [c0, c1, data @ ..] = input else { return };
    // Mostly a count consistent with the length, sometimes an arbitrary one.
    let raw = usize::from(u16::from_le_bytes([*c0, *c1]));
    let count = if raw % 2 == 0 {
        (data.len() * 5).saturating_sub(raw % 5)
    } else {
        raw
    };
    let decoded = quartic_decode(data, count);
    let mut into = vec![0i8; count];
    assert_eq!(
        quartic_decode_into(data, &mut into).is_ok(),
        decoded.is_ok()
    );
    if let Ok(trits) = decoded {
        assert_eq!(into, trits);
        assert_eq!(trits.len(), count);
        assert_eq!(quartic_encode(&trits).ok().as_deref(), Some(data));
    }
});
