"""Adding an algorithm takes 2 files: its module (tests/toy_algorithm.py, an algorithm that exists only in
the test suite) and its registration (the fixture below). With nothing else touched it trains on real gloo
ranks through the one torch transport with the sharded exchange, overlap with the backward pass and a
resume from a checkpoint, and through a real server with the client's ``Node``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwire
import gradwire.torch as gt
from distributed_toys import all_ranks_equal, checkpoint_roundtrip, flat_parameters, make_model, shard
from gradwire.algorithms import base as registry
from gradwire.client import GradwireClient, Node
from live_server import LiveServer
from server_helpers import train_together
from toy_algorithm import NAME, register_ef_sgd

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def ef_sgd():
    """The algorithm registered for one test (gloo workers fork from here and inherit it)."""
    algorithm = register_ef_sgd()
    try:
        yield algorithm
    finally:
        del registry._REGISTRY[NAME]


def _steps(model, opt, x, y, steps: int, during_backward: list | None = None) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if during_backward is not None:  # buckets already handed to the encode worker by the backward pass
            during_backward.append(len(opt._buckets._started))
        opt.step()
        losses.append(float(loss))
    return losses


def _sharded_overlapped_resumed(rank: int, world: int) -> dict:
    x, y = shard(rank)

    def build(model):
        return gt.AlgorithmOptimizer(model, NAME, {"lr": 0.3}, exchange="sharded", overlap=True, bucket_numel=600)

    model = make_model()
    opt = build(model)
    started: list[int] = []
    losses = _steps(model, opt, x, y, 4, started)
    saved = checkpoint_roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    losses += _steps(model, opt, x, y, 4)
    resumed_model = make_model(seed=1)
    resumed_model.load_state_dict(saved["model"])
    resumed = build(resumed_model)
    resumed.load_state_dict(saved["opt"])
    _steps(resumed_model, resumed, x, y, 4)
    # The live state per parameter: the residual the step updates, the one state_dict() saves.
    body = model.body.weight
    live = opt.state[body]["residual"]
    index = next(i for i, p in enumerate(model.parameters()) if p is body)
    saved_now = opt.state_dict()["state"][index]["residual"]
    return dict(
        identical=all_ranks_equal(flat_parameters(model)),
        resumed_same=torch.equal(flat_parameters(model), flat_parameters(resumed_model)),
        trained=losses[-1] < losses[0],
        pieces=len(saved["opt"]["gradwire"]["pieces"]),
        tensors=len(list(model.parameters())),
        buckets=len(opt._buckets.buckets),
        started_in_backward=max(started),
        live=tuple(live.shape) == tuple(body.shape) and live.dtype == torch.float32 and torch.equal(live, saved_now),
        sent=opt.bytes_sent,
    )


def test_an_algorithm_in_two_files_runs_sharded_overlapped_and_resumes_on_gloo_ranks(ef_sgd):
    for r in gt.spawn(_sharded_overlapped_resumed, 2, (), timeout_s=120):
        assert r["identical"] and r["resumed_same"] and r["trained"] and r["live"] and r["sent"] > 0, r
        assert r["pieces"] > r["tensors"], r  # the sharded exchange cut a tensor into pieces
        assert r["buckets"] > 1 and r["started_in_backward"] >= 1, r  # encoded while the backward pass ran


class _ServerWithTheAlgorithm(LiveServer):
    """``python -m gradwire_server`` in a process that registered the algorithm first (the server's run
    config has a section per registered algorithm, read from the registry when it is imported)."""

    def _command(self) -> list[str]:
        start = (
            "import runpy, toy_algorithm; toy_algorithm.register_ef_sgd(); "
            "runpy.run_module('gradwire_server', run_name='__main__', alter_sys=True)"
        )
        return [self.python, "-c", start, *super()._command()[3:]]


def _loss(model: nn.Module, node: int, step: int) -> torch.Tensor:
    x, y = shard(node, n=64)  # each node its own samples of one task
    return nn.functional.cross_entropy(model(x), y)


def test_the_same_two_files_run_through_the_server_and_the_clients_node(ef_sgd, tmp_path):
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    server = _ServerWithTheAlgorithm(tmp_path / "server", env={"PYTHONPATH": path})
    try:
        with GradwireClient(server.url, server.admin_token) as admin:
            run_id = admin.create_run({"algorithm": NAME, NAME: {"lr": 0.3}, "quorum": 2})
            admin.put_state(run_id, {n: p.detach() for n, p in make_model().named_parameters()})
            nodes = []
            for _ in range(2):
                node_id, token = admin.register_node(run_id)
                codec = gradwire.DCTCodec(chunk_shape=[64], topk=16)
                nodes.append(Node(GradwireClient(server.url, token), run_id, make_model(), codec, node_id, wait=10))
            before = [_loss(n.module, 9, 99).item() for n in nodes]
            train_together(nodes, _loss, steps=5, timeout=120)
            status = admin.status(run_id)
        assert status["version"] == 5 and status["config"]["algorithm"] == NAME
        # Every node checked the published weights hash after each version: all hold the server's weights.
        assert torch.equal(flat_parameters(nodes[0].module), flat_parameters(nodes[1].module))
        assert _loss(nodes[0].module, 9, 99).item() < before[0]
    finally:
        server.close()
