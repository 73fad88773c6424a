"""DeMo with ``overlap=True``: each bucket's momentum step, encode and exchange start during the backward
pass, and the step applies exactly what the step without overlap applies, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradwire.torch as gt
from distributed_toys import all_ranks_equal, flat_parameters, shard
from gradwire.frame import FRAME_HEADER_BYTES
from gradwire.state import state_hash
from gradwire.torch.overlap import GradientBuckets, cut_buckets
from test_torch_sharded_exchange import PIECE, _net

EMPTY_BUNDLE_BYTES = FRAME_HEADER_BYTES + 4  # header and CRC-32C trailer


def _demo(model, overlap: bool, **kw):
    return gt.DeMo(model.parameters(), lr=0.005, beta=0.9, overlap=overlap, **kw)


def _overlap_run(rank: int, world: int, exchange: str) -> dict:
    x, y = shard(rank)
    kw = dict(exchange=exchange, piece_numel=PIECE)
    plain, over = _net(), _net()
    opt_plain = _demo(plain, False, **kw)
    opt_over = _demo(over, True, bucket_numel=2000, **kw)  # the toy model in 3 buckets
    started_in_backward = []
    for _ in range(4):
        for model, opt in ((plain, opt_plain), (over, opt_over)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if opt is opt_over:  # every bucket was handed to the worker by the hooks, before the step
                started_in_backward.append(len(opt._buckets._started))
            opt.step()
    return dict(
        same=torch.equal(flat_parameters(plain), flat_parameters(over)),
        identical=all_ranks_equal(flat_parameters(over)),
        buckets=len(opt_over._buckets.buckets),
        started=started_in_backward,
        sent=(opt_plain.bytes_sent, opt_over.bytes_sent),
    )


@pytest.mark.parametrize("exchange", ["sharded", "all_gather"])
def test_overlapped_steps_apply_the_bits_of_the_steps_without_overlap_on_two_gloo_ranks(exchange):
    for r in gt.spawn(_overlap_run, 2, (exchange,), timeout_s=90):
        assert r["same"] and r["identical"]
        assert r["buckets"] == 3 and r["started"] == [3] * 4
        # The same records; each bucket travels in frames of its own (exchanged while the backward pass runs),
        # so the bytes differ by the extra frames' header and trailer alone: at most one per phase and bucket.
        extra = r["sent"][1] - r["sent"][0]
        phases = 2 if exchange == "sharded" else 1
        assert 0 <= extra <= 4 * (r["buckets"] - 1) * phases * EMPTY_BUNDLE_BYTES


def _accumulation_run(rank: int, world: int) -> dict:
    x, y = shard(rank)
    halves = [(x[:128], y[:128]), (x[128:], y[128:])]
    plain, over = _net(), _net()
    opt_plain, opt_over = _demo(plain, False), _demo(over, True, bucket_numel=2000)
    for _ in range(3):
        for model, opt in ((plain, opt_plain), (over, opt_over)):
            opt.zero_grad()
            with opt.no_sync():  # the earlier micro-batch only accumulates, with or without overlap
                nn.functional.cross_entropy(model(halves[0][0]), halves[0][1]).backward()
            nn.functional.cross_entropy(model(halves[1][0]), halves[1][1]).backward()
            opt.step()
    out = dict(same=torch.equal(flat_parameters(plain), flat_parameters(over)))
    # A second backward pass outside no_sync is refused at the step, naming a parameter and the remedy.
    opt_over.zero_grad()
    for half in halves:
        nn.functional.cross_entropy(over(half[0]), half[1]).backward()
    try:
        opt_over.step()
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    dist.barrier()
    return out


def test_gradient_accumulation_runs_its_earlier_passes_in_no_sync_and_a_stray_pass_is_refused():
    for r in gt.spawn(_accumulation_run, 2, (), timeout_s=90):
        assert r["same"]
        assert "was accumulated again after its bucket had been encoded" in r["refused"]
        assert "optimizer.no_sync()" in r["refused"]


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4)  # never in the graph: its hooks never fire

    def forward(self, x):
        return self.used(x)


def test_parameters_that_get_no_gradient_are_encoded_at_the_step_as_without_overlap():
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    hashes = []
    for overlap in (False, True):
        torch.manual_seed(1)
        model = _WithUnused()
        opt = gt.DeMo(model.parameters(), lr=0.01, overlap=overlap, bucket_numel=40)
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        hashes.append(state_hash(model.state_dict()))
    assert hashes[0] == hashes[1]


def test_overlap_refuses_at_construction_what_it_cannot_encode_by_bucket():
    model = _net()
    with pytest.raises(ValueError, match="model_record=True sends the whole model as one record"):
        _demo(model, True, model_record=True)
    with pytest.raises(ValueError, match="bucket_numel must be >= 1"):
        _demo(model, True, bucket_numel=0)


def test_buckets_follow_the_backward_order_and_never_mix_param_groups():
    def p(n):
        return torch.zeros(n)

    g1, g2 = {}, {}
    params = [("a", p(10), g1), ("b", p(10), g1), ("c", p(30), g1), ("d", p(5), g2), ("e", p(5), g2)]
    # Reversed: e, d (group 2), then c, b, a (group 1) in buckets of at least 25 elements.
    assert cut_buckets(params, 25) == [[4, 3], [2], [1, 0]]
    assert cut_buckets(params, 1000) == [[4, 3], [2, 1, 0]]
    assert cut_buckets(params, 1) == [[4], [3], [2], [1], [0]]


def _under_ddp_run(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = shard(rank)
    weights = []
    for overlap in (False, True):
        model = _net()
        ddp = DDP(model, bucket_cap_mb=0.01)
        ddp.register_comm_hook(None, gt.local_gradients_hook)  # each rank keeps its own gradient
        opt = _demo(model, overlap, piece_numel=PIECE, **({"bucket_numel": 2000} if overlap else {}))
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        weights.append(flat_parameters(model))
    return dict(same=torch.equal(*weights), identical=all_ranks_equal(weights[1]))


def test_overlap_under_ddp_with_the_local_gradients_hook_applies_the_same_bits():
    for r in gt.spawn(_under_ddp_run, 2, (), timeout_s=90):
        assert r["same"] and r["identical"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_overlap_on_a_side_stream_trains_as_the_step_without_overlap():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5)).cuda()
    y = torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(6)).cuda()
    weights = []
    for overlap in (False, True):
        model = _net().cuda()
        opt = _demo(model, overlap, **({"bucket_numel": 2000} if overlap else {}))
        for _ in range(4):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        weights.append(flat_parameters(model))
    # On a GPU the forward transform's last bits follow the batch's size (DCTCodec.compress_batched), so a
    # bucket's records may keep another coefficient at a tie than the whole step's: nearly every weight
    # is the same, none far off (a DeMo step moves a weight by lr at most).
    same = (weights[0] == weights[1]).float().mean().item()
    assert same > 0.99 and (weights[0] - weights[1]).abs().max().item() <= 4 * 4 * 0.005 + 1e-6


class _WaitForExchange(torch.autograd.Function):
    """Identity; its backward notes whether the first bucket's exchange was launched before it ran, and if so
    waits for it (at most 20 s) and notes whether its bytes were counted: the buckets behind it in the
    backward pass must be exchanged while the backward pass still runs."""

    @staticmethod
    def forward(ctx, x, opt, before, seen):
        ctx.opt, ctx.before, ctx.seen = opt, before, seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        launched = ctx.opt._buckets._exchanges.get(0)
        if launched is not None:
            launched.result(timeout=20)
        ctx.seen.append(launched is not None and ctx.opt.bytes_sent > ctx.before)
        return grad, None, None, None


def _exchange_in_backward_run(rank: int, world: int, exchange: str) -> dict:
    from distributed_toys import CLASSES, IN

    x, y = shard(rank)
    torch.manual_seed(0)
    first, rest = nn.Linear(IN, 64), nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    params = list(first.parameters()) + list(rest.parameters())
    opt = gt.DeMo(params, lr=0.005, overlap=True, bucket_numel=1000, exchange=exchange, piece_numel=PIECE)
    seen: list[bool] = []
    for _ in range(3):
        opt.zero_grad()
        h = _WaitForExchange.apply(first(x), opt, opt.bytes_sent, seen)
        nn.functional.cross_entropy(rest(h), y).backward()
        opt.step()
    return dict(
        seen=seen,
        buckets=len(opt._buckets.buckets),
        identical=all_ranks_equal(torch.cat([p.detach().reshape(-1) for p in params])),
    )


@pytest.mark.parametrize("exchange", ["sharded", "all_gather"])
def test_the_later_layers_are_exchanged_while_the_backward_pass_still_runs(exchange):
    """The backward pass stops at the first layer until the buckets behind it have crossed to the other rank:
    with the exchange left to the step nothing is launched by then, and it notes False."""
    for r in gt.spawn(_exchange_in_backward_run, 2, (exchange,), timeout_s=120):
        assert r["buckets"] == 2  # the last two layers, then the first
        assert r["seen"] == [True, True, True]
        assert r["identical"]


def test_exchanges_run_in_bucket_order_and_stop_after_a_failed_one():
    params = [(n, torch.zeros(4, requires_grad=True), None) for n in "abc"]
    order: list[int] = []

    def exchange(indices, records):
        b = buckets.buckets.index(indices)
        order.append(b)
        if records == ["boom"]:
            raise ValueError("bucket refused")
        return b

    buckets = GradientBuckets(params, lambda idx: [params[idx[0]][0]], bucket_numel=1, exchange=exchange)
    try:
        assert buckets.buckets == [[2], [1], [0]]
        buckets._grad_ready(0)  # the last bucket is ready first: its exchange waits for buckets 0 and 1
        buckets._grad_ready(1)
        assert order == [] or order == [0]
        buckets._grad_ready(2)
        assert buckets.collect() == [0, 1, 2] and order == [0, 1, 2]
        # A failed exchange: the buckets after it are not exchanged (no collective of theirs starts).
        order.clear()
        buckets._encode = lambda idx: ["boom"] if idx == [1] else ["fine"]
        with pytest.raises(ValueError, match="bucket refused"):
            buckets.collect()
        assert order == [0, 1]
        # The next step starts afresh: every bucket is exchanged again.
        order.clear()
        buckets._encode = lambda idx: ["fine"]
        assert buckets.collect() == [0, 1, 2] and order == [0, 1, 2]
    finally:
        buckets.close()
