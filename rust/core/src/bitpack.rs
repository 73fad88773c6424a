//! Fixed-width bit packing (FORMAT.md section 6).
//!
//! `n` values of `b` bits (1 ≤ b ≤ 32) form an LSB-first bit stream: value `i` occupies stream
//! bits `[i·b, (i+1)·b)`, its bit `j` at stream bit `i·b + j`; stream bit `m` is bit `m mod 8` of
//! byte `m div 8`. The stream is `ceil(n·b/8)` bytes and the unused high bits of the last byte are
//! zero.
//!
//! Speed: eight values of `b` bits are exactly `b` bytes, so the bulk of the stream is processed
//! in groups of eight with the width a compile-time constant (one monomorphised kernel per width,
//! a 64-bit accumulator flushed 32 bits at a time, fully unrolled), and widths 8, 16 and 32 are
//! plain widening/narrowing copies. Only the last `< 8` values go through a generic loop.

use crate::error::{Result, WireError};

/// Checks `bits` and returns the mask of its low bits.
fn check_bits(bits: u32) -> Result<u32> {
    if (1..=32).contains(&bits) {
        Ok(mask_of(bits))
    } else {
        Err(WireError::InvalidBitWidth { bits })
    }
}

#[inline(always)]
const fn mask_of(bits: u32) -> u32 {
    if bits >= 32 {
        u32::MAX
    } else {
        (1u32 << bits) - 1
    }
}

/// Number of bytes of `count` values of `bits` bits: `ceil(count·bits/8)`, overflow-checked.
pub fn packed_len(count: usize, bits: u32) -> Result<usize> {
    check_bits(bits)?;
    let total_bits = count
        .checked_mul(bits as usize)
        .ok_or(WireError::SizeOverflow { count, bits })?;
    // ceil without the `+ 7` overflow.
    Ok(total_bits / 8 + usize::from(total_bits % 8 != 0))
}

/// Packs `values` at `bits` bits each into a new byte vector of `ceil(n·bits/8)` bytes.
///
/// Errors: `bits` outside `1..=32`; a value that does not fit in `bits` bits (the first such
/// index is reported); a size overflow.
pub fn pack_bits(values: &[u32], bits: u32) -> Result<Vec<u8>> {
    let len = packed_len(values.len(), bits)?;
    let mut out = vec![0u8; len];
    pack_bits_into(values, bits, &mut out)?;
    Ok(out)
}

/// Packs `values` into `out`, which must be exactly `packed_len(values.len(), bits)` bytes.
/// Every byte of `out` is written (padding bits zero). On error the contents of `out` are
/// unspecified.
pub fn pack_bits_into(values: &[u32], bits: u32, out: &mut [u8]) -> Result<()> {
    let mask = check_bits(bits)?;
    let needed = packed_len(values.len(), bits)?;
    if out.len() != needed {
        return Err(WireError::OutputSizeMismatch {
            needed,
            got: out.len(),
        });
    }
    let bad = dispatch_width!(bits, pack_const, values, out);
    if bad != 0 {
        return Err(first_too_wide(values, mask, bits));
    }
    Ok(())
}

fn first_too_wide(values: &[u32], mask: u32, bits: u32) -> WireError {
    match values.iter().position(|&v| v & !mask != 0) {
        Some(index) => WireError::ValueTooWide {
            index,
            value: values[index],
            bits,
        },
        // Unreachable when called after a failed pack; keep a sensible error anyway.
        None => WireError::InvalidBitWidth { bits },
    }
}

/// Unpacks `count` values of `bits` bits. `data` may be longer than needed (extra bytes and
/// padding bits are ignored); use [`unpack_bits_exact`] for the strict form.
pub fn unpack_bits(data: &[u8], bits: u32, count: usize) -> Result<Vec<u32>> {
    let needed = packed_len(count, bits)?;
    if data.len() < needed {
        return Err(WireError::InputTooShort {
            needed,
            got: data.len(),
        });
    }
    let mut out = vec![0u32; count];
    unpack_bits_into(data, bits, &mut out)?;
    Ok(out)
}

/// Unpacks `out.len()` values from `data` (lenient: longer `data` is accepted).
pub fn unpack_bits_into(data: &[u8], bits: u32, out: &mut [u32]) -> Result<()> {
    check_bits(bits)?;
    let needed = packed_len(out.len(), bits)?;
    if data.len() < needed {
        return Err(WireError::InputTooShort {
            needed,
            got: data.len(),
        });
    }
    dispatch_width!(bits, unpack_const, &data[..needed], out);
    Ok(())
}

/// Strict unpack: `data` must be exactly `ceil(count·bits/8)` bytes and its padding bits zero,
/// so that exactly one byte string decodes to a given list of values.
pub fn unpack_bits_exact(data: &[u8], bits: u32, count: usize) -> Result<Vec<u32>> {
    check_exact(data, bits, count)?;
    let mut out = vec![0u32; count];
    dispatch_width!(bits, unpack_const, data, &mut out);
    Ok(out)
}

/// Strict form of [`unpack_bits_into`]: `count` is `out.len()`.
pub fn unpack_bits_exact_into(data: &[u8], bits: u32, out: &mut [u32]) -> Result<()> {
    check_exact(data, bits, out.len())?;
    dispatch_width!(bits, unpack_const, data, out);
    Ok(())
}

fn check_exact(data: &[u8], bits: u32, count: usize) -> Result<()> {
    let needed = packed_len(count, bits)?;
    if data.len() != needed {
        return Err(WireError::LengthMismatch {
            expected: needed,
            got: data.len(),
        });
    }
    if let Some((byte_index, bits_found)) = nonzero_padding(data, bits, count) {
        return Err(WireError::NonzeroPaddingBits {
            byte_index,
            bits: bits_found,
        });
    }
    Ok(())
}

/// Returns the index of the last stream byte and its nonzero padding bits, if any.
fn nonzero_padding(data: &[u8], bits: u32, count: usize) -> Option<(usize, u8)> {
    let total_bits = count.checked_mul(bits as usize)?;
    let used = (total_bits % 8) as u32;
    if used == 0 {
        return None;
    }
    let idx = total_bits / 8;
    let b = *data.get(idx)?;
    let pad = b >> used;
    (pad != 0).then_some((idx, pad << used))
}

/// True when the padding bits after `count` values of `bits` bits are all zero (bytes after the
/// stream are not looked at). False also when `bits` is invalid or `data` is too short.
pub fn padding_is_zero(data: &[u8], bits: u32, count: usize) -> bool {
    match packed_len(count, bits) {
        Ok(needed) if data.len() >= needed => nonzero_padding(data, bits, count).is_none(),
        _ => false,
    }
}

// ---------------------------------------------------------------------------------- kernels

/// Calls `$f::<B>($args)` with `B` the compile-time constant equal to `$bits` (1..=32).
/// Callers have validated `$bits`; the fallback arm is never taken and does nothing harmful.
macro_rules! dispatch_width {
    ($bits:expr, $f:ident, $($arg:expr),*) => {
        match $bits {
            1 => $f::<1>($($arg),*), 2 => $f::<2>($($arg),*), 3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*), 5 => $f::<5>($($arg),*), 6 => $f::<6>($($arg),*),
            7 => $f::<7>($($arg),*), 8 => $f::<8>($($arg),*), 9 => $f::<9>($($arg),*),
            10 => $f::<10>($($arg),*), 11 => $f::<11>($($arg),*), 12 => $f::<12>($($arg),*),
            13 => $f::<13>($($arg),*), 14 => $f::<14>($($arg),*), 15 => $f::<15>($($arg),*),
            16 => $f::<16>($($arg),*), 17 => $f::<17>($($arg),*), 18 => $f::<18>($($arg),*),
            19 => $f::<19>($($arg),*), 20 => $f::<20>($($arg),*), 21 => $f::<21>($($arg),*),
            22 => $f::<22>($($arg),*), 23 => $f::<23>($($arg),*), 24 => $f::<24>($($arg),*),
            25 => $f::<25>($($arg),*), 26 => $f::<26>($($arg),*), 27 => $f::<27>($($arg),*),
            28 => $f::<28>($($arg),*), 29 => $f::<29>($($arg),*), 30 => $f::<30>($($arg),*),
            31 => $f::<31>($($arg),*), _ => $f::<32>($($arg),*),
        }
    };
}
use dispatch_width;

/// Packs `values` (any length) into `out` (exactly `ceil(len·B/8)` bytes). Returns the OR of
/// every value's bits above `B` (nonzero means some value did not fit).
fn pack_const<const B: u32>(values: &[u32], out: &mut [u8]) -> u32 {
    let mask = mask_of(B);
    let nb = B as usize;
    let groups = values.len() / 8;
    let (v_head, v_tail) = values.split_at(groups * 8);
    let (o_head, o_tail) = out.split_at_mut(groups * nb);
    let mut bad = 0u32;
    match B {
        8 => {
            for (o, &v) in o_head.iter_mut().zip(v_head) {
                bad |= v & !mask;
                *o = v as u8;
            }
        }
        16 => {
            for (o, &v) in o_head.chunks_exact_mut(2).zip(v_head) {
                bad |= v & !mask;
                o.copy_from_slice(&(v as u16).to_le_bytes());
            }
        }
        32 => {
            for (o, &v) in o_head.chunks_exact_mut(4).zip(v_head) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => {
            for (vc, oc) in v_head.chunks_exact(8).zip(o_head.chunks_exact_mut(nb)) {
                let mut acc = 0u64;
                let mut nbits = 0u32;
                let mut p = 0usize;
                for &v in vc {
                    bad |= v & !mask;
                    acc |= u64::from(v) << nbits;
                    nbits += B;
                    if nbits >= 32 {
                        oc[p..p + 4].copy_from_slice(&(acc as u32).to_le_bytes());
                        p += 4;
                        acc >>= 32;
                        nbits -= 32;
                    }
                }
                // 8·B bits is whole bytes, so what is left is whole bytes too.
                while nbits > 0 {
                    oc[p] = acc as u8;
                    p += 1;
                    acc >>= 8;
                    nbits -= 8;
                }
            }
        }
    }
    bad | pack_tail(v_tail, B, o_tail)
}

/// Generic packer for the last few values; starts at bit 0 of `out`.
fn pack_tail(values: &[u32], bits: u32, out: &mut [u8]) -> u32 {
    let mask = mask_of(bits);
    let mut bad = 0u32;
    let mut acc = 0u64;
    let mut nbits = 0u32;
    let mut bytes = out.iter_mut();
    for &v in values {
        bad |= v & !mask;
        acc |= u64::from(v & mask) << nbits;
        nbits += bits;
        while nbits >= 8 {
            if let Some(b) = bytes.next() {
                *b = acc as u8;
            }
            acc >>= 8;
            nbits -= 8;
        }
    }
    if nbits > 0 {
        if let Some(b) = bytes.next() {
            *b = acc as u8;
        }
    }
    bad
}

/// Unpacks `out.len()` values from `data`, which holds at least `ceil(len·B/8)` bytes.
fn unpack_const<const B: u32>(data: &[u8], out: &mut [u32]) {
    let mask = u64::from(mask_of(B));
    let nb = B as usize;
    let groups = out.len() / 8;
    let (o_head, o_tail) = out.split_at_mut(groups * 8);
    let split = (groups * nb).min(data.len());
    let (d_head, d_tail) = data.split_at(split);
    match B {
        8 => {
            for (o, &b) in o_head.iter_mut().zip(d_head) {
                *o = u32::from(b);
            }
        }
        16 => {
            for (o, b) in o_head.iter_mut().zip(d_head.chunks_exact(2)) {
                *o = u32::from(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        32 => {
            for (o, b) in o_head.iter_mut().zip(d_head.chunks_exact(4)) {
                *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        _ => {
            for (ic, oc) in d_head.chunks_exact(nb).zip(o_head.chunks_exact_mut(8)) {
                let mut acc = 0u64;
                let mut nbits = 0u32;
                let mut p = 0usize;
                for o in oc.iter_mut() {
                    if nbits < B {
                        if p + 4 <= nb {
                            let w = u32::from_le_bytes([ic[p], ic[p + 1], ic[p + 2], ic[p + 3]]);
                            acc |= u64::from(w) << nbits;
                            p += 4;
                            nbits += 32;
                        } else {
                            while p < nb {
                                acc |= u64::from(ic[p]) << nbits;
                                p += 1;
                                nbits += 8;
                            }
                        }
                    }
                    *o = (acc & mask) as u32;
                    acc >>= B;
                    nbits -= B;
                }
            }
        }
    }
    unpack_tail(d_tail, B, o_tail);
}

/// Generic unpacker for the last few values; starts at bit 0 of `data`.
fn unpack_tail(data: &[u8], bits: u32, out: &mut [u32]) {
    let mask = u64::from(mask_of(bits));
    let mut acc = 0u64;
    let mut nbits = 0u32;
    let mut bytes = data.iter();
    for o in out.iter_mut() {
        while nbits < bits {
            acc |= u64::from(bytes.next().copied().unwrap_or(0)) << nbits;
            nbits += 8;
        }
        *o = (acc & mask) as u32;
        acc >>= bits;
        nbits -= bits;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Bit-by-bit reference implementation straight from the definition.
    fn reference_pack(values: &[u32], bits: u32) -> Vec<u8> {
        let total = values.len() * bits as usize;
        let mut out = vec![0u8; total.div_ceil(8)];
        for (i, &v) in values.iter().enumerate() {
            for j in 0..bits as usize {
                if (v >> j) & 1 == 1 {
                    let m = i * bits as usize + j;
                    out[m / 8] |= 1 << (m % 8);
                }
            }
        }
        out
    }

    #[test]
    fn twelve_bit_rule() {
        let values = [0xABC, 0x123, 0xFFF, 0x000, 0x801];
        let packed = pack_bits(&values, 12).unwrap();
        let mut expect = Vec::new();
        let padded = [0xABC, 0x123, 0xFFF, 0x000, 0x801, 0];
        for p in padded.chunks(2) {
            let (v0, v1) = (p[0] as u32, p[1] as u32);
            expect.extend_from_slice(&[
                (v0 & 0xFF) as u8,
                ((v0 >> 8) | ((v1 & 0xF) << 4)) as u8,
                (v1 >> 4) as u8,
            ]);
        }
        expect.truncate(8); // 5 values * 12 bits = 60 bits = 8 bytes
        assert_eq!(packed, expect);
        assert_eq!(unpack_bits_exact(&packed, 12, 5).unwrap(), values);
    }

    #[test]
    fn twelve_bit_rule_many() {
        let values: Vec<u32> = (0..1000u32)
            .map(|i| i.wrapping_mul(2654435761u32) >> 20)
            .collect();
        let packed = pack_bits(&values, 12).unwrap();
        assert_eq!(packed.len(), 1500);
        for (p, v) in packed.chunks(3).zip(values.chunks(2)) {
            assert_eq!(
                p,
                [
                    (v[0] & 0xFF) as u8,
                    ((v[0] >> 8) | ((v[1] & 0xF) << 4)) as u8,
                    (v[1] >> 4) as u8
                ]
            );
        }
    }

    #[test]
    fn every_width_matches_reference() {
        for bits in 1..=32u32 {
            for n in [0usize, 1, 7, 8, 9, 15, 16, 17, 63, 64, 100] {
                let mask = mask_of(bits);
                let values: Vec<u32> = (0..n as u32)
                    .map(|i| i.wrapping_mul(0x9E37_79B9).rotate_left(i % 32) & mask)
                    .collect();
                let packed = pack_bits(&values, bits).unwrap();
                assert_eq!(packed, reference_pack(&values, bits), "bits {bits} n {n}");
                assert_eq!(unpack_bits(&packed, bits, n).unwrap(), values);
                assert_eq!(unpack_bits_exact(&packed, bits, n).unwrap(), values);
                assert!(padding_is_zero(&packed, bits, n));
            }
        }
    }

    #[test]
    fn rejects_bad_width() {
        assert_eq!(
            pack_bits(&[1], 0),
            Err(WireError::InvalidBitWidth { bits: 0 })
        );
        assert_eq!(
            pack_bits(&[1], 33),
            Err(WireError::InvalidBitWidth { bits: 33 })
        );
        assert_eq!(
            unpack_bits(&[1], 0, 1),
            Err(WireError::InvalidBitWidth { bits: 0 })
        );
        assert_eq!(
            unpack_bits_exact(&[1], 40, 1),
            Err(WireError::InvalidBitWidth { bits: 40 })
        );
    }

    #[test]
    fn rejects_value_too_wide_with_index() {
        let mut values = vec![1u32; 20];
        values[3] = 5000;
        values[11] = 9999;
        let err = pack_bits(&values, 12).unwrap_err();
        assert_eq!(
            err,
            WireError::ValueTooWide {
                index: 3,
                value: 5000,
                bits: 12
            }
        );
        assert_eq!(
            err.to_string(),
            "value 5000 at index 3 does not fit in 12 bits"
        );
        // In the tail too.
        let mut values = vec![0u32; 10];
        values[9] = 2;
        assert_eq!(
            pack_bits(&values, 1),
            Err(WireError::ValueTooWide {
                index: 9,
                value: 2,
                bits: 1
            })
        );
        for bits in [8, 16] {
            let mut values = vec![0u32; 17];
            values[5] = 1 << bits;
            assert_eq!(
                pack_bits(&values, bits),
                Err(WireError::ValueTooWide {
                    index: 5,
                    value: 1 << bits,
                    bits
                })
            );
        }
    }

    #[test]
    fn length_rules() {
        let packed = pack_bits(&[1, 2, 3], 5).unwrap(); // 15 bits -> 2 bytes
        assert_eq!(packed.len(), 2);
        assert_eq!(
            unpack_bits(&packed[..1], 5, 3),
            Err(WireError::InputTooShort { needed: 2, got: 1 })
        );
        let mut longer = packed.clone();
        longer.push(0xFF);
        assert_eq!(unpack_bits(&longer, 5, 3).unwrap(), vec![1, 2, 3]);
        assert_eq!(
            unpack_bits_exact(&longer, 5, 3),
            Err(WireError::LengthMismatch {
                expected: 2,
                got: 3
            })
        );
        let mut dirty = packed.clone();
        dirty[1] |= 0x80;
        assert!(!padding_is_zero(&dirty, 5, 3));
        assert_eq!(unpack_bits(&dirty, 5, 3).unwrap(), vec![1, 2, 3]);
        assert_eq!(
            unpack_bits_exact(&dirty, 5, 3),
            Err(WireError::NonzeroPaddingBits {
                byte_index: 1,
                bits: 0x80
            })
        );
        let mut out = [0u8; 3];
        assert_eq!(
            pack_bits_into(&[1, 2, 3], 5, &mut out),
            Err(WireError::OutputSizeMismatch { needed: 2, got: 3 })
        );
    }

    #[test]
    fn count_overflow_is_checked() {
        assert_eq!(
            packed_len(usize::MAX, 2),
            Err(WireError::SizeOverflow {
                count: usize::MAX,
                bits: 2
            })
        );
        assert!(matches!(
            unpack_bits(&[], 32, usize::MAX / 4),
            Err(WireError::SizeOverflow { .. })
        ));
        assert!(matches!(
            unpack_bits_exact(&[], 3, usize::MAX),
            Err(WireError::SizeOverflow { .. })
        ));
        assert!(!padding_is_zero(&[], 3, usize::MAX));
    }

    #[test]
    fn empty() {
        assert_eq!(pack_bits(&[], 7).unwrap(), Vec::<u8>::new());
        assert_eq!(unpack_bits_exact(&[], 7, 0).unwrap(), Vec::<u32>::new());
    }

    fn width_and_values() -> impl Strategy<Value = (u32, Vec<u32>)> {
        (1u32..=32).prop_flat_map(|bits| {
            let mask = mask_of(bits);
            (
                Just(bits),
                proptest::collection::vec(any::<u32>().prop_map(move |v| v & mask), 0..300),
            )
        })
    }

    proptest! {
        #[test]
        fn prop_round_trip((bits, values) in width_and_values()) {
            let packed = pack_bits(&values, bits).unwrap();
            prop_assert_eq!(&packed, &reference_pack(&values, bits));
            prop_assert_eq!(unpack_bits_exact(&packed, bits, values.len()).unwrap(), values.clone());
            prop_assert_eq!(unpack_bits(&packed, bits, values.len()).unwrap(), values);
        }

        #[test]
        fn prop_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..200),
                                            bits in 0u32..40, count in 0usize..400) {
            let lenient = unpack_bits(&data, bits, count);
            if let Ok(values) = unpack_bits_exact(&data, bits, count) {
                // A strict decode is canonical: re-encoding gives the same bytes.
                prop_assert_eq!(pack_bits(&values, bits).unwrap(), data.clone());
                prop_assert_eq!(lenient.unwrap(), values);
            }
        }
    }
}
