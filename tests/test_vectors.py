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
from vectors.make_vectors import build, model_inputs, model_spec

VECTORS = Path(__file__).parent / "vectors"
MANIFEST = json.loads((VECTORS / "manifest.json").read_text())
NAMES = sorted(MANIFEST)
#: Whole-model vectors (FORMAT.md section 9): they list their model spec.
MODEL_NAMES = sorted(n for n in NAMES if "model_spec" in MANIFEST[n])


def load(name):
    return (VECTORS / f"{name}.gwf").read_bytes(), load_file(str(VECTORS / f"{name}.safetensors"))


def test_every_vector_kind_is_present():
    assert {"identity_f32", "identity_bundle_f16_bf16", "dct_flat", "dct_flat_padded", "dct_tiles_bundle"} <= set(NAMES)
    assert {"model_identity", "model_dct_rice"} <= set(MODEL_NAMES)


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
    assert (f.round, f.sender, f.bundle) == (
        MANIFEST[name]["round"],
        MANIFEST[name]["sender"],
        MANIFEST[name]["bundle"],
    )
    assert write_frame(f.entries, round=f.round, sender=f.sender, bundle=f.bundle) == frame


@pytest.mark.parametrize("name", NAMES)
def test_encoding_the_stored_input_reproduces_the_golden_frame(name):
    frame, tensors = load(name)
    meta = MANIFEST[name]
    if not meta["stable"]:
        pytest.skip("input not designed for a BLAS-independent top-k; decoded and re-read only")
    entries = [build(r).compress(tensors[f"input/{rec}"], rec)[0] for rec, r in meta["records"].items()]
    again = write_frame(entries, round=meta["round"], sender=meta["sender"], bundle=meta["bundle"])
    assert_same_frame(again, frame, exact=MANIFEST[name]["records"][entries[0].name]["codec"] == "identity")


def assert_same_frame(again: bytes, frame: bytes, *, exact: bool) -> None:
    """``again`` is ``frame``: byte for byte when ``exact``; else (DCT) header, params, positions and
    values byte for byte, scale and min to float rounding."""
    if exact:
        assert again == frame
        return
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


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_vector_decodes_by_its_spec_and_encodes_again(name):
    frame, tensors = load(name)
    meta = MANIFEST[name]
    spec = model_spec(meta["model_spec"])
    [rec] = meta["records"]
    assert rec == spec.record_name and gradwire.is_model_record(read_frame(frame).entries[0])
    out = gradwire.decode_model(frame, spec)
    whole = gradwire.decode_bundle(frame)[rec]
    assert list(out) == spec.names
    for n, (a, b) in spec.offsets().items():
        assert torch.equal(out[n].reshape(-1), whole[a:b])  # the record's decode, sliced
        want = tensors[f"model/{n}"]
        assert out[n].dtype == want.dtype == torch.float32 and out[n].shape == want.shape
        if meta["records"][rec]["codec"] == "identity":
            assert torch.equal(out[n], want)
        else:
            torch.testing.assert_close(out[n], want, rtol=0, atol=1e-6)
    inputs = model_inputs(spec, tensors[f"input/{rec}"])
    again = gradwire.encode_model(build(meta["records"][rec]), inputs, spec, round=meta["round"], sender=meta["sender"])
    assert_same_frame(again, frame, exact=meta["records"][rec]["codec"] == "identity")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_independent_reader_hashes_the_spec_and_splits_the_model(name):
    frame, tensors = load(name)
    spec = MANIFEST[name]["model_spec"]
    parsed = reference_reader.parse(frame)
    assert parsed["entries"][0]["name"] == "@model:" + reference_reader.spec_hash(spec)
    assert reference_reader.spec_bytes(spec) == model_spec(spec).encode()  # two writers of §9.1 agree
    split = reference_reader.split_model(parsed, spec)
    assert list(split) == [t["name"] for t in spec]
    for t in spec:
        want = tensors[f"model/{t['name']}"]
        assert list(want.shape) == t["shape"]
        got, want = split[t["name"]], want.double().reshape(-1).tolist()
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-4), (t["name"], a, b)
    other = [dict(spec[0], name=spec[0]["name"] + "_renamed"), *spec[1:]]
    with pytest.raises(ValueError, match="mismatch"):
        reference_reader.split_model(parsed, other)


def test_independent_reader_rejects_a_corrupted_golden_frame():
    frame, _ = load("dct_flat")
    bad = bytearray(frame)
    bad[len(bad) // 2] ^= 0x10
    with pytest.raises(ValueError, match="crc"):
        reference_reader.parse(bytes(bad))
