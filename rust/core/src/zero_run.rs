//! 3LC zero-run encoding of quartic bytes.
//!
//! Quartic bytes are at most 242, and an all-zero group of five trits is the byte 121. A maximal
//! run of `r` bytes equal to 121 becomes `r / 14` bytes of 255, then, with `rem = r % 14`, one
//! byte `243 + rem − 2` if `rem ≥ 2`, the byte 121 if `rem = 1` and nothing if `rem = 0`. Every
//! other byte is copied. Decoding expands each byte `b > 242` into `b − 241` bytes of 121 and
//! copies every other byte.
//!
//! Runs of exactly 14, 28, 42 … bytes encode as 255 bytes alone (no trailing code byte).

use crate::error::{Result, WireError};
use crate::quartic::QUARTIC_MAX;

/// The quartic byte of five zero trits.
pub const ZERO_BYTE: u8 = 121;
/// The longest run one code byte (255) stands for.
pub const MAX_RUN: usize = 14;

const RUN_OF_ZERO_BYTES: [u8; MAX_RUN] = [ZERO_BYTE; MAX_RUN];

/// Block size of the vectorisable scans.
const BLOCK: usize = 32;

/// Zero-run encodes quartic bytes. A byte above 242 is an error (it would be read back as a run).
pub fn zero_run_encode(data: &[u8]) -> Result<Vec<u8>> {
    if let Some(index) = first_above(data, QUARTIC_MAX) {
        return Err(WireError::ZeroRunInputByte { index, value: data[index] });
    }
    // Encoding never grows the input (a run of r ≥ 1 bytes becomes at most r bytes).
    let mut out = Vec::with_capacity(data.len());
    let mut rest = data;
    while !rest.is_empty() {
        match memchr::memchr(ZERO_BYTE, rest) {
            None => {
                out.extend_from_slice(rest);
                break;
            }
            Some(start) => {
                out.extend_from_slice(&rest[..start]);
                let tail = &rest[start..];
                let run = run_length(tail);
                emit_run(&mut out, run);
                rest = &tail[run..];
            }
        }
    }
    Ok(out)
}

fn emit_run(out: &mut Vec<u8>, run: usize) {
    let full = run / MAX_RUN;
    out.resize(out.len() + full, 255);
    match run % MAX_RUN {
        0 => {}
        1 => out.push(ZERO_BYTE),
        // 2..=13 -> 243..=254; the cast cannot truncate.
        rem => out.push(243 + (rem - 2) as u8),
    }
}

/// Length of the run of 121 bytes at the start of `s`.
fn run_length(s: &[u8]) -> usize {
    let mut n = 0;
    for block in s.chunks(BLOCK) {
        if block.iter().fold(true, |all, &b| all & (b == ZERO_BYTE)) {
            n += block.len();
        } else {
            return n + block.iter().position(|&b| b != ZERO_BYTE).unwrap_or(block.len());
        }
    }
    n
}

/// Index of the first byte of `s` above `limit`, if any.
fn first_above(s: &[u8], limit: u8) -> Option<usize> {
    let mut off = 0;
    for block in s.chunks(BLOCK * 16) {
        if block.iter().fold(0u8, |m, &b| m.max(b)) > limit {
            return block.iter().position(|&b| b > limit).map(|p| off + p);
        }
        off += block.len();
    }
    None
}

/// The number of bytes `data` decodes to (each byte > 242 counts `b − 241`, others 1).
pub fn zero_run_decoded_len(data: &[u8]) -> usize {
    let extra: usize = data
        .chunks(4096)
        // ≤ 13 per byte, ≤ 53 248 per block: no u32 overflow.
        .map(|c| c.iter().map(|&b| u32::from(b.saturating_sub(QUARTIC_MAX))).sum::<u32>() as usize)
        .sum();
    data.len() + extra
}

/// The decoded length of `data`, checked against `expected_len` when given (the size to
/// allocate for [`zero_run_decode_into`]).
pub fn zero_run_output_len(data: &[u8], expected_len: Option<usize>) -> Result<usize> {
    let decoded = zero_run_decoded_len(data);
    check_expected(decoded, expected_len)?;
    Ok(decoded)
}

/// Decodes zero-run bytes. With `expected_len`, a decoded length other than it is an error,
/// detected before any output is allocated; without it the output is at most 14× the input.
pub fn zero_run_decode(data: &[u8], expected_len: Option<usize>) -> Result<Vec<u8>> {
    let decoded = zero_run_output_len(data, expected_len)?;
    let mut out = Vec::with_capacity(decoded);
    let mut rest = data;
    while !rest.is_empty() {
        let span = first_above(rest, QUARTIC_MAX).unwrap_or(rest.len());
        out.extend_from_slice(&rest[..span]);
        rest = &rest[span..];
        if let Some((&code, tail)) = rest.split_first() {
            out.extend_from_slice(&RUN_OF_ZERO_BYTES[..(code - 241) as usize]);
            rest = tail;
        }
    }
    Ok(out)
}

/// Decodes into `out`, whose length must be exactly the decoded length.
pub fn zero_run_decode_into(data: &[u8], out: &mut [u8]) -> Result<()> {
    check_expected(zero_run_decoded_len(data), Some(out.len()))?;
    let mut rest = data;
    let mut pos = 0usize;
    while !rest.is_empty() {
        let span = first_above(rest, QUARTIC_MAX).unwrap_or(rest.len());
        out[pos..pos + span].copy_from_slice(&rest[..span]);
        pos += span;
        rest = &rest[span..];
        if let Some((&code, tail)) = rest.split_first() {
            let run = (code - 241) as usize;
            out[pos..pos + run].fill(ZERO_BYTE);
            pos += run;
            rest = tail;
        }
    }
    Ok(())
}

fn check_expected(decoded: usize, expected_len: Option<usize>) -> Result<()> {
    match expected_len {
        Some(expected) if decoded > expected => Err(WireError::ZeroRunTooLong { expected, decoded }),
        Some(expected) if decoded < expected => Err(WireError::ZeroRunTooShort { expected, decoded }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(n: usize) -> Vec<u8> {
        vec![ZERO_BYTE; n]
    }

    #[test]
    fn run_codes() {
        assert_eq!(zero_run_encode(&run(1)).unwrap(), vec![121]);
        assert_eq!(zero_run_encode(&run(2)).unwrap(), vec![243]);
        assert_eq!(zero_run_encode(&run(13)).unwrap(), vec![254]);
        assert_eq!(zero_run_encode(&run(15)).unwrap(), vec![255, 121]);
        assert_eq!(zero_run_encode(&run(16)).unwrap(), vec![255, 243]);
        assert_eq!(zero_run_encode(&[5, 121, 121, 121, 7, 121]).unwrap(), vec![5, 244, 7, 121]);
        assert_eq!(zero_run_encode(&[]).unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn multiples_of_fourteen_round_trip() {
        for k in 1..=3 {
            let data = run(14 * k);
            let enc = zero_run_encode(&data).unwrap();
            assert_eq!(enc, vec![255; k], "no stray byte after a run of {}", 14 * k);
            assert_eq!(zero_run_decode(&enc, Some(14 * k)).unwrap(), data);
            assert_eq!(zero_run_decode(&enc, None).unwrap(), data);
            let mut framed = vec![3];
            framed.extend_from_slice(&data);
            framed.push(4);
            let enc = zero_run_encode(&framed).unwrap();
            assert_eq!(zero_run_decode(&enc, Some(framed.len())).unwrap(), framed);
        }
    }

    #[test]
    fn rejects_bytes_above_242() {
        assert_eq!(zero_run_encode(&[1, 2, 243]), Err(WireError::ZeroRunInputByte { index: 2, value: 243 }));
        let mut v = vec![121u8; 5000];
        v[4321] = 255;
        assert_eq!(zero_run_encode(&v), Err(WireError::ZeroRunInputByte { index: 4321, value: 255 }));
    }

    #[test]
    fn expected_len() {
        let enc = [7, 255, 243];
        assert_eq!(zero_run_decoded_len(&enc), 17);
        assert_eq!(zero_run_decode(&enc, Some(17)).unwrap().len(), 17);
        assert_eq!(zero_run_decode(&enc, Some(16)), Err(WireError::ZeroRunTooLong { expected: 16, decoded: 17 }));
        assert_eq!(zero_run_decode(&enc, Some(18)), Err(WireError::ZeroRunTooShort { expected: 18, decoded: 17 }));
        assert_eq!(zero_run_output_len(&enc, None), Ok(17));
        assert_eq!(zero_run_output_len(&enc, Some(16)), Err(WireError::ZeroRunTooLong { expected: 16, decoded: 17 }));
        let mut out = vec![0u8; 17];
        zero_run_decode_into(&enc, &mut out).unwrap();
        let mut expect = vec![7];
        expect.extend(run(16));
        assert_eq!(out, expect);
        let mut short = vec![0u8; 3];
        assert!(zero_run_decode_into(&enc, &mut short).is_err());
    }

    fn quartic_bytes() -> impl Strategy<Value = Vec<u8>> {
        // Mostly zero-groups, as after 3LC quantisation, with runs of every length.
        proptest::collection::vec(
            prop_oneof![4 => Just(vec![ZERO_BYTE]), 1 => (0u8..=242).prop_map(|b| vec![b]),
                        1 => (0usize..60).prop_map(|n| vec![ZERO_BYTE; n])],
            0..80,
        )
        .prop_map(|parts| parts.concat())
    }

    proptest! {
        #[test]
        fn prop_round_trip(data in quartic_bytes()) {
            let enc = zero_run_encode(&data).unwrap();
            prop_assert!(enc.len() <= data.len());
            prop_assert_eq!(zero_run_decoded_len(&enc), data.len());
            prop_assert_eq!(zero_run_decode(&enc, None).unwrap(), data.clone());
            prop_assert_eq!(zero_run_decode(&enc, Some(data.len())).unwrap(), data.clone());
            let mut out = vec![0u8; data.len()];
            zero_run_decode_into(&enc, &mut out).unwrap();
            prop_assert_eq!(out, data);
        }

        #[test]
        fn prop_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..300),
                                            expected in proptest::option::of(0usize..2000)) {
            if let Ok(dec) = zero_run_decode(&data, expected) {
                prop_assert!(dec.len() <= 14 * data.len());
                prop_assert!(dec.iter().all(|&b| b <= 242));
                // Not every input is the canonical encoding, but re-encoding preserves content.
                let re = zero_run_encode(&dec).unwrap();
                prop_assert_eq!(zero_run_decode(&re, Some(dec.len())).unwrap(), dec);
            }
        }
    }
}
