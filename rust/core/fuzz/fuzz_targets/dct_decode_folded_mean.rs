//! decode_folded_mean never panics on any senders, positions, levels, sizes, weights or thread
//! count, writes nothing when it refuses, and where it accepts equals each sender decoded by
//! decode_folded and combined elementwise (`acc = d_0 · w_0`, `acc = acc + d_i · w_i`) bit for bit.
#![no_main]

use gradwire_core::{decode_folded, decode_folded_mean, SenderLevels};
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

struct Sender {
    positions: Vec<i64>,
    levels: Vec<i16>,
    k: usize,
    scales: Vec<f64>,
    mins: Vec<f64>,
}

fuzz_target!(|input: &[u8]| {
    let [r, l, n, c, t, g, w, data @ ..] = input else {
        return;
    };
    let (rows, last) = (usize::from(*r % 9), usize::from(*l % 9)); // odd and zero sides too
    let (senders, chunks, threads) = (
        usize::from(*n % 5),
        usize::from(*c % 5),
        usize::from(*t % 4),
    );
    let grid_cols = usize::from(*g % 4);
    let mut bytes = data.iter().copied();
    let mut all = Vec::new();
    for i in 0..senders {
        let k = usize::from(bytes.next().unwrap_or(0) % 10);
        // a sender with one chunk too few now and then: the count check
        let mine = if bytes.len() % 7 == 3 {
            chunks.saturating_sub(1)
        } else {
            chunks
        };
        let positions: Vec<i64> = bytes
            .by_ref()
            .take(k * mine)
            .map(|b| i64::from(b) - 4)
            .collect();
        let levels = positions.iter().map(|&p| (p * 37 % 256) as i16).collect();
        let scales = (0..mine).map(|j| 1e-6 * (i + j + 1) as f64).collect();
        let mins = (0..mine).map(|j| -1e-4 * (i * 3 + j) as f64).collect();
        all.push(Sender {
            positions,
            levels,
            k,
            scales,
            mins,
        });
    }
    let weights: Vec<f32> = (0..senders)
        .map(|i| (f32::from(*w) + i as f32) / 97.0)
        .collect();
    let views: Vec<SenderLevels<'_>> = all
        .iter()
        .map(|s| SenderLevels {
            positions: &s.positions,
            levels: &s.levels,
            k: s.k,
            scales: &s.scales,
            mins: &s.mins,
        })
        .collect();
    let (rb, cb) = (int_basis(rows), int_basis(last));
    let len = chunks * rows * last;
    let mut out = vec![0f32; len];
    let got = decode_folded_mean(
        &views, &weights, rows, last, &rb, &cb, grid_cols, threads, &mut out,
    );
    if got.is_err() {
        assert!(out.iter().all(|&v| v == 0.0), "a refused input wrote");
        return;
    }
    let mut want = vec![0f32; len];
    for (i, (s, &wt)) in views.iter().zip(&weights).enumerate() {
        let mut d = vec![0f32; len];
        decode_folded(
            s.positions,
            s.levels,
            s.k,
            rows,
            last,
            &rb,
            &cb,
            s.scales,
            s.mins,
            grid_cols,
            1,
            &mut d,
        )
        .expect("every sender the mean accepted decodes on its own");
        for (a, &v) in want.iter_mut().zip(&d) {
            let p = v * wt;
            *a = if i == 0 { p } else { *a + p };
        }
    }
    assert_eq!(
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
});
