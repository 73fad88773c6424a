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
from gradwire import FrameError, read_frame, write_frame
from vectors.make_vectors import build, layout_templates, model_inputs, model_spec

VECTORS = Path(__file__).parent / "vectors"
MANIFEST = json.loads((VECTORS / "manifest.json").read_text())
#: Layout frames (FORMAT.md section 12): they list the templates a reader must hold to read them.
LAYOUT_NAMES = sorted(n for n in MANIFEST if "templates" in MANIFEST[n])
#: Frames of sections 1–11, which any reader reads as they are.
NAMES = sorted(n for n in MANIFEST if n not in LAYOUT_NAMES)
#: Whole-model vectors (FORMAT.md section 9): they list their model spec.
MODEL_NAMES = sorted(n for n in NAMES if "model_spec" in MANIFEST[n])


def load(name):
    return (VECTORS / f"{name}.gwf").read_bytes(), load_file(str(VECTORS / f"{name}.safetensors"))


def test_every_vector_kind_is_present():
    assert {"identity_f32", "identity_bundle_f16_bf16", "dct_flat", "dct_flat_padded", "dct_tiles_bundle"} <= set(NAMES)
    assert {"model_identity", "model_dct_rice"} <= set(MODEL_NAMES)
    assert {"dct_layout_bundle"} <= set(LAYOUT_NAMES)


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


def assert_same_frame(again: bytes, frame: bytes, *, exact: bool, templates=None) -> None:
    """``again`` is ``frame``: byte for byte when ``exact``; else (DCT) header, params, positions and
    values byte for byte, scale and min to float rounding (both read with ``templates``, for layout frames)."""
    if exact:
        assert again == frame
        return
    golden, mine = read_frame(frame, templates=templates), read_frame(again, templates=templates)
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
    assert parsed["forms"] == ["full"] * len(parsed["entries"]) and not parsed["layout"]
    assert reference_reader.parse(frame, templates=[]) == parsed  # templates do not change a plain frame
    for e in parsed["entries"]:
        want = tensors[f"decoded/{e['name']}"].double().reshape(-1).tolist()
        got = reference_reader.decode_entry(e)
        assert list(e["shape"]) == list(tensors[f"decoded/{e['name']}"].shape)
        for a, b in zip(got, want):
            assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-4), (e["name"], a, b)
        assert len(got) == len(want)
        # FORMAT.md §5.2's integer decoding, written from the text alone, gives gradwire's bits.
        assert reference_reader.decode_entry(e, exact=True) == want, e["name"]


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


# -- layout frames (FORMAT.md section 12) --------------------------------------------------------------


def templates_of(name):
    """The vector's templates: as gradwire takes them, and as the manifest lists them (plain data)."""
    listed = MANIFEST[name]["templates"]
    return layout_templates(listed), listed


def reframed(body: bytes) -> bytes:
    """``body`` (a frame less its CRC) with its ``total_len`` and CRC made right again."""
    body = bytearray(body)
    body[8:16] = (len(body) + 4).to_bytes(8, "little")
    return bytes(body) + reference_reader.crc32c(bytes(body)).to_bytes(4, "little")


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_layout_vector_decodes_with_its_templates_to_its_stored_tensors_bit_for_bit(name):
    frame, tensors = load(name)
    meta = MANIFEST[name]
    templates, _ = templates_of(name)
    f = read_frame(frame, templates=templates)
    assert (f.round, f.sender, f.bundle) == (meta["round"], meta["sender"], meta["bundle"])
    assert [e.name for e in f.entries] == list(meta["records"])
    out = gradwire.decode_bundle(f)
    for rec in meta["records"]:
        want = tensors[f"decoded/{rec}"]
        assert out[rec].dtype == want.dtype and out[rec].shape == want.shape
        assert torch.equal(out[rec], want), rec


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_layout_vector_writes_back_to_its_own_bytes(name):
    frame, _ = load(name)
    templates, _ = templates_of(name)
    f = read_frame(frame, templates=templates)
    assert write_frame(f.entries, round=f.round, sender=f.sender, bundle=True, templates=templates) == frame
    plain = write_frame(f.entries, round=f.round, sender=f.sender, bundle=True)
    assert len(plain) > len(frame)  # the same records written whole


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_encoding_the_stored_input_with_the_templates_reproduces_the_layout_vector(name):
    frame, tensors = load(name)
    meta = MANIFEST[name]
    assert meta["stable"]
    templates, _ = templates_of(name)
    entries = [build(r).compress(tensors[f"input/{rec}"], rec)[0] for rec, r in meta["records"].items()]
    again = write_frame(entries, round=meta["round"], sender=meta["sender"], bundle=True, templates=templates)
    assert_same_frame(again, frame, exact=False, templates=templates)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_independent_reader_reads_the_layout_vector_with_its_templates(name):
    frame, tensors = load(name)
    meta = MANIFEST[name]
    templates, listed = templates_of(name)
    parsed = reference_reader.parse(frame, templates=listed)
    assert (parsed["round"], parsed["sender"], parsed["bundle"], parsed["layout"]) == (
        meta["round"],
        meta["sender"],
        True,
        True,
    )
    assert [e["name"] for e in parsed["entries"]] == list(meta["records"])
    # All three forms of a record occur: full where no template has the name, compact with the
    # template's params where they are the record's, compact with its own params where they are not.
    by_name = {t["name"]: t for t in listed}
    for e, form in zip(parsed["entries"], parsed["forms"]):
        t = by_name.get(e["name"])
        assert form == ("full" if t is None else "compact" if e["params"].hex() == t["params"] else "compact_params")
    assert set(parsed["forms"]) == {"full", "compact", "compact_params"}
    # A compact record reads as the very structure the same record written whole reads as.
    f = read_frame(frame, templates=templates)
    plain = reference_reader.parse(write_frame(f.entries, round=f.round, sender=f.sender, bundle=True))
    assert parsed["entries"] == plain["entries"]
    for e in parsed["entries"]:
        want = tensors[f"decoded/{e['name']}"].double().reshape(-1).tolist()
        assert list(e["shape"]) == list(tensors[f"decoded/{e['name']}"].shape)
        assert reference_reader.decode_entry(e, exact=True) == want, e["name"]  # bit for bit
        got = reference_reader.decode_entry(e)  # the plain inverse transform, as for any record
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-4), (e["name"], a, b)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_a_reader_without_the_templates_refuses_the_layout_vector(name):
    frame, _ = load(name)
    with pytest.raises(FrameError) as err:
        read_frame(frame)
    assert err.value.kind == "reserved_flags"
    with pytest.raises(FrameError) as err:
        gradwire.decode_bundle(frame)
    assert err.value.kind == "reserved_flags"
    with pytest.raises(ValueError, match="reserved flags"):
        reference_reader.parse(frame)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_both_readers_reject_a_broken_layout_vector_by_the_same_rule(name):
    frame, _ = load(name)
    templates, listed = templates_of(name)
    parsed = reference_reader.parse(frame, templates=listed)

    def both(kind, match, data=frame, mine=templates, theirs=listed):
        with pytest.raises(FrameError) as err:
            read_frame(data, templates=mine)
        assert err.value.kind == kind
        with pytest.raises(ValueError, match=match):
            reference_reader.parse(data, templates=theirs)

    # A compact record of a template the reader does not hold: the frame's highest index, dropped.
    both("unknown_template", "unknown template", mine=templates[:-1], theirs=listed[:-1])
    both("unknown_template", "unknown template", mine=[], theirs=[])
    # A compact record whose template's name is a full record's: names are unique across both.
    full = parsed["entries"][parsed["forms"].index("full")]["name"]
    compact = parsed["entries"][parsed["forms"].index("compact")]["name"]
    i = [t["name"] for t in listed].index(compact)
    renamed = [dict(t, name=full) if j == i else t for j, t in enumerate(listed)]
    both("duplicate_name", "duplicate name", mine=layout_templates(renamed), theirs=renamed)
    # A section of an odd number of bytes whose template says u16.
    t, odd = next(
        (t, n)
        for e in parsed["entries"]
        for t in listed
        if t["name"] == e["name"]
        for n, elem in t["sections"]
        if elem == 0 and len(e["sections"][n]) % 2
    )
    wide = [dict(u, sections=[[n, 2 if n == odd else el] for n, el in u["sections"]]) if u is t else u for u in listed]
    both("section_length", "whole elements", mine=layout_templates(wide), theirs=wide)
    # The first record's tag (one byte) written with a trailing zero group, or as a 65-bit number.
    assert frame[32] < 0x80
    longer = reframed(frame[:32] + bytes([frame[32] | 0x80, 0x00]) + frame[33:-4])
    both("invalid_varint", "not minimal", data=longer)
    too_wide = reframed(frame[:32] + b"\x80" * 9 + b"\x02" + frame[33:-4])
    both("invalid_varint", "longer than 64 bits", data=too_wide)


def test_independent_reader_reads_leb128_as_section_12_says():
    def leb(data: bytes) -> int:
        r = reference_reader.Reader(data)
        value = r.leb128()
        assert r.pos == len(data)
        return value

    assert leb(b"\x00") == 0 and leb(b"\x7f") == 127 and leb(b"\x80\x01") == 128 and leb(b"\xe5\x8e\x26") == 624485
    assert leb(b"\xff" * 9 + b"\x01") == 2**64 - 1
    for bad, match in [
        (b"\x80\x00", "not minimal"),
        (b"\xff\x80\x00", "not minimal"),
        (b"\xff" * 9 + b"\x02", "longer than 64 bits"),
        (b"\x80" * 10 + b"\x01", "longer than 64 bits"),
        (b"\x80", "past the end"),
    ]:
        with pytest.raises(ValueError, match=match):
            leb(bad)
