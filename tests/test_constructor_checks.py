"""What the gradwire optimizers refuse or warn about when they are built (gradwire.torch.constructor_checks):
DeMo's reference names pointed to gradwire's, a parameter that is not floating point refused, float64 trained
with a warning, and a DCT topk beyond its chunks warned about (it would compress nothing)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwire
import gradwire.torch as gt


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_frozen_integer_tensor_among_the_parameters_is_refused():
    model = _model()
    counter = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match=r"parameter g0\.p4 is torch\.int64: .*register it as a buffer"):
        gt.DeMo([*model.parameters(), counter], lr=1e-3)


def test_float64_parameters_are_trained_with_a_warning_that_they_keep_float32_precision():
    model = _model().double()
    with pytest.warns(UserWarning, match=r"g0\.p0, g0\.p1, g0\.p2 … are float64; .*float32 precision"):
        gt.SparseLoCo(model.parameters(), torch.optim.AdamW(model.parameters()))


def test_topk_beyond_a_chunk_warns_that_nothing_is_compressed():
    model = _model()
    codec = gradwire.DCTCodec(chunk_shape=(8, 8), topk=100)
    with pytest.warns(UserWarning, match=r"codec's topk=100 is more than its largest chunk holds \(64 elements"):
        gt.DeMo(model.parameters(), lr=1e-3, codec=codec)
    tiles = gradwire.DCTCodec(chunk_shape=(64, 64), mode="tiles", topk=5000)
    with pytest.warns(UserWarning, match=r"downlink_codec's topk=5000 .*4096 elements"):
        gt.DeMo(model.parameters(), lr=1e-3, downlink_codec=tiles)


def test_demo_reference_names_point_to_gradwire_equivalents():
    model = _model()
    with pytest.raises(TypeError) as err:
        gt.DeMo(model.parameters(), lr=1e-3, compression_decay=0.999, compression_topk=32, compression_chunk=64)
    message = str(err.value)
    assert "compression_decay= is beta=" in message and "compression_topk= is codec=gradwire.DCTCodec(" in message
    assert "compression_chunk= is the c of codec=gradwire.DCTCodec(chunk_shape=(c, c)" in message
    assert "docs/howto-from-demo.md" in message
    with pytest.raises(TypeError, match=r"SparseLoCo got inner_optimizer=, .*inner= \(the local optimizer"):
        gt.SparseLoCo(model.parameters(), inner_optimizer=torch.optim.AdamW(model.parameters()))
