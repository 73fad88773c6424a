"""The optimizers' full state dict: every rank's share in one file, which every rank resumes from (what the
HF Trainer does with the file rank 0 saves), bit-identically, in either exchange; and the byte form the
shares cross ranks in (gradwire.torch.state_bytes), which is no pickle."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

import gradwire.torch as gt
from distributed_toys import all_ranks_equal, checkpoint_roundtrip, flat_parameters, shard
from gradwire.torch.state_bytes import StateBytesError, state_from_bytes, state_to_bytes
from test_torch_sharded_exchange import PIECE, _make, _net, _train, interrupted_run


def _resume_from_rank_zeros_file(rank: int, world: int, which: str, exchange: str, path: str) -> dict:
    x, y = shard(rank)
    kw = dict(piece_numel=PIECE) if exchange == "sharded" else dict(exchange="all_gather")

    def rank_zeros_file(opt):
        full = opt.full_state_dict()  # collective: every rank calls it
        if rank == 0:  # the HF Trainer saves rank 0's file only ...
            torch.save(full, path)
        dist.barrier()
        return torch.load(path, weights_only=True)  # ... and every rank loads that one file

    run = interrupted_run(lambda m: _make(which, m, **kw), x, y, rank_zeros_file)
    whole, resumed, saved = run.whole, run.resumed, run.saved
    out = dict(
        same=torch.equal(flat_parameters(whole), flat_parameters(resumed)),
        identical=all_ranks_equal(flat_parameters(resumed)),
        shares=len(saved["gradwire"]["ranks"]),
    )
    # rank 0's own state_dict() is no full one: on rank 1 (sharded) it is refused, naming the rank.
    if exchange == "sharded" and rank == 1:
        try:
            _make(which, _net(), **kw).load_state_dict(_rank_zero_share(saved))
            out["refused"] = None
        except ValueError as e:
            out["refused"] = str(e)
    dist.barrier()
    return out


def _rank_zero_share(full: dict) -> dict:
    return dict(full, gradwire=full["gradwire"]["ranks"][0])


@pytest.mark.parametrize(
    "which, exchange", [("demo", "sharded"), ("sparseloco", "sharded"), ("sparseloco", "all_gather")]
)
def test_every_rank_resumes_bit_identically_from_rank_zeros_full_state_file(tmp_path, which, exchange):
    results = gt.spawn(_resume_from_rank_zeros_file, 2, (which, exchange, str(tmp_path / "optimizer.pt")), timeout_s=90)
    for r in results:
        assert r["same"] and r["identical"] and r["shares"] == 2
    if exchange == "sharded":
        assert "this checkpoint is rank 0's; this is rank 1" in results[1]["refused"]


def test_a_full_state_of_another_group_size_is_resharded_into_this_ones():
    x, y = shard(0)
    model = _net()
    opt = _make("demo", model, piece_numel=PIECE)
    _train(opt, model, x, y, 2)
    full = checkpoint_roundtrip(opt.full_state_dict())
    assert len(full["gradwire"]["ranks"]) == 1
    _make("demo", _net(), piece_numel=PIECE).load_state_dict(full)  # a group of one takes its own share
    # Two identical shares, as two ranks that held the same state: their mean is that state, so a group of
    # one resumes with this one's momenta (gradwire.torch.reshard; tests/test_torch_reshard.py for real groups).
    two = dict(full, gradwire=dict(full["gradwire"], ranks=full["gradwire"]["ranks"] * 2, world=2))
    resumed = _make("demo", _net(), piece_numel=PIECE)
    resumed.load_state_dict(two)
    mine, theirs = resumed.full_state_dict()["gradwire"]["ranks"][0], full["gradwire"]["ranks"][0]
    assert all(torch.equal(mine["params"][n]["momentum"], f["momentum"]) for n, f in theirs["params"].items())
    assert resumed.steps == 2 and resumed.bytes_sent == 0  # counters start afresh in the new group


def test_state_bytes_round_trip_every_kind_of_value():
    state = {
        "state": {0: {"exp_avg": torch.randn(3, 4), "step": torch.tensor(7.0)}},
        "param_groups": [
            {"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None, "amsgrad": False, "params": [0, 1], "name": "g0"}
        ],
        "bf16": torch.randn(5).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "inf": float("inf"),
        "nested": [[1, 2], {"k": torch.arange(4)}],
    }
    back = state_from_bytes(state_to_bytes(state))
    assert back["param_groups"][0]["betas"] == (0.9, 0.999) and back["param_groups"][0]["foreach"] is None
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert list(back["state"]) == [0]  # integer keys stay integers, as torch's optimizer state has them
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], state["bf16"])
    assert back["empty"].shape == (0, 3) and back["inf"] == float("inf")
    assert torch.equal(back["nested"][1]["k"], torch.arange(4)) and back["nested"][0] == [1, 2]
    # shared storage (views of one tensor) is written as separate tensors
    base = torch.arange(6.0)
    got = state_from_bytes(state_to_bytes({"a": base[:3], "b": base}))
    assert torch.equal(got["a"], base[:3]) and torch.equal(got["b"], base)


@pytest.mark.parametrize("bad", [b"", b"\x00" * 7, b"\xff" * 64, io.BytesIO().getvalue() + b"12345678{}"])
def test_state_bytes_refuse_what_they_did_not_write(bad):
    with pytest.raises(StateBytesError):
        state_from_bytes(bad)


def test_a_state_with_a_value_that_has_no_byte_form_is_refused_naming_where():
    with pytest.raises(StateBytesError, match="type object at /groups/0/fn"):
        state_to_bytes({"groups": [{"fn": object()}]})
