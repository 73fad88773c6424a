"""gradwire.torch.AlgorithmOptimizer: any registered algorithm on torch.distributed through the registry
alone. DeMo and SparseLoCo through it apply the bits their own optimizers apply, and an algorithm
registered in a test file (no optimizer class of its own) trains on real gloo ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

import gradwire.torch as gt
from distributed_toys import all_ranks_equal, flat_parameters, make_model, shard
from gradwire.algorithms import Algorithm, NodeSide, SparseLoCoConfig, register


def _train(model, opt, x, y, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _same_as_own_optimizer(rank: int, world: int, which: str) -> dict:
    x, y = shard(rank)
    ours, theirs = make_model(), make_model()
    if which == "demo":
        config = {"lr": 0.01, "beta": 0.9, "weight_decay": 0.01}
        own = gt.DeMo(theirs.parameters(), lr=0.01, beta=0.9, weight_decay=0.01, exchange="all_gather")
    else:
        cfg = SparseLoCoConfig(
            sync_every=2,
            outer_lr=0.7,
            outer_momentum=0.9,
            nesterov=True,
            inner=dataclasses.replace(SparseLoCoConfig().inner, lr=0.01),
        )
        inner = torch.optim.AdamW(theirs.parameters(), **cfg.inner.torch_kwargs())
        own = gt.SparseLoCo(
            theirs.parameters(),
            inner,
            sync_every=2,
            outer_lr=0.7,
            outer_momentum=0.9,
            nesterov=True,
            exchange="all_gather",
        )
        config = cfg
    opt = gt.AlgorithmOptimizer(ours, which, config)
    _train(ours, opt, x, y, 6)
    _train(theirs, own, x, y, 6)
    return dict(
        same=torch.equal(flat_parameters(ours), flat_parameters(theirs)),
        identical=all_ranks_equal(flat_parameters(ours)),
        rounds=opt.rounds,
        sent=opt.bytes_sent,
    )


@pytest.mark.parametrize("which, rounds", [("demo", 6), ("sparseloco", 3)])
def test_demo_and_sparseloco_through_the_registry_apply_their_own_optimizers_bits(which, rounds):
    for r in gt.spawn(_same_as_own_optimizer, 2, (which,), timeout_s=90):
        assert r["same"] and r["identical"] and r["rounds"] == rounds and r["sent"] > 0


# -- an algorithm that exists only here ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeanSGDConfig:
    """SGD on the exact mean of the nodes' compressed gradients."""

    lr: float = 0.1


class MeanSGDNode(NodeSide):
    def __init__(self, config: MeanSGDConfig, codec, params):
        self.config, self.codec, self.params = config, codec, params

    def records(self, grads):
        return [self.codec.compress(grads[n], n)[0] for n in sorted(grads)]

    def target(self):
        return self.params

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class MeanSGD(Algorithm):
    name = "test_mean_sgd"
    config_field = "test_mean_sgd"
    config_type = MeanSGDConfig
    publication = "mean"

    def default_codec(self, config):
        return "topk", {"density": 0.25}

    def node(self, config, codec, params, module=None, model_spec=None):
        return MeanSGDNode(self.config(config), codec, params)

    def apply(self, config, weights, mean, state):
        with torch.no_grad():
            for n in sorted(weights):
                weights[n].sub_(mean[n].to(weights[n].dtype), alpha=self.config(config).lr)
        return {}


def _new_algorithm_run(rank: int, world: int) -> dict:
    register(MeanSGD())  # in this worker only: the test process's registry stays as it is
    x, y = shard(rank)
    model = make_model()
    opt = gt.AlgorithmOptimizer(model, "test_mean_sgd", {"lr": 0.5})
    losses = _train(model, opt, x, y, 8)
    return dict(
        identical=all_ranks_equal(flat_parameters(model)), first=losses[0], last=losses[-1], sent=opt.bytes_sent
    )


def test_an_algorithm_registered_in_a_test_file_trains_on_gloo_ranks_with_no_optimizer_class():
    for r in gt.spawn(_new_algorithm_run, 2, (), timeout_s=90):
        assert r["identical"] and r["last"] < r["first"] and r["sent"] > 0


def test_algorithms_the_registry_cannot_run_on_torch_are_refused_when_built():
    with pytest.raises(ValueError, match="publishes 'diff' versions"):
        gt.AlgorithmOptimizer(make_model(), "adamw")
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        gt.AlgorithmOptimizer(make_model(), "nope")
    with pytest.raises(ValueError):
        gt.AlgorithmOptimizer(make_model(), "demo", {"lr": -1.0})  # the config's own check, as the server's
