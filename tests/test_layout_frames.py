"""Layout frames (docs/FORMAT.md section 12) through gradwire's Python API and the sharded exchange: records
of a layout both sides hold travel as their payloads, read back to the very records, and a reader without
the writer's templates (or with other ones) is refused with a named error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import gradwire.torch as gt
from gradwire.algorithms import default_demo_codec, default_sparseloco_downlink
from gradwire.algorithms.demo import demo_codec_params
from gradwire.dct import DCTCodec
from gradwire.errors import FrameError
from gradwire.frame import ELEM_F32, RecordTemplate, decode_entry, read_frame, write_frame
from gradwire.state import state_hash
from gradwire.wire import crc32c

SHAPES = {"embed": (512, 256), "mid.weight": (384, 256), "mid.bias": (384,), "head.weight": (16, 384)}


def _records(codec, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [codec.compress(torch.randn(s, generator=g), name=n)[0] for n, s in SHAPES.items()]


def _templates(codec):
    return [codec.record_template(n, s) for n, s in SHAPES.items()]


def _same_record(a, b) -> None:
    assert (a.name, a.codec, a.dtype, tuple(a.shape), bytes(a.params)) == (
        b.name,
        b.codec,
        b.dtype,
        tuple(b.shape),
        bytes(b.params),
    )
    assert list(a.sections) == list(b.sections)
    for n in a.sections:
        assert a.sections[n].dtype == b.sections[n].dtype and a.sections[n].tobytes() == b.sections[n].tobytes()


@pytest.mark.parametrize("codec", [default_demo_codec(), default_sparseloco_downlink(), DCTCodec(topk=16)])
def test_records_of_their_templates_travel_as_payloads_and_read_back_unchanged(codec):
    records, templates = _records(codec), _templates(codec)
    full = write_frame(records, round=3, sender=1, bundle=True)
    compact = write_frame(records, round=3, sender=1, bundle=True, templates=templates)
    got = read_frame(compact, templates=templates)
    assert (got.round, got.sender, got.bundle) == (3, 1, True)
    for a, b in zip(got.entries, records):
        _same_record(a, b)
        assert torch.equal(decode_entry(a), decode_entry(b))
    # A full record's headers (name, shape, params, section names and lengths): 100 to 140 bytes here;
    # a compact one's tag and lengths: under 10.
    saved = (len(full) - len(compact)) / len(records)
    assert saved > 90, (len(full), len(compact))


def test_a_record_whose_params_differ_from_its_template_carries_its_own():
    codec = default_demo_codec()
    records, templates = _records(codec), _templates(codec)
    other = DCTCodec(**{**demo_codec_params(), "topk": 9}).record_template("embed", SHAPES["embed"])
    assert other.params != templates[0].params
    templates[0] = other
    same = write_frame(records, bundle=True, templates=_templates(codec))
    own = write_frame(records, bundle=True, templates=templates)
    # its params and their length are the extra bytes: still no name, shape or section names
    assert len(own) - len(same) == len(records[0].params) + 1
    got = read_frame(own, templates=templates)
    _same_record(got.entries[0], records[0])


def test_a_record_that_matches_no_template_goes_whole_beside_compact_ones():
    codec = default_demo_codec()
    records, templates = _records(codec), _templates(codec)
    wrong_shape = dataclasses.replace(templates[1], shape=(64, 256))
    no_template = templates[2:]  # "embed" has none
    for tpl in ([templates[0], wrong_shape, *templates[2:]], no_template):
        data = write_frame(records, bundle=True, templates=tpl)
        for a, b in zip(read_frame(data, templates=tpl).entries, records):
            _same_record(a, b)
    # a template with other sections (names or element types) does not match either
    other_sections = dataclasses.replace(templates[0], sections=(("idx", ELEM_F32),) + templates[0].sections[1:])
    data = write_frame(records[:1], bundle=True, templates=[other_sections])
    assert len(data) == len(write_frame(records[:1], bundle=True, templates=[]))


def test_a_reader_without_the_writers_templates_is_refused_by_name():
    codec = default_demo_codec()
    records, templates = _records(codec), _templates(codec)
    data = write_frame(records, bundle=True, templates=templates)
    with pytest.raises(FrameError) as plain:
        read_frame(data)
    assert plain.value.kind == "reserved_flags"
    with pytest.raises(FrameError) as fewer:
        read_frame(data, templates=templates[:2])
    assert fewer.value.kind == "unknown_template"
    # a plain bundle still reads with templates given: it has none of the layout frame's records
    plain_bundle = write_frame(records, bundle=True)
    for a, b in zip(read_frame(plain_bundle, templates=templates).entries, records):
        _same_record(a, b)


def test_templates_must_name_distinct_records_and_a_layout_frame_is_a_bundle():
    codec = default_demo_codec()
    records, templates = _records(codec), _templates(codec)
    with pytest.raises(ValueError, match="'embed' is 2 templates' name"):
        write_frame(records, bundle=True, templates=[templates[0], templates[0]])
    with pytest.raises(ValueError, match="'embed' is 2 templates' name"):
        read_frame(write_frame(records, bundle=True), templates=[templates[0], templates[0]])
    with pytest.raises(ValueError, match="bundle=True"):
        write_frame(records[:1], templates=templates)


def test_the_dct_codec_predicts_its_records_params_where_they_are_data_free():
    # Packed positions: the params are the plan's, exactly.
    fixed = DCTCodec(chunk_shape=(64, 64), topk=22, mode="tiles")
    g = torch.Generator().manual_seed(0)
    for n, s in SHAPES.items():
        for _ in range(3):
            entry, _ = fixed.compress(torch.randn(s, generator=g), name=n)
            tpl = fixed.record_template(n, s)
            assert isinstance(tpl, RecordTemplate) and tpl.params == entry.params
            # its codec, dtype, shape and sections' names and elements are the record's: it goes compact
            compact = write_frame([entry], bundle=True, templates=[tpl])
            assert len(compact) < len(write_frame([entry], bundle=True)) - 90
    # Rice (DeMo's "auto"): the estimate is the search's start and stays on a tie, so random positions
    # mostly keep it (measured: every weight's record over 5 seeds).
    demo = default_demo_codec()
    hits = 0
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        for n in ("embed", "mid.weight"):
            entry, _ = demo.compress(torch.randn(SHAPES[n], generator=g), name=n)
            hits += demo.record_template(n, SHAPES[n]).params == entry.params
    assert hits >= 8


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_damaged_layout_frame_is_a_frame_error_never_a_crash(data):
    codec = default_demo_codec()
    records, templates = _records(codec), _templates(codec)
    frame = bytearray(write_frame(records, bundle=True, templates=templates))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(32, len(frame) - 5))  # past the header, before the CRC
        frame[at] = data.draw(st.integers(0, 255))
    frame[-4:] = np.uint32(crc32c(bytes(frame[:-4]))).tobytes()  # a valid CRC: the records are what is tried
    try:
        got = read_frame(bytes(frame), templates=templates)
    except FrameError:
        return
    for e in got.entries:  # what parses is well-formed records; decoding checks them as hostile input too
        try:
            decode_entry(e)
        except (FrameError, ValueError):
            pass


# -- the sharded exchange -----------------------------------------------------------------------------------


class _FullRecordsDCT(DCTCodec):
    """DeMo's codec, its records never compact: the plain bundles the sharded exchange sent before."""

    def record_template(self, name, shape, dtype=torch.float32):
        return None


def _demo_run(rank: int, world: int, compact: bool, mixed: bool = False) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    full = _FullRecordsDCT(**demo_codec_params())
    codec = None if compact and not (mixed and rank == 1) else full
    kw = {} if codec is None else {"codec": codec, "downlink_codec": _FullRecordsDCT(**demo_codec_params())}
    opt = gt.DeMo(model.parameters(), lr=0.01, piece_numel=4096, **kw)
    g = torch.Generator().manual_seed(rank + 1)
    err = None
    try:
        for _ in range(3):
            x = torch.randn(16, 32, generator=g)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    except (FrameError, ValueError) as e:
        err = str(e)
    dist.barrier()
    return {"sent": opt.bytes_sent, "received": opt.bytes_received, "hash": state_hash(model.state_dict()), "err": err}


def test_the_sharded_exchange_sends_layout_frames_and_the_replicas_are_the_same_bits():
    compact = gt.spawn(_demo_run, 3, (True,), timeout_s=120)
    full = gt.spawn(_demo_run, 3, (False,), timeout_s=120)
    assert not any(r["err"] for r in compact + full)
    # the same payloads, so the same means and the same weights, bit for bit, on every rank of both runs
    assert len({r["hash"] for r in compact + full}) == 1
    # 10 pieces; each rank's records go out compact in phase 1 and its owned means in phase 2
    for c, f in zip(compact, full):
        assert c["sent"] < 0.8 * f["sent"] and c["received"] < 0.8 * f["received"], (c, f)


def test_ranks_whose_codecs_write_other_headers_are_refused_before_any_exchange():
    got = gt.spawn(_demo_run, 2, (True, True), timeout_s=120)
    assert all(r["err"] and "write other records" in r["err"] for r in got), got
