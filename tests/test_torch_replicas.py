"""gradwire.torch.replicas_agree: every rank's parameters bit-identical, or not, seen on every rank."""

from __future__ import annotations

import torch
from torch import nn

import gradwire.torch as gt


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)).to(dtype)


def _agree_run(rank: int, world: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(dtype)
        out[f"{dtype} same"] = gt.replicas_agree(model)
        if rank == 1:  # the last bit of one weight on one rank
            with torch.no_grad():
                w = model[1].weight.view(-1)
                bits = w[:1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                bits ^= 1
        out[f"{dtype} one bit off"] = gt.replicas_agree(model)
    return out


def test_replicas_agree_until_one_bit_of_one_rank_differs_in_fp32_and_bf16():
    for r in gt.spawn(_agree_run, 2, ()):
        assert r == {
            "torch.float32 same": True,
            "torch.float32 one bit off": False,
            "torch.bfloat16 same": True,
            "torch.bfloat16 one bit off": False,
        }, r


def test_one_process_without_a_group_agrees_with_itself():
    assert gt.replicas_agree(_model(torch.float32))
