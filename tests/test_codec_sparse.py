"""gradwire.TopK (id 7) and gradwire.RandomK (id 8): sparsification with sorted, delta-coded positions
or positions regenerated from a seed; their sparse accumulator and norm."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

import gradwire
from gradwire import ErrorFeedback, FrameError, RandomK, TopK, wire
from gradwire.accumulate import DenseAccumulator, entry_norm, make_accumulator
from gradwire.codecs.sparse import SparseAccumulator, global_topk_bundle, mix64, random_k_indices, resolve_k
from gradwire.frame import read_frame, write_frame

CUDA = torch.cuda.is_available()


def _rand(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


CODECS = [
    TopK(k=10),
    TopK(density=0.1),
    TopK(density=0.3, value_dtype=torch.float16),
    TopK(k=7, value_dtype=torch.bfloat16),
    RandomK(k=10),
    RandomK(density=0.2, unbiased=False),
    RandomK(density=0.1, value_dtype=torch.bfloat16),
]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("shape", [(1000,), (64, 33), (3, 4, 5), (), (1,), (0, 3)], ids=str)
def test_frame_decodes_to_the_reconstruction_compress_reports(codec, shape):
    x = _rand(shape, seed=1)
    entry, recon = codec.compress(x, "w")
    out = gradwire.decode(write_frame([entry]))
    assert out.shape == x.shape and out.dtype == x.dtype and torch.equal(out, recon)


def test_k_and_density_resolve_per_tensor():
    assert [resolve_k(n, 10, None) for n in (0, 3, 10, 100)] == [0, 3, 10, 10]
    assert [resolve_k(n, None, 0.01) for n in (0, 1, 100, 150, 1000)] == [0, 1, 1, 2, 10]
    with pytest.raises(ValueError):
        TopK()
    with pytest.raises(ValueError):
        TopK(k=3, density=0.5)
    for bad in (dict(k=0), dict(density=0.0), dict(density=1.5)):
        with pytest.raises(ValueError):
            RandomK(**bad)
    with pytest.raises(ValueError):
        TopK(k=1, scope="layer")
    with pytest.raises(ValueError):
        TopK(k=1, value_dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# Top-k


def test_topk_keeps_the_k_largest_magnitudes_exactly():
    x = _rand((50, 40), seed=2)
    entry, recon = TopK(k=100).compress(x)
    kept = recon != 0
    assert int(kept.sum()) == 100
    assert torch.equal(recon[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


def test_topk_positions_are_sorted_gaps_at_the_minimal_width():
    x = torch.zeros(1000)
    pos = [3, 4, 100, 101, 999]
    x[pos] = torch.tensor([5.0, -4.0, 3.0, 2.0, -6.0])
    entry, recon = TopK(k=5).compress(x)
    coding, width, k = struct.unpack("<BBQ", entry.params)
    gaps = [3, 0, 95, 0, 897]
    assert (coding, width, k) == (0, 10, 5)  # 897 needs 10 bits
    assert entry.sections["idx"].tobytes() == wire.pack_bits(np.array(gaps, np.uint32), 10)
    assert entry.sections["val"].tolist() == [5.0, -4.0, 3.0, 2.0, -6.0]
    assert torch.equal(recon, x)


def test_topk_wire_cost_is_small_at_one_percent():
    x = _rand((100_000,), seed=3)
    entry, _ = TopK(density=0.01).compress(x)
    _, width, k = struct.unpack("<BBQ", entry.params)
    assert k == 1000 and width <= 12
    assert entry.nbytes() == 10 + math.ceil(1000 * width / 8) + 4000


def test_global_topk_spends_k_where_the_magnitudes_are():
    tensors = {"small": _rand((500,), seed=4) * 0.01, "big": _rand((300,), seed=5), "tiny": torch.zeros(10)}
    out = TopK(k=50, scope="global").compress_bundle(tensors)
    ks = {n: struct.unpack("<BBQ", e.params)[2] for n, (e, _) in out.items()}
    assert ks == {"small": 0, "big": 50, "tiny": 0}
    allv = torch.cat([t.reshape(-1) for t in tensors.values()])
    thresh = allv.abs().topk(50).values.min()
    for n, t in tensors.items():
        kept = out[n][1] != 0
        assert torch.equal(out[n][1][kept], t[kept]) and bool((t[kept].abs() >= thresh).all())
    frame = global_topk_bundle(tensors, k=50)
    dec = gradwire.decode_bundle(frame)
    assert all(torch.equal(dec[n], out[n][1]) for n in tensors)
    # Per-tensor scope gives every tensor its own k.
    per = TopK(k=50).compress_bundle(tensors)
    assert [struct.unpack("<BBQ", e.params)[2] for e, _ in per.values()] == [50, 50, 10]


def test_global_topk_bundle_with_density_over_the_total():
    tensors = {"a": _rand((100,), seed=6), "b": _rand((300,), seed=7)}
    dec = gradwire.decode_bundle(global_topk_bundle(tensors, density=0.1))
    assert sum(int((t != 0).sum()) for t in dec.values()) == 40


def test_topk_with_error_feedback_sends_everything_eventually():
    shape = (40, 25)
    ef = ErrorFeedback(TopK(density=0.05))
    sum_in, sum_fb = torch.zeros(shape), torch.zeros(shape)
    gaps = []
    for t in range(100):
        g = _rand(shape, seed=100 + t) * 0.1 + 0.05
        sum_in += g
        sum_fb += gradwire.decode(ef.encode(g, "w", round=t))
        gaps.append((sum_fb - sum_in).norm().item())
    assert gaps[-1] == pytest.approx(ef.residual("w").norm().item(), rel=1e-3)
    assert max(gaps[60:]) < 1.3 * max(gaps[20:60])
    assert gaps[-1] < 0.2 * sum_in.norm()


# ---------------------------------------------------------------------------------------------
# Random-k


def _mix64_reference(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def test_mix64_on_int64_lanes_matches_unsigned_reference_arithmetic():
    z = np.array([0, 1, 2, 12345, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15], dtype=np.uint64)
    got = mix64(torch.from_numpy(z.view(np.int64))).numpy().view(np.uint64)
    assert np.array_equal(got, _mix64_reference(z))
    # splitmix64's first output for state 0 advanced once: a published constant.
    assert int(_mix64_reference(np.array([0x9E3779B97F4A7C15], np.uint64))[0]) == 0xE220A8397B1DCDAF


def test_random_k_indices_are_the_k_smallest_unsigned_keys():
    seed, n, k = 0xDEADBEEFCAFEF00D, 500, 37
    keys = _mix64_reference(np.arange(n, dtype=np.uint64) ^ np.uint64(seed))
    expect = np.sort(np.argsort(keys, kind="stable")[:k])
    assert random_k_indices(seed, n, k).tolist() == expect.tolist()


def test_random_k_regenerates_identical_positions_from_the_frame_alone():
    x = _rand((2000,), seed=8)
    codec = RandomK(k=100, seed=42, unbiased=False)
    frame = codec.encode(x)
    seed, k, scaled = struct.unpack("<QQB", read_frame(frame).entries[0].params)
    idx = random_k_indices(seed, 2000, 100)
    out = gradwire.decode(frame)
    assert (k, scaled) == (100, 0)
    assert torch.equal(out.nonzero().reshape(-1), idx)
    assert torch.equal(out[idx], x[idx])


def test_random_k_seeds_advance_per_call_and_repeat_per_codec_seed():
    x = _rand((1000,), seed=9)
    a, b, c = RandomK(k=20, seed=1), RandomK(k=20, seed=1), RandomK(k=20, seed=2)
    sets_a = [gradwire.decode(a.encode(x)).nonzero().reshape(-1).tolist() for _ in range(3)]
    sets_b = [gradwire.decode(b.encode(x)).nonzero().reshape(-1).tolist() for _ in range(3)]
    sets_c = [gradwire.decode(c.encode(x)).nonzero().reshape(-1).tolist() for _ in range(3)]
    assert sets_a == sets_b  # same seed, same call order: peers agree
    assert len({tuple(s) for s in sets_a}) == 3  # fresh coordinates each step
    assert sets_a[0] != sets_c[0]


def test_random_k_positions_are_uniform():
    n, k, trials = 100, 10, 2000
    counts = torch.zeros(n)
    codec = RandomK(k=k, seed=3)
    for _ in range(trials):
        counts[random_k_indices(codec.next_seed(), n, k)] += 1
    expect = trials * k / n  # 200 per position
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    # 99 degrees of freedom (slightly fewer: k per trial are without replacement); p = 1e-4 is ~150.
    assert chi2 < 150
    assert counts.min() > 0.6 * expect and counts.max() < 1.4 * expect


def test_scaled_random_k_is_unbiased():
    x = _rand((64,), seed=10)
    codec = RandomK(k=8, seed=4)  # unbiased: values times 64 / 8
    trials = 1500
    total = torch.zeros(64)
    for _ in range(trials):
        total += codec.compress(x)[1]
    mean = total / trials
    # Per coordinate the estimate has variance x_i^2 (n/k - 1); its mean over trials has standard error
    # |x_i| sqrt(7 / 1500) ~ 0.07 |x_i|. Five standard errors everywhere:
    se = x.abs() * math.sqrt(7 / trials)
    assert bool(((mean - x).abs() <= 5 * se + 1e-6).all())
    # ... while without scaling the mean is x * k / n.
    plain = RandomK(k=8, seed=4, unbiased=False)
    total = torch.zeros(64)
    for _ in range(trials):
        total += plain.compress(x)[1]
    torch.testing.assert_close(total / trials, x / 8, atol=0.05, rtol=0.2)


# ---------------------------------------------------------------------------------------------
# Sparse sums


@pytest.mark.parametrize("codec", [TopK(k=30), RandomK(k=30), TopK(k=30, value_dtype=torch.bfloat16)], ids=repr)
def test_sparse_accumulator_equals_dense_decoding(codec):
    entries = [codec.compress(_rand((20, 10), seed=20 + i), "w")[0] for i in range(5)]
    entries = [read_frame(write_frame([e])).entries[0] for e in entries]
    acc = make_accumulator(entries[0])
    dense = DenseAccumulator((20, 10))
    assert isinstance(acc, SparseAccumulator)
    for i, e in enumerate(entries):
        acc.add(e, weight=0.5 + i)
        dense.add(e, weight=0.5 + i)
    # A dense record of the same tensor is accepted too.
    extra = gradwire.IdentityCodec().compress(_rand((20, 10), seed=30), "w")[0]
    acc.add(extra)
    dense.add(extra)
    torch.testing.assert_close(acc.finish(), dense.finish(), atol=1e-6, rtol=1e-6)
    assert acc.finish().shape == (20, 10)


@pytest.mark.parametrize("codec", [TopK(k=30), RandomK(k=30, value_dtype=torch.float16)], ids=repr)
def test_norm_reads_the_values_alone(codec):
    entry, recon = codec.compress(_rand((20, 10), seed=11))
    assert entry_norm(entry) == pytest.approx(recon.norm().item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Hostile records


def _topk(params=None, **sections):
    e = TopK(k=5).compress(_rand((40,), seed=12), "w")[0]
    e.sections = {**e.sections, **sections}
    if params is not None:
        e.params = params
    return e


def _randk(params=None, **sections):
    e = RandomK(k=5).compress(_rand((40,), seed=13), "w")[0]
    e.sections = {**e.sections, **sections}
    if params is not None:
        e.params = params
    return e


def _topk_gaps(gaps, width=6):
    return _topk(
        params=struct.pack("<BBQ", 0, width, len(gaps)),
        idx=np.frombuffer(wire.pack_bits(np.array(gaps, np.uint32), width), np.uint8),
        val=np.ones(len(gaps), np.float32),
    )


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: _topk(params=b"\x00"), "params must be 10 bytes"),
        (lambda: _topk(params=struct.pack("<BBQ", 1, 6, 5)), "index_coding must be 0"),
        (lambda: _topk(params=struct.pack("<BBQ", 0, 0, 5)), "gap width\\) must lie"),
        (lambda: _topk(params=struct.pack("<BBQ", 0, 33, 5)), "gap width\\) must lie"),
        (lambda: _topk(params=struct.pack("<BBQ", 0, 6, 41)), "k must be <= numel"),
        (lambda: _topk(params=struct.pack("<BBQ", 0, 6, 2**63)), "k must be <= numel"),
        (lambda: _topk(params=struct.pack("<BBQ", 0, 7, 5)), "ceil\\(k \\* index_param / 8\\)"),
        (lambda: _topk_gaps([10, 10, 10, 10]), "positions must be < numel"),  # 10, 21, 32, 43
        (lambda: _topk_gaps([45], width=6), "gap of 45"),
        (lambda: _topk(val=np.ones(4, np.float32)), "'val' must hold k"),
        (lambda: _topk(val=np.ones(5, np.float64)), "element type"),
        (lambda: _topk(val=np.array([1, 2, np.inf, 4, 5], np.float32)), "finite"),
        (lambda: _topk(params=struct.pack("<BBQ", 0, 5, 5), idx=np.array([0, 0, 0, 0x80], np.uint8)), "padding"),
        (lambda: _randk(params=struct.pack("<QQB", 1, 41, 1)), "k must be <= numel"),
        (lambda: _randk(params=struct.pack("<QQB", 1, 5, 2)), "scaled must be 0 or 1"),
        (lambda: _randk(params=b""), "params must be 17 bytes"),
        (lambda: _randk(val=np.ones(6, np.float32)), "'val' must hold k"),
        (lambda: _randk(idx=np.ones(6, np.uint8)), "unexpected section"),
    ],
)
def test_malformed_records_raise_frame_errors_naming_the_rule(make, rule):
    frame = write_frame([make()])
    with pytest.raises(FrameError, match=rule):
        gradwire.decode(frame)


def test_sparse_accumulator_checks_records_too():
    acc = SparseAccumulator((40,))
    with pytest.raises(FrameError, match="positions must be < numel"):
        acc.add(read_frame(write_frame([_topk_gaps([10, 10, 10, 10])])).entries[0])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("codec_fn", [lambda: TopK(k=50), lambda: RandomK(k=50, seed=5)])
def test_cuda_matches_cpu(codec_fn):
    x = _rand((300, 17), seed=14)
    entry_c, recon_c = codec_fn().compress(x.cuda())
    entry, recon = codec_fn().compress(x)
    assert recon_c.device.type == "cuda"
    assert entry.params == entry_c.params
    assert torch.equal(gradwire.decode(write_frame([entry_c]), device="cuda"), recon_c)
    assert torch.equal(recon_c.cpu(), recon)
    # Random-k positions regenerate identically on the GPU and the CPU.
    seed = 0x1234
    assert torch.equal(random_k_indices(seed, 10_000, 77, "cuda").cpu(), random_k_indices(seed, 10_000, 77))
