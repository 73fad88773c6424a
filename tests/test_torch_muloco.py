"""gradwire.torch.MuLoCo is the README's headline recipe under one name: the same weights, bit for bit, as
SparseLoCo built by hand around MuonAdamW with one bit both ways, 11 local steps per sync and no error decay;
on two gloo ranks the replicas agree and each local step costs over 200× fewer bytes than fp32 (303× on the
byte LM; the per-column means cost more on this test's 64- and 256-row matrices)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwire
import gradwire.torch as gt

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="MuonAdamW needs torch.optim.Muon")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 64), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 32))


def _train(model: nn.Module, opt, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 32, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), (x + 1) % 32).backward()
        opt.step()


def test_muloco_is_the_headline_recipe_bit_for_bit():
    named, by_hand = _model(), _model()
    opt = gt.MuLoCo(named, lr=0.02)
    head = by_hand[-1]
    inner = gt.MuonAdamW(*gt.muon_split(by_hand, exclude=[head]), lr=0.02)
    ref = gt.SparseLoCo(
        by_hand.parameters(),
        inner,
        sync_every=11,
        codec=gradwire.OneBit(),
        downlink_codec=gradwire.OneBit(),
        error_decay=1.0,
    )
    assert isinstance(opt, gt.SparseLoCo) and isinstance(opt.inner, gt.MuonAdamW)
    assert (opt.sync_every, opt.node.error_decay, opt.exchange) == (11, 1.0, "sharded")
    assert isinstance(opt.codec, gradwire.OneBit) and isinstance(opt.downlink_codec, gradwire.OneBit)
    # Muon takes the two hidden matrices; the embedding, the head and the biases go to AdamW.
    assert [tuple(p.shape) for g in opt.inner.muon.param_groups for p in g["params"]] == [(256, 64), (256, 256)]
    _train(named, opt, 22)
    _train(by_hand, ref, 22)
    assert opt.syncs == ref.syncs == 2
    for a, b in zip(named.parameters(), by_hand.parameters()):
        assert torch.equal(a, b)


def test_muloco_takes_muon_splits_pair_and_refuses_a_bare_parameter_list():
    model = _model()
    opt = gt.MuLoCo(gt.muon_split(model, exclude=[]), lr=0.02)
    assert len(opt.inner.muon.param_groups[0]["params"]) == 3  # the head too: nothing excluded
    with pytest.raises(TypeError, match=r"MuLoCo takes the model itself .* got generator"):
        gt.MuLoCo(model.parameters(), lr=0.02)
    with pytest.raises(TypeError, match=r"H= is sync_every="):
        gt.MuLoCo(model, lr=0.02, H=11)


def _two_ranks(rank: int, world: int) -> dict:
    model = _model()
    opt = gt.MuLoCo(model, lr=0.02)
    _train(model, opt, 22, seed=rank + 1)
    fp32 = 4 * sum(p.numel() for p in model.parameters()) * opt.local_steps
    return {"agree": gt.replicas_agree(model), "ratio": fp32 / opt.bytes_sent, "syncs": opt.syncs}


def test_muloco_on_two_gloo_ranks_agrees_at_over_200x():
    for r in gt.spawn(_two_ranks, 2):
        assert r["agree"] and r["syncs"] == 2, r
        assert 220 < r["ratio"] < 352, r  # 1 bit per element per 11 steps is 352× before the column means
