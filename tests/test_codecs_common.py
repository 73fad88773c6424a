"""Every codec in the registry through the same checks: round trip, bundle, error feedback, hostile bytes.

A codec added to ``gradwire.codecs.CODECS`` is picked up here. One that cannot be built without
arguments needs an entry in ``KWARGS``; the first test fails until it has one. Codecs outside the
registry that follow the protocol (``gradwire.Accordion``, a policy over two codecs) get the same
checks through ``POLICIES``.
"""

from __future__ import annotations

import random
import struct

import pytest
import torch

import gradwire
from gradwire import Accordion, ErrorFeedback, FrameError, Limits, wire
from gradwire.codecs import CODECS, make_codec
from gradwire.frame import write_frame

#: Arguments for codecs that need some; every other codec is built with its defaults.
KWARGS = {
    "topk": dict(density=0.1),
    "randomk": dict(density=0.1),
    # Stateless decoding here: every frame carries its codebook (by default only a changed book travels).
    "gcomp": dict(carry_book="always"),
}
#: Protocol-following codecs outside the registry, by a test id: how to build one.
POLICIES = {
    "accordion": lambda: Accordion(
        low={"codec": "powersgd", "rank": 2}, high={"codec": "powersgd", "rank": 1}, interval=2
    ),
}
REGISTERED = sorted(CODECS)
NAMES = REGISTERED + sorted(POLICIES)
SHAPES = [(40, 24), (8, 3, 3, 3), (100,), (1,), ()]
LIMITS = Limits(max_frame_bytes=1 << 24, max_entries=64, max_tensor_elements=1 << 20)


def _make(name):
    if name in POLICIES:
        return POLICIES[name]()
    return make_codec(name, **KWARGS.get(name, {}))


def _rand(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("name", REGISTERED)
def test_every_registered_codec_can_be_built(name):
    codec = _make(name)
    assert callable(codec.compress)
    assert codec.name == name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_round_trip_equals_the_reported_reconstruction(name, dtype):
    codec = _make(name)
    for i, shape in enumerate(SHAPES):
        x = _rand(shape, seed=i, dtype=dtype)
        for step in range(2):  # stateful codecs (warm starts, seed counters) change between calls
            entry, recon = codec.compress(x, f"t{i}")
            assert recon.shape == x.shape and recon.dtype == x.dtype
            out = gradwire.decode(write_frame([entry], round=step), limits=LIMITS)
            assert out.shape == x.shape and out.dtype == x.dtype
            assert torch.equal(out, recon), (name, shape, step)


@pytest.mark.parametrize("name", NAMES)
def test_bundle_decodes_to_what_each_tensor_compresses_to(name):
    tensors = {f"t{i}": _rand(s, seed=10 + i) for i, s in enumerate(SHAPES)}
    frame = _make(name).encode_bundle(tensors, round=3, sender=7)
    f = gradwire.read_frame(frame)
    assert f.bundle and (f.round, f.sender) == (3, 7) and [e.name for e in f.entries] == list(tensors)
    out = gradwire.decode_bundle(frame)
    twin = _make(name)  # a fresh codec called in the same order makes the same records
    for n, t in tensors.items():
        assert torch.equal(out[n], twin.compress(t, n)[1]), n


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_loses_nothing(name):
    ef = ErrorFeedback(_make(name))
    shape = (24, 16)
    sum_in, sum_out = torch.zeros(shape), torch.zeros(shape)
    for t in range(4):
        g = _rand(shape, seed=20 + t) + 0.1
        sum_in += g
        sum_out += gradwire.decode(ef.encode(g, "w", round=t))
    # sum(decoded) + residual = sum(inputs), up to float rounding.
    torch.testing.assert_close(sum_out + ef.residual("w"), sum_in, atol=1e-4, rtol=1e-5)


def _flip_and_reseal(frame: bytes, rng: random.Random, flips: int) -> bytes:
    """Flip bits after the header and recompute the CRC, so the decoders (not the CRC) see them."""
    buf = bytearray(frame)
    body_end = len(buf) - 4
    for _ in range(flips):
        pos = rng.randrange(32, body_end)
        buf[pos] ^= 1 << rng.randrange(8)
    buf[body_end:] = struct.pack("<I", wire.crc32c(bytes(buf[:body_end])))
    return bytes(buf)


@pytest.mark.parametrize("name", NAMES)
def test_corrupted_records_raise_frame_errors_and_nothing_else(name):
    rng = random.Random(name)
    tensors = {"w": _rand((12, 10), seed=30), "b": _rand((10,), seed=31), "s": _rand((), seed=32)}
    frame = _make(name).encode_bundle(tensors)
    rejected = 0
    for trial in range(150):
        bad = _flip_and_reseal(frame, rng, flips=1 + trial % 3)
        try:
            out = gradwire.decode_bundle(bad, limits=LIMITS)
        except FrameError:
            rejected += 1
            continue
        # Accepted: then it decoded to well-formed tensors.
        for t in out.values():
            assert isinstance(t, torch.Tensor) and t.is_floating_point()
    assert rejected > 0


@pytest.mark.parametrize("name", NAMES)
def test_plain_bit_flips_and_truncations_are_caught(name):
    frame = _make(name).encode(_rand((12, 10), seed=33), name="w")
    rng = random.Random(name)
    for _ in range(50):
        buf = bytearray(frame)
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        with pytest.raises(FrameError):
            gradwire.decode(bytes(buf))
    for cut in sorted({0, 1, 35, len(frame) // 2, len(frame) - 1}):
        with pytest.raises(FrameError):
            gradwire.decode(frame[:cut])


@pytest.mark.parametrize("name", NAMES)
def test_encoders_take_non_float_tensors_as_errors(name):
    with pytest.raises((ValueError, TypeError)):
        _make(name).compress(torch.arange(12).reshape(3, 4), "w")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_tensors_stay_on_the_gpu_and_decode_there(name):
    codec = _make(name)
    for i, shape in enumerate(SHAPES):
        x = _rand(shape, seed=40 + i).cuda()
        entry, recon = codec.compress(x, f"t{i}")
        assert recon.device == x.device
        out = gradwire.decode(write_frame([entry]), device=x.device)
        assert out.device == x.device and torch.equal(out, recon)
        cpu = gradwire.decode(write_frame([entry]))
        torch.testing.assert_close(cpu, recon.cpu(), atol=1e-4, rtol=1e-4)
