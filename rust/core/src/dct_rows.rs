//! Stage one of the exact DCT decode (docs/FORMAT.md section 5.2), sparse.
//!
//! A chunk of shape `(..., last)` holds `k` kept coefficients at flat positions `p` (row-major:
//! `row = p / last`, `col = p % last`) with integer levels `u`. The inverse transform along the
//! chunk's last axis turns coefficient `(row, col)` into `u · B[col, :]`, `B` the integer basis of
//! size `last`: a row of `B` added into row `row` of the chunk. Done for all `k` coefficients this
//! costs `k · last` additions per chunk, where a dense transform of the scattered levels costs
//! `C · last`; the remaining axes are then transformed densely by the caller (a matrix product).
//!
//! Two channels are accumulated side by side, as the decode needs both: the levels (`Σ u · B[col]`)
//! and the grid offsets (`Σ B[col]`). Every term is an integer and every partial sum stays below
//! 2^53 for the bases of section 5.2, so float64 sums them exactly in any order: this kernel,
//! a GPU's scatter and a dense matrix product all give the same numbers.

use crate::error::{Result, WireError};

/// Adds each coefficient's basis row into `out`, laid out `(rows, chunks, 2, last)` row-major:
/// `out[((row · chunks + chunk) · 2 + 0) · last + n] += u · basis[col · last + n]` (levels) and
/// `out[((row · chunks + chunk) · 2 + 1) · last + n] += basis[col · last + n]` (offsets).
///
/// `positions` and `levels` hold `chunks · k` entries, chunk by chunk; positions must lie below
/// `rows · last`. `basis` is the `last × last` integer basis, row `f` the frequency `f`. `out`
/// is added to, not overwritten (pass zeros), and must hold exactly `rows · chunks · 2 · last`
/// values. Levels are used as given (the record checker bounds them); positions are checked.
pub fn scatter_basis_rows(
    positions: &[i64],
    levels: &[i16],
    k: usize,
    rows: usize,
    last: usize,
    basis: &[f64],
    out: &mut [f64],
) -> Result<()> {
    if positions.len() != levels.len() {
        return Err(WireError::SparseLengthMismatch {
            positions: positions.len(),
            levels: levels.len(),
        });
    }
    if k == 0 || positions.len() % k != 0 {
        if positions.is_empty() {
            return check_out(out, 0);
        }
        return Err(WireError::NotWholeSets {
            count: positions.len(),
            set_len: k,
        });
    }
    if last.checked_mul(last) != Some(basis.len()) || last == 0 {
        return Err(WireError::BasisSizeMismatch {
            side: last,
            got: basis.len(),
        });
    }
    let chunks = positions.len() / k;
    // f64 slots of `out`; on overflow the error names the saturated count.
    let overflow = || WireError::SizeOverflow {
        count: rows
            .saturating_mul(last)
            .saturating_mul(chunks)
            .saturating_mul(2),
        bits: 64,
    };
    let universe = rows.checked_mul(last).ok_or_else(overflow)?;
    let needed = universe
        .checked_mul(chunks)
        .and_then(|n| n.checked_mul(2))
        .ok_or_else(overflow)?;
    check_out(out, needed)?;
    // Every position is checked before anything is written: a refused input leaves `out` as it was.
    if let Some((index, &p)) = positions
        .iter()
        .enumerate()
        .find(|&(_, &p)| usize::try_from(p).map_or(true, |p| p >= universe))
    {
        return Err(WireError::IndexOutOfRange {
            index,
            value: p as u64,
            universe: universe as u64,
        });
    }
    for (i, (&p, &u)) in positions.iter().zip(levels).enumerate() {
        let chunk = i / k;
        let p = p as usize; // checked above: 0 <= p < universe
        let (row, col) = (p / last, p % last);
        let b = &basis[col * last..(col + 1) * last];
        let start = (row * chunks + chunk) * 2 * last;
        let (lv, off) = out[start..start + 2 * last].split_at_mut(last);
        let u = f64::from(u);
        for ((l, o), &v) in lv.iter_mut().zip(off.iter_mut()).zip(b) {
            *l += u * v;
            *o += v;
        }
    }
    Ok(())
}

fn check_out(out: &[f64], needed: usize) -> Result<()> {
    if out.len() != needed {
        return Err(WireError::OutputSizeMismatch {
            needed,
            got: out.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The dense reference: scatter the levels into a grid, multiply each row by the basis.
    fn dense(
        positions: &[i64],
        levels: &[i16],
        k: usize,
        rows: usize,
        last: usize,
        basis: &[f64],
    ) -> Vec<f64> {
        let chunks = positions.len() / k;
        let mut out = vec![0.0; rows * chunks * 2 * last];
        for chunk in 0..chunks {
            let mut grid = vec![(0.0f64, 0.0f64); rows * last];
            for j in 0..k {
                let p = positions[chunk * k + j] as usize;
                grid[p] = (f64::from(levels[chunk * k + j]), 1.0);
            }
            for row in 0..rows {
                for n in 0..last {
                    let (mut l, mut o) = (0.0, 0.0);
                    for f in 0..last {
                        let (u, one) = grid[row * last + f];
                        l += u * basis[f * last + n];
                        o += one * basis[f * last + n];
                    }
                    let at = (row * chunks + chunk) * 2 * last;
                    out[at + n] = l;
                    out[at + last + n] = o;
                }
            }
        }
        out
    }

    fn basis(last: usize) -> Vec<f64> {
        (0..last * last)
            .map(|i| ((i * 7919) % 2001) as f64 - 1000.0)
            .collect()
    }

    #[test]
    fn matches_the_dense_transform_of_the_scattered_levels() {
        let (rows, last, k) = (3, 4, 2);
        let positions = [0i64, 11, 5, 6];
        let levels = [255i16, 3, 0, 17];
        let b = basis(last);
        let mut out = vec![0.0; rows * 2 * 2 * last];
        scatter_basis_rows(&positions, &levels, k, rows, last, &b, &mut out).unwrap();
        assert_eq!(out, dense(&positions, &levels, k, rows, last, &b));
    }

    #[test]
    fn rejects_bad_input_with_named_errors() {
        let b = basis(4);
        let mut out = vec![0.0; 2 * 2 * 4];
        let e = scatter_basis_rows(&[0, 8], &[1, 1], 2, 2, 4, &b, &mut out).unwrap_err();
        assert_eq!(
            e,
            WireError::IndexOutOfRange {
                index: 1,
                value: 8,
                universe: 8
            }
        );
        assert!(
            out.iter().all(|&v| v == 0.0),
            "a refused input must leave out untouched"
        );
        let e = scatter_basis_rows(&[0, -1], &[1, 1], 2, 2, 4, &b, &mut out).unwrap_err();
        assert!(matches!(e, WireError::IndexOutOfRange { index: 1, .. }));
        let e = scatter_basis_rows(&[0], &[1, 1], 1, 2, 4, &b, &mut out).unwrap_err();
        assert_eq!(
            e,
            WireError::SparseLengthMismatch {
                positions: 1,
                levels: 2
            }
        );
        let e = scatter_basis_rows(&[0, 1, 2], &[1, 1, 1], 2, 2, 4, &b, &mut out).unwrap_err();
        assert_eq!(
            e,
            WireError::NotWholeSets {
                count: 3,
                set_len: 2
            }
        );
        let e = scatter_basis_rows(&[0, 1], &[1, 1], 2, 2, 4, &b[..15], &mut out).unwrap_err();
        assert_eq!(e, WireError::BasisSizeMismatch { side: 4, got: 15 });
        let e = scatter_basis_rows(&[0, 1], &[1, 1], 2, 2, 4, &b, &mut out[..15]).unwrap_err();
        assert_eq!(
            e,
            WireError::OutputSizeMismatch {
                needed: 16,
                got: 15
            }
        );
        let e = scatter_basis_rows(&[0, 1], &[1, 1], 2, usize::MAX, 4, &b, &mut out).unwrap_err();
        assert!(matches!(e, WireError::SizeOverflow { .. }));
    }

    proptest! {
        #[test]
        fn any_positions_sum_like_the_dense_transform(
            rows in 1usize..5, last in 1usize..6, chunks in 1usize..4, seed in any::<u64>(),
        ) {
            let c = rows * last;
            let k = 1 + (seed as usize) % c;
            let mut positions = Vec::new();
            let mut levels = Vec::new();
            for chunk in 0..chunks {
                // k distinct positions per chunk, from a seeded permutation
                let mut all: Vec<i64> = (0..c as i64).collect();
                let mut s = seed.wrapping_add(chunk as u64);
                for i in (1..c).rev() {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    all.swap(i, (s >> 33) as usize % (i + 1));
                }
                let mut chosen = all[..k].to_vec();
                chosen.sort_unstable();
                positions.extend(chosen);
                levels.extend((0..k).map(|j| ((seed >> (j % 48)) & 255) as i16));
            }
            let b = basis(last);
            let mut out = vec![0.0; rows * chunks * 2 * last];
            scatter_basis_rows(&positions, &levels, k, rows, last, &b, &mut out).unwrap();
            prop_assert_eq!(out, dense(&positions, &levels, k, rows, last, &b));
        }
    }
}
