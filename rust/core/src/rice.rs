//! Golomb-Rice coding of sorted index sets (FORMAT.md section 6.2).
//!
//! The input is `sets` consecutive sets of `set_len` indices each (one set per DCT chunk, or a
//! single set), each strictly ascending and below the universe `C`. Each set is coded as its gaps
//! `g_0 = i_0`, `g_j = i_j − i_{j−1} − 1`, and a gap `g` with parameter `r` as its Rice code: the
//! remainder `g mod 2^r` in `r` bits and the quotient `q = g >> r` in unary. The stream keeps the
//! two parts of every code apart, which costs the same bits as interleaving them and lets each
//! part be read without a serial bit-by-bit dependency:
//!
//! ```text
//! stream = remainders unary
//! remainders = the n remainders packed at r bits (section 6), ceil(n·r / 8) bytes
//! unary      = per gap, q zero bits then a one bit, LSB-first (section 6 bit order), zero padding
//!              bits to the byte; exactly ceil((n + Σq) / 8) bytes
//! ```
//!
//! where `n` counts every index of every set. Decoding finds the one bits of the unary part with
//! `trailing_zeros` a 64-bit word at a time and unpacks the remainders with the fixed-width
//! kernel, so a gap costs a few instructions with no data-dependent branch.
//!
//! A uniformly random `k`-subset of `C` positions has roughly geometric gaps of mean
//! `(C − k) / (k + 1)`, for which the best Rice parameter codes within a few percent of the
//! information floor `log2(C choose k)` bits per set (2–3 % at `k/C` from 1/1024 to 1/16).
//! [`rice_param`] finds the exact best parameter of given data, [`rice_param_estimate`] a
//! parameter from `k` and `C` alone.

use crate::bitpack::{packed_len, unpack_bits_into};
use crate::error::{Result, WireError};
/// The largest Rice parameter (a gap of a `u32` index set fits in 32 bits).
pub const MAX_RICE_PARAM: u32 = 31;
/// The largest universe: indices are `u32`.
pub const MAX_UNIVERSE: u64 = 1 << 32;

fn check_param(param: u32) -> Result<()> {
    if param > MAX_RICE_PARAM {
        return Err(WireError::InvalidRiceParameter { param });
    }
    Ok(())
}

/// Checks the universe and that `count` values make whole sets of `set_len`; returns the number
/// of sets. `set_len == 0` is allowed with `count == 0` (no sets).
fn check_sets(count: usize, set_len: usize, universe: u64) -> Result<usize> {
    if universe == 0 && count > 0 || universe > MAX_UNIVERSE {
        return Err(WireError::InvalidUniverse { universe });
    }
    if set_len == 0 {
        return if count == 0 {
            Ok(0)
        } else {
            Err(WireError::NotWholeSets { count, set_len })
        };
    }
    if count % set_len != 0 {
        return Err(WireError::NotWholeSets { count, set_len });
    }
    if set_len as u64 > universe {
        return Err(WireError::SetTooLarge { set_len, universe });
    }
    Ok(count / set_len)
}

/// The error for index `v` at `index` when the set requires `v >= next_min` and `v < universe`.
#[cold]
fn set_error(index: usize, next_min: u64, v: u64, universe: u64) -> WireError {
    if v < next_min {
        WireError::NotStrictlyAscending {
            index,
            prev: next_min - 1,
            value: v,
        }
    } else {
        WireError::IndexOutOfRange {
            index,
            value: v,
            universe,
        }
    }
}

/// Calls `f(gap)` for every gap of every set, validating the sets (strictly ascending within a
/// set, every index below `universe`).
#[inline(always)]
fn for_each_gap(
    indices: &[u32],
    set_len: usize,
    universe: u64,
    mut f: impl FnMut(u64),
) -> Result<()> {
    check_sets(indices.len(), set_len, universe)?;
    if set_len == 0 {
        return Ok(());
    }
    for (s, set) in indices.chunks_exact(set_len).enumerate() {
        let mut next_min = 0u64;
        for (j, &v) in set.iter().enumerate() {
            let v = u64::from(v);
            if (v < next_min) | (v >= universe) {
                return Err(set_error(s * set_len + j, next_min, v, universe));
            }
            f(v - next_min);
            next_min = v + 1;
        }
    }
    Ok(())
}

/// A Rice parameter for sets of `set_len` random indices below `universe`, from those two
/// numbers alone: `round(log2(ln 2 · mean gap))`, the Golomb rule restricted to powers of two.
pub fn rice_param_estimate(set_len: usize, universe: u64) -> u32 {
    if set_len == 0 || universe <= set_len as u64 {
        return 0;
    }
    let mean_gap = (universe - set_len as u64) as f64 / (set_len as f64 + 1.0);
    let p = (mean_gap * std::f64::consts::LN_2).log2().round();
    if p.is_nan() || p < 0.0 {
        0
    } else {
        (p as u32).min(MAX_RICE_PARAM)
    }
}

/// Bytes of the remainder part and of the unary part for `n` gaps whose quotients sum to `q_sum`.
fn part_lens(n: usize, q_sum: u64, param: u32) -> Result<(usize, usize)> {
    let rem = if param == 0 { 0 } else { packed_len(n, param)? };
    let unary_bits = (n as u64)
        .checked_add(q_sum)
        .ok_or(WireError::SizeOverflow {
            count: n,
            bits: param,
        })?;
    let unary = usize::try_from(unary_bits.div_ceil(8)).map_err(|_| WireError::SizeOverflow {
        count: n,
        bits: param,
    })?;
    Ok((rem, unary))
}

/// Exact byte length of the sets' Rice stream with parameter `param`.
pub fn rice_encoded_len(
    indices: &[u32],
    set_len: usize,
    universe: u64,
    param: u32,
) -> Result<usize> {
    check_param(param)?;
    let mut q_sum = 0u64;
    for_each_gap(indices, set_len, universe, |g| q_sum += g >> param)?;
    let (rem, unary) = part_lens(indices.len(), q_sum, param)?;
    Ok(rem + unary)
}

/// The parameter that codes the sets in the fewest bits, and the stream's length in bytes.
///
/// The cost `n·(r + 1) + Σ (g >> r)` bits is convex in `r`, so a walk downhill from
/// [`rice_param_estimate`] finds the minimum with a few exact evaluations.
pub fn rice_param(indices: &[u32], set_len: usize, universe: u64) -> Result<(u32, usize)> {
    let mut gaps = Vec::with_capacity(indices.len());
    for_each_gap(indices, set_len, universe, |g| gaps.push(g as u32))?;
    let n = gaps.len() as u64;
    let q_sum = |r: u32| -> u64 { gaps.iter().map(|&g| u64::from(g >> r)).sum::<u64>() };
    let cost = |r: u32| -> u64 { q_sum(r) + n * u64::from(r + 1) };
    let mut best = rice_param_estimate(set_len, universe);
    let mut best_cost = cost(best);
    for step in [-1i32, 1] {
        loop {
            let r = best as i32 + step;
            if !(0..=MAX_RICE_PARAM as i32).contains(&r) {
                break;
            }
            let c = cost(r as u32);
            if c < best_cost {
                best = r as u32;
                best_cost = c;
            } else {
                break;
            }
        }
    }
    let (rem, unary) = part_lens(gaps.len(), q_sum(best), best)?;
    Ok((best, rem + unary))
}

/// Rice-codes `sets` sets of `set_len` strictly ascending indices below `universe` with
/// parameter `param` (0..=31), in the layout of the module documentation.
pub fn rice_encode(indices: &[u32], set_len: usize, universe: u64, param: u32) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    rice_encode_into(indices, set_len, universe, param, &mut out)?;
    Ok(out)
}

/// Indices per block of the encoder: a multiple of 8, so each block's remainders are whole bytes.
const BLOCK: usize = 256;

/// [`rice_encode`] into `out`, whose contents are replaced (its allocation is reused).
///
/// One pass, a block of indices at a time: the block's gaps (a vectorisable difference, fixed
/// up at set starts) and its validation (vectorisable counts of steps that do not ascend and a
/// maximum), its remainders packed by the fixed-width kernel, then its unary bits built a 64-bit
/// word at a time in a register. Invalid input is then walked again to name the first error.
pub fn rice_encode_into(
    indices: &[u32],
    set_len: usize,
    universe: u64,
    param: u32,
    out: &mut Vec<u8>,
) -> Result<()> {
    check_param(param)?;
    let n = indices.len();
    check_sets(n, set_len, universe)?;
    out.clear();
    if set_len == 0 {
        return Ok(());
    }
    let rem_len = if param == 0 { 0 } else { packed_len(n, param)? };
    out.resize(rem_len, 0);
    // Room for the unary part of gaps near the Rice optimum (about two bits each).
    out.reserve(n / 3 + 16);
    let mask = ((1u64 << param) - 1) as u32;
    let mut gaps = [0u32; BLOCK];
    let mut rems = [0u32; BLOCK];
    let mut word = 0u64;
    let mut word_base = 0u64;
    let mut bit = 0u64;
    for (b, block) in indices.chunks(BLOCK).enumerate() {
        let start = b * BLOCK;
        let gaps = &mut gaps[..block.len()];
        // Steps that do not ascend, counted over the whole block and then taken back at set
        // starts (where the index restarts); branch-free, so the compiler vectorises it.
        let mut descents = 0u32;
        for t in 1..block.len() {
            gaps[t] = block[t].wrapping_sub(block[t - 1]).wrapping_sub(1);
            descents += u32::from(block[t] <= block[t - 1]);
        }
        let first_start = (set_len - start % set_len) % set_len;
        let mut t = first_start;
        while t < block.len() {
            gaps[t] = block[t];
            if t > 0 {
                descents -= u32::from(block[t] <= block[t - 1]);
            }
            t += set_len;
        }
        if first_start != 0 {
            let prev = indices[start - 1];
            gaps[0] = block[0].wrapping_sub(prev).wrapping_sub(1);
            descents += u32::from(block[0] <= prev);
        }
        let top = block.iter().copied().max().map_or(0, u64::from);
        if descents != 0 || top >= universe {
            // Name the first problem.
            for_each_gap(indices, set_len, universe, |_| {})?;
        }
        if param > 0 {
            let rems = &mut rems[..block.len()];
            for (r, &g) in rems.iter_mut().zip(gaps.iter()) {
                *r = g & mask;
            }
            let from = start * param as usize / 8;
            let to = ((start + block.len()) * param as usize).div_ceil(8);
            crate::bitpack::pack_bits_into(rems, param, &mut out[from..to])?;
        }
        // Two gaps at a time: when both one bits fall in the current word (the common case),
        // one test and one OR place them.
        let mut pairs = gaps.chunks_exact(2);
        for pair in &mut pairs {
            let a = bit + u64::from(pair[0] >> param);
            let b = a + 1 + u64::from(pair[1] >> param);
            if b < word_base + 64 {
                word |= (1u64 << (a - word_base)) | (1u64 << (b - word_base));
            } else {
                for one in [a, b] {
                    while one >= word_base + 64 {
                        out.extend_from_slice(&word.to_le_bytes());
                        word = 0;
                        word_base += 64;
                    }
                    word |= 1u64 << (one - word_base);
                }
            }
            bit = b + 1;
        }
        for &g in pairs.remainder() {
            let one = bit + u64::from(g >> param);
            while one >= word_base + 64 {
                out.extend_from_slice(&word.to_le_bytes());
                word = 0;
                word_base += 64;
            }
            word |= 1u64 << (one - word_base);
            bit = one + 1;
        }
    }
    out.extend_from_slice(&word.to_le_bytes());
    let unary_len = usize::try_from(bit.div_ceil(8)).map_err(|_| WireError::SizeOverflow {
        count: n,
        bits: param,
    })?;
    out.truncate(rem_len + unary_len);
    Ok(())
}

/// Decodes `count` indices in sets of `set_len` (see [`rice_encode`]) into a new vector.
///
/// Every index takes at least one unary bit and `param` remainder bits, so `count` is checked
/// against `data`'s length before anything is allocated.
pub fn rice_decode(
    data: &[u8],
    count: usize,
    set_len: usize,
    universe: u64,
    param: u32,
) -> Result<Vec<u32>> {
    check_param(param)?;
    check_sets(count, set_len, universe)?;
    let (rem_len, unary_min) = part_lens(count, 0, param)?;
    if data.len() < rem_len.saturating_add(unary_min) {
        return Err(WireError::InputTooShort {
            needed: rem_len.saturating_add(unary_min),
            got: data.len(),
        });
    }
    let mut out = vec![0u32; count];
    rice_decode_into(data, set_len, universe, param, &mut out)?;
    Ok(out)
}

/// [`rice_decode`] into `out` (`count` is `out.len()`). The stream must be exact: no byte after
/// the last one bit's byte, zero padding bits in both parts.
///
/// Works block by block, so each block of `out` is written, completed and summed while it is in
/// cache: the block's remainders by the fixed-width kernel, then its quotients (one per one bit
/// of the unary part, found with `trailing_zeros` a word at a time) joined to them as gaps, then
/// the gaps summed into indices.
pub fn rice_decode_into(
    data: &[u8],
    set_len: usize,
    universe: u64,
    param: u32,
    out: &mut [u32],
) -> Result<()> {
    check_param(param)?;
    let count = out.len();
    check_sets(count, set_len, universe)?;
    let (rem_len, unary_min) = part_lens(count, 0, param)?;
    if data.len() < rem_len.saturating_add(unary_min) {
        return Err(WireError::InputTooShort {
            needed: rem_len.saturating_add(unary_min),
            got: data.len(),
        });
    }
    let (rem_data, unary) = data.split_at(rem_len);
    if param > 0 {
        if let Some(e) = rem_padding_error(rem_data, param, count) {
            return Err(e);
        }
    }
    if count == 0 {
        return if unary.is_empty() {
            Ok(())
        } else {
            Err(WireError::LengthMismatch {
                expected: 0,
                got: data.len(),
            })
        };
    }
    let mut scan = UnaryScan::new(unary, set_len, universe, param);
    scan.load();
    for (b, block) in out.chunks_mut(DECODE_BLOCK).enumerate() {
        let start = b * DECODE_BLOCK;
        if param > 0 {
            let from = start * param as usize / 8;
            let to = ((start + block.len()) * param as usize).div_ceil(8);
            unpack_bits_into(&rem_data[from..to], param, block)?;
        } else {
            block.fill(0);
        }
        scan.fill(block, start, count, data.len())?;
    }
    finish_unary(
        rem_len,
        scan.last_one(),
        scan.w,
        scan.base,
        unary,
        data.len(),
    )
}

/// Indices per block of the decoder: a multiple of 8 (whole bytes of remainders), small enough
/// for a block to stay in cache across its three steps.
const DECODE_BLOCK: usize = 2048;

/// The error for nonzero padding bits after `count` remainders of `param` bits, if any.
fn rem_padding_error(rem_data: &[u8], param: u32, count: usize) -> Option<WireError> {
    let bits = count.checked_mul(param as usize)?;
    let used = (bits % 8) as u32;
    if used == 0 {
        return None;
    }
    let byte_index = bits / 8;
    let last = *rem_data.get(byte_index)?;
    (last >> used != 0).then_some(WireError::NonzeroPaddingBits {
        byte_index,
        bits: (last >> used) << used,
    })
}

/// Reads the unary part's one bits in order and turns them, with the remainders, into indices.
///
/// With `next_min` the smallest value the next index may take (0 at a set's start) and
/// `after_prev` the unary position after the previous one bit, the next index is
/// `next_min + ((one − after_prev) << r) + rem` for its one bit at `one`. The scan keeps the single
/// register `z = next_min − (after_prev << r)` (mod 2^64), so that an index costs
/// `v = z + (one << r) + rem`, and inside a set the update `z' = v + 1 − ((one + 1) << r)`
/// is `z + rem + 1 − 2^r`: the running sum's dependency chain is a single addition.
struct UnaryScan<'a> {
    unary: &'a [u8],
    /// Byte offset of the next word to load.
    next_word: usize,
    /// The current word, the one bits already used cleared, and as loaded.
    w: u64,
    loaded: u64,
    /// Unary position of the current word's bit 0.
    base: u64,
    z: u64,
    /// Indices left in the current set.
    left: usize,
    /// The largest quotient a valid gap can have.
    q_limit: u64,
    param: u32,
    set_len: usize,
    universe: u64,
}

impl UnaryScan<'_> {
    fn new(unary: &[u8], set_len: usize, universe: u64, param: u32) -> UnaryScan<'_> {
        UnaryScan {
            unary,
            next_word: 0,
            w: 0,
            loaded: 0,
            base: 0,
            z: 0,
            left: set_len,
            q_limit: (universe - 1) >> param,
            param,
            set_len,
            universe,
        }
    }

    /// Loads the word at `next_word` (zero-padded past the end) and advances.
    #[inline(always)]
    fn load(&mut self) {
        let mut buf = [0u8; 8];
        if let Some(c) = self.unary.get(self.next_word..self.next_word + 8) {
            buf.copy_from_slice(c);
        } else if let Some(c) = self.unary.get(self.next_word..) {
            buf[..c.len()].copy_from_slice(c);
        }
        self.w = u64::from_le_bytes(buf);
        self.loaded = self.w;
        self.base = self.next_word as u64 * 8;
        self.next_word += 8;
    }

    /// Loads words until one has a one bit. A quotient spanning more zero words than any valid
    /// gap allows is an error, which also bounds every quotient below `q_limit + 192`, so
    /// `q << r` never overflows.
    #[cold]
    fn next_nonzero(&mut self, index: usize, count: usize, data_len: usize) -> Result<()> {
        let mut loads = 0u64;
        while self.w == 0 {
            if self.next_word >= self.unary.len() {
                return Err(WireError::StreamTruncated {
                    decoded: index,
                    count,
                    bit_offset: data_len as u64 * 8,
                });
            }
            self.load();
            loads += 1;
            if (loads - 1) * 64 > self.q_limit {
                return Err(WireError::IndexOutOfRange {
                    index,
                    value: ((loads - 1) * 64) << self.param,
                    universe: self.universe,
                });
            }
        }
        Ok(())
    }

    /// The unary position of the last one bit used (at least one was).
    fn last_one(&self) -> u64 {
        let used = self.loaded & !self.w;
        self.base + u64::from(63 - used.leading_zeros())
    }

    /// Turns the remainders in `block` (indices `start..` of `count`) into indices: each gets
    /// the next quotient, then the running sum of its set (`i_0 = g_0`, `i_j = i_{j−1} + 1 +
    /// g_j`), and is checked against the universe. Out of line, so that its state stays in
    /// registers.
    #[inline(never)]
    fn fill(
        &mut self,
        block: &mut [u32],
        start: usize,
        count: usize,
        data_len: usize,
    ) -> Result<()> {
        let (param, set_len, universe) = (self.param, self.set_len, self.universe);
        let step = 1u64 << param;
        let carry = 1u64.wrapping_sub(step);
        let (mut z, mut left) = (self.z, self.left);
        let mut k = 0usize;
        while k < block.len() {
            if self.w == 0 {
                self.next_nonzero(start + k, count, data_len)?;
            }
            let (mut w, base) = (self.w, self.base);
            let take = (w.count_ones() as usize).min(block.len() - k);
            let mut slots = block[k..k + take].iter_mut();
            while let Some(slot) = slots.next() {
                // `one << r` as a product: no shift-count register to shuffle.
                let t = (base + u64::from(w.trailing_zeros())) * step;
                w &= w - 1;
                let rem = u64::from(*slot);
                let v = z.wrapping_add(t).wrapping_add(rem);
                *slot = v as u32;
                // z' = v + 1 − t − 2^r: t cancels, leaving a chain of one addition.
                z = z.wrapping_add(rem).wrapping_add(carry);
                left -= 1;
                if left == 0 {
                    // Indices ascend within a set, so checking its last one checks them all
                    // (v is exact: quotients are bounded, see `next_nonzero`).
                    if v >= universe {
                        return Err(WireError::IndexOutOfRange {
                            // The slots not yet visited tell the position without a counter.
                            index: start + k + take - 1 - slots.len(),
                            value: v,
                            universe,
                        });
                    }
                    left = set_len;
                    z = 0u64.wrapping_sub(t).wrapping_sub(step);
                }
            }
            k += take;
            self.w = w;
        }
        (self.z, self.left) = (z, left);
        Ok(())
    }
}

/// Checks that the last code's one bit (at unary position `last_one`, in the word at `base`
/// whose bits above it are `rest`) ends the stream: no further one bit, no byte after its byte.
fn finish_unary(
    rem_len: usize,
    last_one: u64,
    rest: u64,
    base: u64,
    unary: &[u8],
    data_len: usize,
) -> Result<()> {
    if rest != 0 {
        return Err(trailing_unary(
            rem_len,
            last_one,
            base + u64::from(rest.trailing_zeros()),
            unary,
        ));
    }
    let expected = (last_one / 8 + 1) as usize;
    if unary.len() != expected {
        return Err(WireError::LengthMismatch {
            expected: rem_len + expected,
            got: data_len,
        });
    }
    Ok(())
}

/// The error for a one bit at unary position `extra` after the last code's one bit.
fn trailing_unary(rem_len: usize, last_one: u64, extra: u64, unary: &[u8]) -> WireError {
    let byte = (last_one / 8) as usize;
    if extra / 8 == last_one / 8 {
        let used = (last_one % 8 + 1) as u32;
        WireError::NonzeroPaddingBits {
            byte_index: rem_len + byte,
            bits: unary[byte] >> used << used,
        }
    } else {
        WireError::LengthMismatch {
            expected: rem_len + byte + 1,
            got: rem_len + unary.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The layout straight from the definition: one bool per bit of each part, packed LSB-first.
    fn reference_encode(sets: &[Vec<u32>], param: u32) -> Vec<u8> {
        let mut rem_bits = Vec::new();
        let mut unary_bits = Vec::new();
        for set in sets {
            let mut prev: i64 = -1;
            for &v in set {
                let g = (i64::from(v) - prev - 1) as u64;
                for b in 0..param {
                    rem_bits.push((g >> b) & 1 == 1);
                }
                unary_bits.resize(unary_bits.len() + (g >> param) as usize, false);
                unary_bits.push(true);
                prev = i64::from(v);
            }
        }
        let pack = |bits: &[bool]| {
            let mut out = vec![0u8; bits.len().div_ceil(8)];
            for (i, &b) in bits.iter().enumerate() {
                if b {
                    out[i / 8] |= 1 << (i % 8);
                }
            }
            out
        };
        let mut out = pack(&rem_bits);
        out.extend(pack(&unary_bits));
        out
    }

    #[test]
    fn known_bytes() {
        // gaps 3, 0, 5 with r = 1: remainders 1 0 1 -> 0b101; quotients 1, 0, 2 -> unary bits
        // 0 1 | 1 | 0 0 1 -> 0b0010_0110.
        let enc = rice_encode(&[3, 4, 10], 3, 16, 1).unwrap();
        assert_eq!(enc, vec![0b101, 0b0010_0110]);
        assert_eq!(rice_decode(&enc, 3, 3, 16, 1).unwrap(), vec![3, 4, 10]);
        assert_eq!(rice_encoded_len(&[3, 4, 10], 3, 16, 1).unwrap(), 2);
    }

    #[test]
    fn sets_restart_their_gaps() {
        let idx = [1u32, 5, 0, 7];
        let enc = rice_encode(&idx, 2, 8, 2).unwrap();
        assert_eq!(enc, reference_encode(&[vec![1, 5], vec![0, 7]], 2));
        assert_eq!(rice_decode(&enc, 4, 2, 8, 2).unwrap(), idx.to_vec());
    }

    #[test]
    fn rejects_bad_sets() {
        assert_eq!(
            rice_encode(&[3, 3], 2, 10, 1),
            Err(WireError::NotStrictlyAscending {
                index: 1,
                prev: 3,
                value: 3
            })
        );
        assert_eq!(
            rice_encode(&[3, 10], 2, 10, 1),
            Err(WireError::IndexOutOfRange {
                index: 1,
                value: 10,
                universe: 10
            })
        );
        assert_eq!(
            rice_encode(&[1, 2, 3], 2, 10, 1),
            Err(WireError::NotWholeSets {
                count: 3,
                set_len: 2
            })
        );
        assert_eq!(
            rice_encode(&[1], 1, 10, 32),
            Err(WireError::InvalidRiceParameter { param: 32 })
        );
        assert!(matches!(
            rice_encode(&[0, 1, 2], 3, 2, 0),
            Err(WireError::SetTooLarge { .. })
        ));
        assert_eq!(
            rice_encode(&[1], 1, 0, 1),
            Err(WireError::InvalidUniverse { universe: 0 })
        );
    }

    #[test]
    fn rejects_bad_streams() {
        let enc = rice_encode(&[3, 4, 10], 3, 16, 1).unwrap();
        // Too short for three codes.
        assert!(matches!(
            rice_decode(&enc[..1], 3, 3, 16, 1),
            Err(WireError::InputTooShort { .. })
        ));
        // The unary part ends after two one bits.
        assert!(matches!(
            rice_decode(&[0b101, 0b0000_0110], 3, 3, 16, 1),
            Err(WireError::StreamTruncated { decoded: 2, .. })
        ));
        // Trailing byte.
        let mut long = enc.clone();
        long.push(0);
        assert_eq!(
            rice_decode(&long, 3, 3, 16, 1),
            Err(WireError::LengthMismatch {
                expected: 2,
                got: 3
            })
        );
        let mut long = enc.clone();
        long.push(1);
        assert!(matches!(
            rice_decode(&long, 3, 3, 16, 1),
            Err(WireError::LengthMismatch { .. })
        ));
        // Padding bits set, in the unary part and in the remainder part.
        let mut pad = enc.clone();
        pad[1] |= 0x80;
        assert!(matches!(
            rice_decode(&pad, 3, 3, 16, 1),
            Err(WireError::NonzeroPaddingBits { byte_index: 1, .. })
        ));
        let mut pad = enc.clone();
        pad[0] |= 0x80;
        assert!(matches!(
            rice_decode(&pad, 3, 3, 16, 1),
            Err(WireError::NonzeroPaddingBits { byte_index: 0, .. })
        ));
        // An index past the universe.
        assert!(matches!(
            rice_decode(&enc, 3, 3, 10, 1),
            Err(WireError::IndexOutOfRange { index: 2, .. })
        ));
        // A count the input cannot hold is refused before allocating.
        assert_eq!(
            rice_decode(&[0xFF], 1 << 40, 1, 1 << 32, 3),
            Err(WireError::InputTooShort {
                needed: 3 * (1 << 37) + (1 << 37),
                got: 1
            })
        );
        // A quotient longer than any index allows.
        let mut zeros = vec![0u8; 64];
        zeros.push(1);
        assert!(matches!(
            rice_decode(&zeros, 1, 1, 100, 0),
            Err(WireError::IndexOutOfRange { .. })
        ));
        assert!(matches!(
            rice_decode(&[0u8; 4], 1, 1, 1 << 20, 0),
            Err(WireError::StreamTruncated { .. })
        ));
    }

    #[test]
    fn empty() {
        assert_eq!(rice_encode(&[], 0, 0, 3).unwrap(), Vec::<u8>::new());
        assert_eq!(rice_decode(&[], 0, 0, 0, 3).unwrap(), Vec::<u32>::new());
        assert_eq!(rice_decode(&[], 0, 5, 10, 3).unwrap(), Vec::<u32>::new());
        assert!(rice_decode(&[0], 0, 5, 10, 3).is_err());
    }

    #[test]
    fn long_quotients_and_the_largest_universe() {
        // Quotients of thousands of bits (param 0) and the largest gaps (param 31).
        let small = [0u32, 1000, 70_000];
        let enc = rice_encode(&small, 3, 1 << 32, 0).unwrap();
        assert_eq!(enc, reference_encode(&[small.to_vec()], 0));
        assert_eq!(rice_decode(&enc, 3, 3, 1 << 32, 0).unwrap(), small.to_vec());
        let idx = [0u32, 1000, u32::MAX];
        for param in [12, 20, 31] {
            let enc = rice_encode(&idx, 3, 1 << 32, param).unwrap();
            assert_eq!(enc, reference_encode(&[idx.to_vec()], param));
            assert_eq!(
                rice_decode(&enc, 3, 3, 1 << 32, param).unwrap(),
                idx.to_vec()
            );
            assert_eq!(
                rice_encoded_len(&idx, 3, 1 << 32, param).unwrap(),
                enc.len()
            );
        }
    }

    #[test]
    fn estimate_and_optimum_on_random_sets() {
        // 64 sets of k = 32 of C = 4096, from a fixed xorshift.
        let mut state = 0x0123_4567_89AB_CDEF_u64;
        let mut idx = Vec::new();
        for _ in 0..64 {
            let mut set = std::collections::BTreeSet::new();
            while set.len() < 32 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                set.insert((state % 4096) as u32);
            }
            idx.extend(set);
        }
        assert_eq!(rice_param_estimate(32, 4096), 6);
        let (best, len) = rice_param(&idx, 32, 4096).unwrap();
        for r in 0..=12 {
            assert!(rice_encoded_len(&idx, 32, 4096, r).unwrap() >= len);
        }
        assert_eq!(rice_encode(&idx, 32, 4096, best).unwrap().len(), len);
        // Within 5 % of the floor log2(4096 choose 32) = 266.2 bits per set.
        let per_set = len as f64 * 8.0 / 64.0;
        assert!(per_set < 266.2 * 1.05, "{per_set}");
    }

    #[test]
    fn sets_across_block_boundaries() {
        // Blocks of 256 (encoder) and 2048 (decoder) indices cut sets of 7 and 300 anywhere.
        let mut state = 0xDEAD_BEEFu64;
        for (set_len, universe, sets) in
            [(7usize, 1000u64, 900usize), (300, 5000, 30), (1, 3, 5000)]
        {
            let mut idx = Vec::new();
            for _ in 0..sets {
                let mut set = std::collections::BTreeSet::new();
                while set.len() < set_len {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    set.insert((state % universe) as u32);
                }
                idx.extend(set);
            }
            let sets_v: Vec<Vec<u32>> = idx.chunks(set_len).map(|c| c.to_vec()).collect();
            for param in [0, 2, 5] {
                let enc = rice_encode(&idx, set_len, universe, param).unwrap();
                assert_eq!(enc, reference_encode(&sets_v, param));
                assert_eq!(
                    rice_decode(&enc, idx.len(), set_len, universe, param).unwrap(),
                    idx
                );
            }
            // A repeat deep inside is named by position.
            let mut bad = idx.clone();
            let at = idx.len() - set_len / 2 - 1;
            if set_len > 1 {
                bad[at] = bad[at - 1];
                assert!(matches!(
                    rice_encode(&bad, set_len, universe, 3),
                    Err(WireError::NotStrictlyAscending { index, .. }) if index == at
                ));
            }
        }
    }

    fn sets() -> impl Strategy<Value = (u64, usize, Vec<u32>, u32)> {
        (1u64..5000, 1usize..20, 0usize..8, 0u32..=31).prop_flat_map(
            |(universe, set_len, sets, param)| {
                let set_len = set_len.min(universe as usize);
                let one = proptest::sample::subsequence(
                    (0..universe as u32).collect::<Vec<_>>(),
                    set_len,
                );
                (
                    Just(universe),
                    Just(set_len),
                    proptest::collection::vec(one, sets).prop_map(|v| v.concat()),
                    Just(param),
                )
            },
        )
    }

    proptest! {
        #[test]
        fn prop_round_trip((universe, set_len, idx, param) in sets()) {
            let enc = rice_encode(&idx, set_len, universe, param).unwrap();
            let sets: Vec<Vec<u32>> = idx.chunks(set_len).map(|c| c.to_vec()).collect();
            prop_assert_eq!(&enc, &reference_encode(&sets, param));
            prop_assert_eq!(rice_encoded_len(&idx, set_len, universe, param).unwrap(), enc.len());
            prop_assert_eq!(rice_decode(&enc, idx.len(), set_len, universe, param).unwrap(), idx);
        }

        #[test]
        fn prop_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..100),
                                            count in 0usize..200, set_len in 1usize..20,
                                            universe in 1u64..100_000, param in 0u32..=33) {
            let count = count - count % set_len;
            if let Ok(out) = rice_decode(&data, count, set_len, universe, param) {
                // What is accepted is canonical: it re-encodes to the same bytes.
                prop_assert_eq!(rice_encode(&out, set_len, universe, param).unwrap(), data);
            }
        }
    }
}
