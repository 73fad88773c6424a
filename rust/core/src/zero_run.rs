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
use crate::quartic::{first_invalid_byte, QUARTIC_MAX};

/// The quartic byte of five zero trits.
pub const ZERO_BYTE: u8 = 121;
/// The longest run one code byte (255) stands for.
pub const MAX_RUN: usize = 14;

/// Code byte for a run remainder `rem` (index); `CODE[0]` is unused (a remainder of 0 emits
/// nothing), `CODE[1]` is 121 itself and `CODE[r]` is `243 + r − 2` for `r` in 2..=13.
const CODE: [u8; MAX_RUN] = [
    0, 121, 243, 244, 245, 246, 247, 248, 249, 250, 251, 252, 253, 254,
];

/// Zero-run encodes quartic bytes. A byte above 242 is an error (it would be read back as a run).
///
/// Speed: 64-byte blocks are classified with a SWAR bitmask of their 121 bytes; a block without
/// any is copied whole, a block of only 121 extends the pending run, and in a mixed block the
/// loop runs once per *literal* (non-121 byte), found with `trailing_zeros`, writing the pending
/// run's code bytes and the literal with fixed-size stores (no per-byte branches).
pub fn zero_run_encode(data: &[u8]) -> Result<Vec<u8>> {
    if let Some(index) = first_invalid_byte(data) {
        return Err(WireError::ZeroRunInputByte {
            index,
            value: data[index],
        });
    }
    // Encoding never grows the input, and the output written so far is never longer than the
    // input consumed; the slack absorbs the fixed-size stores.
    let mut out = vec![0u8; data.len() + SLACK];
    let mut pos = 0usize;
    // 121 bytes seen and not yet written.
    let mut run = 0usize;
    let blocks = data.chunks_exact(MASK_BLOCK);
    let tail = blocks.remainder();
    for block in blocks {
        let zeros = mask_of_zero_bytes(block);
        if zeros == 0 {
            flush_run(&mut out, &mut pos, run);
            run = 0;
            out[pos..pos + MASK_BLOCK].copy_from_slice(block);
            pos += MASK_BLOCK;
            continue;
        }
        if zeros == u64::MAX {
            run += MASK_BLOCK;
            continue;
        }
        // A mixed block has at least one literal. The first one closes the carried run (of any
        // length); the runs between later literals are < 64 and come from a table.
        let mut literals = !zeros;
        let p = literals.trailing_zeros() as usize;
        literals &= literals - 1;
        run_then_literal(&mut out, &mut pos, run + p, block[p]);
        let mut next = p + 1; // position after the previous literal in this block
        while literals != 0 {
            let p = literals.trailing_zeros() as usize;
            literals &= literals - 1;
            let r = (p - next) & (MASK_BLOCK - 1);
            let len = SHORT_RUN_LEN[r];
            let word = SHORT_RUN_CODES[r] | u64::from(block[p & (MASK_BLOCK - 1)]) << (8 * len);
            out[pos..pos + 8].copy_from_slice(&word.to_le_bytes());
            pos += len + 1;
            next = p + 1;
        }
        run = MASK_BLOCK - next;
    }
    for &b in tail {
        if b == ZERO_BYTE {
            run += 1;
        } else {
            run_then_literal(&mut out, &mut pos, run, b);
            run = 0;
        }
    }
    flush_run(&mut out, &mut pos, run);
    out.truncate(pos);
    Ok(out)
}

/// Block of the bitmask scans.
const MASK_BLOCK: usize = 64;

/// The code bytes of a run of `r < 64` bytes of 121, packed little-endian (at most 4 bytes 255
/// and one remainder code), and their count.
static SHORT_RUN_CODES: [u64; MASK_BLOCK] = short_run_table().0;
static SHORT_RUN_LEN: [usize; MASK_BLOCK] = short_run_table().1;

const fn short_run_table() -> ([u64; MASK_BLOCK], [usize; MASK_BLOCK]) {
    let mut codes = [0u64; MASK_BLOCK];
    let mut lens = [0usize; MASK_BLOCK];
    let mut r = 0;
    while r < MASK_BLOCK {
        let mut word = 0u64;
        let mut len = 0;
        while len < r / MAX_RUN {
            word |= 255 << (8 * len);
            len += 1;
        }
        if r % MAX_RUN > 0 {
            word |= (CODE[r % MAX_RUN] as u64) << (8 * len);
            len += 1;
        }
        codes[r] = word;
        lens[r] = len;
        r += 1;
    }
    (codes, lens)
}
/// Output slack for fixed-size stores.
const SLACK: usize = 32;

/// Bit `i` set iff `block[i] == 121` (`block` is 64 bytes). SWAR, exact (no false positives).
#[inline(always)]
fn mask_of_zero_bytes(block: &[u8]) -> u64 {
    const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const SPLAT: u64 = 0x7979_7979_7979_7979; // 121 in every byte
    let mut mask = 0u64;
    for (k, w) in block.chunks_exact(8).enumerate() {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        let t = u64::from_le_bytes(a) ^ SPLAT; // zero bytes where the input is 121
        let nonzero = ((t & LOW7) + LOW7) | t; // high bit of each byte: byte != 0
        let flags = (!nonzero & HIGH) >> 7; // bit 8j: byte j == 121
        let packed = flags.wrapping_mul(0x0102_0408_1020_4080) >> 56; // bit j: byte j == 121
        mask |= packed << (8 * k);
    }
    mask
}

/// Writes the code of a run of `run` 121 bytes (possibly none) followed by the literal `lit`.
#[inline(always)]
fn run_then_literal(out: &mut [u8], pos: &mut usize, run: usize, lit: u8) {
    let full = run / MAX_RUN;
    let rem = run % MAX_RUN;
    if full <= 16 {
        out[*pos..*pos + 16].copy_from_slice(&[255u8; 16]);
    } else {
        out[*pos..*pos + full].fill(255);
    }
    let p = *pos + full;
    let has_code = u8::from(rem > 0);
    // Branch-free select: the code byte if the run has a remainder, else the literal itself.
    let keep_code = 0u8.wrapping_sub(has_code);
    out[p] = (CODE[rem] & keep_code) | (lit & !keep_code);
    out[p + 1] = lit;
    *pos = p + 1 + usize::from(has_code);
}

/// Writes the code of a run of `run` 121 bytes with nothing after it.
fn flush_run(out: &mut [u8], pos: &mut usize, run: usize) {
    let full = run / MAX_RUN;
    out[*pos..*pos + full].fill(255);
    *pos += full;
    let rem = run % MAX_RUN;
    if rem > 0 {
        out[*pos] = CODE[rem];
        *pos += 1;
    }
}

/// The number of bytes `data` decodes to (each byte > 242 counts `b − 241`, others 1).
pub fn zero_run_decoded_len(data: &[u8]) -> usize {
    let extra: usize = data
        .chunks(4096)
        // ≤ 13 per byte, ≤ 53 248 per block: no u32 overflow.
        .map(|c| {
            c.iter()
                .map(|&b| u32::from(b.saturating_sub(QUARTIC_MAX)))
                .sum::<u32>() as usize
        })
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
    let mut out = vec![0u8; decoded];
    decode_exact(data, &mut out);
    Ok(out)
}

/// Decodes into `out`, whose length must be exactly the decoded length.
pub fn zero_run_decode_into(data: &[u8], out: &mut [u8]) -> Result<()> {
    check_expected(zero_run_decoded_len(data), Some(out.len()))?;
    decode_exact(data, out);
    Ok(())
}

/// Decodes `data` into `out`, which is exactly the decoded length.
///
/// Fast part, while a 64-byte input block's worst case (14 output bytes per input byte) fits:
/// a block without run codes is one copy; otherwise the loop runs once per code byte (found
/// with a SWAR bitmask and `trailing_zeros`), copying the literals before it with 16-byte
/// over-copies and writing its run with one 16-byte store of 121s.
fn decode_exact(data: &[u8], out: &mut [u8]) {
    const RUN: [u8; 16] = [ZERO_BYTE; 16];
    let mut pos = 0usize;
    let mut i = 0usize;
    while i + MASK_BLOCK + 16 <= data.len() && pos + MASK_BLOCK * MAX_RUN + 64 <= out.len() {
        let block = &data[i..i + MASK_BLOCK];
        let mut codes = mask_of_code_bytes(block);
        if codes == 0 {
            out[pos..pos + MASK_BLOCK].copy_from_slice(block);
            pos += MASK_BLOCK;
            i += MASK_BLOCK;
            continue;
        }
        let mut next = 0usize; // input position after the previous code in this block
        while codes != 0 {
            let p = codes.trailing_zeros() as usize;
            codes &= codes - 1;
            let span = p - next;
            copy_literals(out, pos, &data[i + next..], span);
            pos += span;
            out[pos..pos + 16].copy_from_slice(&RUN);
            pos += usize::from(block[p & (MASK_BLOCK - 1)]) - 241;
            next = p + 1;
        }
        let span = MASK_BLOCK - next;
        copy_literals(out, pos, &data[i + next..], span);
        pos += span;
        i += MASK_BLOCK;
    }
    // Exact part for the end.
    for &b in &data[i..] {
        if b > QUARTIC_MAX {
            let run = usize::from(b - 241);
            if let Some(dst) = out.get_mut(pos..pos + run) {
                dst.fill(ZERO_BYTE);
            }
            pos += run;
        } else {
            if let Some(o) = out.get_mut(pos) {
                *o = b;
            }
            pos += 1;
        }
    }
}

/// Copies `span ≤ 64` bytes from `src` to `out[pos..]` in 16-byte pieces (over-copying up to 15
/// bytes; the caller guarantees room on both sides).
#[inline(always)]
fn copy_literals(out: &mut [u8], pos: usize, src: &[u8], span: usize) {
    let mut k = 0;
    loop {
        out[pos + k..pos + k + 16].copy_from_slice(&src[k..k + 16]);
        k += 16;
        if k >= span {
            break;
        }
    }
}

/// Bit `i` set iff `block[i] > 242` (a run code); `block` is 64 bytes. SWAR, exact.
#[inline(always)]
fn mask_of_code_bytes(block: &[u8]) -> u64 {
    const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const THIRTEEN: u64 = 0x0D0D_0D0D_0D0D_0D0D;
    let mut mask = 0u64;
    for (k, w) in block.chunks_exact(8).enumerate() {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        let x = u64::from_le_bytes(a);
        let flags = ((((x & LOW7) + THIRTEEN) & x) & HIGH) >> 7;
        mask |= (flags.wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * k);
    }
    mask
}

fn check_expected(decoded: usize, expected_len: Option<usize>) -> Result<()> {
    match expected_len {
        Some(expected) if decoded > expected => {
            Err(WireError::ZeroRunTooLong { expected, decoded })
        }
        Some(expected) if decoded < expected => {
            Err(WireError::ZeroRunTooShort { expected, decoded })
        }
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
        assert_eq!(
            zero_run_encode(&[5, 121, 121, 121, 7, 121]).unwrap(),
            vec![5, 244, 7, 121]
        );
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
        assert_eq!(
            zero_run_encode(&[1, 2, 243]),
            Err(WireError::ZeroRunInputByte {
                index: 2,
                value: 243
            })
        );
        let mut v = vec![121u8; 5000];
        v[4321] = 255;
        assert_eq!(
            zero_run_encode(&v),
            Err(WireError::ZeroRunInputByte {
                index: 4321,
                value: 255
            })
        );
    }

    #[test]
    fn expected_len() {
        let enc = [7, 255, 243];
        assert_eq!(zero_run_decoded_len(&enc), 17);
        assert_eq!(zero_run_decode(&enc, Some(17)).unwrap().len(), 17);
        assert_eq!(
            zero_run_decode(&enc, Some(16)),
            Err(WireError::ZeroRunTooLong {
                expected: 16,
                decoded: 17
            })
        );
        assert_eq!(
            zero_run_decode(&enc, Some(18)),
            Err(WireError::ZeroRunTooShort {
                expected: 18,
                decoded: 17
            })
        );
        assert_eq!(zero_run_output_len(&enc, None), Ok(17));
        assert_eq!(
            zero_run_output_len(&enc, Some(16)),
            Err(WireError::ZeroRunTooLong {
                expected: 16,
                decoded: 17
            })
        );
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
                        1 => (0usize..60).prop_map(|n| vec![ZERO_BYTE; n]),
                        1 => proptest::collection::vec(0u8..=120, 0..70)],
            0..80,
        )
        .prop_map(|parts| parts.concat())
    }

    /// Straightforward encoder from the definition.
    fn reference_encode(data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < data.len() {
            if data[i] != ZERO_BYTE {
                out.push(data[i]);
                i += 1;
                continue;
            }
            let r = data[i..].iter().take_while(|&&b| b == ZERO_BYTE).count();
            out.extend(std::iter::repeat(255).take(r / 14));
            match r % 14 {
                0 => {}
                1 => out.push(121),
                rem => out.push(241 + rem as u8),
            }
            i += r;
        }
        out
    }

    #[test]
    fn large_mixed_input_matches_reference() {
        // Long literal stretches, long runs, and mixed blocks, across block boundaries.
        let mut x = 0x1234_5678u32;
        let mut data = Vec::new();
        for seg in 0..2000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let len = (x % 100) as usize;
            match seg % 3 {
                0 => data.extend(std::iter::repeat(ZERO_BYTE).take(len)),
                1 => data.extend((0..len).map(|k| ((x as usize + k) % 121) as u8)),
                _ => data.extend((0..len).map(|k| {
                    if (x >> (k % 32)) & 1 == 1 {
                        ZERO_BYTE
                    } else {
                        7
                    }
                })),
            }
        }
        let enc = zero_run_encode(&data).unwrap();
        assert_eq!(enc, reference_encode(&data));
        assert_eq!(zero_run_decode(&enc, Some(data.len())).unwrap(), data);
    }

    proptest! {
        #[test]
        fn prop_matches_reference(data in quartic_bytes()) {
            prop_assert_eq!(zero_run_encode(&data).unwrap(), reference_encode(&data));
        }

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
