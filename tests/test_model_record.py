"""Whole-model records (FORMAT.md section 9): a model's update as one record named by its spec's hash."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradwire
from gradwire import (
    DCTCodec,
    Entry,
    ErrorFeedback,
    FrameError,
    IdentityCodec,
    ModelSpec,
    TopK,
    decode_entry,
    decode_model,
    encode_model,
    is_model_record,
    read_frame,
    write_frame,
)
from gradwire.errors import PYTHON_KINDS


def tensors(seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 16, generator=g).to(dtype),
        "block.0.weight": torch.randn(16, 16, generator=g).to(dtype),
        "block.0.bias": torch.randn(16, generator=g).to(dtype),
        "scale": torch.randn((), generator=g).to(dtype),
        "head.weight": torch.randn(7, 16, generator=g).to(dtype),
    }


def synthetic_model(n: int, total: int = 400_000, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` tensors of ``total`` elements in all, alternating matrices and vectors of uneven sizes."""
    g = torch.Generator().manual_seed(seed)
    sizes = [total // n] * n
    sizes[-1] += total - sum(sizes)
    out = {}
    for i, s in enumerate(sizes):
        shape = (s // 8, 8) if i % 2 == 0 and s % 8 == 0 else (s,)
        out[f"layers.{i}.{'weight' if len(shape) == 2 else 'bias'}"] = torch.randn(shape, generator=g)
    return out


CODECS = {
    "identity": lambda: IdentityCodec(),
    "identity_f16": lambda: IdentityCodec(wire_dtype=torch.float16),
    "dct_flat_rice": lambda: DCTCodec(chunk_shape=(64, 64), topk=16, index_coding="rice", value_bits=2),
    "dct_flat_fixed": lambda: DCTCodec(chunk_shape=(16, 16), topk=8),
    "topk": lambda: TopK(density=0.05),
}


def kind_of(fn) -> str:
    with pytest.raises(FrameError) as info:
        fn()
    return info.value.kind


# -- the spec ----------------------------------------------------------------------------------------


def test_spec_bytes_follow_the_format_byte_for_byte():
    spec = ModelSpec([("a.w", torch.float32, (2, 3)), ("é", torch.bfloat16, ()), ("b", torch.float16, (0, 4))])
    want = (
        struct.pack("<I", 3)
        + struct.pack("<H", 3)
        + b"a.w"
        + bytes([10, 2])
        + struct.pack("<2Q", 2, 3)
        + struct.pack("<H", 2)
        + "é".encode()
        + bytes([9, 0])
        + struct.pack("<H", 1)
        + b"b"
        + bytes([8, 2])
        + struct.pack("<2Q", 0, 4)
    )
    assert spec.encode() == want
    assert spec.hash == hashlib.blake2b(want, digest_size=16).hexdigest()
    assert spec.record_name == "@model:" + spec.hash and len(spec.hash) == 32
    assert spec.numel == 6 + 1 + 0 and spec.names == ["a.w", "é", "b"]
    assert spec.offsets() == {"a.w": (0, 6), "é": (6, 7), "b": (7, 7)}
    assert ModelSpec.from_bytes(spec.encode()) == spec


def test_spec_from_a_module_follows_named_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    model[1].weight.requires_grad_(False)
    spec = ModelSpec.from_module(model)
    assert spec.names == [n for n, _ in model.named_parameters()]
    assert spec.shapes == [tuple(p.shape) for _, p in model.named_parameters()]
    assert "1.weight" not in ModelSpec.from_module(model, trainable_only=True).names
    assert spec == ModelSpec.from_tensors(dict(model.named_parameters()))


@pytest.mark.parametrize(
    "items, match",
    [
        ([], "at least one"),
        ([("@model:x", torch.float32, (2,))], "reserved"),
        ([("", torch.float32, (2,))], "non-empty"),
        ([("a", torch.float32, (2,)), ("a", torch.float32, (2,))], "twice"),
        ([("a", torch.int64, (2,))], "floating"),
        ([("a", torch.float32, (1,) * 9)], "dims"),
        ([("a", torch.float32, (-1,))], "dims"),
        ([("x" * 1025, torch.float32, (2,))], "longer"),
    ],
)
def test_a_bad_spec_is_refused(items, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec(items)


def test_spec_bytes_are_checked_when_read():
    good = ModelSpec([("a", torch.float32, (2, 3))]).encode()
    for bad in (
        good[:-1],
        good + b"\0",
        struct.pack("<I", 0),
        good[:6] + b"\xff" + good[7:],
        good[:7] + bytes([3]) + good[8:],
        good[:8] + bytes([9]) + good[9:],
    ):
        with pytest.raises(ValueError):
            ModelSpec.from_bytes(bad)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
            st.lists(st.integers(0, 5), max_size=3),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 2**31),
)
def test_flatten_then_unflatten_gives_the_tensors_back(layout, seed):
    g = torch.Generator().manual_seed(seed)
    named = {f"t{i}": torch.randn(shape, generator=g).to(dtype) for i, (dtype, shape) in enumerate(layout)}
    spec = ModelSpec.from_tensors(named)
    assert ModelSpec.from_bytes(spec.encode()) == spec
    flat = spec.flatten(dict(reversed(list(named.items()))))  # the mapping's order does not matter
    assert flat.dtype == torch.float32 and flat.shape == (spec.numel,)
    back = spec.unflatten(flat)
    assert list(back) == spec.names
    for name, t in named.items():
        assert back[name].shape == t.shape
        assert torch.equal(back[name], t.float())
    # in order, row-major, nothing between
    assert torch.equal(flat, torch.cat([t.reshape(-1).float() for t in named.values()]))


def test_flatten_refuses_tensors_that_are_not_the_specs():
    named = tensors()
    spec = ModelSpec.from_tensors(named)
    missing = dict(named)
    missing.pop("scale")
    extra = dict(named, more=torch.zeros(2))
    reshaped = dict(named, **{"block.0.weight": named["block.0.weight"].t().reshape(16, 16).reshape(8, 32)})
    retyped = dict(named, scale=named["scale"].double())
    for bad, match in (
        (missing, "missing"),
        (extra, "not in the spec"),
        (reshaped, "spec says"),
        (retyped, "spec says"),
    ):
        with pytest.raises(ValueError, match=match):
            spec.flatten(bad)
    with pytest.raises(ValueError, match="1-D tensor"):
        spec.unflatten(torch.zeros(spec.numel + 1))


# -- round trips -------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_round_trip_is_the_records_decode_sliced(codec):
    named = tensors(1)
    spec = ModelSpec.from_tensors(named)
    frame = encode_model(CODECS[codec](), named, spec, round=5, sender=2)
    f = read_frame(frame)
    assert (f.round, f.sender, f.bundle, len(f.entries)) == (5, 2, True, 1)
    entry = f.entries[0]
    assert entry.name == spec.record_name and is_model_record(entry)
    assert entry.shape == (spec.numel,) and entry.dtype == torch.float32
    whole = decode_entry(entry)
    out = decode_model(frame, spec)
    assert list(out) == spec.names
    for name, (a, b) in spec.offsets().items():
        assert out[name].shape == named[name].shape
        assert torch.equal(out[name].reshape(-1), whole[a:b])  # bit for bit: no arithmetic
    # the tensors are views of one decoded vector
    assert len({t.untyped_storage().data_ptr() for t in out.values()}) == 1
    if codec == "identity":
        for name, t in named.items():
            assert torch.equal(out[name], t)


def test_decode_model_accepts_a_parsed_frame_and_a_device():
    named = tensors(2)
    spec = ModelSpec.from_tensors(named)
    frame = encode_model(IdentityCodec(), named, spec)
    out = decode_model(read_frame(frame), spec, device="cpu")
    assert all(torch.equal(out[n], named[n]) for n in named)


def test_low_precision_model_travels_as_float32():
    named = tensors(3, dtype=torch.bfloat16)
    spec = ModelSpec.from_tensors(named)
    out = decode_model(encode_model(IdentityCodec(), named, spec), spec)
    for name, t in named.items():
        assert out[name].dtype == torch.float32 and torch.equal(out[name], t.float())


def test_error_feedback_keeps_one_residual_for_the_model():
    spec = ModelSpec.from_tensors(tensors())
    ef = ErrorFeedback(DCTCodec(chunk_shape=(16, 16), topk=4, index_coding="rice", value_bits=4))
    sent_sum = torch.zeros(spec.numel)
    in_sum = torch.zeros(spec.numel)
    for step in range(4):
        named = tensors(10 + step)
        frame = encode_model(ef, named, spec, round=step)
        out = decode_model(frame, spec)
        sent_sum += spec.flatten(out)
        in_sum += spec.flatten(named)
    assert ef.names() == [spec.record_name]
    assert ef.residual(spec.record_name).shape == (spec.numel,)
    # nothing lost, only delayed: what was sent plus what waits is what came in
    torch.testing.assert_close(sent_sum + ef.residual(spec.record_name), in_sum, rtol=0, atol=1e-4)


# -- size --------------------------------------------------------------------------------------------


def test_model_frame_size_does_not_grow_with_the_tensor_count():
    fixed = DCTCodec(chunk_shape=(64, 64), topk=16, value_bits=1)
    rice = DCTCodec(chunk_shape=(64, 64), topk=16, value_bits=1, index_coding="rice")
    model_fixed, model_rice, bundle = {}, {}, {}
    for n in (6, 30, 100):
        named = synthetic_model(n)
        spec = ModelSpec.from_tensors(named)
        assert spec.numel == 400_000
        model_fixed[n] = len(encode_model(fixed, named, spec))
        model_rice[n] = len(encode_model(rice, named, spec))
        bundle[n] = len(rice.encode_bundle(named))
        assert model_rice[n] < bundle[n]
    # fixed-width positions: the same bytes whatever the count; Rice: within the data's few bytes
    assert len(set(model_fixed.values())) == 1, model_fixed
    assert max(model_rice.values()) - min(model_rice.values()) <= 32, model_rice
    # per-tensor records cost at least their ~100-byte headers each
    assert (bundle[30] - bundle[6]) / 24 > 100 and (bundle[100] - bundle[30]) / 70 > 100, bundle
    assert 400_000 * 4 / model_rice[30] > 450  # one record: about 530x, where 30 records reach 230x


# -- what a receiver rejects ---------------------------------------------------------------------------


def test_the_model_record_kinds_are_python_kinds():
    # test_error_kinds checks that every Python kind is documented in FORMAT.md section 7.1
    assert {"model_spec_mismatch", "invalid_model_record"} <= set(PYTHON_KINDS)


@pytest.mark.parametrize("change", ["rename", "reshape_same_numel", "reshape", "reorder", "retype", "drop"])
def test_a_receiver_with_another_spec_rejects_the_frame(change):
    named = tensors()
    sender = ModelSpec.from_tensors(named)
    frame = encode_model(IdentityCodec(), named, sender)
    items = list(sender.tensors)
    if change == "rename":
        items[1] = ("block.0.weight_renamed", *items[1][1:])
    elif change == "reshape_same_numel":
        items[1] = (items[1][0], items[1][1], (8, 32))
    elif change == "reshape":
        items[0] = (items[0][0], items[0][1], (51, 16))
    elif change == "reorder":
        items[1], items[2] = items[2], items[1]
    elif change == "retype":
        items[3] = (items[3][0], torch.bfloat16, items[3][2])
    else:
        items.pop()
    receiver = ModelSpec(items)
    assert receiver.hash != sender.hash
    with pytest.raises(FrameError, match="model spec") as info:
        decode_model(frame, receiver)
    assert info.value.kind == "model_spec_mismatch"
    assert type(info.value) is PYTHON_KINDS["model_spec_mismatch"]


def model_entry(spec: ModelSpec, *, numel=None, name=None, dtype=torch.float32) -> Entry:
    n = spec.numel if numel is None else numel
    return Entry(
        name=spec.record_name if name is None else name,
        codec=0,
        dtype=dtype,
        shape=(n,),
        sections={"data": np.zeros(n, dtype=np.float32)},
    )


def test_hostile_model_frames_are_rejected():
    spec = ModelSpec.from_tensors(tensors())
    other = Entry(
        name="head.weight", codec=0, dtype=torch.float32, shape=(2,), sections={"data": np.zeros(2, dtype=np.float32)}
    )
    cases = {
        "wrong length": write_frame([model_entry(spec, numel=spec.numel - 1)], bundle=True),
        "longer": write_frame([model_entry(spec, numel=spec.numel + 1)], bundle=True),
        "f64 record": write_frame([model_entry(spec, dtype=torch.float64)], bundle=True),
        "extra record": write_frame([model_entry(spec), other], bundle=True),
        "extra record first": write_frame([other, model_entry(spec)], bundle=True),
        "no record": write_frame([], bundle=True),
        "tensor frame": write_frame([model_entry(spec)]),
        "per-tensor bundle": IdentityCodec().encode_bundle(tensors()),
        "upper-case hash": write_frame(
            [model_entry(spec, name=spec.record_name.upper().replace("@MODEL", "@model"))], bundle=True
        ),
        "short hash": write_frame([model_entry(spec, name=spec.record_name[:-1])], bundle=True),
    }
    for what, frame in cases.items():
        assert kind_of(lambda frame=frame: decode_model(frame, spec)) == "invalid_model_record", what
    # a record of the right name and length whose codec rules are broken: the codec's own error
    bad = model_entry(spec)
    bad.sections["data"] = np.zeros(spec.numel - 1, dtype=np.float32)
    assert kind_of(lambda: decode_model(write_frame([bad], bundle=True), spec)) == "invalid_record"
    # and the frame's own rules come first
    good = encode_model(IdentityCodec(), tensors(), spec)
    assert kind_of(lambda: decode_model(good[:-1], spec)) == "frame_truncated"


def test_is_model_record_reads_the_name_only():
    spec = ModelSpec.from_tensors(tensors())
    assert is_model_record(model_entry(spec))
    assert not is_model_record(model_entry(spec, name="@model:"))
    assert not is_model_record(model_entry(spec, name="embed.weight"))


def test_public_names():
    for name in ("ModelSpec", "encode_model", "decode_model", "is_model_record"):
        assert name in gradwire.__all__ and getattr(gradwire, name) is not None
