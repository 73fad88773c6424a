//! decode_folded never panics on any positions, levels, sizes or thread count, and agrees with the
//! unfolded rows route (scatter, row product, combine) bit for bit wherever it accepts the input.
#![no_main]

use gradwire_core::{combine_level_sums, decode_folded, scatter_basis_rows, WireError};
use libfuzzer_sys::fuzz_target;

/// The DCT-II basis of size `n` on the integer grid 2^10, row `f` the frequency.
fn int_basis(n: usize) -> Vec<f64> {
    let mut b = Vec::with_capacity(n * n);
    for f in 0..n {
        let scale = if f == 0 {
            (1.0 / n as f64).sqrt()
        } else {
            (2.0 / n as f64).sqrt()
        };
        for i in 0..n {
            let angle = std::f64::consts::PI * (2 * i + 1) as f64 * f as f64 / (2 * n) as f64;
            b.push((scale * angle.cos() * 1024.0).round());
        }
    }
    b
}

fuzz_target!(|input: &[u8]| {
    let [r, l, k, c, t, g, data @ ..] = input else {
        return;
    };
    let (rows, last) = (usize::from(*r % 9), usize::from(*l % 9)); // odd and zero sides too
    let (k, chunks, threads) = (
        usize::from(*k % 12),
        usize::from(*c % 6),
        usize::from(*t % 4),
    );
    let grid_cols = usize::from(*g % 4);
    let positions: Vec<i64> = data
        .iter()
        .take(k * chunks)
        .map(|&b| i64::from(b) - 4)
        .collect();
    let levels: Vec<i16> = positions.iter().map(|&p| (p * 37 % 256) as i16).collect();
    let scales: Vec<f64> = (0..chunks).map(|i| 1e-6 * (i + 1) as f64).collect();
    let mins: Vec<f64> = (0..chunks).map(|i| -1e-4 * i as f64).collect();
    let (rb, cb) = (int_basis(rows), int_basis(last));
    let mut out = vec![0f32; chunks * rows * last];
    let got = decode_folded(
        &positions, &levels, k, rows, last, &rb, &cb, &scales, &mins, grid_cols, threads, &mut out,
    );
    if got.is_err() {
        assert!(out.iter().all(|&v| v == 0.0), "a refused input wrote");
        return;
    }
    if chunks == 0 || k == 0 || positions.len() != k * chunks {
        return;
    }
    let mut sums = vec![0.0; rows * chunks * 2 * last];
    scatter_basis_rows(&positions, &levels, k, rows, last, &cb, 1, &mut sums).unwrap();
    let width = chunks * 2 * last;
    let mut y = vec![0.0; sums.len()];
    for n in 0..rows {
        for f in 0..rows {
            for w in 0..width {
                y[n * width + w] += rb[f * rows + n] * sums[f * width + w];
            }
        }
    }
    let mut want = vec![0f32; out.len()];
    let r: Result<(), WireError> =
        combine_level_sums(&y, &scales, &mins, rows, last, 0, grid_cols, 1, &mut want);
    r.unwrap();
    assert_eq!(
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
});
