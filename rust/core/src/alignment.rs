//! Inner products of sparse vectors with their weighted sum, for the server's direction check
//! (`gradwire.aggregation.sender_alignment`): `dots[i] = ⟨uᵢ, Σⱼ wⱼ uⱼ⟩` and `squares[i] = |uᵢ|²`
//! of each sender's kept coefficients, in float64.
//!
//! The positions of each sender are strictly ascending, so the senders' runs inside any window of
//! positions are contiguous: the sum is formed one window at a time in a buffer that stays in the
//! cache, read back for each sender's product and cleared where it was written. Every position of
//! the sum adds the senders in order (`((w₀u₀ + w₁u₁) + w₂u₂) + …`, one rounded multiply and one
//! rounded add each), and each product runs over the sender's positions in order, so the results
//! are the same on every machine.

use crate::error::{Result, WireError};

/// Positions covered by one window of the sum.
const WINDOW: usize = 4096;

/// One sender's sparse vector: `values[j]` at position `positions[j]`, positions strictly
/// ascending and below the vectors' common `size`.
#[derive(Clone, Copy, Debug)]
pub struct SparseVector<'a> {
    pub positions: &'a [i64],
    pub values: &'a [f64],
}

fn check(v: &SparseVector<'_>, size: usize) -> Result<()> {
    if v.positions.len() != v.values.len() {
        return Err(WireError::SparseLengthMismatch {
            positions: v.positions.len(),
            levels: v.values.len(),
        });
    }
    let mut prev: Option<u64> = None;
    for (index, &p) in v.positions.iter().enumerate() {
        if p < 0 || p as u64 >= size as u64 {
            return Err(WireError::IndexOutOfRange {
                index,
                value: p as u64,
                universe: size as u64,
            });
        }
        let value = p as u64;
        if let Some(prev) = prev {
            if value <= prev {
                return Err(WireError::NotStrictlyAscending { index, prev, value });
            }
        }
        prev = Some(value);
    }
    Ok(())
}

/// `(dots, squares)`: for each vector `i`, `⟨uᵢ, Σⱼ weights[j] · uⱼ⟩` and `⟨uᵢ, uᵢ⟩`. Every vector
/// is checked first (lengths, positions in `0..size`, strictly ascending); a bad one is an error
/// and nothing is computed.
pub fn sparse_alignment(
    vectors: &[SparseVector<'_>],
    weights: &[f64],
    size: usize,
) -> Result<(Vec<f64>, Vec<f64>)> {
    if weights.len() != vectors.len() {
        return Err(WireError::OperandLength {
            operand: "weights",
            expected: vectors.len(),
            got: weights.len(),
        });
    }
    for v in vectors {
        check(v, size)?;
    }
    let n = vectors.len();
    let mut dots = vec![0.0f64; n];
    let squares: Vec<f64> = vectors
        .iter()
        .map(|v| v.values.iter().fold(0.0, |acc, &x| acc + x * x))
        .collect();
    let mut buf = vec![0.0f64; WINDOW.min(size.max(1))];
    let mut cursors = vec![0usize; n];
    let mut ends = vec![0usize; n];
    let mut start = 0usize;
    while start < size {
        // Skip positions no sender holds: the loop runs at most once per window holding a coefficient.
        match vectors
            .iter()
            .zip(&cursors)
            .filter_map(|(v, &c)| v.positions.get(c))
            .min()
        {
            Some(&next) => start = start.max(next as usize),
            None => break,
        }
        let stop = (start + WINDOW).min(size);
        for (i, v) in vectors.iter().enumerate() {
            let mut e = cursors[i];
            while e < v.positions.len() && (v.positions[e] as usize) < stop {
                e += 1;
            }
            ends[i] = e;
        }
        for (i, v) in vectors.iter().enumerate() {
            let w = weights[i];
            for j in cursors[i]..ends[i] {
                let at = v.positions[j] as usize - start;
                buf[at] += w * v.values[j];
            }
        }
        for (i, v) in vectors.iter().enumerate() {
            let mut acc = dots[i];
            for j in cursors[i]..ends[i] {
                acc += v.values[j] * buf[v.positions[j] as usize - start];
            }
            dots[i] = acc;
        }
        for (i, v) in vectors.iter().enumerate() {
            for j in cursors[i]..ends[i] {
                buf[v.positions[j] as usize - start] = 0.0;
            }
            cursors[i] = ends[i];
        }
        start = stop;
    }
    Ok((dots, squares))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dense(v: &SparseVector<'_>, size: usize) -> Vec<f64> {
        let mut out = vec![0.0; size];
        for (&p, &x) in v.positions.iter().zip(v.values) {
            out[p as usize] = x;
        }
        out
    }

    proptest! {
        #[test]
        fn matches_the_dense_products(
            size in 1usize..20_000,
            picks in prop::collection::vec(prop::collection::btree_map(0usize..20_000, -4.0f64..4.0, 0..300), 1..6),
            weights in prop::collection::vec(-2.0f64..2.0, 6),
        ) {
            let owned: Vec<(Vec<i64>, Vec<f64>)> = picks
                .iter()
                .map(|m| m.iter().filter(|(p, _)| **p < size).map(|(p, x)| (*p as i64, *x)).unzip())
                .collect();
            let vectors: Vec<SparseVector<'_>> =
                owned.iter().map(|(p, v)| SparseVector { positions: p, values: v }).collect();
            let w = &weights[..vectors.len()];
            let (dots, squares) = sparse_alignment(&vectors, w, size).unwrap();
            let dense_all: Vec<Vec<f64>> = vectors.iter().map(|v| dense(v, size)).collect();
            let total: Vec<f64> = (0..size).map(|k| dense_all.iter().zip(w).map(|(d, a)| a * d[k]).sum()).collect();
            for (i, d) in dense_all.iter().enumerate() {
                let want: f64 = d.iter().zip(&total).map(|(x, t)| x * t).sum();
                let sq: f64 = d.iter().map(|x| x * x).sum();
                prop_assert!((dots[i] - want).abs() <= 1e-9 * (1.0 + want.abs()));
                prop_assert!((squares[i] - sq).abs() <= 1e-9 * (1.0 + sq));
            }
        }
    }

    #[test]
    fn bad_vectors_are_named_errors() {
        let good = SparseVector {
            positions: &[1, 5],
            values: &[1.0, 2.0],
        };
        let cases: [(SparseVector<'_>, &str); 4] = [
            (
                SparseVector {
                    positions: &[1, 5],
                    values: &[1.0],
                },
                "sparse_length_mismatch",
            ),
            (
                SparseVector {
                    positions: &[1, 10],
                    values: &[1.0, 2.0],
                },
                "index_out_of_range",
            ),
            (
                SparseVector {
                    positions: &[-1, 3],
                    values: &[1.0, 2.0],
                },
                "index_out_of_range",
            ),
            (
                SparseVector {
                    positions: &[3, 3],
                    values: &[1.0, 2.0],
                },
                "not_strictly_ascending",
            ),
        ];
        for (bad, kind) in cases {
            let err = sparse_alignment(&[good, bad], &[1.0, 1.0], 10).unwrap_err();
            assert_eq!(err.kind(), kind, "{err}");
        }
        assert_eq!(
            sparse_alignment(&[good], &[1.0, 2.0], 10)
                .unwrap_err()
                .kind(),
            "operand_length"
        );
        assert_eq!(sparse_alignment(&[], &[], 0).unwrap(), (vec![], vec![]));
    }
}
