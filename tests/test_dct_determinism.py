"""DCT decoding gives the same bits whatever the thread count: nodes that apply the same frames agree."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire import dct as D
from gradwire.accumulate import make_accumulator


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _dense_reference(idx, values, plan):
    dense = torch.zeros(plan.num_chunks, plan.chunk_numel, dtype=values.dtype)
    dense.scatter_(1, idx, values)
    return D.from_chunks(D.idct_chunks(dense.reshape(plan.num_chunks, *plan.chunk_shape)), plan)


@pytest.mark.parametrize("chunk, k", [((64, 64), 32), ((8, 8), 16), ((16,), 5), ((4, 4, 4), 7), ((8, 8), 60)])
def test_decode_chunks_matches_the_matrix_inverse(chunk, k):
    plan = D.plan_flat((3000,), chunk)
    g = torch.Generator().manual_seed(0)
    coeffs = torch.randn(plan.num_chunks, plan.chunk_numel, generator=g)
    idx, vals = D.select_topk(coeffs, k)
    torch.testing.assert_close(D.decode_chunks(idx, vals, plan), _dense_reference(idx, vals, plan), rtol=1e-5, atol=1e-6)


def test_exact_inverse_matches_the_matrix_inverse():
    x = torch.randn(7, 16, 12, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(D.idct_chunks_exact(x), D.idct_chunks(x), rtol=1e-5, atol=1e-6)


def test_decoding_a_frame_is_bit_identical_across_thread_counts(restore_threads):
    g = torch.Generator().manual_seed(2)
    tensors = {"w": torch.randn(300, 257, generator=g), "b": torch.randn(40, generator=g)}
    frame = gradwire.DCTCodec(topk=32).encode_bundle(tensors)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(gradwire.decode_bundle(frame))
    for name in tensors:
        assert torch.equal(results[0][name], results[1][name])


def test_domain_sum_is_bit_identical_across_thread_counts(restore_threads):
    g = torch.Generator().manual_seed(3)
    codec = gradwire.DCTCodec(topk=16)
    entries = [gradwire.read_frame(codec.encode(torch.randn(200, 130, generator=g))).entries[0] for _ in range(4)]
    sums = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        acc = make_accumulator(entries[0])
        for e in entries:
            acc.add(e)
        sums.append(acc.finish())
    assert torch.equal(sums[0], sums[1])
