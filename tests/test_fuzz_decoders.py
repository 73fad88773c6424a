"""Every Python decoder of bytes from the network, fuzzed: any input gives a typed error of
``gradwire.errors`` (``WireError``, or its subclass ``FrameError``), never another exception, a hang or a
huge allocation.

Inputs are arbitrary bytes and, mostly, valid frames mutated: bytes of the records overwritten, cut or
inserted, then the frame's length and CRC fixed up, so that the mutation passes the envelope checks and
reaches the codecs' decoders, the model records and the published versions. The valid frames are the
golden vectors (tests/vectors), a frame of every wire codec, whole-model frames and published versions.

A huge allocation is caught by a cap on the process's data segment around each decode (RLIMIT_DATA, the
current size plus ``HEADROOM``): an allocation past it fails in torch or numpy with an exception that is
not a ``WireError``, and the test fails. The receiver's limits bound a record's tensor to
``MAX_ELEMENTS`` elements, as a node's or the server's limits bound it to its model. Examples are derived
from a fixed seed so CI is repeatable; ``GRADWIRE_FUZZ_EXAMPLES`` raises the count for a longer run.
"""

from __future__ import annotations

import contextlib
import os
import resource
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradwire
from gradwire import _native, wire
from gradwire.aggregation import exact_aggregate
from gradwire.client.http_client import split_frames
from gradwire.codecs import CODECS, make_codec
from gradwire.errors import WireError
from gradwire.frame import Limits, decode_bundle, frame_length, read_frame, weighted_sum_fused
from gradwire.model_record import ModelSpec, decode_model, encode_model
from gradwire.published import read_published, write_published, write_published_aggregate

VECTORS = Path(__file__).parent / "vectors"
#: The largest tensor a record may announce to this receiver (its model's largest, in real use).
MAX_ELEMENTS = 1 << 16
LIMITS = Limits(max_frame_bytes=1 << 22, max_entries=64, max_tensor_elements=MAX_ELEMENTS)
#: What one decode may allocate beyond the process's data segment before it: far above what
#: MAX_ELEMENTS-sized tensors need, far below what an allocation bomb asks for.
HEADROOM = 1 << 30

FUZZ = settings(
    max_examples=int(os.environ.get("GRADWIRE_FUZZ_EXAMPLES", "120")),
    derandomize="GRADWIRE_FUZZ_EXAMPLES" not in os.environ,
    deadline=None,  # a hang shows as the run's timeout; slow inputs as the test's time
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------------------------------------
# The valid inputs mutations start from


def _codec_frames() -> list[bytes]:
    g = torch.Generator().manual_seed(11)
    tensors = {"w": torch.randn(16, 12, generator=g), "b": torch.randn(37, generator=g)}
    params = {"topk": {"k": 8}, "randomk": {"k": 8}}
    frames = []
    for name in CODECS:
        codec = make_codec(name, **params.get(name, {}))
        entries = [entry for entry, _ in codec.compress_bundle(tensors).values()]
        frames.append(gradwire.write_frame(entries, round=5, sender=2, bundle=True))
    return frames


MODEL = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
SPEC = ModelSpec.from_module(MODEL)


def _model_frames() -> list[bytes]:
    grads = {n: torch.randn_like(p) for n, p in MODEL.named_parameters()}
    return [encode_model(make_codec(name), grads, SPEC, round=1, sender=1) for name in ("identity", "dct")]


def _published() -> list[bytes]:
    identity = make_codec("identity")
    node = [
        gradwire.write_frame(
            [identity.compress(torch.full((6,), float(i)), "x")[0]], round=4, sender=i + 1, bundle=True
        )
        for i in range(3)
    ]
    dct = make_codec("dct")
    aggregate = [entry for entry, _ in dct.compress_bundle({"x": torch.randn(8, 8)}).values()]
    return [
        write_published(4, node, [0.5, 0.25, 0.25]),
        write_published(4, node, [1.0, 1.0, 1.0], trim=1),
        write_published_aggregate(5, aggregate, senders=3),
    ]


# Layout frames (flag bit 1) read only with their templates: tests/test_layout_frames.py and the
# layout_frame fuzz target mutate those.
GOLDEN = [b for b in (p.read_bytes() for p in sorted(VECTORS.glob("*.gwf"))) if not b[6] & 2]
FRAMES = GOLDEN + _codec_frames()
MODEL_FRAMES = _model_frames()
PUBLISHED = _published()


def _split(stream: bytes) -> list[bytes]:
    out, offset = [], 0
    while offset < len(stream):
        n = frame_length(stream[offset:])
        out.append(stream[offset : offset + n])
        offset += n
    return out


# ---------------------------------------------------------------------------------------------
# Mutations that keep the envelope valid


@st.composite
def edits(draw):
    """A list of (kind, position in [0, 1), bytes) mutations of a frame's records."""
    edit = st.tuples(
        st.sampled_from(["set", "insert", "cut"]),
        st.floats(0, 1, exclude_max=True),
        st.binary(min_size=1, max_size=8),
    )
    return draw(st.lists(edit, min_size=1, max_size=6))


def mutate(frame: bytes, changes) -> bytes:
    """``frame`` with its records (bytes 32 .. -4) changed, then total_len and the CRC fixed up."""
    body = bytearray(frame[32:-4])
    for kind, where, data in changes:
        at = int(where * (len(body) + 1))
        if kind == "set":
            body[at : at + len(data)] = data
        elif kind == "insert":
            body[at:at] = data
        else:
            del body[at : at + len(data)]
    out = bytearray(frame[:32]) + body + bytes(4)
    out[8:16] = struct.pack("<Q", len(out))
    out[-4:] = struct.pack("<I", wire.crc32c(bytes(out[:-4])))
    return bytes(out)


def payload_ranges(frame: bytes) -> list[tuple[int, int]]:
    """The byte ranges of every record's params and sections in ``frame`` (the codecs' own bytes)."""
    _, _, _, entries = _native.decode_frame(np.frombuffer(frame, dtype=np.uint8))
    ranges = []
    for _, _, _, _, params, sections in entries:
        ranges.append(params)
        ranges.extend((s0, s1) for _, _, s0, s1 in sections)
    return [(a, b) for a, b in ranges if b > a]


@st.composite
def payload_edits(draw, frame: bytes):
    """Bytes of the records' params and sections overwritten in place: the frame's layout stays valid, so
    every such frame reaches its codec's decoder."""
    ranges = payload_ranges(frame)
    changes = []
    for _ in range(draw(st.integers(1, 4))):
        start, end = draw(st.sampled_from(ranges))
        at = draw(st.integers(start, end - 1))
        data = draw(st.binary(min_size=1, max_size=min(8, end - at)))
        changes.append(("set", (at - 32) / max(1, len(frame) - 36), data, at))
    return changes


def overwrite(frame: bytes, changes) -> bytes:
    """``frame`` with ``payload_edits`` applied at their exact offsets, then its CRC fixed up."""
    out = bytearray(frame)
    for _, _, data, at in changes:
        out[at : at + len(data)] = data
    out[-4:] = struct.pack("<I", wire.crc32c(bytes(out[:-4])))
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# The checks


def _data_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1])
    raise RuntimeError("no VmData in /proc/self/status")


@contextlib.contextmanager
def allocation_cap():
    """The data segment capped at its size now plus ``HEADROOM`` while the block runs (Linux)."""
    if not Path("/proc/self/status").exists():
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = _data_kib() * 1024 + HEADROOM
    resource.setrlimit(resource.RLIMIT_DATA, (min(cap, hard) if hard != resource.RLIM_INFINITY else cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def typed(decode, *args, **kwargs):
    """``decode(*args)``'s result, or ``None`` where it raised a ``WireError``; any other exception fails."""
    with allocation_cap():
        try:
            return decode(*args, **kwargs)
        except WireError:
            return None


def test_the_cap_catches_a_huge_allocation():
    # the cap itself: an allocation of twice the headroom fails instead of succeeding
    with pytest.raises((RuntimeError, MemoryError)):
        with allocation_cap():
            torch.ones(2 * HEADROOM // 4, dtype=torch.float32)


def test_mutations_keep_the_envelope_valid():
    # the mutated frames pass the CRC, so the fuzzing reaches the records
    frame = mutate(FRAMES[0], [("set", 0.5, b"\x00")])
    assert frame_length(frame) == len(frame)
    typed(read_frame, frame)  # a record error at most, never the envelope's
    with pytest.raises(WireError) as exc:
        read_frame(frame[:-1] + bytes([frame[-1] ^ 1]))
    assert exc.value.kind == "checksum_mismatch"


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_as_a_frame(data):
    typed(read_frame, data, limits=LIMITS)
    typed(frame_length, data)
    typed(split_frames, data, limits=LIMITS)
    typed(read_published, data, limits=LIMITS)
    typed(ModelSpec.from_bytes, data)


@FUZZ
@given(st.sampled_from(FRAMES), st.data())
def test_mutated_records_of_every_codec(frame, draw):
    if draw.draw(st.booleans()):
        data = overwrite(frame, draw.draw(payload_edits(frame)))  # the codec's bytes, layout intact
    else:
        data = mutate(frame, draw.draw(edits()))  # the layout too
    parsed = typed(read_frame, data, limits=LIMITS)
    if parsed is None:
        return
    tensors = typed(decode_bundle, parsed)
    if tensors is not None:
        assert {e.name for e in parsed.entries} == set(tensors)
    # the fused weighted sum (the DCT's one Rust pass) and the exact mean of two senders (the same records
    # twice: senders that disagree on the tensors are refused where the bytes are read, read_published)
    typed(weighted_sum_fused, parsed.entries, [0.5] * len(parsed.entries))
    typed(exact_aggregate, [parsed.entries, parsed.entries], [0.5, 0.5])


@FUZZ
@given(st.sampled_from(MODEL_FRAMES), edits())
def test_mutated_model_records(frame, changes):
    tensors = typed(decode_model, mutate(frame, changes), SPEC, limits=LIMITS)
    if tensors is not None:
        assert list(tensors) == SPEC.names


@FUZZ
@given(st.data())
def test_mutated_model_specs(data):
    spec = SPEC.encode()
    at = data.draw(st.integers(0, len(spec)))
    cut = data.draw(st.integers(0, 12))
    blob = spec[:at] + data.draw(st.binary(max_size=12)) + spec[at + cut :]
    parsed = typed(ModelSpec.from_bytes, blob)
    if parsed is not None:
        assert parsed.encode() == blob


@FUZZ
@given(st.sampled_from(PUBLISHED), st.data())
def test_mutated_published_versions(version, data):
    frames = _split(version)
    i = data.draw(st.integers(0, len(frames) - 1))
    frames[i] = mutate(frames[i], data.draw(edits()))
    if data.draw(st.booleans()):
        frames = frames[: data.draw(st.integers(0, len(frames)))]
    published = typed(read_published, b"".join(frames), limits=LIMITS)
    for v in published or []:
        typed(v.mean)


@FUZZ
@given(
    data=st.binary(max_size=64),
    bits=st.integers(0, 40),
    count=st.integers(0, 600),
    universe=st.integers(0, 1 << 40),
    param=st.integers(0, 40),
    set_len=st.integers(0, 40),
    kind=st.sampled_from(["gamma", "omega"]),
    expected=st.none() | st.integers(0, 4000),
)
def test_section_decoders(data, bits, count, universe, param, set_len, kind, expected):
    typed(wire.unpack_bits, data, bits, count)
    typed(wire.unpack_bits_exact, data, bits, count)
    typed(wire.quartic_decode, data, count)
    typed(wire.zero_run_decode, data, expected)
    typed(wire.rice_decode, data, count, universe, param, set_len=set_len or None)
    typed(wire.elias_decode, data, count, kind)
    typed(wire.sparse_levels_decode, data, count, universe, bits, kind)
    typed(wire.huffman_book_lengths, data)
    book = wire.huffman_book(np.arange(1, 257, dtype=np.uint64), 12)
    typed(wire.huffman_decode, data, count, book)
    typed(wire.huffman_decode, data[8:], count, data[:8])
