"""An independent reader of gradwire frames, written from docs/FORMAT.md alone.

Pure Python (struct, math and hashlib only): it shares no code with gradwire, so when it and gradwire
agree on the golden frames, the document and the implementation agree.
"""

from __future__ import annotations

import hashlib
import math
import struct

MAGIC = b"GWIR"
ELEM = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("Q", 8),
    7: ("q", 8),
    8: ("e", 2),
    9: (None, 2),
    10: ("f", 4),
    11: ("d", 8),
}


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


class Reader:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("field runs past the end")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def leb128(self) -> int:
        """§12: unsigned LEB128, 7 bits a byte, low group first; minimal (no trailing zero group), at most
        64 bits."""
        value, shift = 0, 0
        while True:
            b = self.u("B")
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
            if shift >= 70:  # ten groups already hold 70 bits
                raise ValueError("LEB128 number longer than 64 bits")
        if b == 0 and shift > 7:
            raise ValueError("LEB128 number not minimal (a trailing zero group)")
        if value >> 64:
            raise ValueError("LEB128 number longer than 64 bits")
        return value


def _values(elem: int, payload: bytes) -> list:
    if elem not in ELEM:
        raise ValueError(f"unknown element code {elem}")
    fmt, size = ELEM[elem]
    if len(payload) % size:
        raise ValueError(f"section of {len(payload)} bytes is not whole elements of {size} bytes")
    n = len(payload) // size
    if elem == 9:  # bf16: the high half of an f32
        return [struct.unpack("<f", b"\0\0" + payload[2 * i : 2 * i + 2])[0] for i in range(n)]
    return list(struct.unpack(f"<{n}{fmt}", payload))


#: Flag bits of the header (§2): a bundle frame; with it, a layout frame (§12).
BUNDLE_FLAG, LAYOUT_FLAG = 1, 2
MAX_PARAMS = 4096
SECTION_NAME_CHARS = set(b"abcdefghijklmnopqrstuvwxyz0123456789_")


def template(t) -> dict:
    """§12: a template the reader holds, from a dict (or a tuple in this order) of ``name``, ``codec``,
    ``dtype`` (code, table 4.1), ``shape``, ``params`` (bytes, or their hex digits) and ``sections``
    ((name, elem code) pairs, in order)."""
    if isinstance(t, dict):
        t = tuple(t[k] for k in ("name", "codec", "dtype", "shape", "params", "sections"))
    name, codec, dtype, shape, params, sections = t
    params = bytes.fromhex(params) if isinstance(params, str) else bytes(params)
    sections = [(str(n), int(e)) for n, e in sections]
    if int(dtype) not in (8, 9, 10, 11) or len(shape) > 8 or len(params) > MAX_PARAMS or len(sections) > 32:
        raise ValueError(f"template {name!r} breaks the rules of a record (§3)")
    for n, e in sections:
        if not 1 <= len(n) <= 32 or set(n.encode()) - SECTION_NAME_CHARS or e not in ELEM:
            raise ValueError(f"template {name!r}: bad section {n!r}")
    if len({n for n, _ in sections}) != len(sections):
        raise ValueError(f"template {name!r}: section names repeat")
    return dict(
        name=str(name),
        codec=int(codec),
        dtype=int(dtype),
        shape=[int(d) for d in shape],
        params=params,
        sections=sections,
    )


def _full_record(r: Reader) -> dict:
    """§3."""
    name = r.take(r.u("H")).decode("utf-8")
    codec, dtype, ndim = r.u("H"), r.u("B"), r.u("B")
    shape = [r.u("Q") for _ in range(ndim)]
    params = r.take(r.u("I"))
    sections = {}
    for _ in range(r.u("B")):
        sname = r.take(r.u("B")).decode("ascii")
        elem = r.u("B")
        if sname in sections:
            raise ValueError(f"section {sname!r} twice in record {name!r}")
        sections[sname] = _values(elem, r.take(r.u("Q")))
    return dict(name=name, codec=codec, dtype=dtype, shape=shape, params=params, sections=sections)


def _compact_record(r: Reader, t: dict, own_params: bool) -> dict:
    """§12: a compact record of template ``t`` — the very structure a full record of the same bytes gives."""
    params = t["params"]
    if own_params:
        n = r.leb128()
        if n > MAX_PARAMS:
            raise ValueError(f"params_len {n} above {MAX_PARAMS}")
        params = r.take(n)
    sections = {sname: _values(elem, r.take(r.leb128())) for sname, elem in t["sections"]}
    return dict(
        name=t["name"], codec=t["codec"], dtype=t["dtype"], shape=list(t["shape"]), params=params, sections=sections
    )


def parse(data: bytes, templates=None) -> dict:
    """The frame as plain Python: header fields and records with their sections as value lists.

    ``templates`` (a list of what :func:`template` takes) are those a layout frame (§12) may refer to;
    without them a layout frame is rejected, as flag bit 1 is reserved to a reader of §1–§11. ``forms``
    says how each record came: ``"full"``, ``"compact"`` (its template's params) or ``"compact_params"``.
    """
    if len(data) < 36 or data[:4] != MAGIC:
        raise ValueError("not a gradwire frame")
    r = Reader(data, 4)
    version, flags, total_len, rnd, sender, count = (r.u("H"), r.u("H"), r.u("Q"), r.u("Q"), r.u("I"), r.u("I"))
    if version != 1 or total_len != len(data):
        raise ValueError("bad header")
    layout = flags == BUNDLE_FLAG | LAYOUT_FLAG
    if flags & ~BUNDLE_FLAG and not layout:
        raise ValueError("bad header: reserved flags")
    if layout and templates is None:
        raise ValueError("bad header: reserved flags (a layout frame, section 12, and no templates to read it)")
    if crc32c(data[:-4]) != struct.unpack("<I", data[-4:])[0]:
        raise ValueError("crc mismatch")
    if not flags & BUNDLE_FLAG and count != 1:
        raise ValueError("a tensor frame holds exactly one record")
    held = [template(t) for t in templates] if layout else []
    entries, forms = [], []
    for _ in range(count):
        tag = r.leb128() if layout else 0
        if tag == 0:
            entries.append(_full_record(r))
            forms.append("full")
            continue
        i, own_params = divmod(tag - 1, 2)
        if i >= len(held):
            raise ValueError(f"unknown template {i} (the reader holds {len(held)})")
        entries.append(_compact_record(r, held[i], bool(own_params)))
        forms.append("compact_params" if own_params else "compact")
    if r.pos != len(data) - 4:
        raise ValueError("bytes left before the crc")
    names = [e["name"] for e in entries]
    if len(set(names)) != len(names):
        raise ValueError("duplicate name: record names repeat within the frame")
    return dict(bundle=bool(flags & BUNDLE_FLAG), layout=layout, round=rnd, sender=sender, entries=entries, forms=forms)


def unpack_bits(data: bytes, bits: int, count: int) -> list[int]:
    stream = int.from_bytes(data, "little")
    return [(stream >> (i * bits)) & ((1 << bits) - 1) for i in range(count)]


def rice_decode(data: bytes, count: int, set_len: int, param: int) -> list[int]:
    """FORMAT.md §6.2: the remainders packed at ``param`` bits, then one unary quotient per gap."""
    rem_len = (count * param + 7) // 8
    rems = unpack_bits(data[:rem_len], param, count) if param else [0] * count
    stream = int.from_bytes(data[rem_len:], "little")
    out, pos = [], 0
    for i in range(count):
        q = 0
        while not (stream >> pos) & 1:
            q += 1
            pos += 1
        pos += 1
        gap = (q << param) | rems[i]
        out.append(gap if i % set_len == 0 else out[-1] + 1 + gap)
    assert (pos + 7) // 8 == len(data) - rem_len, "bytes after the last code"
    return out


class Bits:
    """A bit stream read LSB-first (FORMAT.md §6): bit m is bit m mod 8 of byte m div 8."""

    def __init__(self, data: bytes):
        self.value, self.len, self.pos = int.from_bytes(data, "little"), 8 * len(data), 0

    def bit(self) -> int:
        if self.pos >= self.len:
            raise ValueError("bit stream ends early")
        b = (self.value >> self.pos) & 1
        self.pos += 1
        return b

    def msb_first(self, n: int) -> int:
        v = 0
        for _ in range(n):
            v = 2 * v + self.bit()
        return v

    def lsb_first(self, n: int) -> int:
        return sum(self.bit() << j for j in range(n))

    def assert_ended(self) -> None:
        assert (self.pos + 7) // 8 == self.len // 8, "bytes after the stream"
        assert self.value >> self.pos == 0, "nonzero padding bits"


def elias(bits: Bits, kind: int) -> int:
    """§6.3: kind 0 = ω, 1 = γ."""
    if kind == 1:
        zeros = 0
        while bits.bit() == 0:
            zeros += 1
        return (1 << zeros) | bits.msb_first(zeros)
    n = 1
    while bits.bit() == 1:
        n = (1 << n) | bits.msb_first(n)
    return n


def huffman_table(book: bytes) -> tuple[dict, dict]:
    """§6.4: {(length, codeword): symbol} of a serialized book (the escape is 256), and the lengths."""
    cap, esc, lo, count = book[0], book[1], book[2], struct.unpack_from("<H", book, 3)[0]
    lengths = {lo + i: (book[5 + i // 2] >> (4 * (i % 2))) & 0xF for i in range(count)}
    lengths = {sym: n for sym, n in lengths.items() if n}
    if esc:
        lengths[256] = esc
    assert max(lengths.values()) <= cap
    table, code, prev = {}, 0, 0
    for sym in sorted(lengths, key=lambda s_: (lengths[s_], s_)):
        code <<= lengths[sym] - prev
        table[(lengths[sym], code)] = sym
        code, prev = code + 1, lengths[sym]
    return table, lengths


def huffman_symbols(bits: Bits, count: int, book: bytes) -> list[int]:
    table, lengths = huffman_table(book)
    out = []
    for _ in range(count):
        n, code = 0, 0
        while (n, code) not in table:
            code, n = 2 * code + bits.bit(), n + 1
            assert n <= 15, "not a codeword"
        sym = table[(n, code)]
        if sym == 256:
            sym = bits.lsb_first(8)
            assert sym not in lengths, "escaped symbol with a code"
        out.append(sym)
    bits.assert_ended()
    return out


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def decode_gcomp(e: dict, numel: int) -> list[float]:
    """§5.4."""
    fmt, block, _book_id = struct.unpack("<BII", e["params"])
    sec = {k: bytes(v) for k, v in e["sections"].items()}
    width, drops = (23, (0, 6, 12, 18)) if fmt == 0 else (7, (0, 2, 4, 6))
    exps = huffman_symbols(Bits(sec["exp"]), numel, sec["book"])
    nblocks = (numel + block - 1) // block
    levels = unpack_bits(sec["level"], 2, nblocks)
    nonzero = [i for i in range(numel) if exps[i]]
    signs = unpack_bits(sec["sign"], 1, len(nonzero))
    kept, start = {}, 0
    for lv, d in enumerate(drops):
        mine = [i for i in nonzero if levels[i // block] == lv]
        size = (len(mine) * (width - d) + 7) // 8
        for i, k in zip(mine, unpack_bits(sec["mant"][start : start + size], width - d, len(mine))):
            kept[i] = k
        start += size
    assert start == len(sec["mant"])
    out = [0.0] * numel
    for j, i in enumerate(nonzero):
        d = drops[levels[i // block]]
        mant = (kept[i] << d) | ((1 << (d - 1)) if d else 0)
        if fmt == 1:
            mant <<= 16
        out[i] = struct.unpack("<f", struct.pack("<I", (signs[j] << 31) | (exps[i] << 23) | mant))[0]
    return out


def decode_qsgd(e: dict, numel: int) -> list[float]:
    """§5.5."""
    levels, bucket, kind, nnz = struct.unpack("<IIBQ", e["params"])
    norms = e["sections"]["norm"]
    bits = Bits(bytes(e["sections"]["data"]))
    out, pos = [0.0] * numel, -1
    for _ in range(nnz):
        pos += elias(bits, kind)
        negative = bits.bit()
        level = elias(bits, kind)
        assert pos < numel and level <= levels
        out[pos] = f32(norms[pos // bucket] * f32((-level if negative else level) / levels))
    bits.assert_ended()
    return out


def dct_matrix(n: int) -> list[list[float]]:
    return [
        [math.sqrt((1 if f == 0 else 2) / n) * math.cos(math.pi * (2 * i + 1) * f / (2 * n)) for i in range(n)]
        for f in range(n)
    ]


def _inverse_nd(coeffs: list[float], dims: list[int]) -> list[float]:
    """x = X ×_1 D^T ×_2 D^T …: a 1-D inverse DCT along each dimension of a row-major chunk."""
    x = list(coeffs)
    for axis, n in enumerate(dims):
        d = dct_matrix(n)
        inner = math.prod(dims[axis + 1 :])
        outer = math.prod(dims[:axis])
        y = [0.0] * len(x)
        for o in range(outer):
            for i in range(inner):
                base = o * n * inner + i
                col = [x[base + f * inner] for f in range(n)]
                for t in range(n):
                    y[base + t * inner] = sum(d[f][t] * col[f] for f in range(n))
        x = y
    return x


def largest_divisor(n: int, cap: int = 64) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def exact_basis(n: int, s: int) -> list[list[int]]:
    """§5.2 bit-identical decoding: ``E = round(D_n · 2^s)``, D computed in f64, rounded half to even."""
    return [[round(v * 2.0**s) for v in row] for row in dct_matrix(n)]


def _exact_chunk(positions: list[int], levels: list[int], scale: float, mn: float, dims: list[int]) -> list[float]:
    """§5.2 bit-identical decoding of one chunk: integer sums ``L`` (of ``u_j`` times the tensor product of
    the ``E_i`` rows of position j's frequencies) and ``P`` (of the products alone), then
    ``f32(((L · scale) + (P · min)) · 2^(−s·d))`` in f64."""
    d, c = len(dims), math.prod(dims)
    s = max(1, min(24, (44 - c.bit_length()) // d))
    bases = [exact_basis(n, s) for n in dims]
    lsum, psum = [0] * c, [0] * c
    for pos, u in zip(positions, levels):
        freqs = []
        for n in reversed(dims):  # the position unravelled in row-major order
            pos, f = divmod(pos, n)
            freqs.append(f)
        w = [1]
        for basis, f in zip(bases, reversed(freqs)):
            w = [x * y for x in w for y in basis[f]]
        for i, x in enumerate(w):
            lsum[i] += u * x
            psum[i] += x
    unit = 2.0 ** (-s * d)
    return [f32((float(lv) * scale + float(pv) * mn) * unit) for lv, pv in zip(lsum, psum)]


def _finite_f32(x: float) -> bool:
    try:
        return math.isfinite(f32(x))
    except OverflowError:  # beyond f32's range
        return False


def cast(values: list[float], dtype: int) -> list[float]:
    """Values rounded to ``dtype`` (table 4.1 code) as a conversion from f32 or f64 rounds: to nearest, ties
    to even."""
    if dtype == 11:
        return list(values)
    if dtype == 10:
        return [f32(v) for v in values]
    if dtype == 9:  # bf16: the f32's high half, rounded to nearest even on the low half
        out = []
        for v in values:
            bits = struct.unpack("<I", struct.pack("<f", f32(v)))[0]
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            out.append(struct.unpack("<f", struct.pack("<I", bits))[0])
        return out
    if dtype == 8:
        out = []
        for v in values:
            try:
                out.append(struct.unpack("<e", struct.pack("<e", v))[0])
            except OverflowError:
                out.append(math.copysign(math.inf, v))
        return out
    raise ValueError(f"dtype {dtype} is not a floating point code")


def decode_entry(e: dict, exact: bool = False) -> list[float]:
    """The record's tensor, flattened in row-major order.

    ``exact``: bit for bit what §5.2's integer decoding gives for a DCT record (the transform with the
    rounded basis, in integers), and every codec's values cast to the record's dtype; else the DCT record's
    values by the plain inverse transform in f64 (about 1e-4 apart)."""
    numel = math.prod(e["shape"])
    if e["codec"] == 0:
        values = [float(v) for v in e["sections"]["data"]]
        return cast(values, e["dtype"]) if exact else values
    if e["codec"] == 3:
        values = decode_gcomp(e, numel)
        return cast(values, e["dtype"]) if exact else values
    if e["codec"] == 4:
        values = decode_qsgd(e, numel)
        return cast(values, e["dtype"]) if exact else values
    if e["codec"] != 1:
        raise ValueError("codec not in this reader")
    p = Reader(e["params"])
    mode, cnd = p.u("B"), p.u("B")
    chunk = [p.u("I") for _ in range(cnd)]
    k, index_bits, value_bits, coding, pad = p.u("I"), p.u("B"), p.u("B"), p.u("B"), p.u("Q")
    assert value_bits in (8, 4, 2, 1) and coding in (0, 1)
    c = math.prod(chunk)
    n_chunks = (numel + pad) // c
    if coding == 0:
        idx = unpack_bits(bytes(e["sections"]["idx"]), index_bits, n_chunks * k)
    else:  # Rice-coded gaps, the parameter in index_bits
        idx = rice_decode(bytes(e["sections"]["idx"]), n_chunks * k, k, index_bits)
    if value_bits == 8:
        levels = [v + 128 for v in e["sections"]["val"]]
    else:
        levels = unpack_bits(bytes(e["sections"]["val"]), value_bits, n_chunks * k)
    scale, mn = e["sections"]["scale"], e["sections"]["min"]
    top = (1 << value_bits) - 1
    for sc, m in zip(scale, mn):
        if not (math.isfinite(sc) and sc > 0 and math.isfinite(m)):
            raise ValueError("a chunk's scale is not finite and > 0, or its min not finite")
        if not (_finite_f32(top * sc) and _finite_f32(f32(top * sc) + m)):
            raise ValueError("a chunk's largest coefficient is not finite in f32")
    chunks = []
    for j in range(n_chunks):
        ts = range(j * k, (j + 1) * k)
        if exact:
            chunks.append(_exact_chunk([idx[t] for t in ts], [levels[t] for t in ts], scale[j], mn[j], chunk))
            continue
        coeffs = [0.0] * c
        for t in ts:
            coeffs[idx[t]] = levels[t] * scale[j] + mn[j]
        chunks.append(_inverse_nd(coeffs, chunk))
    if mode == 0:
        flat = [v for ch in chunks for v in ch]
        out = flat[:numel]
    else:
        # tiles: the tensor viewed as a matrix (rows, cols), or as a vector
        shape = e["shape"]
        rows, cols = (shape[0], numel // shape[0]) if len(shape) >= 2 else (1, numel)
        a, b = (chunk[0], chunk[1]) if cnd == 2 else (1, chunk[0])
        out = [0.0] * numel
        tiles_per_row = cols // b
        for j, ch in enumerate(chunks):
            u, v = divmod(j, tiles_per_row)
            for r_ in range(a):
                for s in range(b):
                    out[(u * a + r_) * cols + v * b + s] = ch[r_ * b + s]
    return cast(out, e["dtype"]) if exact else out


# Whole-model records (section 9).

#: dtype codes of table 4.1 by type name.
DTYPE_CODES = {"f16": 8, "bf16": 9, "f32": 10, "f64": 11}
MODEL_PREFIX = "@model:"


def spec_bytes(spec: list[dict]) -> bytes:
    """§9.1: u32 count, then per tensor u16 name length, UTF-8 name, u8 dtype, u8 ndim, ndim u64 dims."""
    out = struct.pack("<I", len(spec))
    for t in spec:
        name = t["name"].encode("utf-8")
        out += struct.pack("<H", len(name)) + name + struct.pack("<BB", DTYPE_CODES[t["dtype"]], len(t["shape"]))
        out += b"".join(struct.pack("<Q", d) for d in t["shape"])
    return out


def spec_hash(spec: list[dict]) -> str:
    """BLAKE2b-128 of the spec's bytes, 32 lowercase hex digits."""
    return hashlib.blake2b(spec_bytes(spec), digest_size=16).hexdigest()


def split_model(frame: dict, spec: list[dict]) -> dict[str, list[float]]:
    """§9.3: the one record of a parsed model frame, checked against ``spec``, decoded and cut into
    ``{name: values in row-major order}``."""
    if not frame["bundle"] or len(frame["entries"]) != 1:
        raise ValueError("a model frame is a bundle of exactly one record")
    e = frame["entries"][0]
    digits = e["name"][len(MODEL_PREFIX) :]
    if not e["name"].startswith(MODEL_PREFIX) or len(digits) != 32 or set(digits) - set("0123456789abcdef"):
        raise ValueError("not a model record")
    if digits != spec_hash(spec):
        raise ValueError("model spec mismatch")
    sizes = [math.prod(t["shape"]) for t in spec]
    if e["dtype"] != DTYPE_CODES["f32"] or e["shape"] != [sum(sizes)]:
        raise ValueError("a model record is 1-D f32 of the spec's element count")
    flat = decode_entry(e)
    out, start = {}, 0
    for t, n in zip(spec, sizes):
        out[t["name"]] = flat[start : start + n]
        start += n
    return out


# -- §11: run binding -------------------------------------------------------------------------------

RUN_PREFIX = "@run:"


def run_binding(run_id: str, round_: int) -> str:
    """§11: BLAKE2b-128, personalization ``gradwire-run-v1``, of the run id, a zero byte and the round (u64)."""
    data = run_id.encode("utf-8") + b"\0" + struct.pack("<Q", round_)
    return hashlib.blake2b(data, digest_size=16, person=b"gradwire-run-v1").hexdigest()


def frame_binding(frame: dict) -> str | None:
    """§11: the hex digits of a parsed frame's run-binding record, or None; ValueError for a malformed one."""
    found = None
    for e in frame["entries"]:
        if not e["name"].startswith(RUN_PREFIX):
            continue
        digits = e["name"][len(RUN_PREFIX) :]
        if found is not None or len(digits) != 32 or set(digits) - set("0123456789abcdef"):
            raise ValueError("not a run binding")
        if e["codec"] != 0 or e["dtype"] != DTYPE_CODES["f32"] or e["shape"] != [0]:
            raise ValueError("a run binding is an empty f32 identity record of shape (0)")
        found = digits
    return found
