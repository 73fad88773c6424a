//! The exact DCT decode of 2-D chunks in one pass, with the basis folded in half
//! (docs/FORMAT.md section 5.2): half the work of the rows route ([`crate::dct_rows`]), the same
//! integers, so the same bits.
//!
//! The DCT-II basis is symmetric: `B[f, N-1-n] = (-1)^f · B[f, n]`, and rounding to the integer
//! grid keeps that exactly (checked: [`fold_basis_is_exact`]). So a sum over frequencies `Σ_f c_f ·
//! B[f, n]` splits into its even-`f` part `E[n]` and odd-`f` part `O[n]`, and for `n < N/2` the
//! outputs are `E[n] + O[n]` at `n` and `E[n] - O[n]` at `N-1-n`. Each coefficient is then added into
//! `N/2` values instead of `N`, and the product over the other axis becomes two products of half
//! size. Every term and partial sum is an integer bounded as before (below 2^53), so float64 sums
//! them exactly in any order — this kernel, a fused multiply-add, a GPU — and the decoded bits do not
//! change.
//!
//! A chunk of `rows × last` (both even) goes through three steps, all in cache:
//! 1. each chunk row's coefficients are summed into the folded halves of its slot (row `r` goes to
//!    slot `r / 2` if even, `rows / 2 + r / 2` if odd), two channels: levels and offsets;
//! 2. the slots are multiplied by the row basis: even slots by its even-frequency half, odd slots by
//!    its odd half, each slot's even- and odd-column halves apart, and only the (slot, half) pairs
//!    that hold terms — at most `k` of the `2 · rows`, so a sparse chunk costs a fraction of the
//!    dense product;
//! 3. both axes are unfolded and `float32(L · scale + O · min)` written in place in the output.
//!
//! Threads each take a contiguous range of chunks and run all three steps a chunk at a time, so
//! nothing waits on another thread or leaves the core's cache between steps. Where the CPU has AVX2
//! and FMA the steps run in a build that uses them ([`crate::simd`]); the integers are the same.

use crate::dct_rows::{check_out, chunk_segments, for_each_share};
use crate::error::{Result, WireError};

/// Whether `basis` (`n × n`, row `f` the frequency `f`) is exactly symmetric, `B[f, n-1-i] =
/// (-1)^f · B[f, i]` for every `f` and `i`, with `n` even: the condition for folding.
pub fn fold_basis_is_exact(basis: &[f64], n: usize) -> bool {
    if n == 0 || n % 2 != 0 || n.checked_mul(n) != Some(basis.len()) {
        return false;
    }
    basis.chunks_exact(n).enumerate().all(|(f, row)| {
        let sign = if f % 2 == 0 { 1.0 } else { -1.0 };
        (0..n / 2).all(|i| row[n - 1 - i] == sign * row[i])
    })
}

fn check_fold(basis: &[f64], n: usize) -> Result<()> {
    if n.checked_mul(n) != Some(basis.len()) || n == 0 {
        return Err(WireError::BasisSizeMismatch {
            side: n,
            got: basis.len(),
        });
    }
    if !fold_basis_is_exact(basis, n) {
        return Err(WireError::BasisNotFoldable { side: n });
    }
    Ok(())
}

/// Decodes every chunk of a 2-D-chunked tensor exactly: `out` gets `float32(L · scale + O · min)`
/// (each product and the sum rounded in float64, no fused multiply-add, as in
/// [`crate::combine_level_sums`]), `L = Σ u · B[p]` and `O = Σ B[p]` over the chunk's `k` coefficients
/// at positions `p` with levels `u`, `B[p]` the integer basis product of `row_basis` (`rows × rows`)
/// and `col_basis` (`last × last`).
///
/// `positions` and `levels` hold `k` entries per chunk; positions are checked (below `rows ·
/// last`), levels are used as given (the record checker bounds them). `scales` and `mins` (one per
/// chunk) already carry the fixed point's power of two. Both bases must fold exactly
/// (`basis_not_foldable`). `out` is the whole tensor as a grid of `grid_cols` tiles of `rows ×
/// last` per tile row (1: chunk-major) holding exactly the chunks given (`tile_layout`). Nothing is
/// written unless every check passes. Up to `threads` threads share the chunks; the sums are exact,
/// so the result does not depend on the thread count.
#[allow(clippy::too_many_arguments)]
pub fn decode_folded(
    positions: &[i64],
    levels: &[i16],
    k: usize,
    rows: usize,
    last: usize,
    row_basis: &[f64],
    col_basis: &[f64],
    scales: &[f64],
    mins: &[f64],
    grid_cols: usize,
    threads: usize,
    out: &mut [f32],
) -> Result<()> {
    decode_folded_on(
        positions,
        levels,
        k,
        rows,
        last,
        row_basis,
        col_basis,
        scales,
        mins,
        grid_cols,
        threads,
        out,
        crate::simd::has_avx2_fma(),
    )
}

/// [`decode_folded`], with AVX2 and FMA used only if `avx2_fma` (true only where the CPU has them):
/// the tests run both ways.
#[allow(clippy::too_many_arguments)]
fn decode_folded_on(
    positions: &[i64],
    levels: &[i16],
    k: usize,
    rows: usize,
    last: usize,
    row_basis: &[f64],
    col_basis: &[f64],
    scales: &[f64],
    mins: &[f64],
    grid_cols: usize,
    threads: usize,
    out: &mut [f32],
    avx2_fma: bool,
) -> Result<()> {
    let sender = SenderLevels {
        positions,
        levels,
        k,
        scales,
        mins,
    };
    // One sender at weight 1: each value stored as `d · 1 = d`, exactly.
    decode_folded_mean_on(
        &[sender],
        &[1.0],
        rows,
        last,
        row_basis,
        col_basis,
        grid_cols,
        threads,
        out,
        avx2_fma,
        false,
    )
}

/// One sender's record of a tensor as the exact decode reads it: `k` positions and levels per
/// chunk, and per chunk a scale and minimum (float64, the fixed point's power of two included).
#[derive(Clone, Copy, Debug)]
pub struct SenderLevels<'a> {
    pub positions: &'a [i64],
    pub levels: &'a [i16],
    pub k: usize,
    pub scales: &'a [f64],
    pub mins: &'a [f64],
}

impl SenderLevels<'_> {
    fn chunk(&self, chunk: usize) -> (&[i64], &[i16], f64, f64) {
        let at = chunk * self.k..(chunk + 1) * self.k;
        (
            &self.positions[at.clone()],
            &self.levels[at],
            self.scales[chunk],
            self.mins[chunk],
        )
    }
}

/// The number of chunks `sender` holds, after checking that its arrays agree (whole sets of `k`,
/// one scale and minimum per chunk) and that every position lies in a `rows × last` chunk.
fn check_sender(sender: &SenderLevels<'_>, rows: usize, last: usize) -> Result<usize> {
    let SenderLevels {
        positions,
        levels,
        k,
        scales,
        mins,
    } = *sender;
    if positions.len() != levels.len() {
        return Err(WireError::SparseLengthMismatch {
            positions: positions.len(),
            levels: levels.len(),
        });
    }
    if k == 0 || positions.len() % k != 0 {
        if positions.is_empty() && scales.is_empty() && mins.is_empty() {
            return Ok(0);
        }
        return Err(WireError::NotWholeSets {
            count: positions.len(),
            set_len: k,
        });
    }
    let chunks = positions.len() / k;
    for got in [scales.len(), mins.len()] {
        if got != chunks {
            return Err(WireError::LengthMismatch {
                expected: chunks,
                got,
            });
        }
    }
    let universe = rows * last; // both sides' squares fit in memory: no overflow
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
    Ok(chunks)
}

/// The weighted mean of several senders' records of one tensor, each decoded exactly as
/// [`decode_folded`] decodes it: `out = float32(d_0 · w_0)`, then `out = out + float32(d_i · w_i)`
/// for each further sender in order, `d_i` sender `i`'s decoded float32 value — two correctly
/// rounded float32 operations per sender, no fused multiply-add, so the same bits as decoding each
/// record and combining the tensors elementwise.
///
/// Each chunk is decoded for every sender while its output stays in cache: the decoded tensors are
/// never written out. Every sender must have the same number of chunks
/// (`sender_chunks_mismatch`); `k` may differ. `weights` holds one float32 per sender. The other
/// arguments, the checks and the threads are [`decode_folded`]'s; nothing is written unless every
/// check passes.
#[allow(clippy::too_many_arguments)]
pub fn decode_folded_mean(
    senders: &[SenderLevels<'_>],
    weights: &[f32],
    rows: usize,
    last: usize,
    row_basis: &[f64],
    col_basis: &[f64],
    grid_cols: usize,
    threads: usize,
    out: &mut [f32],
) -> Result<()> {
    decode_folded_mean_on(
        senders,
        weights,
        rows,
        last,
        row_basis,
        col_basis,
        grid_cols,
        threads,
        out,
        crate::simd::has_avx2_fma(),
        false,
    )
}

/// [`decode_folded_mean`] added onto what `out` holds: `out = out + float32(d_i · w_i)` for every
/// sender in order, the first one included — with one sender at weight −1, `out = out − d`, the bits of
/// decoding the record and subtracting it (error feedback's rest, with no decoded tensor written out).
/// Arguments, checks and threads as [`decode_folded_mean`]'s; nothing is written unless every check
/// passes.
#[allow(clippy::too_many_arguments)]
pub fn decode_folded_mean_accumulate(
    senders: &[SenderLevels<'_>],
    weights: &[f32],
    rows: usize,
    last: usize,
    row_basis: &[f64],
    col_basis: &[f64],
    grid_cols: usize,
    threads: usize,
    out: &mut [f32],
) -> Result<()> {
    decode_folded_mean_on(
        senders,
        weights,
        rows,
        last,
        row_basis,
        col_basis,
        grid_cols,
        threads,
        out,
        crate::simd::has_avx2_fma(),
        true,
    )
}

/// `accumulate`: the first sender is added onto `out` as the others are, not stored.
#[allow(clippy::too_many_arguments)]
fn decode_folded_mean_on(
    senders: &[SenderLevels<'_>],
    weights: &[f32],
    rows: usize,
    last: usize,
    row_basis: &[f64],
    col_basis: &[f64],
    grid_cols: usize,
    threads: usize,
    out: &mut [f32],
    avx2_fma: bool,
    accumulate: bool,
) -> Result<()> {
    if senders.is_empty() {
        return Err(WireError::NoSenders);
    }
    if weights.len() != senders.len() {
        return Err(WireError::LengthMismatch {
            expected: senders.len(),
            got: weights.len(),
        });
    }
    check_fold(row_basis, rows)?;
    check_fold(col_basis, last)?;
    let chunks = check_sender(&senders[0], rows, last)?;
    for (sender, s) in senders.iter().enumerate().skip(1) {
        let got = check_sender(s, rows, last)?;
        if got != chunks {
            return Err(WireError::SenderChunksMismatch {
                sender,
                chunks: got,
                expected: chunks,
            });
        }
    }
    check_out(out, chunks.saturating_mul(rows * last))?;
    if chunks == 0 {
        return Ok(());
    }
    let mut segments = chunk_segments(out, rows, last, 0, chunks, grid_cols)?;
    let decode_range = |from: usize, share: &mut [Vec<&mut [f32]>]| {
        let mut decoder = ChunkDecoder::new(rows, last, row_basis, col_basis, avx2_fma);
        for (c, chunk_rows) in share.iter_mut().enumerate() {
            let chunk = from + c;
            for (i, (sender, &w)) in senders.iter().zip(weights).enumerate() {
                let sink = if i == 0 && !accumulate {
                    Sink::Scale(w)
                } else {
                    Sink::AddScaled(w)
                };
                decoder.decode(sender, chunk, sink, chunk_rows);
            }
        }
    };
    for_each_share(&mut segments, threads, decode_range);
    Ok(())
}

/// What the decode does with each decoded float32 value `d` at its place `o` in the output.
#[derive(Clone, Copy)]
enum Sink {
    /// `o = d · w` (one rounding; exact for `w = 1`)
    Scale(f32),
    /// `o = o + d · w` (two roundings: the product, then the sum)
    AddScaled(f32),
}

impl Sink {
    #[inline(always)]
    fn put(self, o: &mut f32, d: f32) {
        match self {
            Sink::Scale(w) => *o = d * w,
            // Rust never contracts this into a fused multiply-add: two roundings, as documented.
            Sink::AddScaled(w) => *o += d * w,
        }
    }
}

/// One thread's decoder: a chunk at a time through the three steps, its scratch (two `rows × 2·last`
/// float64 buffers, 64 KiB each for 64 × 64 chunks) reused from chunk to chunk.
///
/// Step two multiplies only the slots that hold terms: a chunk of `k` coefficients fills at most `k`
/// of its `rows` slots, and a slot's even-column and odd-column halves are separate products. So its
/// cost is `(rows / 2) · last` multiply-adds per (slot, column parity) with terms — at most `k`
/// of them, where the dense product costs `rows` of them whatever `k` is (at k = 32 of 64 × 64,
/// about 29 against 128 on random positions).
struct ChunkDecoder<'a> {
    rows: usize,
    last: usize,
    row_basis: &'a [f64],
    col_basis: &'a [f64],
    folder: Folder,
    t: Vec<f64>,
    y: Vec<f64>,
    /// The slots with terms, by (row parity, column parity): `(f · rows, slot · 2·last)`, the
    /// offsets of the row basis's frequency `f` and of the slot in `t`.
    terms: [Vec<(usize, usize)>; 4],
    avx2_fma: bool,
}

impl<'a> ChunkDecoder<'a> {
    /// `avx2_fma`: run the AVX2 and FMA build of the kernel; true only where the CPU has both.
    fn new(
        rows: usize,
        last: usize,
        row_basis: &'a [f64],
        col_basis: &'a [f64],
        avx2_fma: bool,
    ) -> Self {
        ChunkDecoder {
            rows,
            last,
            row_basis,
            col_basis,
            folder: Folder::new(rows, last),
            t: vec![0.0; rows * 2 * last],
            y: vec![0.0; rows * 2 * last],
            terms: Default::default(),
            avx2_fma: avx2_fma && crate::simd::has_avx2_fma(),
        }
    }

    /// All three steps for chunk `chunk` of `sender`, into its output rows through `sink`.
    fn decode(
        &mut self,
        sender: &SenderLevels<'_>,
        chunk: usize,
        sink: Sink,
        chunk_rows: &mut [&mut [f32]],
    ) {
        let (positions, levels, scale, min) = sender.chunk(chunk);
        #[cfg(target_arch = "x86_64")]
        if self.avx2_fma {
            /// The decode compiled with AVX2 and FMA ([`crate::simd`]).
            #[target_feature(enable = "avx2,fma")]
            #[allow(unsafe_code)]
            unsafe fn decode_avx2_fma(
                decoder: &mut ChunkDecoder<'_>,
                chunk: (&[i64], &[i16], f64, f64),
                sink: Sink,
                chunk_rows: &mut [&mut [f32]],
            ) {
                decoder.decode_with::<true>(chunk, sink, chunk_rows);
            }
            // SAFETY: `avx2_fma` is `has_avx2_fma()`: this CPU has both features, the one
            // condition for running code compiled with them (as in dct_fast, the crate's other `unsafe`).
            #[allow(unsafe_code)]
            unsafe {
                decode_avx2_fma(self, (positions, levels, scale, min), sink, chunk_rows)
            };
            return;
        }
        self.decode_with::<false>((positions, levels, scale, min), sink, chunk_rows);
    }

    /// `FUSED`: multiply-adds as fused instructions (only where the CPU has them). The products
    /// and sums are integers below 2^53 either way, so both give the same numbers.
    #[inline(always)]
    fn decode_with<const FUSED: bool>(
        &mut self,
        (positions, levels, scale, min): (&[i64], &[i16], f64, f64),
        sink: Sink,
        chunk_rows: &mut [&mut [f32]],
    ) {
        let (rows, last) = (self.rows, self.last);
        let (h, half, width) = (rows / 2, last / 2, 2 * last);
        self.folder
            .scatter(positions, levels, self.col_basis, &mut self.t, width, 0);
        for list in &mut self.terms {
            list.clear();
        }
        for row in 0..rows {
            let parities = self.folder.column_parities[row];
            let slot = if row % 2 == 0 { row / 2 } else { h + row / 2 };
            for column_parity in 0..2 {
                if parities & (1 << column_parity) != 0 {
                    self.terms[2 * (row % 2) + column_parity].push((row * rows, slot * width));
                }
            }
        }
        for row_parity in 0..2 {
            for column_parity in 0..2 {
                // Both channels' halves of this column parity: levels at `column_parity · half`,
                // offsets `last` further on.
                for channel in [0, last] {
                    column_product::<FUSED>(
                        &self.terms[2 * row_parity + column_parity],
                        self.row_basis,
                        &self.t,
                        &mut self.y,
                        ColumnBlock {
                            first_slot: row_parity * h,
                            slots: h,
                            column: channel + column_parity * half,
                            columns: half,
                            stride: width,
                        },
                    );
                }
            }
        }
        unfold_chunk(&self.y, width, 0, rows, last, scale, min, sink, chunk_rows);
    }
}

/// Where [`column_product`] writes: `slots` slots of `y` from `first_slot`, columns `column ..
/// column + columns` of each, slots `stride` values apart.
#[derive(Clone, Copy)]
struct ColumnBlock {
    first_slot: usize,
    slots: usize,
    column: usize,
    columns: usize,
    stride: usize,
}

/// Register tile of [`column_product`]: `TILE_SLOTS × TILE_COLUMNS` sums held at once (8 vector
/// registers of four float64 with AVX2), each term one broadcast basis value times a row of `t`.
const TILE_SLOTS: usize = 4;
const TILE_COLUMNS: usize = 8;

/// `y[first_slot + n][c] = Σ_(f, s) B[f, n] · t[s][c]` over the listed `(f · rows, s · stride)`
/// terms, for `n < slots` and the block's columns: every value written, zero where the list is
/// empty.
#[inline(always)]
fn column_product<const FUSED: bool>(
    terms: &[(usize, usize)],
    basis: &[f64],
    t: &[f64],
    y: &mut [f64],
    block: ColumnBlock,
) {
    let madd = |a: f64, b: f64, acc: f64| {
        if FUSED {
            a.mul_add(b, acc)
        } else {
            acc + a * b
        }
    };
    let out_at = |n: usize, c: usize| (block.first_slot + n) * block.stride + block.column + c;
    let mut n0 = 0;
    while n0 < block.slots {
        let ns = TILE_SLOTS.min(block.slots - n0);
        let mut c0 = 0;
        while c0 < block.columns {
            let cs = TILE_COLUMNS.min(block.columns - c0);
            if ns == TILE_SLOTS && cs == TILE_COLUMNS {
                let mut acc = [[0.0f64; TILE_COLUMNS]; TILE_SLOTS];
                for &(f, s) in terms {
                    // Fixed-length slices: the conversions cannot fail.
                    let a: &[f64; TILE_SLOTS] = basis[f + n0..f + n0 + TILE_SLOTS]
                        .try_into()
                        .expect("TILE_SLOTS values");
                    let at = s + block.column + c0;
                    let v: &[f64; TILE_COLUMNS] = t[at..at + TILE_COLUMNS]
                        .try_into()
                        .expect("TILE_COLUMNS values");
                    for (acc_row, &a_n) in acc.iter_mut().zip(a) {
                        for (sum, &v_c) in acc_row.iter_mut().zip(v) {
                            *sum = madd(a_n, v_c, *sum);
                        }
                    }
                }
                for (n, acc_row) in acc.iter().enumerate() {
                    let at = out_at(n0 + n, c0);
                    y[at..at + TILE_COLUMNS].copy_from_slice(acc_row);
                }
            } else {
                for n in n0..n0 + ns {
                    for c in c0..c0 + cs {
                        let mut sum = 0.0;
                        for &(f, s) in terms {
                            sum = madd(basis[f + n], t[s + block.column + c], sum);
                        }
                        y[out_at(n, c)] = sum;
                    }
                }
            }
            c0 += cs;
        }
        n0 += ns;
    }
}

/// Step one's scratch: a chunk row's terms split by the parity of their column, which slots a
/// chunk has written, and for each row the parities of its columns (bit 0: an even column, bit 1:
/// an odd one).
struct Folder {
    rows: usize,
    last: usize,
    even: Vec<(usize, f64)>,
    odd: Vec<(usize, f64)>,
    written: Vec<bool>,
    column_parities: Vec<u8>,
}

impl Folder {
    fn new(rows: usize, last: usize) -> Self {
        Folder {
            rows,
            last,
            even: Vec::with_capacity(last),
            odd: Vec::with_capacity(last),
            written: vec![false; rows],
            column_parities: vec![0; rows],
        }
    }

    /// Step one for one chunk (positions checked by the caller): slot `s` of the chunk is
    /// `t[s · stride + offset ..][.. 2 · last]`, per channel `[E_0 .. E_{h-1}, O_0 .. O_{h-1}]` over
    /// the columns. The first run of a row is stored over whatever the buffer held and later runs
    /// (positions out of order) added. Slots of rows with no coefficient are left as they were: the
    /// column step reads only the slots `column_parities` marks.
    #[inline(always)]
    fn scatter(
        &mut self,
        positions: &[i64],
        levels: &[i16],
        basis: &[f64],
        t: &mut [f64],
        stride: usize,
        offset: usize,
    ) {
        let (rows, last) = (self.rows, self.last);
        let half = last / 2;
        let slot_of = |row: usize| {
            if row % 2 == 0 {
                row / 2
            } else {
                rows / 2 + row / 2
            }
        };
        let shift = last.is_power_of_two().then(|| last.trailing_zeros());
        let split = |p: i64| match shift {
            Some(sh) => ((p as usize) >> sh, p as usize & (last - 1)),
            None => (p as usize / last, p as usize % last),
        };
        self.written.fill(false);
        self.column_parities.fill(0);
        let mut j = 0;
        while j < positions.len() {
            let row = split(positions[j]).0;
            self.even.clear();
            self.odd.clear();
            while j < positions.len() {
                let (r, col) = split(positions[j]);
                if r != row {
                    break;
                }
                let term = (col, f64::from(levels[j]));
                if col % 2 == 0 {
                    self.even.push(term);
                } else {
                    self.odd.push(term);
                }
                j += 1;
            }
            let at = slot_of(row) * stride + offset;
            let seg = &mut t[at..at + 2 * last];
            if !self.written[row] {
                seg.fill(0.0);
                self.written[row] = true;
            }
            let (lv, off) = seg.split_at_mut(last);
            let (lv_e, lv_o) = lv.split_at_mut(half);
            let (off_e, off_o) = off.split_at_mut(half);
            self.column_parities[row] |=
                u8::from(!self.even.is_empty()) | (u8::from(!self.odd.is_empty()) << 1);
            add_half_rows(&self.even, last, basis, lv_e, off_e);
            add_half_rows(&self.odd, last, basis, lv_o, off_o);
        }
    }
}

/// Outputs summed at once in [`add_half_rows`]: enough independent accumulators to keep the
/// floating-point adders busy, few enough to stay in registers.
const LANES: usize = 8;

/// Adds `Σ u · basis[col, n]` into `lv[n]` and `Σ basis[col, n]` into `off[n]` for `n` below
/// `lv.len()` (half a row), over the `(col, u)` terms.
#[inline(always)]
fn add_half_rows(
    terms: &[(usize, f64)],
    last: usize,
    basis: &[f64],
    lv: &mut [f64],
    off: &mut [f64],
) {
    if terms.is_empty() {
        return;
    }
    let half = lv.len();
    let mut n0 = 0;
    while n0 + LANES <= half {
        let mut acc_l = [0.0f64; LANES];
        let mut acc_o = [0.0f64; LANES];
        for &(col, u) in terms {
            let at = col * last + n0;
            // The slice is LANES long by construction: the conversion cannot fail.
            let b: &[f64; LANES] = basis[at..at + LANES]
                .try_into()
                .expect("a slice of LANES values");
            for i in 0..LANES {
                acc_l[i] += u * b[i];
                acc_o[i] += b[i];
            }
        }
        for i in 0..LANES {
            lv[n0 + i] += acc_l[i];
            off[n0 + i] += acc_o[i];
        }
        n0 += LANES;
    }
    for n in n0..half {
        let (mut acc_l, mut acc_o) = (0.0f64, 0.0f64);
        for &(col, u) in terms {
            let v = basis[col * last + n];
            acc_l += u * v;
            acc_o += v;
        }
        lv[n] += acc_l;
        off[n] += acc_o;
    }
}

/// Step three for one chunk: slot `i < rows/2` of `y` (at `i · stride + offset`) holds the
/// even-frequency part `E_i` of output rows `i` and `rows-1-i`, slot `rows/2 + i` the odd part
/// `O_i`; output row `i` is `E_i + O_i`, row `rows-1-i` is `E_i - O_i`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn unfold_chunk(
    y: &[f64],
    stride: usize,
    offset: usize,
    rows: usize,
    last: usize,
    scale: f64,
    min: f64,
    sink: Sink,
    chunk_rows: &mut [&mut [f32]],
) {
    let h = rows / 2;
    let slot = |i: usize| &y[i * stride + offset..i * stride + offset + 2 * last];
    for i in 0..h {
        let (e, o) = (slot(i), slot(h + i));
        unfold_row::<true>(e, o, last / 2, scale, min, sink, chunk_rows[i]);
        unfold_row::<false>(e, o, last / 2, scale, min, sink, chunk_rows[rows - 1 - i]);
    }
}

/// One output row from the folded slots `e` and `o` (each `[L: E' | O'][O: E' | O']`, `half`
/// values per part): the row's channels are `e + o` (`PLUS`) or `e - o`, and its columns `m` and
/// `2·half-1-m` are `E'_m + O'_m` and `E'_m - O'_m`. Every sum is of integers, exact.
#[inline(always)]
fn unfold_row<const PLUS: bool>(
    e: &[f64],
    o: &[f64],
    half: usize,
    scale: f64,
    min: f64,
    sink: Sink,
    row: &mut [f32],
) {
    let last = 2 * half;
    // Slices of exactly `half` values, indexed by `m < half`: no bounds checks in the loop.
    let (lo, hi) = row[..last].split_at_mut(half);
    let pick = |a: f64, b: f64| if PLUS { a + b } else { a - b };
    let (le, lodd) = (&e[..half], &e[half..last]);
    let (oe, oodd) = (&e[last..last + half], &e[last + half..2 * last]);
    let (le2, lodd2) = (&o[..half], &o[half..last]);
    let (oe2, oodd2) = (&o[last..last + half], &o[last + half..2 * last]);
    for m in 0..half {
        let (l_even, l_odd) = (pick(le[m], le2[m]), pick(lodd[m], lodd2[m]));
        let (o_even, o_odd) = (pick(oe[m], oe2[m]), pick(oodd[m], oodd2[m]));
        let first: f64 = (l_even + l_odd) * scale + (o_even + o_odd) * min;
        let second: f64 = (l_even - l_odd) * scale + (o_even - o_odd) * min;
        sink.put(&mut lo[m], first as f32);
        sink.put(&mut hi[half - 1 - m], second as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dct_rows::tests::seeded_sets;
    use crate::{combine_level_sums, scatter_basis_rows};
    use proptest::prelude::*;

    /// The orthonormal DCT-II basis of size `n` on the integer grid `2^s`, row `f` the frequency.
    fn int_basis(n: usize, s: i32) -> Vec<f64> {
        let mut b = Vec::with_capacity(n * n);
        for f in 0..n {
            let scale = if f == 0 {
                (1.0 / n as f64).sqrt()
            } else {
                (2.0 / n as f64).sqrt()
            };
            for i in 0..n {
                let angle = std::f64::consts::PI * (2 * i + 1) as f64 * f as f64 / (2 * n) as f64;
                b.push((scale * angle.cos() * 2f64.powi(s)).round());
            }
        }
        b
    }

    /// `Y[n, :] = Σ_f B[f, n] · T[f, :]` over the leading axis of `t` laid out `(rows, width)`.
    fn rows_product(basis: &[f64], rows: usize, t: &[f64]) -> Vec<f64> {
        let width = t.len() / rows;
        let mut y = vec![0.0; t.len()];
        for n in 0..rows {
            for f in 0..rows {
                let b = basis[f * rows + n];
                for w in 0..width {
                    y[n * width + w] += b * t[f * width + w];
                }
            }
        }
        y
    }

    /// The unfolded rows route, stage by stage: the reference the folded decode must equal.
    #[allow(clippy::too_many_arguments)]
    fn rows_route(
        positions: &[i64],
        levels: &[i16],
        k: usize,
        rows: usize,
        last: usize,
        row_basis: &[f64],
        col_basis: &[f64],
        scales: &[f64],
        mins: &[f64],
        grid_cols: usize,
    ) -> Vec<f32> {
        let chunks = scales.len();
        let mut t = vec![0.0; rows * chunks * 2 * last];
        scatter_basis_rows(positions, levels, k, rows, last, col_basis, 1, &mut t).unwrap();
        let y = rows_product(row_basis, rows, &t);
        let mut want = vec![f32::NAN; chunks * rows * last];
        combine_level_sums(&y, scales, mins, rows, last, 0, grid_cols, 1, &mut want).unwrap();
        want
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn real_dct_bases_fold_and_others_do_not() {
        for n in [2, 4, 6, 8, 10, 16, 32, 64] {
            assert!(fold_basis_is_exact(&int_basis(n, 15), n), "{n}");
        }
        assert!(!fold_basis_is_exact(&int_basis(3, 15), 3));
        let mut b = int_basis(4, 15);
        b[5] += 1.0;
        assert!(!fold_basis_is_exact(&b, 4));
        let good = int_basis(4, 15);
        let mut out = [0f32; 16];
        let e = decode_folded(
            &[0],
            &[1],
            1,
            4,
            4,
            &good,
            &b,
            &[1.0],
            &[0.0],
            1,
            1,
            &mut out,
        )
        .unwrap_err();
        assert_eq!(e, WireError::BasisNotFoldable { side: 4 });
        let e = decode_folded(
            &[0],
            &[1],
            1,
            3,
            4,
            &int_basis(3, 15),
            &good,
            &[1.0],
            &[0.0],
            1,
            1,
            &mut out[..12],
        )
        .unwrap_err();
        assert_eq!(e, WireError::BasisNotFoldable { side: 3 });
    }

    #[test]
    fn refuses_bad_input_and_writes_nothing() {
        let b = int_basis(4, 15);
        let mut out = vec![7f32; 2 * 16];
        let e = decode_folded(
            &[0, 16],
            &[1, 1],
            1,
            4,
            4,
            &b,
            &b,
            &[1.0; 2],
            &[0.0; 2],
            1,
            1,
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(
            e,
            WireError::IndexOutOfRange {
                index: 1,
                value: 16,
                ..
            }
        ));
        let e = decode_folded(
            &[0, 1],
            &[1, 1],
            1,
            4,
            4,
            &b,
            &b,
            &[1.0; 2],
            &[0.0],
            1,
            1,
            &mut out,
        )
        .unwrap_err();
        assert_eq!(
            e,
            WireError::LengthMismatch {
                expected: 2,
                got: 1
            }
        );
        let e = decode_folded(
            &[0, 1],
            &[1, 1],
            1,
            4,
            4,
            &b,
            &b,
            &[1.0; 2],
            &[0.0; 2],
            1,
            1,
            &mut out[1..],
        )
        .unwrap_err();
        assert!(matches!(e, WireError::OutputSizeMismatch { .. }));
        let e = decode_folded(
            &[0, 1],
            &[1, 1],
            1,
            4,
            4,
            &b,
            &b,
            &[1.0; 2],
            &[0.0; 2],
            3,
            1,
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(e, WireError::TileLayout { grid_cols: 3, .. }));
        let e = decode_folded(
            &[0, 1, 2],
            &[1, 1, 1],
            2,
            4,
            4,
            &b,
            &b,
            &[1.0],
            &[0.0],
            1,
            1,
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(
            e,
            WireError::NotWholeSets {
                count: 3,
                set_len: 2
            }
        ));
        assert!(out.iter().all(|&v| v == 7.0));
    }

    #[test]
    fn no_chunks_is_an_empty_result_on_any_thread_count() {
        let b = int_basis(4, 15);
        for threads in [0, 1, 2] {
            decode_folded(&[], &[], 5, 4, 4, &b, &b, &[], &[], 1, threads, &mut []).unwrap();
            decode_folded(&[], &[], 0, 4, 4, &b, &b, &[], &[], 1, threads, &mut []).unwrap();
        }
        let e =
            decode_folded(&[], &[], 5, 4, 4, &b, &b, &[1.0], &[0.0], 1, 1, &mut []).unwrap_err();
        assert_eq!(
            e,
            WireError::LengthMismatch {
                expected: 0,
                got: 1
            }
        );
        let e = decode_folded(&[], &[], 5, 4, 4, &b, &b, &[], &[], 1, 1, &mut [0.0]).unwrap_err();
        assert_eq!(e, WireError::OutputSizeMismatch { needed: 0, got: 1 });
    }

    proptest! {
        #[test]
        fn folding_gives_the_same_bits_as_the_rows_route(
            half_rows in 1usize..6, half_last in 1usize..6, tile_rows in 1usize..4, grid_cols in 1usize..4,
            shuffle in any::<bool>(), seed in any::<u64>(),
        ) {
            let (rows, last) = (2 * half_rows, 2 * half_last);
            let chunks = tile_rows * grid_cols;
            let c = rows * last;
            let k = 1 + (seed as usize) % c;
            // shuffled: positions out of order, so runs repeat a row
            let (positions, levels) = seeded_sets(c, k, chunks, seed, !shuffle);
            let (row_basis, col_basis) = (int_basis(rows, 12), int_basis(last, 12));
            let scales: Vec<f64> = (0..chunks).map(|c| 0.001 * (c as f64 + 1.0) / 3.0).collect();
            let mins: Vec<f64> = (0..chunks).map(|c| -0.5 / (c as f64 + 7.0)).collect();
            let want = rows_route(&positions, &levels, k, rows, last, &row_basis, &col_basis, &scales, &mins, grid_cols);
            for (threads, avx2_fma) in [(1, true), (2, true), (3, true), (1, false), (2, false)] {
                let mut got = vec![f32::NAN; chunks * c];
                decode_folded_on(&positions, &levels, k, rows, last, &row_basis, &col_basis, &scales, &mins,
                                 grid_cols, threads, &mut got, avx2_fma).unwrap();
                prop_assert_eq!(bits(&got), bits(&want), "threads {} avx2_fma {}", threads, avx2_fma);
            }
        }
    }

    #[test]
    fn real_tiles_at_every_density_agree_on_any_thread_count_and_either_build() {
        // 64 × 64 tiles at the real grid, from one coefficient to all of them, levels up to 255:
        // the sums at their largest, slot lists from nearly empty to full.
        let (rows, last, chunks) = (64, 64, 13);
        let b = int_basis(64, 15);
        for k in [1, 7, 300, 4096] {
            let mut positions = Vec::new();
            let mut levels = Vec::new();
            for chunk in 0..chunks {
                let mut p: Vec<i64> = (0..k as i64)
                    .map(|j| (j * 13 + chunk as i64 * 7) % 4096)
                    .collect();
                p.sort_unstable();
                p.dedup();
                assert_eq!(p.len(), k);
                positions.extend(p);
                levels.extend((0..k).map(|j| {
                    if j % 3 == 0 {
                        255
                    } else {
                        ((j * 31 + chunk) % 256) as i16
                    }
                }));
            }
            let scales: Vec<f64> = (0..chunks).map(|c| 1e-9 * (c + 1) as f64).collect();
            let mins: Vec<f64> = (0..chunks).map(|c| -1e-7 * (c + 2) as f64).collect();
            let want = rows_route(
                &positions, &levels, k, rows, last, &b, &b, &scales, &mins, 1,
            );
            for (threads, avx2_fma) in [(1, true), (2, true), (4, true), (1, false), (4, false)] {
                let mut got = vec![f32::NAN; chunks * rows * last];
                decode_folded_on(
                    &positions, &levels, k, rows, last, &b, &b, &scales, &mins, 1, threads,
                    &mut got, avx2_fma,
                )
                .unwrap();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "k {k} threads {threads} avx2_fma {avx2_fma}"
                );
            }
        }
    }

    /// Each sender decoded on its own by [`decode_folded`], then `acc = d_0 · w_0`, `acc = acc + d_i ·
    /// w_i` elementwise: the definition [`decode_folded_mean`] must equal bit for bit.
    #[allow(clippy::too_many_arguments)]
    fn mean_one_by_one(
        senders: &[SenderLevels<'_>],
        weights: &[f32],
        rows: usize,
        last: usize,
        row_basis: &[f64],
        col_basis: &[f64],
        grid_cols: usize,
        len: usize,
    ) -> Vec<f32> {
        let mut acc = vec![0f32; len];
        for (i, (s, &w)) in senders.iter().zip(weights).enumerate() {
            let mut d = vec![f32::NAN; len];
            decode_folded(
                s.positions,
                s.levels,
                s.k,
                rows,
                last,
                row_basis,
                col_basis,
                s.scales,
                s.mins,
                grid_cols,
                1,
                &mut d,
            )
            .unwrap();
            for (a, &v) in acc.iter_mut().zip(&d) {
                let p = v * w;
                *a = if i == 0 { p } else { *a + p };
            }
        }
        acc
    }

    proptest! {
        #[test]
        fn the_fused_mean_gives_the_bits_of_decoding_each_sender_then_combining(
            half_rows in 1usize..5, half_last in 1usize..5, tile_rows in 1usize..3, grid_cols in 1usize..3,
            senders in 1usize..5, seed in any::<u64>(), shuffle in any::<bool>(),
        ) {
            let (rows, last) = (2 * half_rows, 2 * half_last);
            let chunks = tile_rows * grid_cols;
            let c = rows * last;
            let (row_basis, col_basis) = (int_basis(rows, 12), int_basis(last, 12));
            let mut sets = Vec::new();
            for i in 0..senders {
                let sseed = seed.wrapping_add(i as u64 * 0x9e37_79b9);
                let k = 1 + (sseed as usize) % c; // senders may keep different budgets
                let (positions, levels) = seeded_sets(c, k, chunks, sseed, !shuffle);
                let scales: Vec<f64> = (0..chunks).map(|ch| 0.001 * (ch as f64 + 1.0) / (3.0 + i as f64)).collect();
                let mins: Vec<f64> = (0..chunks).map(|ch| -0.5 / (ch as f64 + 7.0 + i as f64)).collect();
                sets.push((positions, levels, k, scales, mins));
            }
            let views: Vec<SenderLevels<'_>> = sets.iter().map(|(p, l, k, s, m)| SenderLevels {
                positions: p, levels: l, k: *k, scales: s, mins: m,
            }).collect();
            // Weights as a mean would have them, and ones that round every product.
            let weights: Vec<f32> = (0..senders).map(|i| if seed % 2 == 0 { 1.0 / senders as f32 } else { 0.3 + 0.17 * i as f32 }).collect();
            let want = mean_one_by_one(&views, &weights, rows, last, &row_basis, &col_basis, grid_cols, chunks * c);
            for (threads, avx2_fma) in [(1, true), (3, true), (1, false), (2, false)] {
                let mut got = vec![f32::NAN; chunks * c];
                decode_folded_mean_on(&views, &weights, rows, last, &row_basis, &col_basis, grid_cols,
                                      threads, &mut got, avx2_fma, false).unwrap();
                prop_assert_eq!(bits(&got), bits(&want), "threads {} avx2_fma {}", threads, avx2_fma);
                // Accumulated onto a buffer: the bits of adding each weighted decode to it in order.
                let start: Vec<f32> = (0..chunks * c).map(|j| 0.25 - 0.001 * j as f32).collect();
                let mut want_acc = start.clone();
                for (i, (s, &w)) in views.iter().zip(&weights).enumerate() {
                    let one = mean_one_by_one(std::slice::from_ref(s), &[1.0], rows, last, &row_basis, &col_basis,
                                              grid_cols, chunks * c);
                    for (a, &d) in want_acc.iter_mut().zip(&one) {
                        *a += d * w;
                    }
                    let _ = i;
                }
                let mut acc = start.clone();
                decode_folded_mean_on(&views, &weights, rows, last, &row_basis, &col_basis, grid_cols,
                                      threads, &mut acc, avx2_fma, true).unwrap();
                prop_assert_eq!(bits(&acc), bits(&want_acc), "accumulate, threads {} avx2_fma {}", threads, avx2_fma);
            }
        }
    }

    #[test]
    fn the_fused_mean_refuses_bad_senders_and_writes_nothing() {
        let b = int_basis(4, 15);
        let one = SenderLevels {
            positions: &[0, 5],
            levels: &[1, 2],
            k: 1,
            scales: &[1.0, 1.0],
            mins: &[0.0, 0.0],
        };
        let three_chunks = SenderLevels {
            positions: &[0, 5, 7],
            levels: &[1, 2, 3],
            k: 1,
            scales: &[1.0; 3],
            mins: &[0.0; 3],
        };
        let out_of_range = SenderLevels {
            positions: &[0, 16],
            ..one
        };
        let mut out = vec![7f32; 32];
        let run = |senders: &[SenderLevels<'_>], weights: &[f32], out: &mut [f32]| {
            decode_folded_mean(senders, weights, 4, 4, &b, &b, 1, 2, out).unwrap_err()
        };
        assert_eq!(run(&[], &[], &mut out), WireError::NoSenders);
        assert_eq!(
            run(&[one, one], &[0.5], &mut out),
            WireError::LengthMismatch {
                expected: 2,
                got: 1
            }
        );
        assert_eq!(
            run(&[one, three_chunks], &[0.5, 0.5], &mut out),
            WireError::SenderChunksMismatch {
                sender: 1,
                chunks: 3,
                expected: 2
            }
        );
        assert!(matches!(
            run(&[one, out_of_range], &[0.5, 0.5], &mut out),
            WireError::IndexOutOfRange {
                index: 1,
                value: 16,
                ..
            }
        ));
        assert!(matches!(
            run(&[one], &[1.0], &mut out[1..]),
            WireError::OutputSizeMismatch { .. }
        ));
        assert!(out.iter().all(|&v| v == 7.0));
        // All well: one sender with weight 1 is its plain decode.
        let mut plain = vec![0f32; 32];
        decode_folded(
            one.positions,
            one.levels,
            1,
            4,
            4,
            &b,
            &b,
            one.scales,
            one.mins,
            1,
            1,
            &mut plain,
        )
        .unwrap();
        decode_folded_mean(&[one], &[1.0], 4, 4, &b, &b, 1, 2, &mut out).unwrap();
        assert_eq!(bits(&out), bits(&plain));
    }
}
