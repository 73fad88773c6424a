//! gradwire-core: the pure-Rust half of gradwire.
//!
//! * [`bitpack`]: fixed-width LSB-first bit packing (FORMAT.md section 6);
//! * [`quartic`] and [`zero_run`]: the two lossless stages of 3LC;
//! * [`rice`]: index sets (DCT positions) as Golomb-Rice coded gaps;
//! * [`elias`]: Elias-γ and Elias-ω codes and QSGD's sparse level stream;
//! * [`huffman`]: canonical Huffman codes with a length cap and an escape (GComp's exponents);
//! * [`gcomp`]: GComp's per-element work: exponent counts, block levels by δ, the sections;
//! * [`checksum`]: the CRC-32C frame checksum;
//! * [`alignment`]: sparse vectors' inner products with their weighted sum (the server's direction check);
//! * [`dct_rows`]: the sparse first stage of the exact DCT decode;
//! * [`dct_fast`]: the float32 2-D DCT of power-of-two chunks by Lee's recursion (the server's transforms);
//! * [`topk`]: per-row top-k by magnitude (which DCT coefficients a sender keeps);
//! * [`scatter`]: sparse rows added into a dense buffer (the transform-domain sum of DCT records);
//! * [`frame`]: reader and writer of the frame format v1 (docs/FORMAT.md);
//! * [`layout_frame`]: layout frames, whose records of a layout both sides hold travel compact (section 12).
//!
//! Every function validates its input and reports problems as a [`WireError`]; nothing here
//! panics on bad input.

#![deny(unsafe_code)]

pub mod alignment;
mod bitio;
pub mod bitpack;
pub mod checksum;
pub mod dct_fast;
pub mod dct_folded;
pub mod dct_payload;
pub mod dct_rows;
pub mod elias;
pub mod error;
pub mod frame;
pub mod gcomp;
pub mod huffman;
pub mod layout_frame;
pub mod outer_step;
pub mod quartic;
pub mod rice;
pub mod scatter;
mod simd;
mod threads;
pub mod topk;
pub mod zero_run;

pub use elias::{
    elias_decode, elias_encode, elias_gamma_decode, elias_gamma_encode, elias_omega_decode,
    elias_omega_encode, sparse_levels_decode, sparse_levels_encode, EliasKind,
};
pub use huffman::{byte_counts, HuffmanBook};
pub use layout_frame::{
    layout_frame_len, parse_layout_frame, write_layout_frame, write_layout_frame_into, LayoutEntry,
    LayoutFrameView, RecordTemplate,
};
pub use rice::{
    rice_decode, rice_decode_into, rice_encode, rice_encode_into, rice_encoded_len, rice_param,
    rice_param_estimate,
};

pub use alignment::{sparse_alignment, SparseVector};
pub use bitpack::{
    pack_bits, pack_bits_into, packed_len, padding_is_zero, unpack_bits, unpack_bits_exact,
    unpack_bits_exact_into, unpack_bits_into,
};
pub use checksum::crc32c;
pub use dct_fast::dct2_chunks;
pub use dct_folded::{
    decode_folded, decode_folded_mean, decode_folded_mean_accumulate, fold_basis_is_exact,
    SenderLevels,
};
pub use dct_payload::{
    dct_payloads, index_bits_for, IndexCodingChoice, RecordLayout, RecordPayload,
};
pub use dct_rows::{combine_level_sums, scatter_basis_rows};
pub use error::{Result, WireError};
pub use frame::{
    elem_size, frame_len, frame_len_at_start, is_float_dtype, parse_frame, parse_header,
    write_frame, write_frame_into, EntrySpec, EntryView, FrameHeader, FrameView, FrameWriter,
    Limits, SectionView,
};
pub use outer_step::{outer_step, OuterStepRule};
pub use quartic::{
    quartic_decode, quartic_decode_into, quartic_encode, quartic_encode_into, quartic_len,
};
pub use scatter::scatter_add_rows;
pub use topk::select_topk_rows;
pub use zero_run::{
    zero_run_decode, zero_run_decode_into, zero_run_decoded_len, zero_run_encode,
    zero_run_output_len,
};
