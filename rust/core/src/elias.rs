//! Elias-γ and Elias-ω codes of positive integers, and the sparse signed-level stream of QSGD
//! built on them (FORMAT.md section 6.3).
//!
//! Both codes are defined most significant bit first and written so that their first bit is the
//! first stream bit of the LSB-first stream of section 6:
//!
//! * γ(n): `N = floor(log2 n)` zero bits, then the `N + 1` binary digits of `n`.
//! * ω(n): the groups of the recursion `n, N₁ = len(n) − 1, N₂ = len(N₁) − 1, …` down to a group
//!   of value ≤ 1 (not written), written innermost first, each as its binary digits, then a zero
//!   bit. ω(1) = `0`, ω(2) = `10 0`, ω(17) = `10 100 10001 0`.
//!
//! The sparse stream (QSGD, Alistarh et al. 2017): for each nonzero level in order of position,
//! the code of the distance to the previous nonzero position (the first one's distance is its
//! position + 1), one sign bit (1 = negative), the code of the level's magnitude.

use crate::bitio::{reverse_low, BitReader, BitWriter};
use crate::error::{Result, WireError};

/// Which Elias code a stream uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EliasKind {
    Gamma,
    Omega,
}

/// Bits of `n`'s binary digits (`n >= 1`).
#[inline(always)]
fn bit_len(n: u64) -> u32 {
    64 - n.leading_zeros()
}

#[inline(always)]
fn put_gamma(w: &mut BitWriter, n: u64) {
    let len = bit_len(n);
    if 2 * len - 1 <= 32 {
        // The N zeros are the low bits of one field, the reversed digits above them.
        w.put(reverse_low(n, len) << (len - 1), 2 * len - 1);
    } else {
        w.put_zeros(u64::from(len - 1));
        w.put_long(reverse_low(n, len), len);
    }
}

#[inline(always)]
fn put_omega(w: &mut BitWriter, n: u64) {
    // At most five groups for a 64-bit n (64 → 6 → 2 → 1).
    let mut groups = [0u64; 6];
    let mut count = 0;
    let mut m = n;
    while m > 1 {
        groups[count] = m;
        count += 1;
        m = u64::from(bit_len(m) - 1);
    }
    for &g in groups[..count].iter().rev() {
        let len = bit_len(g);
        w.put_long(reverse_low(g, len), len);
    }
    w.put(0, 1);
}

/// Reads a γ code; `None` past the end of the input, `Some(Err)` for a value over 64 bits.
#[inline(always)]
fn get_gamma(r: &mut BitReader<'_>) -> Option<Result<u64>> {
    let start = r.position();
    let zeros = match r.unary(63) {
        Ok(z) => z as u32,
        Err(crate::bitio::Unary::PastLimit) => {
            return Some(Err(WireError::EliasOverflow { bit_offset: start }))
        }
        Err(crate::bitio::Unary::PastEnd) => return None,
    };
    // The one bit just consumed is the leading digit; `zeros` digits follow.
    if zeros == 0 {
        return Some(Ok(1));
    }
    let rest = r.get_long(zeros)?;
    Some(Ok((1u64 << zeros) | reverse_low(rest, zeros)))
}

/// Reads an ω code; `None` past the end of the input, `Some(Err)` for a value over 64 bits.
#[inline(always)]
fn get_omega(r: &mut BitReader<'_>) -> Option<Result<u64>> {
    let start = r.position();
    let mut n = 1u64;
    loop {
        if r.get(1)? == 0 {
            return Some(Ok(n));
        }
        // A group of n + 1 digits whose leading one was just read.
        if n >= 64 {
            return Some(Err(WireError::EliasOverflow { bit_offset: start }));
        }
        let len = n as u32;
        let rest = r.get_long(len)?;
        n = (1u64 << len) | reverse_low(rest, len);
    }
}

#[inline(always)]
fn put(w: &mut BitWriter, kind: EliasKind, n: u64) {
    match kind {
        EliasKind::Gamma => put_gamma(w, n),
        EliasKind::Omega => put_omega(w, n),
    }
}

#[inline(always)]
fn get(r: &mut BitReader<'_>, kind: EliasKind) -> Option<Result<u64>> {
    match kind {
        EliasKind::Gamma => get_gamma(r),
        EliasKind::Omega => get_omega(r),
    }
}

/// Codes positive integers as one stream of Elias codes of `kind`.
pub fn elias_encode(values: &[u64], kind: EliasKind) -> Result<Vec<u8>> {
    if let Some(index) = values.iter().position(|&v| v == 0) {
        return Err(WireError::EliasZero { index });
    }
    let mut w = BitWriter::with_capacity(values.len() / 2 + 8);
    for &v in values {
        put(&mut w, kind, v);
    }
    Ok(w.finish())
}

/// Decodes exactly `count` Elias codes of `kind`; the stream must end with the last one (zero
/// padding bits, no byte more). Each code is at least one bit, so `count` is checked against the
/// input's length before anything is allocated.
pub fn elias_decode(data: &[u8], count: usize, kind: EliasKind) -> Result<Vec<u64>> {
    if count as u64 > data.len() as u64 * 8 {
        return Err(WireError::InputTooShort {
            needed: count.div_ceil(8),
            got: data.len(),
        });
    }
    let mut out = Vec::with_capacity(count);
    let mut r = BitReader::new(data);
    for decoded in 0..count {
        match get(&mut r, kind) {
            Some(Ok(v)) => out.push(v),
            Some(Err(e)) => return Err(e),
            None => {
                return Err(WireError::StreamTruncated {
                    decoded,
                    count,
                    bit_offset: r.position(),
                })
            }
        }
    }
    r.finish()?;
    Ok(out)
}

/// Elias-γ codes of `values` (each ≥ 1).
pub fn elias_gamma_encode(values: &[u64]) -> Result<Vec<u8>> {
    elias_encode(values, EliasKind::Gamma)
}

/// Decodes `count` Elias-γ codes.
pub fn elias_gamma_decode(data: &[u8], count: usize) -> Result<Vec<u64>> {
    elias_decode(data, count, EliasKind::Gamma)
}

/// Elias-ω codes of `values` (each ≥ 1).
pub fn elias_omega_encode(values: &[u64]) -> Result<Vec<u8>> {
    elias_encode(values, EliasKind::Omega)
}

/// Decodes `count` Elias-ω codes.
pub fn elias_omega_decode(data: &[u8], count: usize) -> Result<Vec<u64>> {
    elias_decode(data, count, EliasKind::Omega)
}

/// The sparse stream of nonzero signed `levels` at strictly ascending `positions`.
pub fn sparse_levels_encode(positions: &[u64], levels: &[i32], kind: EliasKind) -> Result<Vec<u8>> {
    if positions.len() != levels.len() {
        return Err(WireError::SparseLengthMismatch {
            positions: positions.len(),
            levels: levels.len(),
        });
    }
    let mut w = BitWriter::with_capacity(positions.len() + 8);
    // Distances are measured from position −1, so the first one is its position + 1.
    let mut prev: Option<u64> = None;
    for (index, (&p, &l)) in positions.iter().zip(levels).enumerate() {
        let dist = match prev {
            None => p.checked_add(1).ok_or(WireError::IndexOutOfRange {
                index,
                value: p,
                universe: u64::MAX,
            })?,
            Some(q) if p > q => p - q,
            Some(q) => {
                return Err(WireError::NotStrictlyAscending {
                    index,
                    prev: q,
                    value: p,
                })
            }
        };
        if l == 0 {
            return Err(WireError::LevelOutOfRange {
                index,
                level: 0,
                max: u32::MAX,
            });
        }
        put(&mut w, kind, dist);
        w.put(u64::from(l < 0), 1);
        put(&mut w, kind, u64::from(l.unsigned_abs()));
        prev = Some(p);
    }
    Ok(w.finish())
}

/// Decodes a sparse stream of exactly `count` nonzero levels: positions strictly ascending and
/// below `universe`, magnitudes in `1..=max_level`. Returns `(positions, signed levels)`. Each
/// entry takes at least three bits, so `count` is checked against the input before allocating.
pub fn sparse_levels_decode(
    data: &[u8],
    count: usize,
    universe: u64,
    max_level: u32,
    kind: EliasKind,
) -> Result<(Vec<u64>, Vec<i32>)> {
    if (count as u64).saturating_mul(3) > data.len() as u64 * 8 {
        return Err(WireError::InputTooShort {
            needed: usize::try_from((count as u64).saturating_mul(3).div_ceil(8))
                .unwrap_or(usize::MAX),
            got: data.len(),
        });
    }
    if count as u64 > universe {
        return Err(WireError::SetTooLarge {
            set_len: count,
            universe,
        });
    }
    let max_level = max_level.min(i32::MAX as u32);
    let mut positions = Vec::with_capacity(count);
    let mut levels = Vec::with_capacity(count);
    let mut r = BitReader::new(data);
    let truncated = |r: &BitReader<'_>, decoded| WireError::StreamTruncated {
        decoded,
        count,
        bit_offset: r.position(),
    };
    // The next position is `next + dist − 1`.
    let mut next = 0u64;
    for index in 0..count {
        let dist = match get(&mut r, kind) {
            Some(v) => v?,
            None => return Err(truncated(&r, index)),
        };
        let pos = next.checked_add(dist - 1).filter(|&p| p < universe);
        let Some(pos) = pos else {
            return Err(WireError::IndexOutOfRange {
                index,
                value: next.saturating_add(dist - 1),
                universe,
            });
        };
        let Some(negative) = r.get(1) else {
            return Err(truncated(&r, index));
        };
        let mag = match get(&mut r, kind) {
            Some(v) => v?,
            None => return Err(truncated(&r, index)),
        };
        if mag > u64::from(max_level) {
            return Err(WireError::LevelOutOfRange {
                index,
                level: i64::try_from(mag).unwrap_or(i64::MAX),
                max: max_level,
            });
        }
        let mag = mag as i32;
        positions.push(pos);
        levels.push(if negative == 1 { -mag } else { mag });
        next = pos + 1;
    }
    r.finish()?;
    Ok((positions, levels))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The codes as strings of '0'/'1', most significant bit first, straight from the definitions.
    fn gamma_str(n: u64) -> String {
        let digits = format!("{n:b}");
        "0".repeat(digits.len() - 1) + &digits
    }

    fn omega_str(mut n: u64) -> String {
        let mut code = String::from("0");
        while n > 1 {
            let digits = format!("{n:b}");
            code = digits.clone() + &code;
            n = digits.len() as u64 - 1;
        }
        code
    }

    fn pack(bits: &str) -> Vec<u8> {
        let mut out = vec![0u8; bits.len().div_ceil(8)];
        for (i, c) in bits.chars().enumerate() {
            if c == '1' {
                out[i / 8] |= 1 << (i % 8);
            }
        }
        out
    }

    #[test]
    fn textbook_codes() {
        assert_eq!(omega_str(1), "0");
        assert_eq!(omega_str(2), "100");
        assert_eq!(omega_str(17), "10100100010");
        assert_eq!(gamma_str(5), "00101");
        for n in [1u64, 2, 3, 4, 5, 17, 100, 1 << 20, u64::MAX] {
            assert_eq!(
                elias_gamma_encode(&[n]).unwrap(),
                pack(&gamma_str(n)),
                "gamma {n}"
            );
            assert_eq!(
                elias_omega_encode(&[n]).unwrap(),
                pack(&omega_str(n)),
                "omega {n}"
            );
        }
        assert_eq!(elias_omega_encode(&[17]).unwrap(), vec![0b0010_0101, 0b010]);
    }

    #[test]
    fn zero_is_rejected() {
        assert_eq!(
            elias_gamma_encode(&[3, 0]),
            Err(WireError::EliasZero { index: 1 })
        );
        assert_eq!(
            elias_omega_encode(&[0]),
            Err(WireError::EliasZero { index: 0 })
        );
    }

    #[test]
    fn hostile_streams() {
        // 64 zeros then ones: a γ value of 65 digits.
        let mut data = vec![0u8; 8];
        data.extend([0xFF; 9]);
        assert!(matches!(
            elias_gamma_decode(&data, 1),
            Err(WireError::EliasOverflow { .. })
        ));
        // All ones: ω groups grow past 64 bits.
        assert!(matches!(
            elias_omega_decode(&[0xFF; 16], 1),
            Err(WireError::EliasOverflow { .. })
        ));
        assert!(matches!(
            elias_omega_decode(&[0xFF], 1),
            Err(WireError::StreamTruncated { .. })
        ));
        assert!(matches!(
            elias_gamma_decode(&[0], 1),
            Err(WireError::StreamTruncated { .. })
        ));
        assert_eq!(
            elias_gamma_decode(&[0], 9),
            Err(WireError::InputTooShort { needed: 2, got: 1 })
        );
        // Trailing bytes and padding bits.
        let enc = elias_omega_encode(&[17]).unwrap();
        let mut long = enc.clone();
        long.push(0);
        assert!(matches!(
            elias_omega_decode(&long, 1),
            Err(WireError::LengthMismatch { .. })
        ));
        let mut pad = enc;
        pad[1] |= 0x80;
        assert!(matches!(
            elias_omega_decode(&pad, 1),
            Err(WireError::NonzeroPaddingBits { .. })
        ));
    }

    #[test]
    fn sparse_stream_layout() {
        // positions 0 and 5, levels -2 and 1, γ: dist 1 -> "1", sign "1", mag 2 -> "010";
        // dist 5 -> "00101", sign "0", mag 1 -> "1".
        let enc = sparse_levels_encode(&[0, 5], &[-2, 1], EliasKind::Gamma).unwrap();
        assert_eq!(enc, pack("110100010101"));
        let (p, l) = sparse_levels_decode(&enc, 2, 6, 2, EliasKind::Gamma).unwrap();
        assert_eq!((p, l), (vec![0, 5], vec![-2, 1]));
        assert!(matches!(
            sparse_levels_decode(&enc, 2, 5, 2, EliasKind::Gamma),
            Err(WireError::IndexOutOfRange { index: 1, .. })
        ));
        assert!(matches!(
            sparse_levels_decode(&enc, 2, 6, 1, EliasKind::Gamma),
            Err(WireError::LevelOutOfRange {
                index: 0,
                level: 2,
                max: 1
            })
        ));
        assert!(matches!(
            sparse_levels_encode(&[3, 3], &[1, 1], EliasKind::Omega),
            Err(WireError::NotStrictlyAscending { index: 1, .. })
        ));
        assert!(matches!(
            sparse_levels_encode(&[3], &[0], EliasKind::Omega),
            Err(WireError::LevelOutOfRange { .. })
        ));
        assert!(matches!(
            sparse_levels_decode(&[0xFF], 3, 100, 5, EliasKind::Omega),
            Err(WireError::InputTooShort { .. })
        ));
        assert!(matches!(
            sparse_levels_decode(&[0xFF; 4], 3, 2, 5, EliasKind::Omega),
            Err(WireError::SetTooLarge { .. })
        ));
    }

    fn kind() -> impl Strategy<Value = EliasKind> {
        prop_oneof![Just(EliasKind::Gamma), Just(EliasKind::Omega)]
    }

    fn positive() -> impl Strategy<Value = u64> {
        prop_oneof![1u64..20, 1u64..100_000, 1u64..=u64::MAX]
    }

    proptest! {
        #[test]
        fn prop_matches_definition_and_round_trips(values in proptest::collection::vec(positive(), 0..100), kind in kind()) {
            let enc = elias_encode(&values, kind).unwrap();
            let text: String = values.iter().map(|&v| match kind {
                EliasKind::Gamma => gamma_str(v),
                EliasKind::Omega => omega_str(v),
            }).collect();
            prop_assert_eq!(&enc, &pack(&text));
            prop_assert_eq!(elias_decode(&enc, values.len(), kind).unwrap(), values);
        }

        #[test]
        fn prop_sparse_round_trip(entries in proptest::collection::btree_map(0u64..100_000, (1i32..=20, any::<bool>()), 0..100), kind in kind()) {
            let positions: Vec<u64> = entries.keys().copied().collect();
            let levels: Vec<i32> = entries.values().map(|&(m, neg)| if neg { -m } else { m }).collect();
            let enc = sparse_levels_encode(&positions, &levels, kind).unwrap();
            let (p, l) = sparse_levels_decode(&enc, positions.len(), 100_000, 20, kind).unwrap();
            prop_assert_eq!(p, positions);
            prop_assert_eq!(l, levels);
        }

        #[test]
        fn prop_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..64), count in 0usize..100,
                                            universe in 0u64..10_000, max_level in 0u32..50, kind in kind()) {
            if let Ok(v) = elias_decode(&data, count, kind) {
                prop_assert_eq!(elias_encode(&v, kind).unwrap(), data.clone());
            }
            if let Ok((p, l)) = sparse_levels_decode(&data, count, universe, max_level, kind) {
                prop_assert!(p.iter().all(|&x| x < universe));
                prop_assert!(l.iter().all(|&x| x != 0 && x.unsigned_abs() <= max_level));
                prop_assert_eq!(sparse_levels_encode(&p, &l, kind).unwrap(), data);
            }
        }
    }
}
