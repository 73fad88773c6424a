"""The golden frames of tests/vectors/: gradwire and an independent reader agree with them byte for byte."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import gradwire
import reference_reader
from gradwire import read_frame, write_frame
from vectors.make_vectors import build

VECTORS = Path(__file__).parent / "vectors"
MANIFEST = json.loads((VECTORS / "manifest.json").read_text())
NAMES = sorted(MANIFEST)


def load(name):
    return (VECTORS / f"{name}.gwf").read_bytes(), load_file(str(VECTORS / f"{name}.safetensors"))


def test_every_vector_kind_is_present():
    assert {"identity_f32", "identity_bundle_f16_bf16", "dct_flat", "dct_flat_padded", "dct_tiles_bundle"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_golden_frame_decodes_to_its_stored_tensors(name):
    frame, tensors = load(name)
    out = gradwire.decode_bundle(frame)
    for rec in MANIFEST[name]["records"]:
        want = tensors[f"decoded/{rec}"]
        got = out[rec]
        assert got.dtype == want.dtype and got.shape == want.shape
        if name.startswith("identity"):
            assert torch.equal(got, want)
        else:  # the inverse transform's last bits depend on the BLAS build
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_reading_and_rewriting_a_golden_frame_gives_the_same_bytes(name):
    frame, _ = load(name)
    f = read_frame(frame)
    assert (f.round, f.sender, f.bundle) == (MANIFEST[name]["round"], MANIFEST[name]["sender"], MANIFEST[name]["bundle"])
    assert write_frame(f.entries, round=f.round, sender=f.sender, bundle=f.bundle) == frame


@pytest.mark.parametrize("name", NAMES)
def test_encoding_the_stored_input_reproduces_the_golden_frame(name):
    frame, tensors = load(name)
    meta = MANIFEST[name]
    if not meta["stable"]:
        pytest.skip("input not designed for a BLAS-independent top-k; decoded and re-read only")
    entries = [build(r).compress(tensors[f"input/{rec}"], rec)[0] for rec, r in meta["records"].items()]
    again = write_frame(entries, round=meta["round"], sender=meta["sender"], bundle=meta["bundle"])
    if name.startswith("identity"):
        assert again == frame
        return
    # DCT: header, params, positions and int8 values byte for byte; scale and min to float rounding.
    golden, mine = read_frame(frame), read_frame(again)
    assert len(again) == len(frame)
    for g, m in zip(golden.entries, mine.entries):
        assert (g.name, g.codec, g.dtype, g.shape, g.params) == (m.name, m.codec, m.dtype, m.shape, m.params)
        assert g.sections["idx"].tobytes() == m.sections["idx"].tobytes()
        assert g.sections["val"].tobytes() == m.sections["val"].tobytes()
        np.testing.assert_allclose(m.sections["scale"], g.sections["scale"], rtol=1e-6)
        np.testing.assert_allclose(m.sections["min"], g.sections["min"], rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_independent_reader_written_from_the_spec_agrees(name):
    frame, tensors = load(name)
    parsed = reference_reader.parse(frame)
    meta = MANIFEST[name]
    assert (parsed["round"], parsed["sender"], parsed["bundle"]) == (meta["round"], meta["sender"], meta["bundle"])
    assert [e["name"] for e in parsed["entries"]] == list(meta["records"])
    for e in parsed["entries"]:
        want = tensors[f"decoded/{e['name']}"].double().reshape(-1).tolist()
        got = reference_reader.decode_entry(e)
        assert list(e["shape"]) == list(tensors[f"decoded/{e['name']}"].shape)
        for a, b in zip(got, want):
            assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-4), (e["name"], a, b)
        assert len(got) == len(want)


def test_independent_reader_rejects_a_corrupted_golden_frame():
    frame, _ = load("dct_flat")
    bad = bytearray(frame)
    bad[len(bad) // 2] ^= 0x10
    with pytest.raises(ValueError, match="crc"):
        reference_reader.parse(bytes(bad))
