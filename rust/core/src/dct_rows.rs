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
use crate::threads::run_joined;

/// Writes each chunk's two channels into `out`, laid out `(rows, chunks, 2, last)` row-major:
/// `out[((row · chunks + chunk) · 2 + 0) · last + n] = Σ u · basis[col · last + n]` (levels) and
/// `out[((row · chunks + chunk) · 2 + 1) · last + n] = Σ basis[col · last + n]` (offsets), the sums
/// over the chunk's coefficients in that row.
///
/// `positions` and `levels` hold `chunks · k` entries, chunk by chunk; positions must lie below
/// `rows · last`. `basis` is the `last × last` integer basis, row `f` the frequency `f`. `out` is
/// overwritten (its previous contents do not matter) and must hold exactly `rows · chunks · 2 ·
/// last` values. Levels are used as given (the record checker bounds them); positions are checked.
///
/// Up to `threads` threads each own a contiguous range of rows (so no two write the same value);
/// the sums are exact, so the result does not depend on the thread count.
#[allow(clippy::too_many_arguments)]
pub fn scatter_basis_rows(
    positions: &[i64],
    levels: &[i16],
    k: usize,
    rows: usize,
    last: usize,
    basis: &[f64],
    threads: usize,
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
    if chunks == 0 {
        return Ok(());
    }
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
    let row_len = chunks * 2 * last;
    let shift = last.is_power_of_two().then(|| last.trailing_zeros());
    // checked above: 0 <= p < universe; a shift where `last` allows (a division is ~30 cycles)
    let row_of = |p: i64| match shift {
        Some(sh) => (p as usize) >> sh,
        None => p as usize / last,
    };
    // One thread's share: chunks `first..first + count`, whose part of each output row is
    // `rows_out[row]`. Coefficients of one chunk row that follow each other (all of them when
    // positions ascend, as decoders give them) are summed in registers, LANES outputs at a time,
    // and the sums added to the output once per run.
    let scatter = |first: usize, count: usize, rows_out: &mut [&mut [f64]]| {
        for r in rows_out.iter_mut() {
            r.fill(0.0);
        }
        let (lo, hi) = (first * k, (first + count) * k);
        let mut j = lo;
        while j < hi {
            let row = row_of(positions[j]);
            let chunk_end = (j / k + 1) * k;
            let mut run_end = j + 1;
            while run_end < chunk_end && row_of(positions[run_end]) == row {
                run_end += 1;
            }
            let start = (j / k - first) * 2 * last;
            let (lv, off) = rows_out[row][start..start + 2 * last].split_at_mut(last);
            add_row_run(
                &positions[j..run_end],
                &levels[j..run_end],
                row * last,
                last,
                basis,
                lv,
                off,
            );
            j = run_end;
        }
    };
    let threads = threads.clamp(1, chunks);
    let per_thread = chunks.div_ceil(threads);
    // Each row of `out` cut at the threads' chunk boundaries: disjoint slices, one set per thread.
    let mut shares: Vec<Vec<&mut [f64]>> = (0..threads).map(|_| Vec::with_capacity(rows)).collect();
    for row in out.chunks_mut(row_len) {
        for (t, piece) in row.chunks_mut(per_thread * 2 * last).enumerate() {
            shares[t].push(piece);
        }
    }
    let mut shares = shares.into_iter().filter(|s| !s.is_empty()).enumerate();
    if threads == 1 {
        if let Some((_, mut rows_out)) = shares.next() {
            scatter(0, chunks, &mut rows_out);
        }
        return Ok(());
    }
    let scatter = &scatter;
    run_joined(shares.map(|(t, mut rows_out)| {
        let count = per_thread.min(chunks - t * per_thread);
        move || scatter(t * per_thread, count, &mut rows_out)
    }));
    Ok(())
}

/// Outputs summed at once in [`add_row_run`]: enough independent accumulators to keep the
/// floating-point adders busy, few enough to stay in registers.
const LANES: usize = 8;

/// Adds `Σ u · basis[col]` into `lv` and `Σ basis[col]` into `off` for the coefficients of one chunk
/// row (`positions` minus `row_start` are their columns), `LANES` outputs at a time.
fn add_row_run(
    positions: &[i64],
    levels: &[i16],
    row_start: usize,
    last: usize,
    basis: &[f64],
    lv: &mut [f64],
    off: &mut [f64],
) {
    let mut n0 = 0;
    // Whole groups of LANES outputs: fixed-size arrays, so the accumulators live in registers and
    // the inner loop unrolls into vector instructions.
    while n0 + LANES <= last {
        let mut acc_l = [0.0f64; LANES];
        let mut acc_o = [0.0f64; LANES];
        for (&p, &u) in positions.iter().zip(levels) {
            let at = (p as usize - row_start) * last + n0;
            // The slice is LANES long by construction: the conversion cannot fail.
            let b: &[f64; LANES] = basis[at..at + LANES]
                .try_into()
                .expect("a slice of LANES values");
            let u = f64::from(u);
            for i in 0..LANES {
                acc_l[i] += u * b[i];
                acc_o[i] += b[i];
            }
        }
        let (dst_l, dst_o) = (&mut lv[n0..n0 + LANES], &mut off[n0..n0 + LANES]);
        for i in 0..LANES {
            dst_l[i] += acc_l[i];
            dst_o[i] += acc_o[i];
        }
        n0 += LANES;
    }
    // The last `last % LANES` outputs, one at a time.
    for n in n0..last {
        let (mut acc_l, mut acc_o) = (0.0f64, 0.0f64);
        for (&p, &u) in positions.iter().zip(levels) {
            let v = basis[(p as usize - row_start) * last + n];
            acc_l += f64::from(u) * v;
            acc_o += v;
        }
        lv[n] += acc_l;
        off[n] += acc_o;
    }
}

/// Stage three of the exact decode: each chunk's float32 values from its two channels,
/// `value = (L · scale[chunk] + O · min[chunk]) as f32` with `L` and `O` the level and offset sums
/// at `sums[((row · chunks + chunk) · 2 + channel) · last + n]` (the layout [`scatter_basis_rows`]
/// writes and a matrix product over the rows keeps).
///
/// `scales` and `mins` already carry the power of two that undoes the fixed point (an exact
/// scaling). Each product rounds to float64, then their sum, then the cast to float32, as
/// docs/FORMAT.md section 5.2 writes it: Rust never fuses a multiply and an add on its own, so the
/// result is the same on every machine.
///
/// `out` is the whole decoded tensor, `total = out.len() / (rows · last)` chunks laid out as a grid
/// with `grid_cols` tiles per tile row: value `(chunk c, row, n)` goes to
/// `out[((c / grid_cols · rows + row) · grid_cols + c % grid_cols) · last + n]`. `grid_cols = 1` is
/// chunk-major (flat chunks); a matrix cut into `rows × last` tiles has `grid_cols` = its width /
/// `last`, so the values land in place and no tile-to-matrix copy follows. The call writes the
/// chunks `first .. first + scales.len()`, a block of a larger decode; nothing else of `out`.
#[allow(clippy::too_many_arguments)]
pub fn combine_level_sums(
    sums: &[f64],
    scales: &[f64],
    mins: &[f64],
    rows: usize,
    last: usize,
    first: usize,
    grid_cols: usize,
    threads: usize,
    out: &mut [f32],
) -> Result<()> {
    let chunks = scales.len();
    if mins.len() != chunks {
        return Err(WireError::LengthMismatch {
            expected: chunks,
            got: mins.len(),
        });
    }
    let overflow = || WireError::SizeOverflow {
        count: rows.saturating_mul(last).saturating_mul(chunks),
        bits: 64,
    };
    let per_chunk = rows.checked_mul(last).ok_or_else(overflow)?;
    let values = per_chunk.checked_mul(chunks).ok_or_else(overflow)?;
    let expected = values.checked_mul(2).ok_or_else(overflow)?;
    if sums.len() != expected {
        return Err(WireError::LengthMismatch {
            expected,
            got: sums.len(),
        });
    }
    if per_chunk == 0 {
        return check_out(out, 0);
    }
    let mut segments = chunk_segments(out, rows, last, first, chunks, grid_cols)?;
    if chunks == 0 {
        return Ok(());
    }
    let row_len = chunks * 2 * last;
    for_each_share(&mut segments, threads, |from, share| {
        for (i, chunk_rows) in share.iter_mut().enumerate() {
            let c = from + i;
            let (scale, min) = (scales[c], mins[c]);
            for (row, row_out) in chunk_rows.iter_mut().enumerate() {
                let at = row * row_len + c * 2 * last;
                let (level, offset) = sums[at..at + 2 * last].split_at(last);
                for ((o, &l), &z) in row_out.iter_mut().zip(level).zip(offset) {
                    let value: f64 = l * scale + z * min;
                    *o = value as f32;
                }
            }
        }
    });
    Ok(())
}

/// Runs `work(first, share)` on up to `threads` contiguous shares of `segments` (each entry one
/// chunk's row segments, `first` the share's first chunk), each share on a thread of its own; with one
/// share, on the calling thread.
pub(crate) fn for_each_share<F>(segments: &mut [Vec<&mut [f32]>], threads: usize, work: F)
where
    F: Fn(usize, &mut [Vec<&mut [f32]>]) + Sync,
{
    let chunks = segments.len();
    if chunks == 0 {
        return;
    }
    let per_thread = chunks.div_ceil(threads.clamp(1, chunks));
    if per_thread >= chunks {
        work(0, segments);
        return;
    }
    let work = &work;
    run_joined(
        segments
            .chunks_mut(per_thread)
            .enumerate()
            .map(|(t, share)| move || work(t * per_thread, share)),
    );
}

/// `out` (a whole tensor: a grid of `grid_cols` tiles of `rows × last` per tile row) cut into the
/// row segments of chunks `first .. first + chunks`, chunk by chunk, row by row: disjoint slices
/// that threads may fill independently. `tile_layout` or `output_size_mismatch` where the chunks
/// do not lie in the grid.
pub(crate) fn chunk_segments(
    out: &mut [f32],
    rows: usize,
    last: usize,
    first: usize,
    chunks: usize,
    grid_cols: usize,
) -> Result<Vec<Vec<&mut [f32]>>> {
    let per_chunk = rows * last;
    if per_chunk == 0 {
        check_out(out, 0)?;
        return Ok(Vec::new());
    }
    let total = out.len() / per_chunk;
    let end = first.checked_add(chunks).ok_or(WireError::SizeOverflow {
        count: chunks,
        bits: 64,
    })?;
    if out.len() % per_chunk != 0 {
        return Err(WireError::OutputSizeMismatch {
            needed: total.saturating_add(1).saturating_mul(per_chunk),
            got: out.len(),
        });
    }
    if grid_cols == 0 || total % grid_cols != 0 || end > total {
        return Err(WireError::TileLayout {
            first,
            end,
            grid_cols,
            total,
        });
    }
    let mut segments: Vec<Vec<&mut [f32]>> =
        (0..chunks).map(|_| Vec::with_capacity(rows)).collect();
    if chunks == 0 {
        return Ok(segments);
    }
    // Each output row (one row of a tile row) cut into the segments of its tiles.
    let tile_row_len = grid_cols * last;
    let (band_lo, band_hi) = (first / grid_cols, (end - 1) / grid_cols + 1);
    let band = &mut out[band_lo * rows * tile_row_len..band_hi * rows * tile_row_len];
    for (i, out_row) in band.chunks_exact_mut(tile_row_len).enumerate() {
        let first_of_band = (band_lo + i / rows) * grid_cols;
        for (col, segment) in out_row.chunks_exact_mut(last).enumerate() {
            let chunk = first_of_band + col;
            if (first..end).contains(&chunk) {
                segments[chunk - first].push(segment);
            }
        }
    }
    Ok(segments)
}

pub(crate) fn check_out<T>(out: &[T], needed: usize) -> Result<()> {
    if out.len() != needed {
        return Err(WireError::OutputSizeMismatch {
            needed,
            got: out.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
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
        scatter_basis_rows(&positions, &levels, k, rows, last, &b, 1, &mut out).unwrap();
        assert_eq!(out, dense(&positions, &levels, k, rows, last, &b));
    }

    #[test]
    fn positions_in_any_order_sum_the_same() {
        // rows revisited out of order within a chunk: each run is added, none overwrites another
        let (rows, last, k) = (3, 4, 4);
        let positions = [9i64, 1, 10, 2, 4, 0, 8, 5];
        let levels = [7i16, 255, 3, 0, 17, 1, 2, 200];
        let b = basis(last);
        for threads in [1, 2] {
            let mut out = vec![f64::NAN; rows * 2 * 2 * last];
            scatter_basis_rows(&positions, &levels, k, rows, last, &b, threads, &mut out).unwrap();
            assert_eq!(out, dense(&positions, &levels, k, rows, last, &b));
        }
    }

    #[test]
    fn rejects_bad_input_with_named_errors() {
        let b = basis(4);
        let mut out = vec![0.0; 2 * 2 * 4];
        let e = scatter_basis_rows(&[0, 8], &[1, 1], 2, 2, 4, &b, 1, &mut out).unwrap_err();
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
        let mut out = vec![7.0; 2 * 2 * 4];
        let e = scatter_basis_rows(&[0, 9], &[1, 1], 2, 2, 4, &b, 2, &mut out).unwrap_err();
        assert!(matches!(e, WireError::IndexOutOfRange { index: 1, .. }));
        assert!(
            out.iter().all(|&v| v == 7.0),
            "a refused input must leave out untouched, whatever it held"
        );
        let e = scatter_basis_rows(&[0, -1], &[1, 1], 2, 2, 4, &b, 1, &mut out).unwrap_err();
        assert!(matches!(e, WireError::IndexOutOfRange { index: 1, .. }));
        let e = scatter_basis_rows(&[0], &[1, 1], 1, 2, 4, &b, 1, &mut out).unwrap_err();
        assert_eq!(
            e,
            WireError::SparseLengthMismatch {
                positions: 1,
                levels: 2
            }
        );
        let e = scatter_basis_rows(&[0, 1, 2], &[1, 1, 1], 2, 2, 4, &b, 1, &mut out).unwrap_err();
        assert_eq!(
            e,
            WireError::NotWholeSets {
                count: 3,
                set_len: 2
            }
        );
        let e = scatter_basis_rows(&[0, 1], &[1, 1], 2, 2, 4, &b[..15], 1, &mut out).unwrap_err();
        assert_eq!(e, WireError::BasisSizeMismatch { side: 4, got: 15 });
        let e = scatter_basis_rows(&[0, 1], &[1, 1], 2, 2, 4, &b, 1, &mut out[..15]).unwrap_err();
        assert_eq!(
            e,
            WireError::OutputSizeMismatch {
                needed: 16,
                got: 15
            }
        );
        let e =
            scatter_basis_rows(&[0, 1], &[1, 1], 2, usize::MAX, 4, &b, 1, &mut out).unwrap_err();
        assert!(matches!(e, WireError::SizeOverflow { .. }));
    }

    #[test]
    fn no_chunks_is_an_empty_result_on_any_thread_count() {
        let b = basis(4);
        for threads in [0, 1, 2] {
            scatter_basis_rows(&[], &[], 3, 2, 4, &b, threads, &mut []).unwrap();
            combine_level_sums(&[], &[], &[], 2, 4, 0, 1, threads, &mut []).unwrap();
        }
        let e = scatter_basis_rows(&[], &[], 3, 2, 4, &b, 2, &mut [0.0]).unwrap_err();
        assert_eq!(e, WireError::OutputSizeMismatch { needed: 0, got: 1 });
    }

    #[test]
    fn combine_rejects_mismatched_lengths() {
        let mut out = vec![0f32; 2 * 3 * 4];
        let sums = vec![0.0; 2 * 2 * 3 * 4];
        let e =
            combine_level_sums(&sums, &[1.0, 1.0], &[0.0], 3, 4, 0, 1, 1, &mut out).unwrap_err();
        assert_eq!(
            e,
            WireError::LengthMismatch {
                expected: 2,
                got: 1
            }
        );
        let e = combine_level_sums(
            &sums[1..],
            &[1.0, 1.0],
            &[0.0, 0.0],
            3,
            4,
            0,
            1,
            1,
            &mut out,
        )
        .unwrap_err();
        assert_eq!(
            e,
            WireError::LengthMismatch {
                expected: 48,
                got: 47
            }
        );
        let e = combine_level_sums(
            &sums,
            &[1.0, 1.0],
            &[0.0, 0.0],
            3,
            4,
            0,
            1,
            1,
            &mut out[1..],
        )
        .unwrap_err();
        assert_eq!(
            e,
            WireError::OutputSizeMismatch {
                needed: 24,
                got: 23
            }
        );
        let e = combine_level_sums(
            &sums,
            &[1.0, 1.0],
            &[0.0, 0.0],
            usize::MAX,
            4,
            0,
            1,
            1,
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(e, WireError::SizeOverflow { .. }));
    }

    /// The block of chunks `b0..b1` of `sums` (laid out `(rows, chunks, 2, last)`) in the same layout.
    fn block_sums(
        sums: &[f64],
        rows: usize,
        chunks: usize,
        last: usize,
        b0: usize,
        b1: usize,
    ) -> Vec<f64> {
        let mut out = Vec::new();
        for row in 0..rows {
            let at = (row * chunks + b0) * 2 * last;
            out.extend_from_slice(&sums[at..at + (b1 - b0) * 2 * last]);
        }
        out
    }

    #[test]
    fn combine_puts_tiles_in_place_block_by_block() {
        // 2 tile rows of 3 tiles, each 2 × 2: a 4 × 6 matrix.
        let (rows, last, chunks, grid_cols) = (2, 2, 6, 3);
        let sums: Vec<f64> = (0..rows * chunks * 2 * last)
            .map(|i| (i * 37 % 101) as f64 - 50.0)
            .collect();
        let scales: Vec<f64> = (0..chunks).map(|c| 0.25 + c as f64).collect();
        let mins: Vec<f64> = (0..chunks).map(|c| -1.5 * c as f64).collect();
        let mut chunk_major = vec![f32::NAN; chunks * rows * last];
        combine_level_sums(&sums, &scales, &mins, rows, last, 0, 1, 1, &mut chunk_major).unwrap();
        let mut tiled = vec![f32::NAN; chunks * rows * last];
        // blocks that start and end inside tile rows, on one and on two threads
        for (b0, b1, threads) in [(0, 2, 1), (2, 5, 2), (5, 6, 1)] {
            let block = block_sums(&sums, rows, chunks, last, b0, b1);
            combine_level_sums(
                &block,
                &scales[b0..b1],
                &mins[b0..b1],
                rows,
                last,
                b0,
                grid_cols,
                threads,
                &mut tiled,
            )
            .unwrap();
        }
        for c in 0..chunks {
            for row in 0..rows {
                for n in 0..last {
                    let matrix_row = (c / grid_cols) * rows + row;
                    let at = (matrix_row * grid_cols + c % grid_cols) * last + n;
                    assert_eq!(
                        tiled[at].to_bits(),
                        chunk_major[(c * rows + row) * last + n].to_bits()
                    );
                }
            }
        }
    }

    #[test]
    fn combine_writes_only_its_block() {
        let (rows, last) = (2, 2);
        let sums = vec![1.0; rows * 2 * 2 * last];
        let mut out = vec![f32::NAN; 4 * rows * last];
        combine_level_sums(
            &sums,
            &[1.0, 1.0],
            &[0.0, 0.0],
            rows,
            last,
            1,
            2,
            1,
            &mut out,
        )
        .unwrap();
        // chunks 1 and 2 of a 2-wide grid: tile (0, 1) and tile (1, 0)
        let written: Vec<bool> = out.iter().map(|v| !v.is_nan()).collect();
        let want: Vec<bool> = (0..16)
            .map(|i| {
                let (r, col) = (i / 4, i % 4);
                (r < 2 && col >= 2) || (r >= 2 && col < 2)
            })
            .collect();
        assert_eq!(written, want);
    }

    #[test]
    fn combine_rejects_blocks_outside_the_grid() {
        let (rows, last) = (2, 2);
        let sums = vec![0.0; rows * 2 * 2 * last];
        let mut out = vec![0f32; 4 * rows * last];
        for (first, grid_cols) in [(3, 1), (0, 0), (0, 3), (usize::MAX, 1)] {
            let e = combine_level_sums(
                &sums,
                &[1.0, 1.0],
                &[0.0, 0.0],
                rows,
                last,
                first,
                grid_cols,
                1,
                &mut out,
            )
            .unwrap_err();
            assert!(
                matches!(
                    e,
                    WireError::TileLayout { .. } | WireError::SizeOverflow { .. }
                ),
                "{e}"
            );
        }
        assert!(out.iter().all(|&v| v == 0.0));
        let e = combine_level_sums(
            &sums,
            &[1.0, 1.0],
            &[0.0, 0.0],
            rows,
            last,
            3,
            1,
            1,
            &mut out,
        )
        .unwrap_err();
        assert_eq!(
            e,
            WireError::TileLayout {
                first: 3,
                end: 5,
                grid_cols: 1,
                total: 4
            }
        );
    }

    /// `k` distinct positions below `c` per chunk for `chunks` chunks, from a seeded permutation
    /// (ascending within each chunk when `sorted`, as decoders give them), and a level for each.
    pub(crate) fn seeded_sets(
        c: usize,
        k: usize,
        chunks: usize,
        seed: u64,
        sorted: bool,
    ) -> (Vec<i64>, Vec<i16>) {
        let mut positions = Vec::new();
        let mut levels = Vec::new();
        for chunk in 0..chunks {
            let mut all: Vec<i64> = (0..c as i64).collect();
            let mut s = seed.wrapping_add(chunk as u64);
            for i in (1..c).rev() {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                all.swap(i, (s >> 33) as usize % (i + 1));
            }
            let mut chosen = all[..k].to_vec();
            if sorted {
                chosen.sort_unstable();
            }
            positions.extend(chosen);
            levels.extend((0..k).map(|j| ((seed >> (j % 48)) & 255) as i16));
        }
        (positions, levels)
    }

    proptest! {
        #[test]
        fn any_positions_sum_like_the_dense_transform(
            rows in 1usize..5, last in 1usize..6, chunks in 1usize..4, seed in any::<u64>(),
        ) {
            let c = rows * last;
            let k = 1 + (seed as usize) % c;
            let (positions, levels) = seeded_sets(c, k, chunks, seed, true);
            let b = basis(last);
            let expected = dense(&positions, &levels, k, rows, last, &b);
            for threads in [1, 2, 3, 8] {
                // stale values in `out` must not leak through: it is overwritten
                let mut out = vec![f64::NAN; rows * chunks * 2 * last];
                scatter_basis_rows(&positions, &levels, k, rows, last, &b, threads, &mut out).unwrap();
                prop_assert_eq!(&out, &expected);
            }
            // the combine: the formula value by value, whatever the thread count
            let scales: Vec<f64> = (0..chunks).map(|c| 0.001 * (c as f64 + 1.0) / 3.0).collect();
            let mins: Vec<f64> = (0..chunks).map(|c| -0.5 / (c as f64 + 7.0)).collect();
            let mut want = vec![0f32; chunks * rows * last];
            for chunk in 0..chunks {
                for row in 0..rows {
                    for n in 0..last {
                        let at = (row * chunks + chunk) * 2 * last + n;
                        let l = expected[at] * scales[chunk];
                        let o = expected[at + last] * mins[chunk];
                        want[(chunk * rows + row) * last + n] = (l + o) as f32;
                    }
                }
            }
            for threads in [1, 2, 5] {
                let mut got = vec![f32::NAN; chunks * rows * last];
                combine_level_sums(&expected, &scales, &mins, rows, last, 0, 1, threads, &mut got).unwrap();
                prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
        }
    }
}
