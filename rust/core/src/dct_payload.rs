//! The coded sections of DCT records (docs/FORMAT.md §5.2), every record of a step in one call: each
//! record's positions coded as its codec asks — packed at `ceil(log2 C)` bits, Golomb-Rice coded at
//! the data's best parameter, or whichever of the two is smaller (a tie to the packing) — and its
//! quantized values packed below a byte.
//!
//! A step's records were coded one by one from Python, a few native calls each; here one call codes
//! them all with the GIL released. The streams are byte for byte those of the record-by-record path
//! (the same [`pack_bits`] and [`rice_encode`] at the same parameters), which the Python tests hold.

use crate::bitpack::pack_bits;
use crate::error::{Result, WireError};
use crate::rice::{rice_encode, rice_param};

/// `index_coding` of a record whose positions are packed at a fixed width.
pub const INDEX_CODING_FIXED: u8 = 0;
/// `index_coding` of a record whose positions are Golomb-Rice coded.
pub const INDEX_CODING_RICE: u8 = 1;

/// How a codec codes its records' positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexCodingChoice {
    /// Always packed at `ceil(log2 C)` bits.
    Fixed,
    /// Always Golomb-Rice coded.
    Rice,
    /// The smaller of the two, a tie to the packing.
    Auto,
}

/// One record's layout: `rows` chunks of `universe` (`C`) coefficients, `k` kept per chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordLayout {
    pub rows: usize,
    pub k: usize,
    pub universe: u64,
}

/// One record's coded sections: its `index_coding` and that coding's parameter (the packing width or
/// the Rice parameter), the `idx` section and, for values below 8 bits, the packed `val` section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordPayload {
    pub coding: u8,
    pub param: u32,
    pub idx: Vec<u8>,
    pub val: Option<Vec<u8>>,
}

/// Bits per packed position for chunks of `c` elements: `max(1, ceil(log2 c))`.
pub fn index_bits_for(c: u64) -> u32 {
    (64 - c.saturating_sub(1).leading_zeros()).max(1)
}

/// The coded sections of every record laid out by `layouts`: `positions` holds each record's
/// `rows · k` positions (ascending within each chunk) one record after another, `levels` its quantized
/// values likewise when `value_bits` is below 8 (empty at 8 bits: those values go as they are).
///
/// Errors: `positions` (or, below 8 bits, `levels`) not exactly as long as the layouts add up to
/// (`length_mismatch`, counting values); a position not below its chunk size or not ascending
/// (`index_out_of_range`, `not_strictly_ascending`, from the Rice coder); a level too wide for
/// `value_bits` (`value_too_wide`).
pub fn dct_payloads(
    positions: &[u32],
    levels: &[u32],
    layouts: &[RecordLayout],
    choice: IndexCodingChoice,
    value_bits: u32,
) -> Result<Vec<RecordPayload>> {
    let total = layouts.iter().try_fold(0usize, |acc, l| {
        l.rows.checked_mul(l.k).and_then(|n| acc.checked_add(n))
    });
    let total = total.ok_or(WireError::SizeOverflow {
        count: usize::MAX,
        bits: 32,
    })?;
    if positions.len() != total {
        return Err(WireError::LengthMismatch {
            expected: total,
            got: positions.len(),
        });
    }
    let packs_values = value_bits < 8;
    if packs_values && levels.len() != total {
        return Err(WireError::LengthMismatch {
            expected: total,
            got: levels.len(),
        });
    }
    let mut out = Vec::with_capacity(layouts.len());
    let mut at = 0usize;
    for layout in layouts {
        let n = layout.rows * layout.k;
        let idx = &positions[at..at + n];
        let bits = index_bits_for(layout.universe);
        let (coding, param, stream) = code_positions(idx, layout, bits, choice)?;
        let val = if packs_values {
            Some(pack_bits(&levels[at..at + n], value_bits)?)
        } else {
            None
        };
        out.push(RecordPayload {
            coding,
            param,
            idx: stream,
            val,
        });
        at += n;
    }
    Ok(out)
}

fn code_positions(
    idx: &[u32],
    layout: &RecordLayout,
    bits: u32,
    choice: IndexCodingChoice,
) -> Result<(u8, u32, Vec<u8>)> {
    let rice = |param: u32| rice_encode(idx, layout.k, layout.universe, param);
    match choice {
        IndexCodingChoice::Fixed => Ok((INDEX_CODING_FIXED, bits, pack_bits(idx, bits)?)),
        IndexCodingChoice::Rice => {
            let param = if idx.is_empty() {
                0
            } else {
                rice_param(idx, layout.k, layout.universe)?.0
            };
            Ok((INDEX_CODING_RICE, param, rice(param)?))
        }
        IndexCodingChoice::Auto => {
            let (param, rice_len) = if idx.is_empty() {
                (0, 0)
            } else {
                rice_param(idx, layout.k, layout.universe)?
            };
            let fixed_len = (idx.len() * bits as usize).div_ceil(8);
            if fixed_len <= rice_len {
                Ok((INDEX_CODING_FIXED, bits, pack_bits(idx, bits)?))
            } else {
                Ok((INDEX_CODING_RICE, param, rice(param)?))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout(rows: usize, k: usize, universe: u64) -> RecordLayout {
        RecordLayout { rows, k, universe }
    }

    #[test]
    fn index_bits_are_ceil_log2_at_least_one() {
        assert_eq!(index_bits_for(1), 1);
        assert_eq!(index_bits_for(2), 1);
        assert_eq!(index_bits_for(3), 2);
        assert_eq!(index_bits_for(4096), 12);
        assert_eq!(index_bits_for(4097), 13);
    }

    #[test]
    fn each_choice_codes_as_the_single_kernels_do() {
        // Two records: 2 chunks of 16 keeping 3, then 1 chunk of 64 keeping 4.
        let positions = [1u32, 5, 9, 0, 2, 15, 3, 10, 40, 63];
        let levels = [0u32, 1, 2, 3, 0, 1, 2, 3, 1, 0];
        let layouts = [layout(2, 3, 16), layout(1, 4, 64)];
        let fixed =
            dct_payloads(&positions, &levels, &layouts, IndexCodingChoice::Fixed, 2).unwrap();
        assert_eq!(fixed[0].idx, pack_bits(&positions[..6], 4).unwrap());
        assert_eq!(fixed[1].idx, pack_bits(&positions[6..], 6).unwrap());
        assert_eq!((fixed[1].coding, fixed[1].param), (INDEX_CODING_FIXED, 6));
        assert_eq!(
            fixed[0].val.as_deref(),
            Some(&pack_bits(&levels[..6], 2).unwrap()[..])
        );
        let rice = dct_payloads(&positions, &levels, &layouts, IndexCodingChoice::Rice, 8).unwrap();
        let (param, _) = rice_param(&positions[6..], 4, 64).unwrap();
        assert_eq!(
            rice[1].idx,
            rice_encode(&positions[6..], 4, 64, param).unwrap()
        );
        assert_eq!(
            (rice[1].coding, rice[1].param, rice[1].val.is_none()),
            (INDEX_CODING_RICE, param, true)
        );
    }

    #[test]
    fn layouts_that_do_not_add_up_are_refused() {
        let err = dct_payloads(
            &[1, 2, 3],
            &[],
            &[layout(1, 2, 8)],
            IndexCodingChoice::Fixed,
            8,
        )
        .unwrap_err();
        assert_eq!(err.kind(), "length_mismatch");
        let err = dct_payloads(
            &[1, 2],
            &[0],
            &[layout(1, 2, 8)],
            IndexCodingChoice::Fixed,
            1,
        )
        .unwrap_err();
        assert_eq!(err.kind(), "length_mismatch");
        let err =
            dct_payloads(&[3, 1], &[], &[layout(1, 2, 8)], IndexCodingChoice::Rice, 8).unwrap_err();
        assert_eq!(err.kind(), "not_strictly_ascending");
    }

    proptest! {
        #[test]
        fn auto_picks_the_smaller_stream_and_a_tie_goes_to_packing(
            sets in proptest::collection::vec(proptest::collection::btree_set(0u32..256, 1..40), 1..8),
        ) {
            let k = sets.iter().map(|s| s.len()).min().unwrap();
            let positions: Vec<u32> = sets.iter().flat_map(|s| s.iter().copied().take(k)).collect();
            let l = layout(sets.len(), k, 256);
            let auto = dct_payloads(&positions, &[], &[l], IndexCodingChoice::Auto, 8).unwrap();
            let fixed = dct_payloads(&positions, &[], &[l], IndexCodingChoice::Fixed, 8).unwrap();
            let rice = dct_payloads(&positions, &[], &[l], IndexCodingChoice::Rice, 8).unwrap();
            let want = if fixed[0].idx.len() <= rice[0].idx.len() { &fixed[0] } else { &rice[0] };
            prop_assert_eq!(&auto[0], want);
        }
    }
}
