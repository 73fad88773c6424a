//! The orthonormal 2-D DCT-II and its inverse (DCT-III) of a batch of chunks whose sides are powers
//! of two, by Lee's recursion: about `n/2 · log2 n` multiplications per length-`n` transform, against
//! the `n²` of the matrix product torch runs otherwise. The server's AdamW close spends most of its
//! time in two such transforms of the whole model (the aggregate's inverse, the downlink's forward).
//!
//! Lee's split of a length-`n` DCT-II `C[k] = Σ x[i] cos(π(2i+1)k / 2n)`:
//! `u[i] = x[i] + x[n-1-i]` and `v[i] = (x[i] − x[n-1-i]) / (2 cos(π(2i+1) / 2n))` for `i < n/2`;
//! then `C[2k]` is the half-length DCT-II of `u` and `C[2k+1] = D[k] + D[k+1]` with `D` that of `v`
//! (`D[n/2] = 0`). The inverse runs the transposed steps. A chunk is transformed along its rows axis
//! with whole rows as the butterflies' operands (contiguous, so the loops vectorize), transposed, and
//! transformed again. No multiply-add is fused (Rust does not contract `a * b + c`), so the bits are
//! the same on every x86-64 CPU, with or without AVX2. Not the exact decode (gradwire.dct.decode):
//! a float32 transform, accurate to about 1e-6 of the chunk's norm.

use crate::error::{Result, WireError};
use crate::threads::run_joined;

/// The fewest values a thread of its own is started for (about 0.2 ms of work).
const MIN_VALUES_PER_THREAD: usize = 1 << 16;

/// The longest side transformed here (the codecs' chunks are at most 1024 per side).
pub const MAX_SIDE: usize = 1024;

/// `1 / (2 cos(π(2i+1) / 2m))` for `i < m/2`, for every power of two `m` from 2 to `n`: index `log2 m`.
struct Factors {
    by_log: Vec<Vec<f32>>,
}

impl Factors {
    fn new(n: usize) -> Self {
        let mut by_log = vec![Vec::new()];
        let mut m = 2;
        while m <= n {
            by_log.push(
                (0..m / 2)
                    .map(|i| {
                        let angle = std::f64::consts::PI * (2 * i + 1) as f64 / (2 * m) as f64;
                        (0.5 / angle.cos()) as f32
                    })
                    .collect(),
            );
            m *= 2;
        }
        Factors { by_log }
    }

    fn of(&self, m: usize) -> &[f32] {
        &self.by_log[m.trailing_zeros() as usize]
    }
}

/// The orthonormal scale of coefficient `k` of a length-`n` transform.
fn scales(n: usize) -> Vec<f32> {
    (0..n)
        .map(|k| {
            let s = if k == 0 {
                1.0 / n as f64
            } else {
                2.0 / n as f64
            };
            s.sqrt() as f32
        })
        .collect()
}

#[inline(always)]
fn row(buf: &[f32], i: usize, w: usize) -> &[f32] {
    &buf[i * w..(i + 1) * w]
}

#[inline(always)]
fn row_mut(buf: &mut [f32], i: usize, w: usize) -> &mut [f32] {
    &mut buf[i * w..(i + 1) * w]
}

/// Four buffers of `len` from the front of `scratch`, and the rest (for the recursion below).
type Quarters<'a> = (
    &'a mut [f32],
    &'a mut [f32],
    &'a mut [f32],
    &'a mut [f32],
    &'a mut [f32],
);

#[inline(always)]
fn quarters(scratch: &mut [f32], len: usize) -> Quarters<'_> {
    let (a, rest) = scratch.split_at_mut(len);
    let (b, rest) = rest.split_at_mut(len);
    let (c, rest) = rest.split_at_mut(len);
    let (d, rest) = rest.split_at_mut(len);
    (a, b, c, d, rest)
}

/// Unnormalized DCT-II of `n` rows of width `w` (`x` → `out`); `scratch` holds at least `4·n·w`.
#[inline(always)]
fn forward(x: &[f32], out: &mut [f32], n: usize, w: usize, scratch: &mut [f32], f: &Factors) {
    if n == 1 {
        out[..w].copy_from_slice(&x[..w]);
        return;
    }
    let h = n / 2;
    let (u, v, even, d, rest) = quarters(scratch, h * w);
    let c = f.of(n);
    for (i, &ci) in c.iter().enumerate() {
        let (a, b) = (row(x, i, w), row(x, n - 1 - i, w));
        for ((uj, vj), (&aj, &bj)) in row_mut(u, i, w)
            .iter_mut()
            .zip(row_mut(v, i, w).iter_mut())
            .zip(a.iter().zip(b))
        {
            *uj = aj + bj;
            *vj = (aj - bj) * ci;
        }
    }
    forward(u, even, h, w, rest, f);
    forward(v, d, h, w, rest, f);
    for k in 0..h {
        row_mut(out, 2 * k, w).copy_from_slice(row(even, k, w));
        let odd = row_mut(out, 2 * k + 1, w);
        if k + 1 < h {
            for ((o, &p), &q) in odd.iter_mut().zip(row(d, k, w)).zip(row(d, k + 1, w)) {
                *o = p + q;
            }
        } else {
            odd.copy_from_slice(row(d, k, w));
        }
    }
}

/// The transpose of [`forward`]: `out[i] = Σ_k y[k] cos(π(2i+1)k / 2n)`; `scratch` as there.
#[inline(always)]
fn inverse(y: &[f32], out: &mut [f32], n: usize, w: usize, scratch: &mut [f32], f: &Factors) {
    if n == 1 {
        out[..w].copy_from_slice(&y[..w]);
        return;
    }
    let h = n / 2;
    let (even, odd, a, b, rest) = quarters(scratch, h * w);
    for k in 0..h {
        row_mut(even, k, w).copy_from_slice(row(y, 2 * k, w));
        let o = row_mut(odd, k, w);
        if k == 0 {
            o.copy_from_slice(row(y, 1, w));
        } else {
            for ((oj, &p), &q) in o
                .iter_mut()
                .zip(row(y, 2 * k + 1, w))
                .zip(row(y, 2 * k - 1, w))
            {
                *oj = p + q;
            }
        }
    }
    inverse(even, a, h, w, rest, f);
    inverse(odd, b, h, w, rest, f);
    let c = f.of(n);
    for (i, &ci) in c.iter().enumerate() {
        let (ar, br) = (row(a, i, w), row(b, i, w));
        for ((o, &p), &q) in row_mut(out, i, w).iter_mut().zip(ar).zip(br) {
            *o = p + ci * q;
        }
        for ((o, &p), &q) in row_mut(out, n - 1 - i, w).iter_mut().zip(ar).zip(br) {
            *o = p - ci * q;
        }
    }
}

/// `dst` (cols × rows) ← `src` (rows × cols) transposed.
#[inline(always)]
fn transpose(src: &[f32], dst: &mut [f32], rows: usize, cols: usize) {
    const B: usize = 16;
    for r0 in (0..rows).step_by(B) {
        for c0 in (0..cols).step_by(B) {
            for r in r0..(r0 + B).min(rows) {
                for c in c0..(c0 + B).min(cols) {
                    dst[c * rows + r] = src[r * cols + c];
                }
            }
        }
    }
}

/// One thread's buffers and tables for chunks of `rows × cols`.
struct ChunkTransform {
    rows: usize,
    cols: usize,
    row_factors: Factors,
    col_factors: Factors,
    row_scales: Vec<f32>,
    col_scales: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    scratch: Vec<f32>,
}

impl ChunkTransform {
    fn new(rows: usize, cols: usize) -> Self {
        let numel = rows * cols;
        ChunkTransform {
            rows,
            cols,
            row_factors: Factors::new(rows),
            col_factors: Factors::new(cols),
            row_scales: scales(rows),
            col_scales: scales(cols),
            a: vec![0.0; numel],
            b: vec![0.0; numel],
            scratch: vec![0.0; 4 * numel],
        }
    }

    /// The 2-D transform of one chunk (`rows × cols`, row-major) in place.
    #[inline(always)]
    fn run(&mut self, chunk: &mut [f32], inverse_transform: bool) {
        let (rows, cols) = (self.rows, self.cols);
        let (a, b, s) = (&mut self.a, &mut self.b, &mut self.scratch);
        if inverse_transform {
            // Scale by both axes' orthonormal factors first, then the two transposed recursions.
            for (r, &sr) in self.row_scales.iter().enumerate() {
                for ((o, &x), &sc) in row_mut(a, r, cols)
                    .iter_mut()
                    .zip(row(chunk, r, cols))
                    .zip(&self.col_scales)
                {
                    *o = x * sr * sc;
                }
            }
            inverse(a, b, rows, cols, s, &self.row_factors);
            transpose(b, a, rows, cols);
            inverse(a, b, cols, rows, s, &self.col_factors);
            transpose(b, chunk, cols, rows);
        } else {
            forward(chunk, a, rows, cols, s, &self.row_factors);
            transpose(a, b, rows, cols);
            forward(b, a, cols, rows, s, &self.col_factors);
            transpose(a, b, cols, rows);
            for (r, &sr) in self.row_scales.iter().enumerate() {
                for ((o, &x), &sc) in row_mut(chunk, r, cols)
                    .iter_mut()
                    .zip(row(b, r, cols))
                    .zip(&self.col_scales)
                {
                    *o = x * sr * sc;
                }
            }
        }
    }

    fn run_all(&mut self, data: &mut [f32], inverse_transform: bool, avx2_fma: bool) {
        #[cfg(target_arch = "x86_64")]
        if avx2_fma {
            /// The same loops compiled with AVX2 ([`crate::simd`]); no fused multiply-adds are formed,
            /// so the results are the baseline build's.
            #[target_feature(enable = "avx2,fma")]
            #[allow(unsafe_code)]
            unsafe fn run_avx2(t: &mut ChunkTransform, data: &mut [f32], inverse_transform: bool) {
                for chunk in data.chunks_exact_mut(t.rows * t.cols) {
                    t.run(chunk, inverse_transform);
                }
            }
            // SAFETY: `avx2_fma` is `has_avx2_fma()`: this CPU has both features, the one condition
            // for running code compiled with them.
            #[allow(unsafe_code)]
            unsafe {
                run_avx2(self, data, inverse_transform)
            };
            return;
        }
        for chunk in data.chunks_exact_mut(self.rows * self.cols) {
            self.run(chunk, inverse_transform);
        }
    }
}

fn is_side(n: usize) -> bool {
    n.is_power_of_two() && n <= MAX_SIDE
}

/// The orthonormal 2-D DCT-II (`inverse` false) or DCT-III (`inverse` true) of every chunk of
/// `data`, in place: `data` holds whole chunks of `rows × cols` values, row-major, each side a power
/// of two from 1 to [`MAX_SIDE`]. Up to `threads` threads share the chunks.
pub fn dct2_chunks(
    data: &mut [f32],
    rows: usize,
    cols: usize,
    inverse: bool,
    threads: usize,
) -> Result<()> {
    dct2_chunks_on(
        data,
        rows,
        cols,
        inverse,
        threads,
        crate::simd::has_avx2_fma(),
    )
}

fn dct2_chunks_on(
    data: &mut [f32],
    rows: usize,
    cols: usize,
    inverse: bool,
    threads: usize,
    avx2_fma: bool,
) -> Result<()> {
    let numel = rows.checked_mul(cols).unwrap_or(0);
    if !is_side(rows) || !is_side(cols) || data.len() % numel.max(1) != 0 {
        return Err(WireError::TransformShape {
            len: data.len(),
            rows,
            cols,
        });
    }
    let chunks = data.len() / numel;
    // A thread costs tens of microseconds to start: give each at least MIN_VALUES_PER_THREAD values.
    let threads = threads
        .clamp(1, chunks.max(1))
        .min((data.len() / MIN_VALUES_PER_THREAD).max(1));
    let per = chunks.div_ceil(threads) * numel;
    if threads == 1 || per == 0 {
        ChunkTransform::new(rows, cols).run_all(data, inverse, avx2_fma);
        return Ok(());
    }
    run_joined(
        data.chunks_mut(per)
            .map(|share| move || ChunkTransform::new(rows, cols).run_all(share, inverse, avx2_fma)),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook orthonormal 2-D DCT-II of one chunk, in float64.
    fn reference(x: &[f32], rows: usize, cols: usize) -> Vec<f64> {
        let basis = |n: usize, k: usize, i: usize| {
            let s = if k == 0 {
                (1.0 / n as f64).sqrt()
            } else {
                (2.0 / n as f64).sqrt()
            };
            s * (std::f64::consts::PI * (2 * i + 1) as f64 * k as f64 / (2 * n) as f64).cos()
        };
        let mut out = vec![0.0; rows * cols];
        for kr in 0..rows {
            for kc in 0..cols {
                let mut acc = 0.0;
                for r in 0..rows {
                    for c in 0..cols {
                        acc += basis(rows, kr, r) * basis(cols, kc, c) * x[r * cols + c] as f64;
                    }
                }
                out[kr * cols + kc] = acc;
            }
        }
        out
    }

    fn sample(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn matches_the_textbook_transform_and_inverts_it() {
        for &(rows, cols) in &[
            (1, 1),
            (1, 8),
            (8, 1),
            (2, 2),
            (4, 16),
            (16, 4),
            (32, 32),
            (64, 64),
        ] {
            let x = sample(3 * rows * cols, (rows * 131 + cols) as u64);
            let mut y = x.clone();
            dct2_chunks(&mut y, rows, cols, false, 2).unwrap();
            let norm = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            for c in 0..3 {
                let at = c * rows * cols..(c + 1) * rows * cols;
                let want = reference(&x[at.clone()], rows, cols);
                for (got, want) in y[at].iter().zip(&want) {
                    assert!(
                        (*got as f64 - want).abs() <= 1e-5 * norm,
                        "{rows}×{cols}: {got} vs {want}"
                    );
                }
            }
            dct2_chunks(&mut y, rows, cols, true, 1).unwrap();
            for (got, want) in y.iter().zip(&x) {
                assert!(
                    (got - want).abs() <= 1e-5 * norm as f32,
                    "{rows}×{cols} round trip: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn the_bits_do_not_depend_on_threads_or_avx2() {
        let x = sample(131 * 64 * 64, 7); // enough values for 8 threads of MIN_VALUES_PER_THREAD
        for inverse in [false, true] {
            let mut base = x.clone();
            dct2_chunks_on(&mut base, 64, 64, inverse, 1, false).unwrap();
            for (threads, avx2) in [(1, true), (3, false), (8, crate::simd::has_avx2_fma())] {
                let mut other = x.clone();
                dct2_chunks_on(
                    &mut other,
                    64,
                    64,
                    inverse,
                    threads,
                    avx2 && crate::simd::has_avx2_fma(),
                )
                .unwrap();
                assert!(base
                    .iter()
                    .zip(&other)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    #[test]
    fn shapes_it_cannot_transform_are_named_errors() {
        let mut data = vec![0.0f32; 96];
        for (rows, cols) in [(3, 32), (0, 4), (2048, 1), (64, 64)] {
            match dct2_chunks(&mut data, rows, cols, false, 1) {
                Err(WireError::TransformShape {
                    len: 96,
                    rows: r,
                    cols: c,
                }) => assert_eq!((r, c), (rows, cols)),
                other => panic!("{rows}×{cols}: {other:?}"),
            }
        }
        let mut empty: Vec<f32> = Vec::new();
        assert!(dct2_chunks(&mut empty, 8, 8, true, 4).is_ok());
    }
}
