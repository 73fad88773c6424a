//! The rows route of the exact DCT decode (the route other chunk shapes take), stage by stage:
//! `scatter_basis_rows` and `combine_level_sums` never panic on any positions, levels, sums, sizes,
//! grid or thread count, write nothing when they refuse, and where they accept equal the formulas
//! of their docs computed plainly here, bit for bit (the sums are of integers, so exact in any order).
#![no_main]

use gradwire_core::{combine_level_sums, scatter_basis_rows};
use libfuzzer_sys::fuzz_target;

/// What a refused call must leave in its output.
const UNTOUCHED: f64 = 7.0;

fn scatter(params: &[u8; 5], data: &[u8]) {
    let [r, l, k, c, t] = *params;
    let (rows, last, k, chunks, threads) = (
        usize::from(r % 9),
        usize::from(l % 9),
        usize::from(k % 12),
        usize::from(c % 6),
        usize::from(t % 4),
    );
    // now and then one basis value too few or an output slot too many: the size checks
    let basis_len = (last * last).saturating_sub(usize::from(r >= 250));
    let basis: Vec<f64> = (0..basis_len)
        .map(|i| (i as f64 * 37.0) % 2048.0 - 1024.0)
        .collect();
    let positions: Vec<i64> = data
        .iter()
        .take(k * chunks)
        .map(|&b| i64::from(b) - 4)
        .collect();
    let levels: Vec<i16> = positions.iter().map(|&p| (p * 91 % 255) as i16).collect();
    let len = rows * chunks * 2 * last + usize::from(l >= 250);
    let mut out = vec![UNTOUCHED; len];
    if scatter_basis_rows(
        &positions, &levels, k, rows, last, &basis, threads, &mut out,
    )
    .is_err()
    {
        assert!(
            out.iter().all(|&v| v == UNTOUCHED),
            "a refused scatter wrote"
        );
        return;
    }
    if k == 0 || positions.is_empty() {
        return;
    }
    let chunks = positions.len() / k;
    let mut want = vec![0.0; out.len()];
    for (j, (&p, &u)) in positions.iter().zip(&levels).enumerate() {
        let (chunk, p) = (j / k, p as usize);
        let (row, col) = (p / last, p % last);
        for n in 0..last {
            let b = basis[col * last + n];
            want[((row * chunks + chunk) * 2) * last + n] += f64::from(u) * b;
            want[((row * chunks + chunk) * 2 + 1) * last + n] += b;
        }
    }
    assert_eq!(
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

fn combine(params: &[u8; 6], data: &[u8]) {
    let [r, l, c, f, g, t] = *params;
    let (rows, last, chunks, first, grid_cols, threads) = (
        usize::from(r % 7),
        usize::from(l % 7),
        usize::from(c % 5),
        usize::from(f % 4),
        usize::from(g % 4),
        usize::from(t % 4),
    );
    let total = usize::from(c / 5 % 8); // chunks in the whole output, maybe fewer than first + chunks
    let mut values = data.iter().map(|&b| f64::from(b as i8));
    let sums: Vec<f64> = (0..rows * chunks * 2 * last + usize::from(r >= 250))
        .map(|_| values.next().unwrap_or(1.0))
        .collect();
    let scales: Vec<f64> = (0..chunks).map(|i| (i + 1) as f64 / 1024.0).collect();
    let mins: Vec<f64> = (0..chunks.saturating_sub(usize::from(l >= 250)))
        .map(|i| -(i as f64) / 8.0)
        .collect();
    let mut out = vec![UNTOUCHED as f32; total * rows * last];
    let got = combine_level_sums(
        &sums, &scales, &mins, rows, last, first, grid_cols, threads, &mut out,
    );
    if got.is_err() {
        assert!(
            out.iter().all(|&v| v == UNTOUCHED as f32),
            "a refused combine wrote"
        );
        return;
    }
    let mut want = vec![UNTOUCHED as f32; out.len()];
    for chunk in 0..chunks {
        let c = first + chunk;
        for row in 0..rows {
            for n in 0..last {
                let at = ((row * chunks + chunk) * 2) * last + n;
                let value: f64 = sums[at] * scales[chunk] + sums[at + last] * mins[chunk];
                want[((c / grid_cols * rows + row) * grid_cols + c % grid_cols) * last + n] =
                    value as f32;
            }
        }
    }
    assert_eq!(
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

fuzz_target!(|input: &[u8]| {
    let [which, a, b, c, d, e, f, data @ ..] = input else {
        return;
    };
    if which % 2 == 0 {
        scatter(&[*a, *b, *c, *d, *e], data);
    } else {
        combine(&[*a, *b, *c, *d, *e, *f], data);
    }
});
