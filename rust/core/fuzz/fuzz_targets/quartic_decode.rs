//! quartic_decode never panics; whatever it accepts re-encodes to the same bytes.
#![no_main]

use gradwire_core::{quartic_decode, quartic_encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [c0, c1, data @ ..] = input else { return };
    // Mostly a count consistent with the length, sometimes an arbitrary one.
    let raw = usize::from(u16::from_le_bytes([*c0, *c1]));
    let count = if raw % 2 == 0 { (data.len() * 5).saturating_sub(raw % 5) } else { raw };
    if let Ok(trits) = quartic_decode(data, count) {
        assert_eq!(trits.len(), count);
        assert_eq!(quartic_encode(&trits).ok().as_deref(), Some(data));
    }
});
