//! 3LC quartic encoding: five ternary values per byte.
//!
//! Each trit `q ∈ {-1, 0, 1}` becomes the digit `d = q + 1 ∈ {0, 1, 2}`. The `n` digits are padded
//! with `d = 0` to a multiple of 5 and the padded array is cut into five contiguous planes
//! `p0..p4` of `L = ceil(n/5)` digits each; byte `i` is
//! `81·p0[i] + 27·p1[i] + 9·p2[i] + 3·p3[i] + p4[i]` (at most 242).
//!
//! An all-zero tensor encodes to bytes of value 121 (`d = 1` everywhere), which is what the
//! zero-run coder compresses. Decoding is strict: byte values above 242, a length other than
//! `ceil(count/5)` and padding digits other than 0 are rejected, so the encoding is canonical.

use crate::error::{Result, WireError};

/// Weights of the five planes.
const W: [u8; 5] = [81, 27, 9, 3, 1];

/// Highest valid quartic byte (`2·(81+27+9+3+1)`).
pub const QUARTIC_MAX: u8 = 242;

/// Number of bytes that hold `count` trits: `ceil(count/5)`.
pub const fn quartic_len(count: usize) -> usize {
    count / 5 + (count % 5 != 0) as usize
}

/// `TABLE[b][k]` is digit `k` of byte `b` minus one, i.e. the trit; rows above 242 are unused.
static TABLE: [[i8; 5]; 256] = build_table();

const fn build_table() -> [[i8; 5]; 256] {
    let mut t = [[0i8; 5]; 256];
    let mut b = 0usize;
    while b <= QUARTIC_MAX as usize {
        let mut k = 0;
        while k < 5 {
            let digit = (b / W[k] as usize) % 3;
            t[b][k] = digit as i8 - 1;
            k += 1;
        }
        b += 1;
    }
    t
}

/// Encodes trits (each -1, 0 or 1) into `ceil(n/5)` quartic bytes.
pub fn quartic_encode(trits: &[i8]) -> Result<Vec<u8>> {
    let mut out = vec![0u8; quartic_len(trits.len())];
    quartic_encode_into(trits, &mut out)?;
    Ok(out)
}

/// Encodes into `out`, which must be exactly `ceil(n/5)` bytes.
pub fn quartic_encode_into(trits: &[i8], out: &mut [u8]) -> Result<()> {
    let n = trits.len();
    let l = quartic_len(n);
    if out.len() != l {
        return Err(WireError::OutputSizeMismatch {
            needed: l,
            got: out.len(),
        });
    }
    // Columns 0..full have all five digits present; the rest have padding in the high planes.
    let full = n.saturating_sub(4 * l);
    let mut worst = 0u8;
    if full > 0 {
        // full > 0 implies n ≥ 4·l + full, so all five plane slices are in bounds.
        let p0 = &trits[..full];
        let p1 = &trits[l..l + full];
        let p2 = &trits[2 * l..2 * l + full];
        let p3 = &trits[3 * l..3 * l + full];
        let p4 = &trits[4 * l..4 * l + full];
        for (i, o) in out[..full].iter_mut().enumerate() {
            let d0 = (p0[i] as u8).wrapping_add(1);
            let d1 = (p1[i] as u8).wrapping_add(1);
            let d2 = (p2[i] as u8).wrapping_add(1);
            let d3 = (p3[i] as u8).wrapping_add(1);
            let d4 = (p4[i] as u8).wrapping_add(1);
            worst = worst.max(d0).max(d1).max(d2).max(d3).max(d4);
            *o = d0
                .wrapping_mul(81)
                .wrapping_add(d1.wrapping_mul(27))
                .wrapping_add(d2.wrapping_mul(9))
                .wrapping_add(d3.wrapping_mul(3))
                .wrapping_add(d4);
        }
    }
    for (i, o) in out.iter_mut().enumerate().skip(full) {
        let mut byte = 0u8;
        for (k, w) in W.iter().enumerate() {
            let d = match trits.get(k * l + i) {
                Some(&t) => (t as u8).wrapping_add(1),
                None => 0,
            };
            worst = worst.max(d);
            byte = byte.wrapping_add(d.wrapping_mul(*w));
        }
        *o = byte;
    }
    if worst > 2 {
        if let Some(index) = trits.iter().position(|&t| !(-1..=1).contains(&t)) {
            return Err(WireError::InvalidTrit {
                index,
                value: trits[index],
            });
        }
    }
    Ok(())
}

/// Decodes `count` trits from exactly `ceil(count/5)` quartic bytes.
pub fn quartic_decode(data: &[u8], count: usize) -> Result<Vec<i8>> {
    // Check the length before allocating `count` bytes: `count` comes from the caller/frame.
    let l = quartic_len(count);
    if data.len() != l {
        return Err(WireError::LengthMismatch {
            expected: l,
            got: data.len(),
        });
    }
    let mut out = vec![0i8; count];
    quartic_decode_into(data, &mut out)?;
    Ok(out)
}

/// Decodes `out.len()` trits from `data` (strict, see the module docs). On error the contents
/// of `out` are unspecified.
pub fn quartic_decode_into(data: &[u8], out: &mut [i8]) -> Result<()> {
    let n = out.len();
    let l = quartic_len(n);
    if data.len() != l {
        return Err(WireError::LengthMismatch {
            expected: l,
            got: data.len(),
        });
    }
    if let Some(index) = first_invalid_byte(data) {
        return Err(WireError::InvalidQuarticByte {
            index,
            value: data[index],
        });
    }
    let full = n.saturating_sub(4 * l);
    if full > 0 {
        let (p0, rest) = out.split_at_mut(l);
        let (p1, rest) = rest.split_at_mut(l);
        let (p2, rest) = rest.split_at_mut(l);
        let (p3, p4) = rest.split_at_mut(l);
        let (p0, p1, p2, p3, p4) = (
            &mut p0[..full],
            &mut p1[..full],
            &mut p2[..full],
            &mut p3[..full],
            &mut p4[..full],
        );
        let data = &data[..full];
        // Division by constants on 16-bit lanes: LLVM vectorises this loop (a table lookup per
        // byte would be a gather and five scalar stores).
        for i in 0..full {
            let b = u16::from(data[i]);
            let d0 = b / 81;
            let r = b - 81 * d0;
            let d1 = r / 27;
            let r = r - 27 * d1;
            let d2 = r / 9;
            let r = r - 9 * d2;
            let d3 = r / 3;
            let d4 = r - 3 * d3;
            p0[i] = d0 as i8 - 1;
            p1[i] = d1 as i8 - 1;
            p2[i] = d2 as i8 - 1;
            p3[i] = d3 as i8 - 1;
            p4[i] = d4 as i8 - 1;
        }
    }
    for (i, &b) in data.iter().enumerate().skip(full) {
        let t = &TABLE[b as usize];
        for (plane, &q) in t.iter().enumerate() {
            match out.get_mut(plane * l + i) {
                Some(o) => *o = q,
                None if q != -1 => {
                    return Err(WireError::NonzeroQuarticPadding {
                        index: i,
                        plane,
                        digit: (q + 1) as u8,
                    })
                }
                None => {}
            }
        }
    }
    Ok(())
}

/// Index of the first byte above 242, if any (fast path: a SWAR scan of 256-byte blocks).
pub(crate) fn first_invalid_byte(data: &[u8]) -> Option<usize> {
    const BLK: usize = 256;
    for (blk, chunk) in data.chunks(BLK).enumerate() {
        if has_byte_above_242(chunk) {
            return chunk
                .iter()
                .position(|&b| b > QUARTIC_MAX)
                .map(|p| blk * BLK + p);
        }
    }
    None
}

/// True if some byte of `s` is above 242. Word-at-a-time: a byte `b` is ≥ 243 iff its high bit
/// is set and `(b & 0x7F) + 13` reaches 128; the sums cannot carry into the next byte.
#[inline(always)]
pub(crate) fn has_byte_above_242(s: &[u8]) -> bool {
    const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const THIRTEEN: u64 = 0x0D0D_0D0D_0D0D_0D0D;
    let words = s.chunks_exact(8);
    let rest = words.remainder();
    let mut acc = 0u64;
    for w in words {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        let x = u64::from_le_bytes(a);
        acc |= ((x & LOW7) + THIRTEEN) & x;
    }
    acc & HIGH != 0 || rest.iter().any(|&b| b > QUARTIC_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn required_vectors() {
        assert_eq!(
            quartic_encode(&[0, -1, 1, 0, 0, 1, 0]).unwrap(),
            vec![147, 45]
        );
        assert_eq!(quartic_encode(&[0; 7]).unwrap(), vec![120, 117]);
        assert_eq!(quartic_encode(&[0; 10]).unwrap(), vec![121, 121]);
        assert_eq!(
            quartic_decode(&[147, 45], 7).unwrap(),
            vec![0, -1, 1, 0, 0, 1, 0]
        );
        assert_eq!(quartic_decode(&[120, 117], 7).unwrap(), vec![0; 7]);
        assert_eq!(quartic_decode(&[121, 121], 10).unwrap(), vec![0; 10]);
    }

    #[test]
    fn small_counts() {
        assert_eq!(quartic_encode(&[]).unwrap(), Vec::<u8>::new());
        assert_eq!(quartic_decode(&[], 0).unwrap(), Vec::<i8>::new());
        // n = 1: only plane 0 present.
        assert_eq!(quartic_encode(&[1]).unwrap(), vec![162]);
        assert_eq!(quartic_encode(&[-1]).unwrap(), vec![0]);
        // n = 2, L = 1: planes 0 and 1 present.
        assert_eq!(quartic_encode(&[0, 1]).unwrap(), vec![81 + 54]);
        assert_eq!(quartic_decode(&[135], 2).unwrap(), vec![0, 1]);
    }

    #[test]
    fn rejects_bad_trit() {
        assert_eq!(
            quartic_encode(&[0, 0, 2, 0]),
            Err(WireError::InvalidTrit { index: 2, value: 2 })
        );
        assert_eq!(
            quartic_encode(&[0; 20].iter().copied().chain([-2]).collect::<Vec<_>>()),
            Err(WireError::InvalidTrit {
                index: 20,
                value: -2
            })
        );
        let mut v = vec![0i8; 100];
        v[37] = i8::MIN;
        assert_eq!(
            quartic_encode(&v),
            Err(WireError::InvalidTrit {
                index: 37,
                value: i8::MIN
            })
        );
    }

    #[test]
    fn rejects_bad_bytes_and_lengths() {
        assert_eq!(
            quartic_decode(&[121, 243], 10),
            Err(WireError::InvalidQuarticByte {
                index: 1,
                value: 243
            })
        );
        assert_eq!(
            quartic_decode(&[121, 121], 11),
            Err(WireError::LengthMismatch {
                expected: 3,
                got: 2
            })
        );
        assert_eq!(
            quartic_decode(&[121, 121], 5),
            Err(WireError::LengthMismatch {
                expected: 1,
                got: 2
            })
        );
        // 7 trits, L = 2: (plane 4, byte 0), (plane 3, byte 1), (plane 4, byte 1) are padding.
        assert!(matches!(
            quartic_decode(&[120, 120], 7),
            Err(WireError::NonzeroQuarticPadding {
                index: 1,
                plane: 3,
                digit: 1
            })
        ));
        assert!(matches!(
            quartic_decode(&[120, 118], 7),
            Err(WireError::NonzeroQuarticPadding {
                index: 1,
                plane: 4,
                digit: 1
            })
        ));
        assert!(matches!(
            quartic_decode(&[121, 117], 7),
            Err(WireError::NonzeroQuarticPadding {
                index: 0,
                plane: 4,
                digit: 1
            })
        ));
    }

    #[test]
    fn swar_scan_is_exact() {
        for b in 0..=255u8 {
            for at in [0usize, 7, 8, 13, 63, 255, 256, 300] {
                let mut v = vec![121u8; 301];
                v[at] = b;
                let expect = (b > 242).then_some(at);
                assert_eq!(first_invalid_byte(&v), expect, "byte {b} at {at}");
                assert_eq!(has_byte_above_242(&v), b > 242);
            }
        }
    }

    #[test]
    fn table_matches_arithmetic() {
        for b in 0..=242u32 {
            let t = TABLE[b as usize];
            let back: u32 = t
                .iter()
                .zip(W)
                .map(|(&q, w)| (q + 1) as u32 * w as u32)
                .sum();
            assert_eq!(back, b);
        }
    }

    proptest! {
        #[test]
        fn prop_round_trip(trits in proptest::collection::vec(-1i8..=1, 0..500)) {
            let enc = quartic_encode(&trits).unwrap();
            prop_assert_eq!(enc.len(), trits.len().div_ceil(5));
            prop_assert!(enc.iter().all(|&b| b <= 242));
            prop_assert_eq!(quartic_decode(&enc, trits.len()).unwrap(), trits);
        }

        #[test]
        fn prop_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..100),
                                            count in 0usize..600) {
            if let Ok(trits) = quartic_decode(&data, count) {
                prop_assert_eq!(quartic_encode(&trits).unwrap(), data);
            }
        }

        #[test]
        fn prop_decodes_when_length_right(data in proptest::collection::vec(0u8..=242, 0..100), extra in 0usize..5) {
            // count = 5·len - extra: decodes iff the padding digits are zero; never panics.
            let count = (data.len() * 5).saturating_sub(extra);
            if let Ok(trits) = quartic_decode(&data, count) {
                prop_assert_eq!(quartic_encode(&trits).unwrap(), data);
            }
        }
    }
}
