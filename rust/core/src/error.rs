//! The single error type of gradwire-core.
//!
//! Every way an input can be wrong has its own variant carrying the values involved, and the
//! `Display` text names the problem. Variants fall in two groups: kernel input errors (bit
//! packing, quartic and zero-run coding, Rice, Elias and Huffman codes) and frame errors (the
//! frame format of `docs/FORMAT.md`); [`WireError::is_frame_error`] tells them apart.
//!
//! Every variant also has a stable snake_case *kind*, [`WireError::kind`], the variant's name
//! in snake case (`ChecksumMismatch` is `"checksum_mismatch"`). Kinds are part of the public
//! interface (docs/FORMAT.md section 7.1 lists them; Python exceptions carry them as `kind`):
//! a released kind is never renamed or reused, a new variant brings a new kind.

use thiserror::Error;

/// Convenience alias used throughout the crate.
pub type Result<T, E = WireError> = std::result::Result<T, E>;

/// Bytes as two hex digits each, space-separated (`47 57 49 52`): how every message shows raw bytes.
fn hex_bytes(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Everything that can be wrong with an input to gradwire-core.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    // ----------------------------------------------------------------- bit packing
    /// A bit width outside `1..=32`.
    #[error("bit width {bits} is outside 1..=32")]
    InvalidBitWidth { bits: u32 },

    /// A value with bits set at or above the bit width.
    #[error("value {value} at index {index} does not fit in {bits} bits")]
    ValueTooWide { index: usize, value: u32, bits: u32 },

    /// `count * bits` (or a derived size) does not fit in the address space.
    #[error("size overflow: {count} values of {bits} bits do not fit in memory")]
    SizeOverflow { count: usize, bits: u32 },

    /// The input holds fewer bytes than the operation needs.
    #[error("input too short: need {needed} bytes, got {got}")]
    InputTooShort { needed: usize, got: usize },

    /// The input must be exactly `expected` bytes long.
    #[error("input length mismatch: expected exactly {expected} bytes, got {got}")]
    LengthMismatch { expected: usize, got: usize },

    /// The output buffer given to an `_into` function has the wrong size.
    #[error("output buffer has {got} slots, need exactly {needed}")]
    OutputSizeMismatch { needed: usize, got: usize },

    /// Nonzero bits after the last value of a bit-packed stream.
    #[error(
        "nonzero padding bits {bits:#04x} in the last byte (index {byte_index}) of the bit stream"
    )]
    NonzeroPaddingBits { byte_index: usize, bits: u8 },

    // ----------------------------------------------------------------- 3LC quartic
    /// A ternary value outside `{-1, 0, 1}`.
    #[error("trit {value} at index {index} is not -1, 0 or 1")]
    InvalidTrit { index: usize, value: i8 },

    /// A quartic byte above 242 (five base-3 digits hold at most 242).
    #[error("byte {value} at index {index} is above 242 and is not a quartic byte")]
    InvalidQuarticByte { index: usize, value: u8 },

    /// A padding digit of the quartic encoding that is not the padding value 0.
    #[error("quartic padding digit {digit} in plane {plane} of byte {index} is not 0 (non-canonical encoding)")]
    NonzeroQuarticPadding {
        index: usize,
        plane: usize,
        digit: u8,
    },

    // ----------------------------------------------------------------- 3LC zero-run
    /// A zero-run encoder input byte above 242 (those values are run codes).
    #[error("byte {value} at index {index} is above 242; zero-run input must be quartic bytes")]
    ZeroRunInputByte { index: usize, value: u8 },

    /// Decoding would produce more bytes than the caller expects.
    #[error("zero-run output exceeds the expected {expected} bytes (decodes to {decoded})")]
    ZeroRunTooLong { expected: usize, decoded: usize },

    /// Decoding produced fewer bytes than the caller expects.
    #[error("zero-run output is {decoded} bytes, expected {expected}")]
    ZeroRunTooShort { expected: usize, decoded: usize },

    // ----------------------------------------------------------------- variable-length codes
    /// A variable-length bit stream ends before the `count` codes the caller expects.
    #[error("bit stream ends after {decoded} of {count} codes (at bit {bit_offset})")]
    StreamTruncated {
        decoded: usize,
        count: usize,
        bit_offset: u64,
    },

    /// `count` values do not split into whole sets of `set_len`.
    #[error("{count} indices do not split into whole sets of {set_len}")]
    NotWholeSets { count: usize, set_len: usize },

    /// A universe (the bound indices lie below) outside `1..=2^32`, or zero with indices to code.
    #[error("universe {universe} is outside 1..=2^32")]
    InvalidUniverse { universe: u64 },

    /// Sets of more distinct indices than the universe holds.
    #[error("sets of {set_len} distinct indices cannot lie below the universe {universe}")]
    SetTooLarge { set_len: usize, universe: u64 },

    /// An index at or above the universe.
    #[error("index {value} at position {index} is not below the universe {universe}")]
    IndexOutOfRange {
        index: usize,
        value: u64,
        universe: u64,
    },

    /// An index set that is not strictly ascending (a repeat or a step back).
    #[error(
        "index {value} at position {index} does not follow {prev} in strictly ascending order"
    )]
    NotStrictlyAscending { index: usize, prev: u64, value: u64 },

    /// A Golomb-Rice parameter outside `0..=31`.
    #[error("Rice parameter {param} is outside 0..=31")]
    InvalidRiceParameter { param: u32 },

    /// Elias codes are defined for positive integers only.
    #[error("value 0 at index {index}: Elias codes take positive integers")]
    EliasZero { index: usize },

    /// An Elias code whose value does not fit in 64 bits.
    #[error("Elias code at bit {bit_offset} has a value wider than 64 bits")]
    EliasOverflow { bit_offset: u64 },

    /// A quantization level of 0 or with magnitude above the maximum.
    #[error("level {level} at index {index} is outside ±1..=±{max}")]
    LevelOutOfRange { index: usize, level: i64, max: u32 },

    /// Positions and levels of a sparse stream of different lengths.
    #[error("{positions} positions but {levels} levels")]
    SparseLengthMismatch { positions: usize, levels: usize },

    /// A DCT basis that is not `side × side` (section 5.2's exact decode).
    #[error("basis has {got} entries, a {side}×{side} basis has side² entries")]
    BasisSizeMismatch { side: usize, got: usize },

    /// A DCT basis that is not exactly symmetric (or of odd size), so it cannot be folded in half
    /// (section 5.2's exact decode, folded).
    #[error(
        "the {side}-point basis does not fold: its size is odd or B[f, n-1-i] != (-1)^f B[f, i]"
    )]
    BasisNotFoldable { side: usize },

    /// Chunks written by the exact decode's combine that do not lie in its output: a grid of
    /// `grid_cols` tiles per tile row, `total` chunks in all (section 5.2).
    #[error(
        "chunks {first}..{end} in tile rows of {grid_cols} do not fit an output of {total} chunks \
         (grid_cols must be at least 1 and divide the chunk count)"
    )]
    TileLayout {
        first: usize,
        end: usize,
        grid_cols: usize,
        total: usize,
    },

    /// A mean of decoded records with no sender to take it over.
    #[error("a mean needs at least one sender, got none")]
    NoSenders,

    /// A sender whose record has another number of chunks than the first sender's: records of one
    /// tensor chunked alike have the same count.
    #[error("sender {sender} has {chunks} chunks, sender 0 has {expected}")]
    SenderChunksMismatch {
        sender: usize,
        chunks: usize,
        expected: usize,
    },

    // ----------------------------------------------------------------- Huffman
    /// A code-length cap outside `1..=15`.
    #[error("code length cap {cap} is outside 1..=15")]
    InvalidCodeLengthCap { cap: u32 },

    /// A code length above the book's cap (symbol 256 is the escape).
    #[error("symbol {symbol} has code length {len}, above the cap {cap}")]
    CodeLengthAboveCap { symbol: u16, len: u8, cap: u8 },

    /// Code lengths that over-subscribe the code space (Kraft sum above 1).
    #[error("code lengths over-subscribe the code space: Kraft sum {sum}/{total} > 1")]
    KraftOverflow { sum: u64, total: u64 },

    /// A codebook without a single codeword.
    #[error("codebook has no codeword")]
    EmptyCodebook,

    /// The symbol range of a serialized codebook is malformed.
    #[error("codebook symbol range {lo}+{count} is not a canonical range within 0..256")]
    CodebookRange { lo: u16, count: u16 },

    /// A symbol that has no code and no escape to fall back on.
    #[error("symbol {symbol} at index {index} has no code and the book has no escape")]
    SymbolNotInBook { index: usize, symbol: u8 },

    /// Bits that start no codeword of the book.
    #[error("bits at offset {bit_offset} are not a codeword of the book")]
    InvalidCode { bit_offset: u64 },

    /// An escaped symbol that has its own code (the encoding is canonical).
    #[error("escaped symbol {symbol} at bit {bit_offset} has its own code")]
    EscapedSymbolHasCode { symbol: u8, bit_offset: u64 },

    // ----------------------------------------------------------------- GComp fields
    /// A GComp `format` code other than 0 (f32) or 1 (bf16).
    #[error("GComp format {format} is not 0 (f32) or 1 (bf16)")]
    InvalidFieldFormat { format: u8 },

    /// A block of 0 elements.
    #[error("block size {block} must be at least 1")]
    InvalidBlockSize { block: usize },

    /// Not one level per block.
    #[error("{got} block levels given for {expected} blocks")]
    BlockCount { expected: usize, got: usize },

    /// A block level above 3.
    #[error("level {level} of block {index} is not 0, 1, 2 or 3")]
    InvalidBlockLevel { index: usize, level: u8 },

    /// An infinity or NaN (biased exponent 255), which GComp cannot send.
    #[error("value at index {index} (bits {bits:#010x}) is not finite")]
    NonFiniteValue { index: usize, bits: u32 },

    /// A buffer the fast DCT cannot cut into chunks of `rows × cols` (a side not a power of two
    /// from 1 to 1024, or a length not a multiple of the chunk).
    #[error("cannot transform {len} values as chunks of {rows} × {cols}: each side must be a power of two from 1 to 1024 and the length a multiple of their product")]
    TransformShape {
        len: usize,
        rows: usize,
        cols: usize,
    },

    /// An operand of a per-element kernel whose length differs from the one the others set.
    #[error("{operand} holds {got} values where {expected} are needed")]
    OperandLength {
        operand: &'static str,
        expected: usize,
        got: usize,
    },

    // ----------------------------------------------------------------- frame: envelope
    /// Fewer bytes than the smallest possible frame.
    #[error("frame too short: {got} bytes, a frame has at least 36")]
    FrameTooShort { got: usize },

    /// The first four bytes are not `GWIR`.
    // Both in one base: hex bytes, space-separated (`{:02x?}` printed `[47, 57, 49, 58]`, which reads as decimal).
    #[error(
        "bad magic: expected 47 57 49 52 (\"GWIR\"), found {}",
        hex_bytes(found)
    )]
    BadMagic { found: [u8; 4] },

    /// A frame version this reader does not know.
    #[error("unsupported frame version {version} (this reader knows version 1)")]
    UnsupportedVersion { version: u16 },

    /// `total_len` is larger than the bytes received.
    #[error("frame truncated: header says {declared} bytes, got {got}")]
    FrameTruncated { declared: u64, got: usize },

    /// More bytes were received than `total_len` says.
    #[error("trailing bytes after frame: header says {declared} bytes, got {got}")]
    FrameTrailingBytes { declared: u64, got: usize },

    /// `total_len` above the reader's (or writer's) limit.
    #[error("frame of {len} bytes exceeds the limit of {limit} bytes")]
    FrameTooLarge { len: u64, limit: u64 },

    /// The stored CRC-32C does not match the frame's bytes.
    #[error("checksum mismatch: frame says {stored:#010x}, computed {computed:#010x}")]
    ChecksumMismatch { stored: u32, computed: u32 },

    /// Reserved flag bits (1..=15) are set.
    #[error("reserved flag bits set: flags = {flags:#06x}")]
    ReservedFlags { flags: u16 },

    // ----------------------------------------------------------------- frame: structure
    /// A tensor frame (bundle bit clear) whose `entry_count` is not 1.
    #[error("tensor frame must hold exactly 1 entry, entry_count is {count}")]
    TensorFrameEntryCount { count: u32 },

    /// More records than the limit allows.
    #[error("entry_count {count} exceeds the limit of {limit} entries")]
    TooManyEntries { count: u32, limit: u32 },

    /// A field that runs past the end of the records.
    #[error("field `{field}` at offset {offset} needs {needed} bytes, only {available} left before the checksum")]
    FieldOverrun {
        field: &'static str,
        offset: usize,
        needed: u64,
        available: usize,
    },

    /// A tensor name longer than 1024 bytes.
    #[error("entry {entry}: name of {len} bytes exceeds the maximum of 1024")]
    NameTooLong { entry: usize, len: usize },

    /// A tensor name that is not UTF-8.
    #[error("entry {entry}: name at offset {offset} is not valid UTF-8")]
    NameNotUtf8 { entry: usize, offset: usize },

    /// An empty tensor name in a bundle frame.
    #[error("entry {entry}: empty name in a bundle frame")]
    EmptyName { entry: usize },

    /// A tensor name used twice in a bundle frame.
    #[error("entry {entry}: duplicate name {name:?} in bundle")]
    DuplicateName { entry: usize, name: String },

    /// A section name length outside `1..=32`.
    #[error("entry {entry}, section {section}: name length {len} is outside 1..=32")]
    SectionNameLength {
        entry: usize,
        section: usize,
        len: usize,
    },

    /// A section name with a byte outside `[a-z0-9_]`.
    #[error("entry {entry}, section {section}: name {name:?} has bytes outside [a-z0-9_]")]
    SectionNameInvalid {
        entry: usize,
        section: usize,
        name: String,
    },

    /// A section name used twice in one record.
    #[error("entry {entry}, section {section}: duplicate section name {name:?}")]
    DuplicateSection {
        entry: usize,
        section: usize,
        name: String,
    },

    /// `ndim` above 8.
    #[error("entry {entry}: ndim {ndim} exceeds the maximum of 8")]
    TooManyDims { entry: usize, ndim: u8 },

    /// The product of the shape does not fit in 64 bits.
    #[error("entry {entry}: element count of shape {shape:?} overflows 64 bits")]
    NumelOverflow { entry: usize, shape: Vec<u64> },

    /// More elements than the limit allows.
    #[error("entry {entry}: {numel} elements exceed the limit of {limit}")]
    TooManyElements {
        entry: usize,
        numel: u64,
        limit: u64,
    },

    /// `params_len` above 4096.
    #[error("entry {entry}: params_len {len} exceeds the maximum of 4096")]
    ParamsTooLong { entry: usize, len: u64 },

    /// More than 32 sections.
    #[error("entry {entry}: {count} sections exceed the maximum of 32")]
    TooManySections { entry: usize, count: usize },

    /// An element type code that is not in table 4.1.
    #[error("entry {entry}, section {section}: unknown element type code {code}")]
    UnknownElemType {
        entry: usize,
        section: usize,
        code: u8,
    },

    /// A dtype code that is not a floating point code (8..=11).
    #[error("entry {entry}: dtype code {code} is not a floating point type (8, 9, 10 or 11)")]
    InvalidDtype { entry: usize, code: u8 },

    /// A section byte length that is not a multiple of its element size.
    #[error("entry {entry}, section {section}: byte_len {byte_len} is not a multiple of the element size {elem_size}")]
    SectionLength {
        entry: usize,
        section: usize,
        byte_len: u64,
        elem_size: u8,
    },

    /// Bytes between the last record and the checksum.
    #[error("{count} bytes left over between the last record and the checksum")]
    LeftoverBytes { count: usize },

    /// A LEB128 number of a layout frame that is not minimal, runs past 10 bytes or past 64 bits.
    #[error("entry {entry}: {field} at offset {offset} is not a minimal LEB128 number of at most 64 bits")]
    InvalidVarint {
        entry: usize,
        field: &'static str,
        offset: usize,
    },

    /// A compact record of a layout frame names a template the reader does not hold.
    #[error(
        "entry {entry}: compact record of template {index}, but the reader holds {count} templates"
    )]
    UnknownTemplate {
        entry: usize,
        index: u64,
        count: usize,
    },
}

/// Declares, from one table, each variant's stable kind and its group: [`WireError::kind`],
/// [`WireError::is_frame_error`], [`WireError::KERNEL_KINDS`] and [`WireError::FRAME_KINDS`].
/// The `match`es are exhaustive, so a new variant does not compile until it is listed here.
macro_rules! error_kinds {
    (
        kernel { $($kv:ident => $kk:literal,)* }
        frame { $($fv:ident => $fk:literal,)* }
    ) => {
        impl WireError {
            /// The kinds of the kernel input errors, in declaration order.
            pub const KERNEL_KINDS: &'static [&'static str] = &[$($kk),*];
            /// The kinds of the frame errors, in declaration order.
            pub const FRAME_KINDS: &'static [&'static str] = &[$($fk),*];

            /// A stable snake_case name of the variant (`ChecksumMismatch` is
            /// `"checksum_mismatch"`), one per variant. Unlike the message, which may be
            /// reworded, a kind never changes once released: callers match on it (the Python
            /// glue sets it as the exception's `kind` attribute, and docs/FORMAT.md section 7.1
            /// lists them all).
            pub fn kind(&self) -> &'static str {
                match self {
                    $(WireError::$kv { .. } => $kk,)*
                    $(WireError::$fv { .. } => $fk,)*
                }
            }

            /// True for errors about the frame format (structure, envelope, limits), false for
            /// kernel input errors. The Python glue raises `FrameError` for the former and
            /// `WireError` for the latter.
            pub fn is_frame_error(&self) -> bool {
                match self {
                    $(WireError::$kv { .. } => false,)*
                    $(WireError::$fv { .. } => true,)*
                }
            }
        }

        /// (variant name, kind) of every variant, for the test that kinds follow the names.
        #[cfg(test)]
        const VARIANT_KINDS: &[(&str, &str)] = &[
            $((stringify!($kv), $kk),)*
            $((stringify!($fv), $fk),)*
        ];
    };
}

error_kinds! {
    kernel {
        InvalidBitWidth => "invalid_bit_width",
        ValueTooWide => "value_too_wide",
        SizeOverflow => "size_overflow",
        InputTooShort => "input_too_short",
        LengthMismatch => "length_mismatch",
        OutputSizeMismatch => "output_size_mismatch",
        NonzeroPaddingBits => "nonzero_padding_bits",
        InvalidTrit => "invalid_trit",
        InvalidQuarticByte => "invalid_quartic_byte",
        NonzeroQuarticPadding => "nonzero_quartic_padding",
        ZeroRunInputByte => "zero_run_input_byte",
        ZeroRunTooLong => "zero_run_too_long",
        ZeroRunTooShort => "zero_run_too_short",
        StreamTruncated => "stream_truncated",
        NotWholeSets => "not_whole_sets",
        InvalidUniverse => "invalid_universe",
        SetTooLarge => "set_too_large",
        IndexOutOfRange => "index_out_of_range",
        NotStrictlyAscending => "not_strictly_ascending",
        InvalidRiceParameter => "invalid_rice_parameter",
        EliasZero => "elias_zero",
        EliasOverflow => "elias_overflow",
        LevelOutOfRange => "level_out_of_range",
        SparseLengthMismatch => "sparse_length_mismatch",
        BasisSizeMismatch => "basis_size_mismatch",
        TileLayout => "tile_layout",
        BasisNotFoldable => "basis_not_foldable",
        NoSenders => "no_senders",
        SenderChunksMismatch => "sender_chunks_mismatch",
        InvalidCodeLengthCap => "invalid_code_length_cap",
        CodeLengthAboveCap => "code_length_above_cap",
        KraftOverflow => "kraft_overflow",
        EmptyCodebook => "empty_codebook",
        CodebookRange => "codebook_range",
        SymbolNotInBook => "symbol_not_in_book",
        InvalidCode => "invalid_code",
        EscapedSymbolHasCode => "escaped_symbol_has_code",
        InvalidFieldFormat => "invalid_field_format",
        InvalidBlockSize => "invalid_block_size",
        BlockCount => "block_count",
        InvalidBlockLevel => "invalid_block_level",
        NonFiniteValue => "non_finite_value",
        OperandLength => "operand_length",
        TransformShape => "transform_shape",
    }
    frame {
        FrameTooShort => "frame_too_short",
        BadMagic => "bad_magic",
        UnsupportedVersion => "unsupported_version",
        FrameTruncated => "frame_truncated",
        FrameTrailingBytes => "frame_trailing_bytes",
        FrameTooLarge => "frame_too_large",
        ChecksumMismatch => "checksum_mismatch",
        ReservedFlags => "reserved_flags",
        TensorFrameEntryCount => "tensor_frame_entry_count",
        TooManyEntries => "too_many_entries",
        FieldOverrun => "field_overrun",
        NameTooLong => "name_too_long",
        NameNotUtf8 => "name_not_utf8",
        EmptyName => "empty_name",
        DuplicateName => "duplicate_name",
        SectionNameLength => "section_name_length",
        SectionNameInvalid => "section_name_invalid",
        DuplicateSection => "duplicate_section",
        TooManyDims => "too_many_dims",
        NumelOverflow => "numel_overflow",
        TooManyElements => "too_many_elements",
        ParamsTooLong => "params_too_long",
        TooManySections => "too_many_sections",
        UnknownElemType => "unknown_elem_type",
        InvalidDtype => "invalid_dtype",
        SectionLength => "section_length",
        LeftoverBytes => "leftover_bytes",
        InvalidVarint => "invalid_varint",
        UnknownTemplate => "unknown_template",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_problem() {
        let e = WireError::ValueTooWide {
            index: 3,
            value: 5000,
            bits: 12,
        };
        assert_eq!(
            e.to_string(),
            "value 5000 at index 3 does not fit in 12 bits"
        );
        assert!(!e.is_frame_error());
        let e = WireError::FrameTruncated {
            declared: 1000,
            got: 998,
        };
        assert_eq!(
            e.to_string(),
            "frame truncated: header says 1000 bytes, got 998"
        );
        assert!(e.is_frame_error());
        let e = WireError::ChecksumMismatch {
            stored: 0xdeadbeef,
            computed: 0x12,
        };
        assert_eq!(
            e.to_string(),
            "checksum mismatch: frame says 0xdeadbeef, computed 0x00000012"
        );
        let e = WireError::BadMagic { found: *b"GWIX" };
        assert_eq!(
            e.to_string(),
            "bad magic: expected 47 57 49 52 (\"GWIR\"), found 47 57 49 58"
        );
    }

    fn snake_case(name: &str) -> String {
        let mut out = String::new();
        for (i, c) in name.chars().enumerate() {
            if c.is_ascii_uppercase() {
                if i > 0 {
                    out.push('_');
                }
                out.push(c.to_ascii_lowercase());
            } else {
                out.push(c);
            }
        }
        out
    }

    #[test]
    fn kinds_are_distinct_snake_case_names_of_the_variants() {
        let mut seen = std::collections::HashSet::new();
        for &(variant, kind) in VARIANT_KINDS {
            assert_eq!(kind, snake_case(variant), "kind of {variant}");
            assert!(
                !kind.is_empty()
                    && !kind.starts_with('_')
                    && !kind.ends_with('_')
                    && !kind.contains("__")
                    && kind
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{kind:?} is not snake_case"
            );
            assert!(seen.insert(kind), "kind {kind:?} is used twice");
        }
        let listed: Vec<&str> = WireError::KERNEL_KINDS
            .iter()
            .chain(WireError::FRAME_KINDS)
            .copied()
            .collect();
        let table: Vec<&str> = VARIANT_KINDS.iter().map(|&(_, k)| k).collect();
        assert_eq!(listed, table);
    }

    #[test]
    fn kind_and_group_of_instances() {
        let cases = [
            (
                WireError::ChecksumMismatch {
                    stored: 1,
                    computed: 2,
                },
                "checksum_mismatch",
                true,
            ),
            (WireError::EmptyCodebook, "empty_codebook", false),
            (
                WireError::ValueTooWide {
                    index: 0,
                    value: 9,
                    bits: 3,
                },
                "value_too_wide",
                false,
            ),
            (
                WireError::LeftoverBytes { count: 1 },
                "leftover_bytes",
                true,
            ),
        ];
        for (e, kind, frame) in cases {
            assert_eq!(e.kind(), kind);
            assert_eq!(e.is_frame_error(), frame);
            let group = if frame {
                WireError::FRAME_KINDS
            } else {
                WireError::KERNEL_KINDS
            };
            assert!(group.contains(&kind));
        }
    }
}
