//! Bitmap coding of index sets (FORMAT.md section 6.3): set `s` of a universe of `C` positions
//! is the `C` stream bits `[s·C, (s+1)·C)`, bit `i` of the set set when `i` is in it, LSB-first
//! as in section 6. `C` bits per set, whatever its size: the cheapest coding once a set holds
//! more than about a third of its universe.

use crate::error::{Result, WireError};
use crate::rice::{check_sets, for_each_gap};

fn stream_bits(sets: usize, universe: u64) -> Result<u64> {
    (sets as u64)
        .checked_mul(universe)
        .ok_or(WireError::SizeOverflow {
            count: sets,
            bits: 32,
        })
}

fn stream_len(sets: usize, universe: u64) -> Result<usize> {
    usize::try_from(stream_bits(sets, universe)?.div_ceil(8)).map_err(|_| WireError::SizeOverflow {
        count: sets,
        bits: 32,
    })
}

/// Bytes of the bitmap of `count` indices in sets of `set_len` below `universe`.
pub fn bitmap_len(count: usize, set_len: usize, universe: u64) -> Result<usize> {
    let sets = check_sets(count, set_len, universe)?;
    stream_len(sets, universe)
}

/// The bitmap of `sets` sets of `set_len` strictly ascending indices below `universe`.
pub fn bitmap_encode(indices: &[u32], set_len: usize, universe: u64) -> Result<Vec<u8>> {
    let sets = check_sets(indices.len(), set_len, universe)?;
    let mut out = vec![0u8; stream_len(sets, universe)?];
    // Validate first (the gaps walk checks order and range), then set the bits.
    for_each_gap(indices, set_len, universe, |_| {})?;
    if set_len > 0 {
        for (s, set) in indices.chunks_exact(set_len).enumerate() {
            let base = s as u64 * universe;
            for &v in set {
                let bit = base + u64::from(v);
                out[(bit / 8) as usize] |= 1 << (bit % 8);
            }
        }
    }
    Ok(out)
}

/// Decodes `count` indices in sets of `set_len` from a bitmap, which must be exactly
/// `ceil(sets·universe / 8)` bytes with zero padding bits and exactly `set_len` positions in
/// every set.
pub fn bitmap_decode(data: &[u8], count: usize, set_len: usize, universe: u64) -> Result<Vec<u32>> {
    let sets = check_sets(count, set_len, universe)?;
    let expected = stream_len(sets, universe)?;
    if data.len() != expected {
        return Err(WireError::LengthMismatch {
            expected,
            got: data.len(),
        });
    }
    let total = stream_bits(sets, universe)?;
    let used = (total % 8) as u32;
    if used != 0 {
        let last = data[expected - 1];
        if last >> used != 0 {
            return Err(WireError::NonzeroPaddingBits {
                byte_index: expected - 1,
                bits: (last >> used) << used,
            });
        }
    }
    // Every set's population is checked before the output (count values) is filled, so a
    // hostile bitmap cannot make it grow past `count`.
    let mut out = Vec::with_capacity(count);
    for s in 0..sets {
        let start = s as u64 * universe;
        let before = out.len();
        collect_ones(data, start, start + universe, set_len, &mut out);
        let ones = (out.len() - before) as u64;
        if ones != set_len as u64 {
            let ones = if ones as usize > set_len {
                popcount(data, start, start + universe)
            } else {
                ones
            };
            return Err(WireError::BitmapCount {
                set: s,
                ones,
                expected: set_len,
            });
        }
    }
    Ok(out)
}

/// Pushes the positions (relative to `start`) of the one bits in stream bits `[start, end)`,
/// stopping once more than `limit` were found.
fn collect_ones(data: &[u8], start: u64, end: u64, limit: usize, out: &mut Vec<u32>) {
    let mut found = 0usize;
    let mut bit = start;
    while bit < end {
        let byte_index = (bit / 8) as usize;
        let offset = (bit % 8) as u32;
        let take = (8 - offset).min((end - bit) as u32);
        let mut byte = (data[byte_index] >> offset) & (((1u16 << take) - 1) as u8);
        while byte != 0 {
            let tz = byte.trailing_zeros();
            if found == limit {
                // One more than the set may hold: signal by pushing it and stop.
                out.push((bit - start + u64::from(tz)) as u32);
                return;
            }
            out.push((bit - start + u64::from(tz)) as u32);
            found += 1;
            byte &= byte - 1;
        }
        bit += u64::from(take);
    }
}

fn popcount(data: &[u8], start: u64, end: u64) -> u64 {
    (start..end)
        .filter(|&b| data[(b / 8) as usize] >> (b % 8) & 1 == 1)
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_bytes() {
        // Two sets of 2 in a universe of 5: {0, 3} and {1, 4} -> bits 0, 3, 6, 9.
        let enc = bitmap_encode(&[0, 3, 1, 4], 2, 5).unwrap();
        assert_eq!(enc, vec![0b0100_1001, 0b10]);
        assert_eq!(bitmap_decode(&enc, 4, 2, 5).unwrap(), vec![0, 3, 1, 4]);
        assert_eq!(bitmap_len(4, 2, 5).unwrap(), 2);
    }

    #[test]
    fn rejects_bad_bitmaps() {
        // The same bytes read with another universe are other sets.
        assert_eq!(
            bitmap_decode(&[0b0100_1001, 0b10], 4, 2, 6).unwrap(),
            vec![0, 3, 0, 3]
        );
        assert!(matches!(
            bitmap_decode(&[0b0100_1001, 0b110], 4, 2, 5),
            Err(WireError::NonzeroPaddingBits { byte_index: 1, .. })
        ));
        assert_eq!(
            bitmap_decode(&[0b0100_1011, 0b10], 4, 2, 5),
            Err(WireError::BitmapCount {
                set: 0,
                ones: 3,
                expected: 2
            })
        );
        assert_eq!(
            bitmap_decode(&[0b0100_0001, 0b10], 4, 2, 5),
            Err(WireError::BitmapCount {
                set: 0,
                ones: 1,
                expected: 2
            })
        );
        assert_eq!(
            bitmap_decode(&[0b0100_1001], 4, 2, 5),
            Err(WireError::LengthMismatch {
                expected: 2,
                got: 1
            })
        );
        assert!(bitmap_encode(&[3, 1], 2, 5).is_err());
        assert!(bitmap_encode(&[3, 5], 2, 5).is_err());
    }

    proptest! {
        #[test]
        fn prop_round_trip(universe in 1u64..300, set_len in 0usize..40, sets in 0usize..6, seed in any::<u64>()) {
            let set_len = set_len.min(universe as usize);
            let mut state = seed | 1;
            let mut idx = Vec::new();
            for _ in 0..if set_len == 0 { 0 } else { sets } {
                let mut set = std::collections::BTreeSet::new();
                while set.len() < set_len {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    set.insert((state % universe) as u32);
                }
                idx.extend(set);
            }
            let enc = bitmap_encode(&idx, set_len, universe).unwrap();
            prop_assert_eq!(enc.len(), bitmap_len(idx.len(), set_len, universe).unwrap());
            prop_assert_eq!(bitmap_decode(&enc, idx.len(), set_len, universe).unwrap(), idx);
        }

        #[test]
        fn prop_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..64),
                                            count in 0usize..100, set_len in 1usize..10, universe in 1u64..200) {
            let count = count - count % set_len;
            if let Ok(out) = bitmap_decode(&data, count, set_len, universe) {
                prop_assert_eq!(bitmap_encode(&out, set_len, universe).unwrap(), data);
            }
        }
    }
}
