//! zero_run_decode never panics nor over-allocates; re-encoding what it accepts preserves the
//! content (the input need not be the canonical encoding, so bytes may differ). Decoding into the
//! caller's buffer of the announced length (`zero_run_output_len`, then `zero_run_decode_into`: the
//! Python binding's path) accepts exactly what `zero_run_decode` accepts, with the same bytes.
#![no_main]

use gradwire_core::{
    zero_run_decode, zero_run_decode_into, zero_run_decoded_len, zero_run_encode,
    zero_run_output_len,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [mode, e0, e1, data @ ..] = input else {
        return;
    };
    let expected = match mode % 3 {
        0 => None,
        1 => Some(zero_run_decoded_len(data)),
        _ => Some(usize::from(u16::from_le_bytes([*e0, *e1]))),
    };
    let decoded = zero_run_decode(data, expected);
    let into = zero_run_output_len(data, expected).and_then(|n| {
        let mut buf = vec![0u8; n];
        zero_run_decode_into(data, &mut buf).map(|()| buf)
    });
    assert_eq!(into.as_ref().ok(), decoded.as_ref().ok());
    if let Ok(out) = decoded {
        assert!(out.len() <= 14 * data.len());
        if let Some(n) = expected {
            assert_eq!(out.len(), n);
        }
        let again = zero_run_encode(&out).ok();
        let back = again
            .as_deref()
            .and_then(|enc| zero_run_decode(enc, Some(out.len())).ok());
        assert_eq!(back, Some(out));
    }
});
