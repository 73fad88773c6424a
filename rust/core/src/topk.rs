//! Top-k by magnitude, row by row: which coefficients of each DCT chunk a sender keeps.
//!
//! A row's magnitudes are ordered through their float32 bit patterns: with the sign bit cleared, the
//! bits of a float compare as unsigned integers in the order of the values (+0 < subnormals < normals
//! < +inf < NaN). So a row's `k`-th largest magnitude is found by counting its keys by their top
//! bits and one `select_nth_unstable` on the keys of the one bucket that holds it, and the kept
//! positions are one ascending scan: every position whose key is above that
//! threshold, and then the lowest positions whose key equals it until `k` are taken. The result is
//! ascending by construction (the order the wire wants), independent of the thread count, and ties
//! always go to the lowest positions, so the same row gives the same selection on any machine.
//! NaN counts as the largest magnitude (as in `torch.topk`), so a caller that checks the kept values
//! for finiteness sees it.

use crate::error::{Result, WireError};
use crate::threads::run_joined;

/// The magnitude of `v` as an integer with the same order: its bits with the sign cleared.
#[inline]
fn magnitude_key(v: f32) -> u32 {
    v.to_bits() & 0x7fff_ffff
}

/// Rows per thread below which a second thread costs more than it saves.
const MIN_ROWS_PER_THREAD: usize = 16;

/// For each row of `values` (rows of `cols` values, row-major), the positions of its `k` values of
/// largest magnitude in ascending order into `positions` and those values into `kept` (`k` per row,
/// row by row). Ties at the threshold go to the lowest positions.
///
/// Errors: `cols` is 0 or does not divide `values.len()` (`length_mismatch`), `k` is 0 or above
/// `cols` (`set_too_large`), or an output does not hold exactly `rows · k` slots
/// (`output_size_mismatch`). Up to `threads` threads share the rows.
pub fn select_topk_rows(
    values: &[f32],
    cols: usize,
    k: usize,
    threads: usize,
    positions: &mut [i64],
    kept: &mut [f32],
) -> Result<()> {
    if cols == 0 || values.len() % cols != 0 {
        return Err(WireError::LengthMismatch {
            expected: values.len().next_multiple_of(cols.max(1)),
            got: values.len(),
        });
    }
    if k == 0 || k > cols {
        return Err(WireError::SetTooLarge {
            set_len: k,
            universe: cols as u64,
        });
    }
    let rows = values.len() / cols;
    // rows · k ≤ values.len(), so this cannot overflow.
    let needed = rows * k;
    for got in [positions.len(), kept.len()] {
        if got != needed {
            return Err(WireError::OutputSizeMismatch { needed, got });
        }
    }
    if rows == 0 {
        return Ok(());
    }
    let threads = threads.clamp(1, rows.div_ceil(MIN_ROWS_PER_THREAD).max(1));
    let per_thread = rows.div_ceil(threads);
    if per_thread >= rows {
        select_rows(values, cols, k, positions, kept);
        return Ok(());
    }
    let shares = values
        .chunks(per_thread * cols)
        .zip(positions.chunks_mut(per_thread * k))
        .zip(kept.chunks_mut(per_thread * k));
    run_joined(shares.map(|((v, p), o)| move || select_rows(v, cols, k, p, o)));
    Ok(())
}

/// Buckets of the first pass: a key's top 11 bits (its exponent and 3 mantissa bits), so a
/// bucket spans an eighth of a binade.
const BUCKET_SHIFT: u32 = 20;
const BUCKETS: usize = 1 << (31 - BUCKET_SHIFT);

/// [`select_topk_rows`] on one thread, arguments already checked.
///
/// Per row: one pass computes the keys and counts them by bucket; counting buckets down from the
/// largest key finds the bucket that holds the `k`-th largest key, and only that bucket's keys —
/// usually a few — go through `select_nth_unstable` for the exact threshold. Then the ascending
/// scan. The threshold is the row's `k`-th largest key however it is found, so the selection is the
/// one the module doc defines.
fn select_rows(values: &[f32], cols: usize, k: usize, positions: &mut [i64], kept: &mut [f32]) {
    let mut keys = vec![0u32; cols];
    let mut counts = vec![0u32; BUCKETS];
    let mut candidates: Vec<u32> = Vec::with_capacity(cols);
    for ((row, pos), out) in values
        .chunks_exact(cols)
        .zip(positions.chunks_exact_mut(k))
        .zip(kept.chunks_exact_mut(k))
    {
        counts.fill(0);
        let mut largest = 0u32;
        for (key, &v) in keys.iter_mut().zip(row) {
            let m = magnitude_key(v);
            *key = m;
            counts[(m >> BUCKET_SHIFT) as usize] += 1;
            largest = largest.max(m);
        }
        // Down from the largest key's bucket: `above` keys lie in buckets over `bucket`, and
        // `bucket` holds the k-th largest (at least k keys in all, so the walk ends).
        let mut bucket = (largest >> BUCKET_SHIFT) as usize;
        let mut above = 0usize;
        while above + (counts[bucket] as usize) < k {
            above += counts[bucket] as usize;
            bucket -= 1;
        }
        candidates.clear();
        candidates.extend(
            keys.iter()
                .copied()
                .filter(|&m| (m >> BUCKET_SHIFT) as usize == bucket),
        );
        // The (k - above)-th largest candidate is the row's k-th largest key.
        let need = k - above;
        let at = candidates.len() - need;
        let threshold = *candidates.select_nth_unstable(at).1;
        let above_threshold = above
            + candidates[at + 1..]
                .iter()
                .filter(|&&m| m > threshold)
                .count();
        let mut ties_left = k - above_threshold;
        let mut n = 0;
        for (i, (&key, &v)) in keys.iter().zip(row).enumerate() {
            let take = key > threshold || (key == threshold && ties_left > 0);
            if take {
                if key == threshold {
                    ties_left -= 1;
                }
                pos[n] = i as i64;
                out[n] = v;
                n += 1;
                if n == k {
                    break;
                }
            }
        }
        debug_assert_eq!(n, k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition, slowly: sort positions by (magnitude descending, position ascending), keep k,
    /// sort them ascending.
    fn reference(row: &[f32], k: usize) -> Vec<i64> {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| {
            magnitude_key(row[b])
                .cmp(&magnitude_key(row[a]))
                .then(a.cmp(&b))
        });
        let mut kept: Vec<i64> = order[..k].iter().map(|&i| i as i64).collect();
        kept.sort_unstable();
        kept
    }

    fn run(values: &[f32], cols: usize, k: usize, threads: usize) -> (Vec<i64>, Vec<f32>) {
        let rows = values.len() / cols;
        let mut pos = vec![0i64; rows * k];
        let mut kept = vec![0f32; rows * k];
        select_topk_rows(values, cols, k, threads, &mut pos, &mut kept).unwrap();
        (pos, kept)
    }

    #[test]
    fn keeps_the_largest_magnitudes_in_ascending_positions() {
        let row = [0.5f32, -3.0, 2.0, -0.25, 1.0, -2.5];
        let (pos, kept) = run(&row, 6, 3, 1);
        assert_eq!(pos, vec![1, 2, 5]);
        assert_eq!(kept, vec![-3.0, 2.0, -2.5]);
    }

    #[test]
    fn ties_go_to_the_lowest_positions() {
        let row = [1.0f32, -1.0, 0.0, 1.0, -1.0, 0.0];
        assert_eq!(run(&row, 6, 3, 1).0, vec![0, 1, 3]);
        let zeros = [0.0f32, -0.0, 0.0, 0.0];
        assert_eq!(run(&zeros, 4, 2, 1).0, vec![0, 1]);
    }

    #[test]
    fn nan_and_infinity_rank_above_every_finite_value() {
        let row = [1e30f32, f32::NAN, 3.0, f32::NEG_INFINITY, 2.0];
        assert_eq!(run(&row, 5, 2, 1).0, vec![1, 3]);
    }

    #[test]
    fn k_equal_to_the_row_keeps_everything() {
        let row = [3.0f32, -1.0, 2.0];
        assert_eq!(run(&row, 3, 3, 1), (vec![0, 1, 2], row.to_vec()));
    }

    #[test]
    fn bad_arguments_are_named_errors() {
        let v = [1.0f32; 6];
        let (mut p, mut o) = (vec![0i64; 2], vec![0f32; 2]);
        assert!(matches!(
            select_topk_rows(&v, 4, 1, 1, &mut p, &mut o),
            Err(WireError::LengthMismatch {
                expected: 8,
                got: 6
            })
        ));
        assert!(matches!(
            select_topk_rows(&v, 0, 1, 1, &mut p, &mut o),
            Err(WireError::LengthMismatch { .. })
        ));
        assert!(matches!(
            select_topk_rows(&v, 3, 4, 1, &mut p, &mut o),
            Err(WireError::SetTooLarge {
                set_len: 4,
                universe: 3
            })
        ));
        assert!(matches!(
            select_topk_rows(&v, 3, 0, 1, &mut p, &mut o),
            Err(WireError::SetTooLarge { set_len: 0, .. })
        ));
        let mut short = vec![0i64; 1];
        assert!(matches!(
            select_topk_rows(&v, 3, 1, 1, &mut short, &mut o),
            Err(WireError::OutputSizeMismatch { needed: 2, got: 1 })
        ));
    }

    #[test]
    fn no_rows_is_an_empty_result() {
        select_topk_rows(&[], 4, 2, 2, &mut [], &mut []).unwrap();
    }

    /// Every row's selection (positions and kept bits) against [`reference`].
    fn matches_reference(
        values: &[f32],
        cols: usize,
        k: usize,
        threads: usize,
    ) -> Result<(), TestCaseError> {
        let (pos, kept) = run(values, cols, k, threads);
        for (r, row) in values.chunks_exact(cols).enumerate() {
            let want = reference(row, k);
            prop_assert_eq!(&pos[r * k..(r + 1) * k], &want[..]);
            for (j, &p) in want.iter().enumerate() {
                prop_assert_eq!(kept[r * k + j].to_bits(), row[p as usize].to_bits());
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn matches_the_sorted_definition_on_any_thread_count(
            // Few distinct magnitudes, so ties are common.
            raw in proptest::collection::vec(-4i8..=4, 1..400),
            cols in 1usize..40,
            k_frac in 0.0f64..1.0,
            threads in 1usize..5,
        ) {
            let rows = raw.len() / cols;
            let values: Vec<f32> = raw[..rows * cols].iter().map(|&x| x as f32 * 0.5).collect();
            let k = 1 + ((cols - 1) as f64 * k_frac) as usize;
            matches_reference(&values, cols, k, threads)?;
        }

        #[test]
        fn matches_the_sorted_definition_on_any_floats(
            // Any bit patterns (NaN, infinities, subnormals, both zeros), or values packed into one
            // bucket of the first pass (1 + a few ulps), so the bucket holds the whole threshold.
            bits in proptest::collection::vec(any::<u32>(), 1..600),
            packed in any::<bool>(),
            cols in 1usize..70,
            k_frac in 0.0f64..1.0,
            threads in 1usize..3,
        ) {
            let rows = bits.len() / cols;
            let values: Vec<f32> = bits[..rows * cols]
                .iter()
                .map(|&b| if packed { f32::from_bits(0x3f80_0000 + (b % 16)) * if b & 1 == 0 { 1.0 } else { -1.0 } } else { f32::from_bits(b) })
                .collect();
            let k = 1 + ((cols - 1) as f64 * k_frac) as usize;
            matches_reference(&values, cols, k, threads)?;
        }
    }
}
