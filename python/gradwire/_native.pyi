"""Type stubs for ``gradwire._native``, the Rust core of gradwire (crate ``gradwire-python``).

Byte inputs are 1-D C-contiguous ``numpy.uint8`` arrays (the wrappers in ``gradwire.wire`` view
any bytes-like object with ``np.frombuffer``, without copying); the module is built against the
stable ABI (abi3, CPython >= 3.10), which has no buffer protocol for extension code. Every kernel
runs with the GIL released. Array outputs own their memory (no copy is made to hand them over).

Errors: problems with a frame raise :class:`FrameError`; every other invalid input raises
:class:`WireError`. Both are ``ValueError`` subclasses and their message names the problem
(for instance ``"value 5000 at index 3 does not fit in 12 bits"`` or
``"checksum mismatch: frame says 0x1a2b3c4d, computed 0x5e6f7a8b"``); their ``kind`` attribute
names it with a stable snake_case string (``"value_too_wide"``, ``"checksum_mismatch"``: one per
error of the core, listed in :data:`ERROR_KINDS` and docs/FORMAT.md section 7.1). A non-contiguous array
raises ``ValueError``; an array of the wrong dtype or number of dimensions raises ``TypeError``;
an integer argument out of range raises ``OverflowError``.
"""

from typing import Final

import numpy as np
import numpy.typing as npt

class WireError(ValueError):
    """Input a gradwire kernel cannot encode or decode (a ``ValueError``)."""

    #: The stable snake_case name of the problem (docs/FORMAT.md section 7.1). A native error
    #: sets its own on the instance; the class default ``"invalid_input"`` marks one raised from
    #: Python code.
    kind: str

class FrameError(WireError):
    """A frame, or one of its records, breaks a rule of docs/FORMAT.md (a ``WireError``)."""

    #: As :attr:`WireError.kind`; the class default ``"invalid_record"`` marks a codec rule of
    #: FORMAT.md section 5 checked by a Python decoder.
    kind: str

#: Every ``kind`` a native error can carry, in the core's order, mapped to the class raised with
#: it (:class:`WireError` for kernel input, :class:`FrameError` for frame rules).
ERROR_KINDS: Final[dict[str, type[WireError]]]

# Frame constants of docs/FORMAT.md, the Rust core's own values.
#: The frame format version this module reads and writes (1).
FORMAT_VERSION: Final[int]
#: The first four bytes of every frame, ``b"GWIR"``.
FRAME_MAGIC: Final[bytes]
#: Bytes of the frame header (32).
FRAME_HEADER_BYTES: Final[int]
#: The shortest frame: header and CRC-32C trailer, a bundle with no records (36).
MIN_FRAME_BYTES: Final[int]
#: The longest record name, in bytes (1024).
MAX_NAME_BYTES: Final[int]
#: Element and dtype codes of FORMAT.md table 4.1 by type name: ``{"u8": 0, ..., "bf16": 9,
#: "f32": 10, "f64": 11}``.
ELEM_CODES: Final[dict[str, int]]

def pack_bits(values: npt.NDArray[np.uint32], bits: int) -> bytes:
    """Pack ``values`` at ``bits`` bits each (1..32) into an LSB-first bit stream.

    Value ``i`` occupies stream bits ``[i*bits, (i+1)*bits)``; stream bit ``m`` is bit ``m % 8`` of
    byte ``m // 8``. The result is ``ceil(len(values)*bits/8)`` bytes, unused high bits of the
    last byte zero (docs/FORMAT.md section 6).

    Raises ``WireError`` if ``bits`` is outside 1..32 or a value does not fit (the message names
    the first such index and value).
    """

def unpack_bits(
    data: npt.NDArray[np.uint8], bits: int, count: int, out: npt.NDArray[np.uint32] | None = None
) -> npt.NDArray[np.uint32]:
    """Unpack ``count`` values of ``bits`` bits from an LSB-first bit stream (lenient form).

    ``data`` must hold at least ``ceil(count*bits/8)`` bytes; extra bytes and padding bits are
    ignored. Raises ``WireError`` on a bad width, too short data or a size overflow. With ``out`` (a
    writeable contiguous array of exactly ``count`` elements) the values go there and ``out`` is returned.
    """

def unpack_bits_exact(
    data: npt.NDArray[np.uint8], bits: int, count: int, out: npt.NDArray[np.uint32] | None = None
) -> npt.NDArray[np.uint32]:
    """Strict :func:`unpack_bits`: ``data`` must be exactly ``ceil(count*bits/8)`` bytes and its
    padding bits zero, so exactly one byte string decodes to a given list of values.

    Raises ``WireError`` otherwise.
    """

def quartic_encode(trits: npt.NDArray[np.int8]) -> bytes:
    """3LC quartic encoding: five trits (-1, 0, 1) per byte, ``ceil(n/5)`` bytes, each <= 242.

    Digits ``d = q + 1`` are padded with ``d = 0`` to a multiple of 5 and cut into five planes of
    ``L = ceil(n/5)`` digits; byte ``i`` is ``81*p0[i] + 27*p1[i] + 9*p2[i] + 3*p3[i] + p4[i]``.
    Raises ``WireError`` naming the first trit outside {-1, 0, 1}.
    """

def quartic_decode(
    data: npt.NDArray[np.uint8], count: int, out: npt.NDArray[np.int8] | None = None
) -> npt.NDArray[np.int8]:
    """Decode ``count`` trits from exactly ``ceil(count/5)`` quartic bytes.

    Raises ``WireError`` on a wrong length, a byte above 242, or a nonzero padding digit
    (the encoding is canonical). With ``out`` (``count`` elements) the trits go there.
    """

def zero_run_encode(data: npt.NDArray[np.uint8]) -> bytes:
    """3LC zero-run encoding of quartic bytes.

    A maximal run of ``r`` bytes equal to 121 becomes ``r // 14`` bytes 255, then with
    ``rem = r % 14``: ``243 + rem - 2`` if ``rem >= 2``, the byte 121 if ``rem == 1``, nothing if
    ``rem == 0``. Other bytes are copied. Raises ``WireError`` if a byte is above 242.
    """

def zero_run_decode(data: npt.NDArray[np.uint8], expected_len: int | None = None) -> bytes:
    """Invert :func:`zero_run_encode`: each byte ``b > 242`` becomes ``b - 241`` bytes 121.

    With ``expected_len``, a decoded length other than it raises ``WireError`` before any output
    is allocated; without it the output is at most 14 times the input.
    """

def zero_run_decode_into(data: npt.NDArray[np.uint8], out: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """:func:`zero_run_decode` into ``out``, whose length must be the decoded length (else
    ``WireError``, checked before writing). Returns ``out``.
    """

def dct_scatter_basis_rows(
    positions: npt.NDArray[np.int64],
    levels: npt.NDArray[np.int16],
    k: int,
    rows: int,
    last: int,
    basis: npt.NDArray[np.float64],
    out: npt.NDArray[np.float64],
    threads: int = 1,
) -> npt.NDArray[np.float64]:
    """Stage one of the exact DCT decode (FORMAT.md §5.2): for each of the ``k`` coefficients per
    chunk at flat position ``p`` (``row = p // last``, ``col = p % last``) with level ``u``, sum
    ``u · basis[col]`` and ``basis[col]`` into ``out`` laid out ``(rows, chunks, 2, last)``.
    ``basis`` is ``last × last`` (flattened); ``out`` (overwritten) holds exactly
    ``rows · chunks · 2 · last`` values. Up to ``threads`` threads share the rows (the sums are
    exact: any count gives the same values). Bad sizes or a position at or above ``rows · last``
    raise ``WireError`` and leave ``out`` untouched. Runs with the GIL released. Returns ``out``.
    """

def dct_combine_level_sums(
    sums: npt.NDArray[np.float64],
    scales: npt.NDArray[np.float64],
    mins: npt.NDArray[np.float64],
    rows: int,
    last: int,
    out: npt.NDArray[np.float32],
    threads: int = 1,
    first: int = 0,
    grid_cols: int = 1,
) -> npt.NDArray[np.float32]:
    """Stage three of the exact DCT decode (FORMAT.md §5.2): ``float32(L · scales[c] + O · mins[c])``
    for every value of chunks ``first .. first + len(scales)``, each product and the sum rounded in
    float64 (no fused multiply-add), ``L`` and ``O`` the two channels of ``sums`` laid out ``(rows,
    chunks, 2, last)``. ``scales`` and ``mins`` carry the fixed point's power of two already.
    ``out`` is the whole decoded tensor, ``len(out) / (rows · last)`` chunks as a grid of
    ``grid_cols`` tiles of ``rows × last`` per tile row: value ``(c, row, n)`` lands at
    ``((c // grid_cols · rows + row) · grid_cols + c % grid_cols) · last + n`` (``grid_cols = 1``:
    chunk-major). Nothing else of ``out`` is written. Up to ``threads`` threads share the chunks. Bad
    sizes raise ``WireError`` (``tile_layout`` for chunks outside the grid). Runs with the GIL
    released. Returns ``out``.
    """

def dct_decode_folded(
    positions: npt.NDArray[np.int64],
    levels: npt.NDArray[np.int16],
    k: int,
    rows: int,
    last: int,
    row_basis: npt.NDArray[np.float64],
    col_basis: npt.NDArray[np.float64],
    scales: npt.NDArray[np.float64],
    mins: npt.NDArray[np.float64],
    out: npt.NDArray[np.float32],
    threads: int = 1,
    grid_cols: int = 1,
) -> npt.NDArray[np.float32]:
    """The exact DCT decode (FORMAT.md §5.2) of chunks of ``rows × last``, in one pass: ``out`` gets
    ``float32(L · scales[c] + O · mins[c])`` for every value of every chunk ``c``, ``L = Σ u ·
    B[p]`` and ``O = Σ B[p]`` over the chunk's ``k`` coefficients (positions ``p``, levels ``u``),
    ``B[p]`` the product of the integer bases ``row_basis`` and ``col_basis`` (flat). Both bases
    are folded in half by their symmetry (half the work of the rows route; the same integers, so the
    same bits): both must fold (:func:`dct_basis_folds`, else ``basis_not_foldable``). ``scales``
    and ``mins`` carry the fixed point's power of two. ``out`` is the whole tensor as a grid of
    ``grid_cols`` tiles per tile row (1: chunk-major), exactly the chunks given. Bad input raises
    ``WireError`` and writes nothing. Up to ``threads`` threads share the chunks, each running all
    steps a chunk at a time in its cache, multiplying only the slots that hold coefficients (with
    AVX2 and FMA where the CPU has them; the same integers either way). Runs with the GIL released.
    Returns ``out``.
    """

def dct_decode_folded_mean(
    senders: list[
        tuple[
            npt.NDArray[np.int64],
            npt.NDArray[np.int16],
            int,
            npt.NDArray[np.float64],
            npt.NDArray[np.float64],
        ]
    ],
    weights: npt.NDArray[np.float32],
    rows: int,
    last: int,
    row_basis: npt.NDArray[np.float64],
    col_basis: npt.NDArray[np.float64],
    out: npt.NDArray[np.float32],
    threads: int = 1,
    grid_cols: int = 1,
    accumulate: bool = False,
) -> npt.NDArray[np.float32]:
    """The weighted mean of several senders' records of one tensor, each decoded as
    :func:`dct_decode_folded` decodes it: ``out = d_0 · w_0``, then ``out = out + d_i · w_i`` for each
    further sender in order, every step one correctly rounded float32 operation — the bits of decoding
    each record and combining the tensors elementwise, without writing the decoded tensors out.
    ``senders`` holds ``(positions, levels, k, scales, mins)`` per sender (``k`` may differ, the
    chunk count may not: ``sender_chunks_mismatch``; none: ``no_senders``); ``weights`` one float32
    per sender. ``accumulate``: added onto what ``out`` holds, ``out = out + d_i · w_i`` from the first
    sender on (one sender at weight −1: ``out − d``, error feedback's rest with no decoded tensor).
    Bad input raises ``WireError`` and writes nothing. GIL released. Returns ``out``.
    """

def scatter_add_rows(
    positions: npt.NDArray[np.int64],
    values: npt.NDArray[np.float32],
    k: int,
    row_len: int,
    weight: float,
    out: npt.NDArray[np.float32],
) -> npt.NDArray[np.float32]:
    """For each row ``r`` (``len(positions) / k`` of them), ``out[r · row_len + p] += values[j] ·
    weight`` over the row's ``k`` entries, in order: one correctly rounded float32 multiply and one add
    each (none fused), the bits of ``out[idx] + values * weight`` elementwise. Positions outside
    ``0..row_len`` (``index_out_of_range``), ragged rows or a wrong ``out`` size raise ``WireError``
    and write nothing. Runs with the GIL released. Returns ``out``.
    """

def dct2_chunks(
    data: npt.NDArray[np.float32], rows: int, cols: int, inverse: bool = False, threads: int = 1
) -> npt.NDArray[np.float32]:
    """The orthonormal 2-D DCT-II (``inverse`` false) or DCT-III (``inverse`` true) of every chunk of
    ``data`` (flat, whole chunks of ``rows × cols`` row-major, each side a power of two up to 1024), in
    place, by Lee's recursion: the same bits on every x86-64 CPU and thread count, within about 1e-6 of
    the chunk's norm of the exact transform. Another shape raises ``WireError``
    (``transform_shape``) and writes nothing. Runs with the GIL released. Returns ``data``.
    """

def sparse_alignment(
    vectors: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]],
    weights: npt.NDArray[np.float64],
    size: int,
) -> tuple[list[float], list[float]]:
    """For each sparse vector ``uᵢ`` (``(positions, values)``: positions strictly ascending below
    ``size``): ``(dots, squares)`` with ``dots[i] = ⟨uᵢ, Σⱼ weights[j] · uⱼ⟩`` and ``squares[i] = |uᵢ|²``
    in float64, summed in a fixed order (the same bits on every machine). A bad vector raises
    ``WireError`` (``sparse_length_mismatch``, ``index_out_of_range``, ``not_strictly_ascending``;
    ``operand_length`` for weights not one per vector). Runs with the GIL released.
    """

def outer_step(
    anchor: npt.NDArray[np.float32],
    buffer: npt.NDArray[np.float32] | None,
    delta: npt.NDArray[np.float32],
    momentum: float,
    nesterov: bool,
    lr: float,
    fresh: bool,
    threads: int = 1,
) -> None:
    """One outer step (SparseLoCo's, DiLoCo's) of ``anchor`` by the mean pseudo-gradient ``delta``, in
    place, with the momentum buffer ``buffer`` (all flat and as long as ``anchor``; ``None`` without
    momentum): ``b = μ·b + d`` (``b = d`` when ``fresh``), the step ``b``, or ``μ·b + d`` with
    ``nesterov``, or ``d`` without momentum, times ``lr`` unless 1, subtracted from ``anchor``. Each
    operation one rounded float32 multiply or add, in that order: the bits of the same torch operations.
    An operand of another length raises ``WireError`` (``operand_length``) and writes nothing. Runs with
    the GIL released.
    """

def select_topk_rows(
    values: npt.NDArray[np.float32], cols: int, k: int, threads: int = 1
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The ``k`` values of largest magnitude of each row of ``values`` (flat, rows of ``cols``):
    ``(positions, kept)``, ``k`` per row, positions ascending within each row, ties to the lowest
    positions, NaN the largest."""

def dct_basis_folds(basis: npt.NDArray[np.float64], side: int) -> bool:
    """Whether the ``side × side`` basis (flat) folds exactly: ``side`` even and ``B[f, side-1-i]
    == (-1)^f · B[f, i]`` for every ``f`` and ``i``."""

def crc32c(data: npt.NDArray[np.uint8], value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing from the running checksum ``value``.

    ``crc32c(b, crc32c(a)) == crc32c(a + b)``; ``crc32c(b"123456789") == 0xE3069283``.
    """

# (name, codec, dtype, shape, params, sections); sections are (name, elem code, payload bytes).
_SectionSpec = tuple[str, int, npt.NDArray[np.uint8]]
_EntrySpec = tuple[str, int, int, list[int], npt.NDArray[np.uint8], list[_SectionSpec]]

def encode_frame(round: int, sender: int, bundle: bool, entries: list[_EntrySpec]) -> bytes:
    """Write a version-1 frame (docs/FORMAT.md) holding ``entries``.

    Each entry is ``(name, codec, dtype, shape, params, sections)`` with ``codec`` a u16,
    ``dtype`` a float code (8 f16, 9 bf16, 10 f32, 11 f64), ``shape`` up to 8 dimensions,
    ``params`` (<= 4096 bytes) and ``sections`` a list of ``(name, elem, payload)`` with ``name``
    1..32 bytes of ``[a-z0-9_]`` and ``elem`` an element code 0..11 (payload length a multiple of
    its size). A tensor frame (``bundle=False``) holds exactly one entry; bundle names are
    non-empty and unique. The writer applies every rule the reader checks, under the default
    limits (2 GiB frame, 2**20 entries, 2**31 elements per tensor), and raises ``FrameError``
    for a violation, so it never writes a frame :func:`decode_frame` would reject.
    The frame is built in a single allocation with the checksum appended.
    """

# (name, elem code, start, end): the payload is data[start:end].
_SectionView = tuple[str, int, int, int]
# (name, codec, dtype, shape, (params_start, params_end), sections)
_EntryView = tuple[str, int, int, tuple[int, ...], tuple[int, int], list[_SectionView]]

# (name, codec, dtype, shape, params, [(section, elem), ...]): a record the reader knows but for its payloads.
_Template = tuple[str, int, int, list[int], bytes, list[tuple[str, int]]]
# As _EntryView, but params None when a compact record's params are its template's.
_LayoutEntryView = tuple[str, int, int, tuple[int, ...], tuple[int, int] | None, list[_SectionView]]

def encode_layout_frame(round: int, sender: int, entries: list[_EntrySpec], templates: list[_Template]) -> bytes:
    """Write a layout frame (docs/FORMAT.md section 12): a bundle frame with flag bits 0 and 1 whose
    records matching a template (by name, and codec, dtype, shape and sections' names and elements) are
    written compact (a LEB128 tag, their params only if they differ from the template's, and a LEB128
    length before each payload); other records are written full. Raises ``FrameError`` for anything
    the reader would reject."""

def decode_layout_frame(
    data: npt.NDArray[np.uint8],
    templates: list[_Template],
    max_frame_bytes: int = 2**31,
    max_entries: int = 2**20,
    max_tensor_elements: int = 2**31,
) -> tuple[int, int, bool, list[_LayoutEntryView]]:
    """Parse and validate a frame that may be a layout frame, given the reader's templates; a frame
    without flag bit 1 parses as :func:`decode_frame` parses it. A compact record's name, codec, dtype,
    shape and sections' names and elements are its template's; its params are ``None`` when they are
    the template's too. Raises ``FrameError`` naming the broken rule (``unknown_template``: a compact
    record of a template the reader does not hold; ``invalid_varint``: a LEB128 number that is not
    minimal or exceeds 64 bits)."""

def frame_length(data: npt.NDArray[np.uint8]) -> int:
    """The ``total_len`` of the frame that starts ``data`` (which may run on into more frames).

    Checks the magic, the version and ``MIN_FRAME_BYTES <= total_len <= len(data)``; raises
    ``FrameError`` (``frame_too_short``, ``bad_magic``, ``unsupported_version``, ``frame_truncated``)
    otherwise. The frame itself is not checked: parse exactly that many bytes with ``decode_frame``.
    """

def decode_frame(
    data: npt.NDArray[np.uint8],
    max_frame_bytes: int = 2**31,
    max_entries: int = 2**20,
    max_tensor_elements: int = 2**31,
) -> tuple[int, int, bool, list[_EntryView]]:
    """Parse and validate a version-1 frame; returns ``(round, sender, bundle, entries)``.

    Checks, in order: length >= 36, magic, version, ``total_len`` equal to ``len(data)``
    (truncated vs. trailing bytes), the ``max_frame_bytes`` limit, the CRC-32C, reserved flags,
    then every structural rule of FORMAT.md section 7 (entry count, names, section names,
    ``ndim``, element-count overflow and ``max_tensor_elements``, params and section limits,
    element and dtype codes, payload lengths, no leftover bytes). Raises ``FrameError`` naming
    the broken rule.

    Payloads are not copied: each entry gives byte offsets into ``data``, so the caller takes
    zero-copy slices ``data[start:end]`` of its own buffer. Codec-specific rules (section 5) are
    left to the codec layer.
    """

# Entropy coders (docs/FORMAT.md sections 6.2-6.4). Index sets: `count` uint32 indices in sets of
# `set_len`, strictly ascending within a set and below `universe` (1..2**32).

def rice_param(indices: npt.NDArray[np.uint32], set_len: int, universe: int) -> tuple[int, int]:
    """The Rice parameter (0..31) coding the sets in the fewest bits, and the stream's byte length."""

def rice_param_estimate(set_len: int, universe: int) -> int:
    """``round(log2(ln 2 * mean gap))`` for random sets: a parameter without looking at the data."""

def rice_encode(indices: npt.NDArray[np.uint32], set_len: int, universe: int, param: int) -> bytes:
    """Rice stream of the sets' gaps: the remainders packed at ``param`` bits, then the quotients in
    unary (zeros then a one bit). Raises ``WireError`` naming the first index out of order or range."""

def dct_payloads(
    positions: npt.NDArray[np.uint32],
    levels: npt.NDArray[np.uint32],
    layouts: npt.NDArray[np.uint64],
    index_coding: int,
    value_bits: int,
) -> list[tuple[int, int, bytes, bytes | None]]:
    """The coded sections of every DCT record of a step in one call, GIL released: ``layouts`` holds
    ``rows, k, C`` per record, ``positions`` (and, below 8 bits, ``levels``) their values one record after
    another; ``index_coding`` 0 packed, 1 Rice, 2 the smaller. One ``(index_coding, parameter, idx,
    val or None)`` per record. ``WireError`` (``length_mismatch``, ``index_out_of_range``,
    ``not_strictly_ascending``, ``value_too_wide``) for input that does not fit."""

def rice_decode(
    data: npt.NDArray[np.uint8],
    count: int,
    set_len: int,
    universe: int,
    param: int,
    out: npt.NDArray[np.uint32] | None = None,
) -> npt.NDArray[np.uint32]:
    """Decode ``count`` indices; the stream must be exact (length, padding). ``count`` is checked
    against the input before allocating."""

def elias_encode(values: npt.NDArray[np.uint64], kind: str) -> bytes:
    """Elias codes (``kind`` ``"gamma"`` or ``"omega"``) of positive integers, first bit first."""

def elias_decode(data: npt.NDArray[np.uint8], count: int, kind: str) -> npt.NDArray[np.uint64]:
    """Exactly ``count`` codes; the stream must end with the last. Values over 64 bits are errors."""

def sparse_levels_encode(positions: npt.NDArray[np.uint64], levels: npt.NDArray[np.int32], kind: str) -> bytes:
    """Per nonzero level: Elias code of the distance to the previous position (first: position + 1),
    a sign bit (1 = negative), Elias code of the magnitude."""

def sparse_levels_decode(
    data: npt.NDArray[np.uint8], count: int, universe: int, max_level: int, kind: str
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int32]]:
    """``count`` entries: positions ascending below ``universe``, levels with ``1 <= |l| <= max_level``."""

def huffman_book(counts: npt.NDArray[np.uint64], cap: int) -> bytes:
    """Serialized canonical Huffman codebook of 256 byte counts with code lengths capped at ``cap``
    (1..15): longer codes are replaced by an escape code followed by the raw byte."""

def huffman_book_lengths(book: npt.NDArray[np.uint8]) -> tuple[int, npt.NDArray[np.uint8]]:
    """Validate a serialized book (cap, lengths, Kraft sum); returns ``(cap, 257 lengths)``."""

def huffman_encode(symbols: npt.NDArray[np.uint8], book: npt.NDArray[np.uint8]) -> bytes:
    """Code bytes with a serialized book; a byte without code and without escape raises."""

def huffman_decode(data: npt.NDArray[np.uint8], count: int, book: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Decode exactly ``count`` symbols by table lookup on the next ``cap`` bits."""

# GComp's per-element work (docs/FORMAT.md section 5.4), on float32 bit patterns (uint32).

def gcomp_exponent_counts(bits: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint64]:
    """How many of the f32 bit patterns have each biased exponent (256 counts; 0: zeros and
    denormals, 255: infinities and NaNs)."""

def gcomp_metric(
    kind: str,
    grad: npt.NDArray[np.uint32],
    param: npt.NDArray[np.float32],
    first: npt.NDArray[np.float32] | None = None,
    second: npt.NDArray[np.float32] | None = None,
    *,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    dampening: float = 0.0,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    alpha: float = 0.99,
    bias_correction1: float = 1.0,
) -> npt.NDArray[np.float64]:
    """δ of the paper's Table 2 per element in f64, for optimizer ``kind`` (``"sgd"``,
    ``"momentum"``, ``"nesterov"``, ``"adagrad"``, ``"rmsprop"``, ``"adam"``, ``"adamw"``):
    ``first`` is momentum_buffer, sum, square_avg or exp_avg, ``second`` exp_avg_sq (None: zeros);
    ``bias_correction1`` is ``1 - beta1**t``, Adagrad's ``lr`` the decayed one. Bit for bit the
    value of ``gradwire.codecs.gcomp.quantization_metric``."""

def gcomp_block_levels(
    kind: str,
    grad: npt.NDArray[np.uint32],
    param: npt.NDArray[np.float32],
    first: npt.NDArray[np.float32] | None = None,
    second: npt.NDArray[np.float32] | None = None,
    *,
    block: int,
    thresholds: tuple[float, float, float],
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    dampening: float = 0.0,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    alpha: float = 0.99,
    bias_correction1: float = 1.0,
) -> npt.NDArray[np.uint8]:
    """Per block of ``block``, the largest level 1..3 whose threshold the block's smallest |δ| over
    its nonzero elements reaches, else 0 (NaN δ counts as 0, a block of zeros gets 3)."""

def gcomp_encode(
    bits: npt.NDArray[np.uint32],
    format: int,
    block: int,
    levels: npt.NDArray[np.uint8],
    book: npt.NDArray[np.uint8],
) -> tuple[
    npt.NDArray[np.uint8], npt.NDArray[np.uint8], npt.NDArray[np.uint8], npt.NDArray[np.uint8], npt.NDArray[np.uint32]
]:
    """The ``exp``, ``level``, ``sign`` and ``mant`` sections of a GComp record and the f32 bit
    patterns a receiver decodes, in one call: format 0 (f32) or 1 (bf16), one level 0..3 per block
    of ``block``, the exponents coded with the serialized codebook ``book``."""
