"""Transform-domain accumulation and norms of DCT records (gradwire.accumulate + gradwire.dct)."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire.accumulate import DenseAccumulator, entry_norm, make_accumulator
from gradwire.dct import DCTAccumulator, parse_record


def _records(codec, shape, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [codec.compress(torch.randn(shape, generator=g) * (i + 1), "w")[0] for i in range(n)]


def _dense_sum(entries, weights):
    total = torch.zeros(entries[0].shape)
    for e, w in zip(entries, weights):
        total += gradwire.decode_entry(e).to(torch.float32) * w
    return total


@pytest.mark.parametrize(
    "codec,shape",
    [
        (gradwire.DCTCodec(chunk_shape=(16, 16), topk=12), (48, 80)),  # flat, padded (3840 % 256 != 0)
        (gradwire.DCTCodec(chunk_shape=(64,), topk=5), (1000,)),  # flat 1-D with padding
        (gradwire.DCTCodec(mode="tiles", topk=9), (96, 40)),  # DeMo tiles
    ],
)
def test_domain_sum_equals_sum_of_dense_decodes(codec, shape):
    entries = _records(codec, shape, 6)
    weights = [1.0, 0.5, 2.0, 1.0, 0.25, 1.5]
    acc = make_accumulator(entries[0])
    assert isinstance(acc, DCTAccumulator)
    for e, w in zip(entries, weights):
        acc.add(e, w)
    got = acc.finish()
    assert got.shape == shape and got.dtype == torch.float32
    want = _dense_sum(entries, weights)
    # the sum runs one float32 inverse; each record's own decode is exact on a 2^-s integer basis
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    assert got.abs().sum() > 0


def test_one_inverse_transform_per_sum(monkeypatch):
    from gradwire.dct import domain

    codec = gradwire.DCTCodec(chunk_shape=(8, 8), topk=4)
    entries = _records(codec, (32, 32), 10, seed=3)
    calls = []
    real = domain.idct_chunks
    # A spy on the real transform: counts calls, computes as usual. DCTAccumulator.finish calls
    # ``idct_chunks`` as gradwire.dct.domain imported it, so the spy goes there.
    monkeypatch.setattr(domain, "idct_chunks", lambda x: calls.append(1) or real(x))
    acc = make_accumulator(entries[0])
    for e in entries:
        acc.add(e)
    acc.finish()
    assert len(calls) == 1


@pytest.mark.parametrize("mode,shape", [("flat", (64, 64)), ("tiles", (50, 30)), ("flat", (4096,))])
def test_norm_equals_dense_norm_without_padding(mode, shape):
    codec = gradwire.DCTCodec(chunk_shape=(64,), topk=7, mode=mode)
    for e in _records(codec, shape, 3, seed=5):
        dense = gradwire.decode_entry(e).to(torch.float64).norm().item()
        assert entry_norm(e) == pytest.approx(dense, rel=1e-5)


def test_norm_bounds_dense_norm_with_padding():
    codec = gradwire.DCTCodec(chunk_shape=(64,), topk=16)
    e = _records(codec, (100,), 1, seed=2)[0]  # 100 elements in chunks of 64: 28 padded zeros
    dense = gradwire.decode_entry(e).to(torch.float64).norm().item()
    assert entry_norm(e) >= dense * (1 - 1e-6)


def test_mixed_params_fall_back_to_a_dense_side_sum():
    shape = (40, 50)
    a = _records(gradwire.DCTCodec(chunk_shape=(8, 8), topk=6), shape, 3, seed=1)
    b = _records(gradwire.DCTCodec(chunk_shape=(10, 10), topk=3), shape, 2, seed=2)
    c = _records(gradwire.DCTCodec(mode="tiles", topk=4), shape, 1, seed=3)
    d = [gradwire.IdentityCodec().compress(torch.randn(shape), "w")[0]]
    entries = [a[0], b[0], a[1], c[0], d[0], b[1], a[2]]
    weights = [1.0, 2.0, -1.0, 0.5, 1.0, 3.0, 1.0]
    acc = make_accumulator(entries[0])
    for e, w in zip(entries, weights):
        acc.add(e, w)
    torch.testing.assert_close(acc.finish(), _dense_sum(entries, weights), rtol=1e-3, atol=1e-3)


def test_same_order_is_bit_identical():
    codec = gradwire.DCTCodec(chunk_shape=(16, 16), topk=20)
    entries = _records(codec, (128, 96), 8, seed=7)

    def run():
        acc = make_accumulator(entries[0])
        for i, e in enumerate(entries):
            acc.add(e, 1.0 / (1 + i))
        return acc.finish()

    first, second = run(), run()
    assert torch.equal(first, second)


def test_summed_coefficients_are_the_elementwise_float32_sum_of_each_records_weighted_values():
    # The CPU sum adds each record's coefficients in one Rust pass: coeffs[p] + value · weight, one
    # rounded float32 multiply and add per coefficient, in record order.
    codec = gradwire.DCTCodec(chunk_shape=(16, 16), topk=20)
    entries = _records(codec, (128, 96), 5, seed=3)
    weights = [1.0, 1.0 / 3.0, 0.7, 2.5, 1e-3]
    acc = make_accumulator(entries[0])
    want = None
    for e, w in zip(entries, weights):
        acc.add(e, w)
        parsed = parse_record(e)
        if want is None:
            want = torch.zeros(parsed.plan.num_chunks, parsed.plan.chunk_numel)
        w32 = torch.tensor(w, dtype=torch.float32)
        rows = torch.arange(parsed.plan.num_chunks).unsqueeze(1).expand_as(parsed.idx)
        want[rows, parsed.idx] = want[rows, parsed.idx] + parsed.values * w32
    assert torch.equal(acc.coeffs.view(torch.int32), want.reshape(-1).view(torch.int32))


def test_shape_mismatch_is_refused():
    codec = gradwire.DCTCodec(chunk_shape=(8,), topk=2)
    acc = make_accumulator(_records(codec, (64,), 1)[0])
    with pytest.raises(ValueError, match="shape"):
        acc.add(_records(codec, (65,), 1)[0])


def test_hostile_record_raises_frame_error_before_touching_the_sum():
    codec = gradwire.DCTCodec(chunk_shape=(8,), topk=2)
    good, bad = _records(codec, (64,), 2)
    bad.sections["scale"] = bad.sections["scale"].copy()
    bad.sections["scale"][0] = float("nan")
    acc = make_accumulator(good)
    acc.add(good)
    before = acc.coeffs.clone()
    with pytest.raises(gradwire.FrameError, match="scales must be finite"):
        acc.add(bad)
    assert torch.equal(acc.coeffs, before)
    with pytest.raises(gradwire.FrameError):
        entry_norm(bad)


def test_parse_record_is_what_the_decoder_uses():
    codec = gradwire.DCTCodec(chunk_shape=(8, 8), topk=5)
    e = _records(codec, (24, 24), 1)[0]
    rec = parse_record(e)
    assert rec.idx.shape == rec.values.shape == (rec.plan.num_chunks, 5)
    assert rec.idx.dtype == torch.int64 and rec.values.dtype == torch.float32
    assert bool((rec.idx[:, 1:] > rec.idx[:, :-1]).all())


def test_dense_accumulator_matches_for_other_codecs():
    entries = [gradwire.IdentityCodec().compress(torch.randn(7, 3), "w")[0] for _ in range(3)]
    acc = make_accumulator(entries[0])
    assert isinstance(acc, DenseAccumulator)
    for e in entries:
        acc.add(e, 2.0)
    torch.testing.assert_close(acc.finish(), _dense_sum(entries, [2.0] * 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sum_matches_cpu_and_is_deterministic():
    codec = gradwire.DCTCodec(chunk_shape=(32, 32), topk=16)
    entries = _records(codec, (256, 256), 5)

    def run(device):
        acc = make_accumulator(entries[0], torch.device(device))
        for e in entries:
            acc.add(e)
        return acc.finish()

    a, b = run("cuda"), run("cuda")
    assert a.device.type == "cuda" and torch.equal(a, b)
    torch.testing.assert_close(a.cpu(), run("cpu"), rtol=1e-4, atol=1e-5)
