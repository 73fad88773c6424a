"""Each wire codec declares one capability object, and every reader of records finds it by codec id."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradwire
from gradwire import capabilities
from gradwire.accordion import setting_of
from gradwire.accumulate import entry_norm, make_accumulator
from gradwire.capabilities import CAPABILITY_NAMES, CodecCapabilities, capabilities_of, declare, provide
from gradwire.codecs import CODECS
from gradwire.errors import FrameError
from gradwire.frame import Entry, decode_entry, register_decoder, weighted_sum_fused


@pytest.fixture
def private_registry(monkeypatch):
    """Declarations made by a test stay in the test."""
    monkeypatch.setattr(capabilities, "_BY_ID", dict(capabilities._BY_ID))


def test_every_wire_codec_declares_one_capability_object_under_its_name():
    for name, factory in CODECS.items():
        caps = capabilities_of(factory.codec_id)
        assert caps.codec_id == factory.codec_id, name
        assert caps.name == name, (name, caps.name)
        assert caps.decode is not None, name
    ids = [f.codec_id for f in CODECS.values()]
    assert sorted(set(ids)) == sorted(ids) == capabilities.declared_ids()


def test_the_readers_use_the_declared_capabilities():
    codec = gradwire.DCTCodec(chunk_shape=(8, 8), topk=4)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    entry, recon = codec.compress(x, "w")
    caps = capabilities_of(entry.codec)
    assert torch.equal(decode_entry(entry), caps.decode(entry, None))
    assert torch.equal(decode_entry(entry), recon)
    assert entry_norm(entry) == caps.norm(entry)
    assert type(make_accumulator(entry)) is type(caps.accumulator(entry, None))
    assert setting_of(entry) == caps.setting(entry)
    assert (setting_of(entry)["codec"], setting_of(entry)["mode"], setting_of(entry)["topk"]) == ("dct", "flat", 4)
    fused = weighted_sum_fused([entry, entry], [0.5, 0.25])
    assert torch.equal(fused, caps.weighted_sum([entry, entry], [0.5, 0.25], None))


def test_a_codec_without_a_capability_falls_back_to_the_dense_reader():
    entry, _ = gradwire.QSGD(levels=4).compress(torch.randn(100, generator=torch.Generator().manual_seed(2)), "q")
    caps = capabilities_of(entry.codec)
    assert caps.norm is None and caps.accumulator is None and caps.weighted_sum is None
    dense = decode_entry(entry).to(torch.float64)
    assert entry_norm(entry) == pytest.approx(float(dense.norm()), rel=1e-6)
    assert weighted_sum_fused([entry], [1.0]) is None
    assert setting_of(entry) == {"codec_id": entry.codec, "params": entry.params.hex()}


def test_an_unknown_codec_id_offers_nothing_and_decoding_names_it():
    caps = capabilities_of(0x7FEE)
    assert all(getattr(caps, what) is None for what in CAPABILITY_NAMES)
    entry = Entry(name="x", codec=0x7FEE, dtype=torch.float32, shape=(1,), params=b"", sections={}, section_elems={})
    with pytest.raises(FrameError, match="unknown codec id 32750"):
        decode_entry(entry)


def test_declaring_again_merges_and_a_second_function_for_one_capability_is_refused(private_registry):
    def decode_a(entry, device):
        return torch.zeros(entry.shape)

    def norm_a(entry):
        return 0.0

    declare(CodecCapabilities(0x7FF0, "mine", decode=decode_a))
    merged = declare(CodecCapabilities(0x7FF0, norm=norm_a))
    assert merged.decode is decode_a and merged.norm is norm_a and merged.name == "mine"
    assert declare(CodecCapabilities(0x7FF0, "mine", decode=decode_a)).decode is decode_a  # the same function
    with pytest.raises(ValueError, match=r"codec id 32752 \(mine\) already has decode"):
        declare(CodecCapabilities(0x7FF0, decode=lambda e, d: None))
    with pytest.raises(ValueError, match="already declared as 'mine', not 'theirs'"):
        declare(CodecCapabilities(0x7FF0, "theirs"))
    with pytest.raises(ValueError, match="already has decode"):
        declare(CodecCapabilities(capabilities_of(1).codec_id, decode=decode_a))  # the DCT's id
    with pytest.raises(ValueError, match="unknown capability 'encode'"):
        provide(0x7FF0, "encode", decode_a)
    with pytest.raises(ValueError, match="codec id must be an integer"):
        declare(CodecCapabilities(70000))


def test_a_codec_written_outside_gradwire_registers_through_the_decorators(private_registry):
    @register_decoder(0x7FF1)
    def decode_ones(entry, device):
        return torch.ones(entry.shape, dtype=entry.dtype)

    entry = Entry(
        name="o",
        codec=0x7FF1,
        dtype=torch.float32,
        shape=(2, 3),
        params=b"",
        sections={"x": np.zeros(1, np.uint8)},
        section_elems={},
    )
    assert torch.equal(decode_entry(entry), torch.ones(2, 3))
    assert capabilities_of(0x7FF1).decode is decode_ones
