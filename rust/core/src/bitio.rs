//! LSB-first bit streams for the variable-length codes (Rice, Elias, Huffman).
//!
//! The bit order is that of fixed-width packing (FORMAT.md section 6): stream bit `m` is bit
//! `m mod 8` of byte `m div 8`. A field of `n` bits written with [`BitWriter::put`] occupies the
//! next `n` stream bits, its bit 0 first. Codes whose definition reads "most significant bit
//! first" (Elias, canonical Huffman) are bit-reversed before they are put, so their first bit is
//! the first stream bit. A finished stream is `ceil(bits / 8)` bytes with zero padding bits, and
//! [`BitReader::finish`] holds a decoder to exactly that: no byte more, no padding bit set.
//!
//! The reader keeps up to 63 bits in a 64-bit buffer refilled eight bytes at a time. Past the end
//! of the input it reads zeros, so peeking never fails; every consumer checks [`BitReader::avail`]
//! before it commits to a code, which is where a truncated stream is detected.

use crate::error::{Result, WireError};

/// Appends bit fields to a growing byte vector.
///
/// Branch-free in the common case: every [`put`](Self::put) stores the whole 64-bit accumulator
/// at the current byte and advances by the whole bytes it completed, so the buffer is kept at
/// least eight bytes longer than the bytes finished.
pub(crate) struct BitWriter {
    out: Vec<u8>,
    /// Bytes finished.
    pos: usize,
    acc: u64,
    /// Bits pending in `acc` (< 8 between calls).
    n: u32,
}

impl BitWriter {
    /// A writer whose output starts with room for `bytes` bytes.
    pub(crate) fn with_capacity(bytes: usize) -> Self {
        BitWriter {
            out: vec![0u8; bytes.saturating_add(8)],
            pos: 0,
            acc: 0,
            n: 0,
        }
    }

    #[cold]
    fn grow(&mut self) {
        let len = self.out.len().saturating_mul(2).max(self.pos + 64);
        self.out.resize(len, 0);
    }

    /// Appends the low `bits` bits of `value` (`bits <= 56`, higher bits of `value` zero).
    #[inline(always)]
    pub(crate) fn put(&mut self, value: u64, bits: u32) {
        debug_assert!(bits <= 56 && value >> bits == 0);
        if self.pos + 8 > self.out.len() {
            self.grow();
        }
        self.acc |= value << self.n;
        self.n += bits;
        if let Some(slot) = self.out.get_mut(self.pos..self.pos + 8) {
            slot.copy_from_slice(&self.acc.to_le_bytes());
        }
        let bytes = self.n >> 3;
        self.pos += bytes as usize;
        // n <= 63, so the shift is at most 56.
        self.acc >>= bytes << 3;
        self.n &= 7;
    }

    /// Appends the low `bits` bits of `value`, `bits <= 64`.
    #[inline]
    pub(crate) fn put_long(&mut self, value: u64, bits: u32) {
        if bits > 32 {
            self.put(value & 0xFFFF_FFFF, 32);
            self.put(value >> 32, bits - 32);
        } else {
            self.put(value, bits);
        }
    }

    /// Appends `count` zero bits.
    #[inline]
    pub(crate) fn put_zeros(&mut self, mut count: u64) {
        while count >= 32 {
            self.put(0, 32);
            count -= 32;
        }
        self.put(0, count as u32);
    }

    /// The stream's bytes (padding bits zero).
    pub(crate) fn finish(mut self) -> Vec<u8> {
        // The pending bits were stored at `pos` by the last put; the bytes after are zero or
        // scratch and are cut off.
        let len = self.pos + usize::from(self.n > 0);
        self.out.truncate(len);
        self.out
    }
}

/// Appends bit fields to a byte slice of the stream's exact length, for hot loops whose
/// output length is known beforehand: no capacity test, no growing, and a state small enough to
/// live in registers. Each put stores the whole 64-bit accumulator at the current byte (the
/// pending bits, zeros above), so the slice holds the stream, padding bits zero, after the last
/// put; near the end only the bytes that fit are stored. Bits put past the end are dropped (the
/// caller's length was wrong: wrong output, never a panic).
pub(crate) struct Sink<'a> {
    buf: &'a mut [u8],
    /// Bytes finished.
    pos: usize,
    acc: u64,
    /// Bits pending in `acc` (< 8 between calls).
    n: u32,
}

impl<'a> Sink<'a> {
    /// A sink writing `buf` from its start.
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        Sink {
            buf,
            pos: 0,
            acc: 0,
            n: 0,
        }
    }

    /// This sink, moved out (the one left behind writes nothing): a loop works on a local copy
    /// and puts it back.
    pub(crate) fn take(&mut self) -> Sink<'a> {
        Sink {
            buf: std::mem::take(&mut self.buf),
            ..*self
        }
    }

    /// Appends the low `bits` bits of `value` (`bits <= 56`, higher bits of `value` zero; 0 bits
    /// append nothing).
    #[inline(always)]
    pub(crate) fn put(&mut self, value: u64, bits: u32) {
        debug_assert!(bits <= 56 && value >> bits == 0);
        self.acc |= value << self.n;
        self.n += bits;
        match self.buf.get_mut(self.pos..self.pos + 8) {
            Some(slot) => slot.copy_from_slice(&self.acc.to_le_bytes()),
            None => self.store_tail(),
        }
        let bytes = self.n >> 3;
        self.pos += bytes as usize;
        self.acc >>= bytes << 3;
        self.n &= 7;
    }

    /// The accumulator's bytes that fit before the end of the slice.
    #[cold]
    fn store_tail(&mut self) {
        if let Some(rest) = self.buf.get_mut(self.pos..) {
            let fit = rest.len().min(8);
            rest[..fit].copy_from_slice(&self.acc.to_le_bytes()[..fit]);
        }
    }
}

/// The bits of `value`'s low `len` bits in reverse order (`1 <= len <= 64`): how a code defined
/// most significant bit first is put into an LSB-first stream.
#[inline(always)]
pub(crate) fn reverse_low(value: u64, len: u32) -> u64 {
    debug_assert!((1..=64).contains(&len));
    value.reverse_bits() >> (64 - len)
}

/// Why [`BitReader::unary`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unary {
    /// More zeros than the caller's limit.
    PastLimit,
    /// The input ended before the one bit.
    PastEnd,
}

/// Reads bit fields from a byte slice.
pub(crate) struct BitReader<'a> {
    data: &'a [u8],
    /// Next byte of `data` not yet in `buf`.
    next: usize,
    /// Stream bits from the read position on; bits at and above `avail` are zero or the true
    /// stream bits at those positions (never anything else), so peeking past `avail` is exact
    /// while input remains and reads zeros after it.
    pub(crate) buf: u64,
    /// Valid bits in `buf` (at most 63).
    pub(crate) avail: u32,
}

impl<'a> BitReader<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        let mut r = BitReader {
            data,
            next: 0,
            buf: 0,
            avail: 0,
        };
        r.refill();
        r
    }

    /// Tops the buffer up to at least 56 valid bits while input remains.
    #[inline(always)]
    pub(crate) fn refill(&mut self) {
        if self.avail >= 56 {
            return;
        }
        if let Some(word) = self.data.get(self.next..self.next + 8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            self.buf |= u64::from_le_bytes(w) << self.avail;
            let bytes = (63 - self.avail) >> 3;
            self.next += bytes as usize;
            self.avail += bytes << 3;
        } else {
            while self.avail <= 55 {
                match self.data.get(self.next) {
                    Some(&b) => {
                        self.buf |= u64::from(b) << self.avail;
                        self.next += 1;
                        self.avail += 8;
                    }
                    None => break,
                }
            }
        }
    }

    /// Drops `n <= avail` bits.
    #[inline(always)]
    pub(crate) fn consume(&mut self, n: u32) {
        debug_assert!(n <= self.avail);
        // n <= 63, so the shift is defined.
        self.buf >>= n;
        self.avail -= n;
    }

    /// Reads `n <= 32` bits as an integer (bit 0 first), or `None` at the end of the input.
    #[inline(always)]
    pub(crate) fn get(&mut self, n: u32) -> Option<u64> {
        debug_assert!(n <= 32);
        if self.avail < n {
            self.refill();
            if self.avail < n {
                return None;
            }
        }
        let v = self.buf & ((1u64 << n) - 1);
        self.consume(n);
        Some(v)
    }

    /// Reads `n <= 64` bits as an integer (bit 0 first), or `None` at the end of the input.
    #[inline]
    pub(crate) fn get_long(&mut self, n: u32) -> Option<u64> {
        if n > 32 {
            let lo = self.get(32)?;
            let hi = self.get(n - 32)?;
            Some(lo | (hi << 32))
        } else {
            self.get(n)
        }
    }

    /// Counts zero bits up to and including the next one bit, which is consumed too. Gives up
    /// once more than `limit` zeros are seen or the input ends: `limit` is a bound the caller
    /// derives from what a valid code can hold, so hostile runs of zeros cost little.
    #[inline]
    pub(crate) fn unary(&mut self, limit: u64) -> Result<u64, Unary> {
        let mut zeros = 0u64;
        loop {
            let tz = self.buf.trailing_zeros();
            if tz < self.avail {
                self.consume(tz + 1);
                zeros += u64::from(tz);
                return if zeros <= limit {
                    Ok(zeros)
                } else {
                    Err(Unary::PastLimit)
                };
            }
            zeros += u64::from(self.avail);
            self.consume(self.avail);
            if zeros > limit {
                return Err(Unary::PastLimit);
            }
            self.refill();
            if self.avail == 0 {
                return Err(Unary::PastEnd);
            }
        }
    }

    /// Stream bits consumed so far.
    #[inline]
    pub(crate) fn position(&self) -> u64 {
        (self.next as u64) * 8 - u64::from(self.avail)
    }

    /// Checks that the stream ended exactly here: the input is `ceil(position / 8)` bytes and
    /// the padding bits of its last byte are zero.
    pub(crate) fn finish(mut self) -> Result<()> {
        let used = self.position();
        let needed = usize::try_from(used.div_ceil(8)).unwrap_or(usize::MAX);
        if self.data.len() != needed {
            return Err(WireError::LengthMismatch {
                expected: needed,
                got: self.data.len(),
            });
        }
        let pad = (needed as u64 * 8 - used) as u32;
        if pad > 0 {
            self.refill();
            let bits = self.buf & ((1u64 << pad) - 1);
            if bits != 0 {
                return Err(WireError::NonzeroPaddingBits {
                    byte_index: needed - 1,
                    bits: (bits << (8 - pad)) as u8,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fields_are_lsb_first_like_fixed_packing() {
        let mut w = BitWriter::with_capacity(0);
        w.put(0xABC, 12);
        w.put(0x123, 12);
        let out = w.finish();
        assert_eq!(out, crate::pack_bits(&[0xABC, 0x123], 12).unwrap());
    }

    #[test]
    fn finish_checks_length_and_padding() {
        let mut w = BitWriter::with_capacity(0);
        w.put(0b101, 3);
        let out = w.finish();
        assert_eq!(out, vec![0b101]);
        let mut r = BitReader::new(&out);
        assert_eq!(r.get(3), Some(0b101));
        assert!(r.finish().is_ok());
        let bad = [0b1101u8];
        let mut r = BitReader::new(&bad);
        r.get(3);
        assert_eq!(
            r.finish(),
            Err(WireError::NonzeroPaddingBits {
                byte_index: 0,
                bits: 0b1000
            })
        );
        let long = [0b101u8, 0];
        let mut r = BitReader::new(&long);
        r.get(3);
        assert_eq!(
            r.finish(),
            Err(WireError::LengthMismatch {
                expected: 1,
                got: 2
            })
        );
    }

    #[test]
    fn unary_stops_at_limit_and_at_end() {
        let zeros = [0u8; 20];
        let mut r = BitReader::new(&zeros);
        assert_eq!(r.unary(1000), Err(Unary::PastEnd));
        let mut data = vec![0u8; 20];
        data.push(1);
        let mut r = BitReader::new(&data);
        assert_eq!(r.unary(1000), Ok(160));
        let mut r = BitReader::new(&data);
        assert_eq!(r.unary(100), Err(Unary::PastLimit));
    }

    proptest! {
        #[test]
        fn prop_fields_round_trip(fields in proptest::collection::vec((any::<u64>(), 0u32..=64), 0..200)) {
            let mut w = BitWriter::with_capacity(0);
            let fields: Vec<(u64, u32)> = fields
                .into_iter()
                .map(|(v, n)| (if n == 64 { v } else { v & ((1u64 << n) - 1) }, n))
                .collect();
            for &(v, n) in &fields {
                w.put_long(v, n);
            }
            let total: u64 = fields.iter().map(|f| u64::from(f.1)).sum();
            let out = w.finish();
            prop_assert_eq!(out.len() as u64, total.div_ceil(8));
            let mut r = BitReader::new(&out);
            for &(v, n) in &fields {
                prop_assert_eq!(r.get_long(n), Some(v));
            }
            prop_assert_eq!(r.position(), total);
            prop_assert!(r.finish().is_ok());
        }
    }
}
