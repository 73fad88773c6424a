//! Canonical Huffman codes of bytes with a code-length cap and an escape (FORMAT.md section 6.4),
//! the exponent coder of GComp (Li et al., SoCC'24).
//!
//! The code has up to 257 codewords: one per byte value that has a code, and an *escape*. A byte
//! without a code is written as the escape's codeword followed by its 8 raw bits. A book is
//! built from symbol counts as a Huffman code; every symbol whose codeword would be longer than
//! the cap `n_θ` is given no code (it is escaped, at `len(escape) + 8` bits), and the code is
//! rebuilt until every codeword, the escape's included, fits in the cap. The escape is always
//! present unless all 256 symbols have codes, so a book built from one step's counts codes any
//! later step's bytes.
//!
//! Codewords are canonical: sorted by (length, symbol) with the escape as symbol 256, each is the
//! previous one plus one, shifted left to its length. A codeword goes into the LSB-first stream
//! of section 6 first bit (its most significant bit) first; escaped raw bytes go bit 0 first.
//!
//! Decoding looks up the next `cap` stream bits in a table of `2^cap` entries (symbol and
//! length), never walking a tree bit by bit.
//!
//! Serialized book: `cap` (u8, 1..=15), `escape_len` (u8, 0..=cap, 0 = no escape), `lo` (u8),
//! `count` (u16): the lengths of symbols `lo..lo+count` follow, two per byte (4 bits each,
//! section 6 packing at b = 4, zero padding nibble). Symbols outside the range have no code;
//! `lo` and `lo + count − 1` have codes (`count = 0` requires `lo = 0`), so the serialization of
//! a book is unique. A reader checks every length ≤ cap, the Kraft sum ≤ 1 and at least one
//! codeword.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::bitio::{reverse_low, BitReader, BitWriter};
use crate::error::{Result, WireError};

/// Symbols of the alphabet (bytes).
pub const ALPHABET: usize = 256;
/// The escape's index among the codewords.
pub const ESCAPE: usize = 256;
/// The largest code-length cap (lengths are serialized in 4 bits).
pub const MAX_CAP: u32 = 15;
/// Bytes of a serialized book's fixed part.
pub const BOOK_HEADER_LEN: usize = 5;

/// A canonical code with a length cap and an escape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HuffmanBook {
    cap: u8,
    /// Code length of each symbol and (last) of the escape; 0 = no codeword.
    lengths: [u8; ALPHABET + 1],
    /// Canonical codewords, most significant bit first.
    codes: [u16; ALPHABET + 1],
}

fn check_cap(cap: u32) -> Result<u8> {
    if (1..=MAX_CAP).contains(&cap) {
        Ok(cap as u8)
    } else {
        Err(WireError::InvalidCodeLengthCap { cap })
    }
}

/// Huffman code lengths of `weights` (all > 0), ties broken by index, so the result is
/// deterministic. A single weight gets length 1.
fn huffman_lengths(weights: &[u64]) -> Vec<u32> {
    let n = weights.len();
    if n == 1 {
        return vec![1];
    }
    let mut parent = vec![usize::MAX; 2 * n];
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = weights
        .iter()
        .enumerate()
        .map(|(i, &w)| Reverse((w, i)))
        .collect();
    let mut next = n;
    while heap.len() > 1 {
        let (Some(Reverse((wa, a))), Some(Reverse((wb, b)))) = (heap.pop(), heap.pop()) else {
            break;
        };
        parent[a] = next;
        parent[b] = next;
        heap.push(Reverse((wa.saturating_add(wb), next)));
        next += 1;
    }
    (0..n)
        .map(|i| {
            let mut depth = 0;
            let mut node = i;
            while parent[node] != usize::MAX {
                node = parent[node];
                depth += 1;
            }
            depth
        })
        .collect()
}

impl HuffmanBook {
    /// The capped code of the byte counts `counts` (256 of them), as described in the module
    /// documentation.
    pub fn from_counts(counts: &[u64; ALPHABET], cap: u32) -> Result<Self> {
        let cap8 = check_cap(cap)?;
        let mut active: Vec<usize> = (0..ALPHABET).filter(|&s| counts[s] > 0).collect();
        let mut escaped: u64 = 0;
        let mut lengths = [0u8; ALPHABET + 1];
        // Each pass either finishes or escapes at least one more symbol, so this ends.
        loop {
            let with_escape = active.len() < ALPHABET;
            let mut weights: Vec<u64> = active.iter().map(|&s| counts[s]).collect();
            if with_escape {
                weights.push(escaped.max(1));
            }
            let lens = huffman_lengths(&weights);
            let over: Vec<usize> = active
                .iter()
                .zip(&lens)
                .filter(|&(_, &l)| l > cap)
                .map(|(&s, _)| s)
                .collect();
            // Escaping the rarest over-long symbol shortens the others' codes, so one at a
            // time keeps as many symbols coded as the cap allows.
            if let Some(&rarest) = over.iter().min_by_key(|&&s| (counts[s], Reverse(s))) {
                escaped = escaped.saturating_add(counts[rarest]);
                active.retain(|&s| s != rarest);
                continue;
            }
            if with_escape && lens[active.len()] > cap {
                // The escape itself is too long: give it the rarest symbol's weight too.
                let Some(pos) =
                    (0..active.len()).min_by_key(|&i| (counts[active[i]], Reverse(active[i])))
                else {
                    break;
                };
                escaped = escaped.saturating_add(counts[active[pos]]);
                active.remove(pos);
                continue;
            }
            for (&s, &l) in active.iter().zip(&lens) {
                lengths[s] = l as u8;
            }
            if with_escape {
                lengths[ESCAPE] = lens[active.len()] as u8;
            }
            break;
        }
        Self::from_lengths(cap8 as u32, &lengths)
    }

    /// The book of given code lengths (256 symbols then the escape; 0 = no codeword).
    pub fn from_lengths(cap: u32, lengths: &[u8; ALPHABET + 1]) -> Result<Self> {
        let cap8 = check_cap(cap)?;
        let mut kraft = 0u64;
        let mut any = false;
        for (s, &l) in lengths.iter().enumerate() {
            if l > cap8 {
                return Err(WireError::CodeLengthAboveCap {
                    symbol: s as u16,
                    len: l,
                    cap: cap8,
                });
            }
            if l > 0 {
                kraft += 1u64 << (cap8 - l);
                any = true;
            }
        }
        if !any {
            return Err(WireError::EmptyCodebook);
        }
        if kraft > 1u64 << cap8 {
            return Err(WireError::KraftOverflow {
                sum: kraft,
                total: 1u64 << cap8,
            });
        }
        let mut order: Vec<usize> = (0..=ALPHABET).filter(|&s| lengths[s] > 0).collect();
        order.sort_by_key(|&s| (lengths[s], s));
        let mut codes = [0u16; ALPHABET + 1];
        let mut code = 0u32;
        let mut prev = 0u8;
        for s in order {
            code <<= lengths[s] - prev;
            codes[s] = code as u16;
            code += 1;
            prev = lengths[s];
        }
        Ok(HuffmanBook {
            cap: cap8,
            lengths: *lengths,
            codes,
        })
    }

    /// The code-length cap.
    pub fn cap(&self) -> u32 {
        u32::from(self.cap)
    }

    /// Code lengths: 256 symbols, then the escape (0 = no codeword).
    pub fn lengths(&self) -> &[u8; ALPHABET + 1] {
        &self.lengths
    }

    /// Bits a symbol costs: its code length, or the escape's plus 8; `None` if it cannot be coded.
    pub fn cost(&self, symbol: u8) -> Option<u32> {
        match (self.lengths[symbol as usize], self.lengths[ESCAPE]) {
            (0, 0) => None,
            (0, e) => Some(u32::from(e) + 8),
            (l, _) => Some(u32::from(l)),
        }
    }

    /// The serialized book (module documentation).
    pub fn to_bytes(&self) -> Vec<u8> {
        let coded: Vec<usize> = (0..ALPHABET).filter(|&s| self.lengths[s] > 0).collect();
        let (lo, count) = match (coded.first(), coded.last()) {
            (Some(&a), Some(&b)) => (a, b - a + 1),
            _ => (0, 0),
        };
        let mut out = Vec::with_capacity(BOOK_HEADER_LEN + count.div_ceil(2));
        out.push(self.cap);
        out.push(self.lengths[ESCAPE]);
        out.push(lo as u8);
        out.extend_from_slice(&(count as u16).to_le_bytes());
        for pair in self.lengths[lo..lo + count].chunks(2) {
            out.push(pair[0] | pair.get(1).map_or(0, |&b| b << 4));
        }
        out
    }

    /// Parses and validates a serialized book.
    pub fn from_bytes(data: &[u8]) -> Result<Self> {
        if data.len() < BOOK_HEADER_LEN {
            return Err(WireError::InputTooShort {
                needed: BOOK_HEADER_LEN,
                got: data.len(),
            });
        }
        let cap = check_cap(u32::from(data[0]))?;
        let lo = u16::from(data[2]);
        let count = u16::from_le_bytes([data[3], data[4]]);
        if usize::from(lo) + usize::from(count) > ALPHABET || (count == 0 && lo != 0) {
            return Err(WireError::CodebookRange { lo, count });
        }
        let expected = BOOK_HEADER_LEN + usize::from(count).div_ceil(2);
        if data.len() != expected {
            return Err(WireError::LengthMismatch {
                expected,
                got: data.len(),
            });
        }
        if count % 2 == 1 && data[expected - 1] >> 4 != 0 {
            return Err(WireError::NonzeroPaddingBits {
                byte_index: expected - 1,
                bits: data[expected - 1] & 0xF0,
            });
        }
        let mut lengths = [0u8; ALPHABET + 1];
        for i in 0..usize::from(count) {
            let byte = data[BOOK_HEADER_LEN + i / 2];
            lengths[usize::from(lo) + i] = if i % 2 == 0 { byte & 0x0F } else { byte >> 4 };
        }
        if count > 0 && (lengths[usize::from(lo)] == 0 || lengths[usize::from(lo + count - 1)] == 0)
        {
            return Err(WireError::CodebookRange { lo, count });
        }
        lengths[ESCAPE] = data[1];
        Self::from_lengths(u32::from(cap), &lengths)
    }

    /// Per symbol, the stream field (codeword reversed, then the raw byte for escaped symbols)
    /// and its width; width 0 when the symbol cannot be coded.
    pub(crate) fn encode_table(&self) -> [(u32, u32); ALPHABET] {
        let mut table = [(0u32, 0u32); ALPHABET];
        let esc_len = u32::from(self.lengths[ESCAPE]);
        let esc = if esc_len > 0 {
            reverse_low(u64::from(self.codes[ESCAPE]), esc_len) as u32
        } else {
            0
        };
        for (s, slot) in table.iter_mut().enumerate() {
            let l = u32::from(self.lengths[s]);
            *slot = if l > 0 {
                (reverse_low(u64::from(self.codes[s]), l) as u32, l)
            } else if esc_len > 0 {
                (esc | ((s as u32) << esc_len), esc_len + 8)
            } else {
                (0, 0)
            };
        }
        table
    }

    /// Exact bit length of `symbols`' code.
    pub fn encoded_bits(&self, symbols: &[u8]) -> Result<u64> {
        let table = self.encode_table();
        let mut bits = 0u64;
        for (index, &s) in symbols.iter().enumerate() {
            let (_, w) = table[usize::from(s)];
            if w == 0 {
                return Err(WireError::SymbolNotInBook { index, symbol: s });
            }
            bits += u64::from(w);
        }
        Ok(bits)
    }

    /// Codes `symbols` as one stream (zero padding bits).
    pub fn encode(&self, symbols: &[u8]) -> Result<Vec<u8>> {
        let table = self.encode_table();
        let mut w = BitWriter::with_capacity(symbols.len() / 2 + 8);
        for (index, &s) in symbols.iter().enumerate() {
            let (field, width) = table[usize::from(s)];
            if width == 0 {
                return Err(WireError::SymbolNotInBook { index, symbol: s });
            }
            w.put(u64::from(field), width);
        }
        Ok(w.finish())
    }

    /// The `2^cap` lookup table: entry = symbol (9 bits) | length << 9, 0 where no codeword starts.
    fn decode_table(&self) -> Vec<u16> {
        let size = 1usize << self.cap;
        let mut lut = vec![0u16; size];
        for s in 0..=ALPHABET {
            let l = self.lengths[s];
            if l == 0 {
                continue;
            }
            let rev = reverse_low(u64::from(self.codes[s]), u32::from(l)) as usize;
            let entry = s as u16 | (u16::from(l) << 9);
            for slot in lut.iter_mut().skip(rev).step_by(1 << l) {
                *slot = entry;
            }
        }
        lut
    }

    /// One symbol near the end of the input, where every read is checked.
    #[cold]
    fn decode_one(
        &self,
        lut: &[u16],
        r: &mut BitReader<'_>,
        decoded: usize,
        count: usize,
    ) -> Result<u8> {
        let cap = u32::from(self.cap);
        r.refill();
        let truncated = |r: &BitReader<'_>| WireError::StreamTruncated {
            decoded,
            count,
            bit_offset: r.position(),
        };
        let entry = lut[(r.buf & ((1u64 << cap) - 1)) as usize];
        let len = u32::from(entry >> 9);
        if len == 0 {
            // Bits past the end read as zeros: a miss there is a truncation, not a bad code.
            return Err(if r.avail < cap {
                truncated(r)
            } else {
                WireError::InvalidCode {
                    bit_offset: r.position(),
                }
            });
        }
        if len > r.avail {
            return Err(truncated(r));
        }
        r.consume(len);
        if usize::from(entry & 0x1FF) != ESCAPE {
            return Ok((entry & 0x1FF) as u8);
        }
        let at = r.position();
        let Some(raw) = r.get(8) else {
            return Err(truncated(r));
        };
        let raw = raw as u8;
        if self.lengths[usize::from(raw)] != 0 {
            return Err(WireError::EscapedSymbolHasCode {
                symbol: raw,
                bit_offset: at,
            });
        }
        Ok(raw)
    }

    /// Decodes exactly `count` symbols; the stream must end with the last one (zero padding bits,
    /// no byte more). Every codeword is at least one bit, so `count` is checked against the
    /// input's length before anything is allocated.
    pub fn decode(&self, data: &[u8], count: usize) -> Result<Vec<u8>> {
        let min_len = self
            .lengths
            .iter()
            .copied()
            .filter(|&l| l > 0)
            .min()
            .unwrap_or(1);
        let min_bits = (count as u64).saturating_mul(u64::from(min_len));
        if min_bits > data.len() as u64 * 8 {
            return Err(WireError::InputTooShort {
                needed: usize::try_from(min_bits.div_ceil(8)).unwrap_or(usize::MAX),
                got: data.len(),
            });
        }
        let lut = self.decode_table();
        let cap = u32::from(self.cap);
        let mask = (1u64 << cap) - 1;
        let mut out = vec![0u8; count];
        let mut r = BitReader::new(data);
        let mut i = 0usize;
        while i < count {
            r.refill();
            // Fast path: while a longest symbol (an escape code and its byte) is sure to be in the
            // buffer, no end-of-input test per symbol.
            while i < count && r.avail >= cap + 8 {
                let entry = lut[(r.buf & mask) as usize];
                let len = u32::from(entry >> 9);
                if len == 0 {
                    return Err(WireError::InvalidCode {
                        bit_offset: r.position(),
                    });
                }
                r.consume(len);
                let symbol = entry & 0x1FF;
                out[i] = if usize::from(symbol) == ESCAPE {
                    let raw = (r.buf & 0xFF) as u8;
                    if self.lengths[usize::from(raw)] != 0 {
                        return Err(WireError::EscapedSymbolHasCode {
                            symbol: raw,
                            bit_offset: r.position(),
                        });
                    }
                    r.consume(8);
                    raw
                } else {
                    symbol as u8
                };
                i += 1;
            }
            if i < count {
                r.refill();
                if r.avail < cap + 8 {
                    // The last bits of the input: one symbol at a time, every read checked.
                    out[i] = self.decode_one(&lut, &mut r, i, count)?;
                    i += 1;
                }
            }
        }
        r.finish()?;
        Ok(out)
    }
}

/// Byte counts of `symbols`.
pub fn byte_counts(symbols: &[u8]) -> [u64; ALPHABET] {
    // Four interleaved tables break the store-to-load dependency of runs of one value.
    let mut c = [[0u64; ALPHABET]; 4];
    let chunks = symbols.chunks_exact(4);
    let tail = chunks.remainder();
    for q in chunks {
        c[0][usize::from(q[0])] += 1;
        c[1][usize::from(q[1])] += 1;
        c[2][usize::from(q[2])] += 1;
        c[3][usize::from(q[3])] += 1;
    }
    for &s in tail {
        c[0][usize::from(s)] += 1;
    }
    let mut out = [0u64; ALPHABET];
    for (s, slot) in out.iter_mut().enumerate() {
        *slot = c[0][s] + c[1][s] + c[2][s] + c[3][s];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn counts_of(pairs: &[(u8, u64)]) -> [u64; ALPHABET] {
        let mut c = [0u64; ALPHABET];
        for &(s, n) in pairs {
            c[usize::from(s)] = n;
        }
        c
    }

    #[test]
    fn canonical_codes_of_known_lengths() {
        // Lengths A=1, B=2, C=3, escape=3 -> codes 0, 10, 110, 111 (escape sorts last).
        let mut lengths = [0u8; ALPHABET + 1];
        lengths[65] = 1;
        lengths[66] = 2;
        lengths[67] = 3;
        lengths[ESCAPE] = 3;
        let book = HuffmanBook::from_lengths(4, &lengths).unwrap();
        assert_eq!(book.codes[65], 0b0);
        assert_eq!(book.codes[66], 0b10);
        assert_eq!(book.codes[67], 0b110);
        assert_eq!(book.codes[ESCAPE], 0b111);
        // "ABCZ": 0 | 10 | 110 | 111 + raw 'Z' (0x5A bit 0 first) -> stream bits
        // 0 1 0 1 1 0 1 1 | 1 0 1 0 1 1 0 1 | 0
        let enc = book.encode(b"ABCZ").unwrap();
        assert_eq!(enc, vec![0b1101_1010, 0b1011_0101, 0b0]);
        assert_eq!(book.decode(&enc, 4).unwrap(), b"ABCZ".to_vec());
        assert_eq!(book.encoded_bits(b"ABCZ").unwrap(), 17);
    }

    #[test]
    fn long_codes_are_escaped_and_every_length_fits_the_cap() {
        // Fibonacci-like counts give a maximally skewed tree of depth 20 without a cap.
        let mut counts = [0u64; ALPHABET];
        let (mut a, mut b) = (1u64, 1u64);
        for s in 0..21 {
            counts[100 + s] = a;
            (a, b) = (b, a + b);
        }
        for cap in [1u32, 2, 3, 5, 8, 15] {
            let book = HuffmanBook::from_counts(&counts, cap).unwrap();
            assert!(book.lengths.iter().all(|&l| u32::from(l) <= cap));
            assert!(
                book.lengths[ESCAPE] > 0,
                "the escape is always there while symbols lack codes"
            );
            // The most frequent symbols keep codes; the rarest are escaped.
            assert!(
                book.lengths[120] > 0,
                "cap {cap}: {:?}",
                &book.lengths[95..125]
            );
            if cap < 15 {
                assert_eq!(book.lengths[100], 0);
            }
            let symbols: Vec<u8> = (0u8..=255).collect();
            let enc = book.encode(&symbols).unwrap();
            assert_eq!(book.decode(&enc, symbols.len()).unwrap(), symbols);
            let again = HuffmanBook::from_bytes(&book.to_bytes()).unwrap();
            assert_eq!(again, book);
        }
    }

    #[test]
    fn degenerate_counts() {
        // Nothing seen: only the escape.
        let book = HuffmanBook::from_counts(&[0; ALPHABET], 4).unwrap();
        assert_eq!(book.lengths[ESCAPE], 1);
        assert_eq!(book.to_bytes(), vec![4, 1, 0, 0, 0]);
        let enc = book.encode(&[7, 200]).unwrap();
        assert_eq!(book.decode(&enc, 2).unwrap(), vec![7, 200]);
        // One symbol: it and the escape share the 1-bit codes.
        let book = HuffmanBook::from_counts(&counts_of(&[(9, 1000)]), 4).unwrap();
        assert_eq!((book.lengths[9], book.lengths[ESCAPE]), (1, 1));
        // All 256 symbols: no escape needed.
        let book = HuffmanBook::from_counts(&[1; ALPHABET], 15).unwrap();
        assert_eq!(book.lengths[ESCAPE], 0);
        assert!(book.lengths[..ALPHABET].iter().all(|&l| l == 8));
        // All 256 symbols with a small cap: some are escaped and the escape appears.
        let book = HuffmanBook::from_counts(&[1; ALPHABET], 6).unwrap();
        assert!(book.lengths[ESCAPE] > 0);
    }

    #[test]
    fn serialized_book_layout_and_validation() {
        let book =
            HuffmanBook::from_counts(&counts_of(&[(120, 50), (121, 30), (123, 20)]), 8).unwrap();
        let bytes = book.to_bytes();
        // cap, escape length, lo = 120, count = 4 (120..=123), 2 bytes of nibbles.
        assert_eq!(&bytes[..5], &[8, book.lengths[ESCAPE], 120, 4, 0]);
        assert_eq!(bytes.len(), 7);
        assert_eq!(bytes[5], book.lengths[120] | (book.lengths[121] << 4));
        assert_eq!(bytes[6], book.lengths[122] | (book.lengths[123] << 4));
        assert_eq!(HuffmanBook::from_bytes(&bytes).unwrap(), book);

        assert_eq!(
            HuffmanBook::from_bytes(&[0, 1, 0, 0, 0]),
            Err(WireError::InvalidCodeLengthCap { cap: 0 })
        );
        assert_eq!(
            HuffmanBook::from_bytes(&[16, 1, 0, 0, 0]),
            Err(WireError::InvalidCodeLengthCap { cap: 16 })
        );
        assert_eq!(
            HuffmanBook::from_bytes(&[4, 0, 0, 0, 0]),
            Err(WireError::EmptyCodebook)
        );
        assert!(matches!(
            HuffmanBook::from_bytes(&[4, 5, 0, 0, 0]),
            Err(WireError::CodeLengthAboveCap { symbol: 256, .. })
        ));
        assert_eq!(
            HuffmanBook::from_bytes(&[4, 1, 3, 0, 0]),
            Err(WireError::CodebookRange { lo: 3, count: 0 })
        );
        assert_eq!(
            HuffmanBook::from_bytes(&[4, 1, 255, 2, 0, 0x11]),
            Err(WireError::CodebookRange { lo: 255, count: 2 })
        );
        // Three codewords of length 1: over-subscribed.
        assert!(matches!(
            HuffmanBook::from_bytes(&[4, 1, 0, 2, 0, 0x11]),
            Err(WireError::KraftOverflow { .. })
        ));
        // Zero length at the range's end: not the canonical serialization.
        assert_eq!(
            HuffmanBook::from_bytes(&[4, 1, 0, 2, 0, 0x01]),
            Err(WireError::CodebookRange { lo: 0, count: 2 })
        );
        assert!(matches!(
            HuffmanBook::from_bytes(&[4, 1, 0, 1, 0, 0x11]),
            Err(WireError::NonzeroPaddingBits { .. })
        ));
        assert!(matches!(
            HuffmanBook::from_bytes(&[4, 1, 0, 1, 0]),
            Err(WireError::LengthMismatch { .. })
        ));
        assert!(matches!(
            HuffmanBook::from_bytes(&[4, 1]),
            Err(WireError::InputTooShort { .. })
        ));
    }

    #[test]
    fn hostile_streams() {
        // A: 1 bit, escape: 1 bit -> every bit pattern decodes; use an incomplete code instead.
        let mut lengths = [0u8; ALPHABET + 1];
        lengths[65] = 2;
        lengths[ESCAPE] = 2;
        // codes: A = 00, escape = 01; 1x is no codeword.
        let book = HuffmanBook::from_lengths(3, &lengths).unwrap();
        assert!(matches!(
            book.decode(&[0b0000_0001], 1),
            Err(WireError::InvalidCode { bit_offset: 0 })
        ));
        // Escape followed by a raw 'A', which has its own code.
        let raw_a = (0b10u16 | (65u16 << 2)).to_le_bytes();
        assert!(matches!(
            book.decode(&raw_a, 1),
            Err(WireError::EscapedSymbolHasCode { symbol: 65, .. })
        ));
        // Truncated escape.
        assert!(matches!(
            book.decode(&[0b10], 1),
            Err(WireError::StreamTruncated { .. })
        ));
        // Too many symbols for the bytes: refused before allocating.
        assert!(matches!(
            book.decode(&[0], 5),
            Err(WireError::InputTooShort { .. })
        ));
        // Symbol without code and no escape.
        let mut lengths = [0u8; ALPHABET + 1];
        lengths[1] = 1;
        let book = HuffmanBook::from_lengths(3, &lengths).unwrap();
        assert_eq!(
            book.encode(&[1, 2]),
            Err(WireError::SymbolNotInBook {
                index: 1,
                symbol: 2
            })
        );
    }

    #[test]
    fn counts() {
        let c = byte_counts(&[1, 1, 2, 255, 1, 0, 0]);
        assert_eq!((c[0], c[1], c[2], c[255], c[3]), (2, 3, 1, 1, 0));
    }

    proptest! {
        #[test]
        fn prop_round_trip(symbols in proptest::collection::vec(prop_oneof![100u8..110, any::<u8>()], 0..400),
                           train in proptest::collection::vec(100u8..112, 0..400), cap in 1u32..=15) {
            let book = HuffmanBook::from_counts(&byte_counts(&train), cap).unwrap();
            prop_assert!(book.lengths.iter().all(|&l| u32::from(l) <= cap));
            let enc = book.encode(&symbols).unwrap();
            prop_assert_eq!(book.encoded_bits(&symbols).unwrap().div_ceil(8), enc.len() as u64);
            prop_assert_eq!(book.decode(&enc, symbols.len()).unwrap(), symbols);
            prop_assert_eq!(HuffmanBook::from_bytes(&book.to_bytes()).unwrap(), book);
        }

        #[test]
        fn prop_optimal_without_cap(train in proptest::collection::vec(0u8..40, 1..400)) {
            // With the cap out of reach the code is an ordinary Huffman code plus the escape of
            // weight 1: never longer in total than a fixed 6-bit code of the 40 symbols.
            let book = HuffmanBook::from_counts(&byte_counts(&train), 15).unwrap();
            prop_assert!(book.encoded_bits(&train).unwrap() <= 6 * train.len() as u64 + 6);
        }

        #[test]
        fn prop_arbitrary_books_and_streams_never_panic(book in proptest::collection::vec(any::<u8>(), 0..40),
                                                        data in proptest::collection::vec(any::<u8>(), 0..64),
                                                        count in 0usize..200) {
            if let Ok(b) = HuffmanBook::from_bytes(&book) {
                prop_assert_eq!(b.to_bytes(), book);
                if let Ok(symbols) = b.decode(&data, count) {
                    prop_assert_eq!(b.encode(&symbols).unwrap(), data);
                }
            }
        }
    }
}
