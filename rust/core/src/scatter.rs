//! Adding sparse rows into a dense buffer: the transform-domain sum of DCT records, where each
//! sender's `k` coefficients per chunk are added into the chunk's row of the summed coefficients.

use crate::error::{Result, WireError};

/// For each row `r` (of `positions.len() / k`), `out[r · row_len + p] = out[r · row_len + p] +
/// values[j] · weight` over the row's `k` entries `(p, values[j])`, in order: one correctly rounded
/// float32 multiply and one add per entry (none fused), so the bits of the elementwise torch
/// expression `out[idx] + values * weight` — and with `weight == 1` the product is `values[j]`
/// exactly.
///
/// Errors: `positions` and `values` of different lengths (`sparse_length_mismatch`), not whole rows
/// of `k` (`not_whole_sets`), `out` not `rows · row_len` long (`output_size_mismatch`), a position
/// outside `0..row_len` (`index_out_of_range`). Nothing is written unless every check passes.
pub fn scatter_add_rows(
    positions: &[i64],
    values: &[f32],
    k: usize,
    row_len: usize,
    weight: f32,
    out: &mut [f32],
) -> Result<()> {
    if positions.len() != values.len() {
        return Err(WireError::SparseLengthMismatch {
            positions: positions.len(),
            levels: values.len(),
        });
    }
    if k == 0 || positions.len() % k != 0 {
        if positions.is_empty() && out.is_empty() {
            return Ok(());
        }
        return Err(WireError::NotWholeSets {
            count: positions.len(),
            set_len: k,
        });
    }
    let rows = positions.len() / k;
    let needed = rows.saturating_mul(row_len);
    if out.len() != needed {
        return Err(WireError::OutputSizeMismatch {
            needed,
            got: out.len(),
        });
    }
    if let Some((index, &p)) = positions
        .iter()
        .enumerate()
        .find(|&(_, &p)| usize::try_from(p).map_or(true, |p| p >= row_len))
    {
        return Err(WireError::IndexOutOfRange {
            index,
            value: p as u64,
            universe: row_len as u64,
        });
    }
    if positions.is_empty() {
        // No rows: nothing to add (and `row_len` may be 0, which `chunks_exact_mut` refuses).
        return Ok(());
    }
    for ((row_out, row_pos), row_vals) in out
        .chunks_exact_mut(row_len)
        .zip(positions.chunks_exact(k))
        .zip(values.chunks_exact(k))
    {
        for (&p, &v) in row_pos.iter().zip(row_vals) {
            // Checked above: every position lies in the row.
            let o = &mut row_out[p as usize];
            *o += v * weight;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn adds_each_row_into_its_own_slice() {
        let mut out = vec![1.0f32; 8];
        scatter_add_rows(&[0, 3, 1, 2], &[2.0, 4.0, 8.0, 16.0], 2, 4, 0.5, &mut out).unwrap();
        assert_eq!(out, vec![2.0, 1.0, 1.0, 3.0, 1.0, 5.0, 9.0, 1.0]);
    }

    #[test]
    fn bad_input_is_a_named_error_and_writes_nothing() {
        let mut out = vec![0.0f32; 8];
        let e = scatter_add_rows(&[0, 4], &[1.0, 1.0], 1, 4, 1.0, &mut out).unwrap_err();
        assert_eq!(
            e,
            WireError::IndexOutOfRange {
                index: 1,
                value: 4,
                universe: 4
            }
        );
        let e = scatter_add_rows(&[0, -1], &[1.0, 1.0], 1, 4, 1.0, &mut out).unwrap_err();
        assert!(matches!(e, WireError::IndexOutOfRange { index: 1, .. }));
        let e = scatter_add_rows(&[0, 1, 2], &[1.0; 3], 2, 4, 1.0, &mut out).unwrap_err();
        assert!(matches!(e, WireError::NotWholeSets { .. }));
        let e = scatter_add_rows(&[0, 1], &[1.0], 1, 4, 1.0, &mut out).unwrap_err();
        assert!(matches!(e, WireError::SparseLengthMismatch { .. }));
        let e = scatter_add_rows(&[0], &[1.0], 1, 4, 1.0, &mut out).unwrap_err();
        assert_eq!(e, WireError::OutputSizeMismatch { needed: 4, got: 8 });
        assert!(out.iter().all(|&v| v == 0.0));
        scatter_add_rows(&[], &[], 0, 4, 1.0, &mut []).unwrap();
    }

    #[test]
    fn no_rows_of_length_zero_is_an_empty_sum() {
        // found by the scatter_add_rows fuzz target: k > 0, no positions, rows of length 0 panicked
        scatter_add_rows(&[], &[], 3, 0, 1.0, &mut []).unwrap();
        let e = scatter_add_rows(&[0], &[1.0], 1, 0, 1.0, &mut []).unwrap_err();
        assert!(matches!(e, WireError::IndexOutOfRange { index: 0, .. }));
    }

    proptest! {
        #[test]
        fn equals_the_elementwise_definition(
            seed in any::<u64>(), rows in 0usize..6, row_len in 1usize..20, weight in -3.0f32..3.0,
        ) {
            let k = 1 + (seed as usize) % row_len;
            let mut positions = Vec::new();
            let mut values = Vec::new();
            for r in 0..rows {
                // k distinct positions, in an order that depends on the seed
                let start = (seed as usize).wrapping_add(r * 7) % row_len;
                positions.extend((0..k).map(|j| ((start + j * 3) % row_len) as i64));
                values.extend((0..k).map(|j| ((seed >> (j % 32)) as u32 as f32).sqrt() * 0.001 - 0.03));
            }
            let distinct = positions.chunks(k.max(1)).all(|row| {
                let mut s = row.to_vec();
                s.sort_unstable();
                s.dedup();
                s.len() == row.len()
            });
            prop_assume!(distinct);
            let base: Vec<f32> = (0..rows * row_len).map(|i| i as f32 * 0.37 - 1.0).collect();
            let mut got = base.clone();
            scatter_add_rows(&positions, &values, k, row_len, weight, &mut got).unwrap();
            let mut want = base;
            for (j, (&p, &v)) in positions.iter().zip(&values).enumerate() {
                let at = (j / k) * row_len + p as usize;
                let product = v * weight;
                want[at] += product;
            }
            prop_assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}
