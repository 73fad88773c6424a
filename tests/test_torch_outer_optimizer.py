"""SparseLoCo's pluggable outer optimizer (gradwire.torch.outer): any torch optimizer over the anchor, every
replica bit-identical on gloo ranks, a checkpoint that resumes bit-identically, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwire.torch as gt
from distributed_toys import all_ranks_equal, checkpoint_roundtrip, flat_parameters, shard
from test_torch_sharded_exchange import PIECE, _net, _train, interrupted_run

NESTEROV = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)


def _adam(ps):
    return torch.optim.Adam(ps, lr=3e-3)


def _make(model: nn.Module, outer, **kw):
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    if outer == "own":
        return gt.SparseLoCo(model.parameters(), inner, sync_every=2, piece_numel=PIECE, **NESTEROV, **kw)
    return gt.SparseLoCo(model.parameters(), inner, sync_every=2, piece_numel=PIECE, outer_optimizer=outer, **kw)


def _run(rank: int, world: int, outer_name: str) -> dict:
    outer = {"sgd": _sgd, "adam": _adam}[outer_name]
    x, y = shard(rank)
    run = interrupted_run(lambda m: _make(m, outer), x, y, lambda o: checkpoint_roundtrip(o.state_dict()))
    whole, resumed, saved = run.whole, run.resumed, run.saved
    own = _net()
    _train(_make(own, "own"), own, x, y, 6)
    start = flat_parameters(_net())
    return dict(
        identical=all_ranks_equal(flat_parameters(whole)),
        moved=not torch.equal(flat_parameters(whole), start),
        resumed=torch.equal(flat_parameters(whole), flat_parameters(resumed)),
        # torch's SGD (Nesterov) is gradwire's own outer step up to rounding (its add takes the lr as alpha)
        close_to_own=float((flat_parameters(whole) - flat_parameters(own)).abs().max()),
        state=sorted(saved["gradwire"]["outer"]),
    )


@pytest.mark.parametrize("outer", ["sgd", "adam"])
def test_any_torch_outer_optimizer_keeps_replicas_bit_identical_and_resumes(outer):
    for r in gt.spawn(_run, 2, (outer,), timeout_s=90):
        assert r["identical"] and r["moved"] and r["resumed"], r
        assert r["state"] == ["torch_optimizer"]
        if outer == "sgd":
            assert r["close_to_own"] < 1e-5, r


def test_outer_optimizer_refusals():
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="either outer_optimizer or outer_lr"):
        gt.SparseLoCo(model.parameters(), inner, outer_optimizer=_sgd, outer_lr=0.7)
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        gt.SparseLoCo(model.parameters(), inner, outer_optimizer=lambda ps: None)
    with pytest.raises(ValueError, match="over exactly the tensors it is given"):
        gt.SparseLoCo(model.parameters(), inner, outer_optimizer=lambda ps: torch.optim.SGD(model.parameters(), lr=1))
    # A checkpoint of one kind of outer step does not resume into the other.
    x, y = shard(0)
    own = _make(model, "own")
    _train(own, model, x, y, 2)
    with pytest.raises(ValueError, match="gradwire's own OuterStep, not a torch optimizer"):
        _make(_net(), _sgd).load_state_dict(checkpoint_roundtrip(own.state_dict()))
    torch_outer = _make(model, _sgd)
    _train(torch_outer, model, x, y, 2)
    with pytest.raises(ValueError, match="outer step is a torch optimizer"):
        _make(_net(), "own").load_state_dict(checkpoint_roundtrip(torch_outer.state_dict()))
