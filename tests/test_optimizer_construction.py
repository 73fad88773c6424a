"""The DeMo and SparseLoCo optimizers refuse at construction what their step would refuse later: a codec
given by name is built from the registry (an unknown name or another type is refused at once), and
add_param_group after construction says what is refused and what to do instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwire
import gradwire.torch as gt


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _make(which: str, model: nn.Module, **kw):
    if which == "demo":
        return gt.DeMo(model.parameters(), lr=1e-3, **kw)
    return gt.SparseLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-3), sync_every=1, **kw)


def _one_step(opt, model: nn.Module) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("which", ["demo", "sparseloco"])
def test_a_codec_given_by_name_is_built_from_the_registry_and_steps(which):
    model = _model()
    opt = _make(which, model, codec="dct", downlink_codec="dct")
    assert isinstance(opt.codec, gradwire.DCTCodec)
    before = [p.detach().clone() for p in model.parameters()]
    _one_step(opt, model)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("which", ["demo", "sparseloco"])
def test_an_unknown_codec_name_or_type_is_refused_at_construction(which):
    with pytest.raises(ValueError, match="unknown codec 'dtc'"):
        _make(which, _model(), codec="dtc")
    with pytest.raises(TypeError, match="codec must be a gradwire codec"):
        _make(which, _model(), codec=42)
    with pytest.raises(TypeError, match="downlink_codec must be a gradwire codec"):
        _make(which, _model(), downlink_codec=object())


@pytest.mark.parametrize("which", ["demo", "sparseloco"])
def test_add_param_group_after_construction_is_refused_with_what_to_do(which):
    model, extra = _model(), nn.Linear(2, 2)
    opt = _make(which, model)
    with pytest.raises(ValueError, match="add_param_group after construction is refused.*over every parameter group"):
        opt.add_param_group({"params": list(extra.parameters())})
    _one_step(opt, model)  # and the optimizer still works


def test_several_groups_at_construction_still_work():
    model = _model()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 5e-4}]
    opt = gt.DeMo(groups, lr=1e-3)
    assert len(opt.param_groups) == 2
    _one_step(opt, model)
