"""gradwire.torch.MuonAdamW / muon_split: Muon on the hidden matrices and AdamW on the rest as one optimizer,
alone and as SparseLoCo's inner optimizer (one bit both ways on real gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwire
import gradwire.torch as gt
from distributed_toys import CLASSES, IN, all_ranks_equal, checkpoint_roundtrip, flat_parameters, shard

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")


class Tiny(nn.Module):
    """An embedding, two hidden matrices with biases, a norm and a head: every kind muon_split sorts."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, IN)
        self.body = nn.Linear(IN, 24)
        self.mid = nn.Linear(24, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.embed.weight[:1]
        return self.head(self.norm(torch.relu(self.mid(torch.relu(self.body(h))))))


def _model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def test_muon_split_gives_muon_the_hidden_matrices_and_adamw_the_rest():
    m = _model()
    matrices, others = muon_split_ids(m, exclude=[m.head])
    assert matrices == {id(m.body.weight), id(m.mid.weight)}
    assert others == {id(p) for p in m.parameters()} - matrices
    # without exclude the head's matrix goes to Muon too; the embedding never does
    matrices, _ = muon_split_ids(m)
    assert matrices == {id(m.body.weight), id(m.mid.weight), id(m.head.weight)}
    # a convolution kernel (4-D) is not a matrix: AdamW takes it
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    matrices, others = muon_split_ids(conv)
    assert matrices == {id(conv[2].weight)} and id(conv[0].weight) in others


def muon_split_ids(model, exclude=()):
    matrices, others = gt.muon_split(model, exclude=exclude)
    return {id(p) for p in matrices}, {id(p) for p in others}


def test_muon_split_lists_a_tied_weight_once_with_adamw():
    m = _model()
    tied = nn.Linear(IN, 10, bias=False)
    tied.weight = m.embed.weight  # an output layer tied to the embedding, as in GPT-2
    m.tied = tied
    matrices, others = gt.muon_split(m)
    ids = [id(p) for p in matrices + others]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))
    assert id(m.embed.weight) in {id(p) for p in others}


def test_muon_split_and_muon_adamw_name_what_is_wrong():
    m = _model()
    with pytest.raises(ValueError, match="not a submodule"):
        gt.muon_split(m, exclude=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="no weight matrix"):
        gt.muon_split(nn.Sequential(nn.Embedding(4, 4), nn.LayerNorm(4)))
    with pytest.raises(ValueError, match=r"2-D matrices; got a parameter of shape \(24,\)"):
        gt.MuonAdamW([m.body.weight, m.body.bias], [], lr=0.01)
    with pytest.raises(ValueError, match="both"):
        gt.MuonAdamW([m.body.weight], [m.body.weight], lr=0.01)
    opt = gt.MuonAdamW([m.body.weight], [m.body.bias], lr=0.01)
    with pytest.raises(ValueError, match="build a new MuonAdamW"):
        opt.add_param_group({"params": [m.mid.weight]})


def _steps(opts, model, steps, lrs=None):
    x, y = shard(0)
    for t in range(steps):
        for o in opts:
            o.zero_grad()
        _loss(model, x, y).backward()
        if lrs is not None:
            for o in opts:
                for g in o.param_groups:
                    g["lr"] = lrs[t]
        for o in opts:
            o.step()


def test_muon_adamw_steps_exactly_as_torch_muon_and_adamw_side_by_side():
    a, b = _model(), _model()
    ma, oa = gt.muon_split(a, exclude=[a.head])
    joined = gt.MuonAdamW(ma, oa, lr=0.02, weight_decay=0.01)
    mb, ob = gt.muon_split(b, exclude=[b.head])
    apart = [
        torch.optim.Muon(mb, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(ob, lr=0.02, weight_decay=0.01),
    ]
    _steps([joined], a, 7)
    _steps(apart, b, 7)
    assert torch.equal(flat_parameters(a), flat_parameters(b))
    assert set(joined.state) == {p for p in a.parameters()}  # both optimizers' state, through one mapping
    x, y = shard(0)

    def closure():
        joined.zero_grad()
        loss = _loss(a, x, y)
        loss.backward()
        return loss

    before = flat_parameters(a)
    assert torch.is_tensor(joined.step(closure)) and not torch.equal(before, flat_parameters(a))


def test_an_lr_scheduler_sets_the_lr_of_both_halves():
    m = _model()
    opt = gt.MuonAdamW(*gt.muon_split(m, exclude=[m.head]), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5**t)
    x, y = shard(0)
    for _ in range(3):
        opt.zero_grad()
        _loss(m, x, y).backward()
        opt.step()
        sched.step()
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert opt.adamw.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def _train(steps, factory, state=None, model_state=None):
    m = _model()
    if model_state is not None:
        m.load_state_dict(model_state)
    opt = factory(m)
    if state is not None:
        opt.load_state_dict(state)
    _steps([opt], m, steps)
    return m, opt


@pytest.mark.parametrize("which", ["alone", "sparseloco"])
def test_state_dict_restart_continues_bit_identically(which):
    def factory(m):
        inner = gt.MuonAdamW(*gt.muon_split(m, exclude=[m.head]), lr=0.02)
        if which == "alone":
            return inner
        return gt.SparseLoCo(m.parameters(), inner, sync_every=3, codec=gradwire.OneBit(), error_decay=1.0)

    whole, _ = _train(10, factory)
    first, opt_first = _train(4, factory)
    resumed, opt_resumed = _train(6, factory, checkpoint_roundtrip(opt_first.state_dict()), first.state_dict())
    assert torch.equal(flat_parameters(whole), flat_parameters(resumed))
    # the groups a scheduler writes to are the ones the halves step with, after a load too
    inner = opt_resumed if which == "alone" else opt_resumed.inner
    assert inner.param_groups[0] is inner.muon.param_groups[0]
    if which == "sparseloco":
        assert opt_resumed.param_groups is inner.param_groups


def _muloco_run(rank: int, world: int, steps: int, sync_every: int, exchange: str) -> dict:
    model = _model()
    inner = gt.MuonAdamW(*gt.muon_split(model, exclude=[model.head]), lr=0.02)
    # sharded: the owners re-encode their slices' exact mean at one bit (all_gather has no downlink codec)
    down = dict(downlink_codec=gradwire.OneBit()) if exchange == "sharded" else {}
    opt = gt.SparseLoCo(
        model.parameters(),
        inner,
        sync_every=sync_every,
        codec=gradwire.OneBit(),
        error_decay=1.0,
        exchange=exchange,
        **down,
    )
    x, y = shard(rank)
    losses, identical = [], True
    for t in range(1, steps + 1):
        loss = _loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if t % sync_every == 0:
            identical &= all_ranks_equal(flat_parameters(model))
    return dict(losses=losses, identical=identical, sent=opt.bytes_sent, received=opt.bytes_received)


@pytest.mark.parametrize("exchange", ["sharded", "all_gather"])
def test_muloco_one_bit_both_ways_keeps_replicas_bit_identical_and_learns(exchange):
    results = gt.spawn(_muloco_run, 2, (24, 4, exchange))
    for r in results:
        assert r["identical"], "parameters differ between ranks after a sync"
        assert sum(r["losses"][-4:]) / 4 < 0.7 * r["losses"][0], r["losses"]
        assert r["sent"] > 0 and r["received"] > 0
