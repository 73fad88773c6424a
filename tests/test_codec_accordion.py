"""gradwire.Accordion: per-layer switching between a gentle and an aggressive codec setting."""

from __future__ import annotations

import math

import pytest
import torch

import gradwire
from gradwire import Accordion, DCTCodec, ErrorFeedback, PowerSGD, TopK
from gradwire.accordion import AccordionDecision, setting_of
from gradwire.frame import read_frame

SHAPE = (48, 32)


def _grad(t, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + t)
    return torch.randn(SHAPE, generator=g) * scale


def _run(acc: Accordion, scales, name="w"):
    """Encode one gradient per step with the given norm scales; the frames' settings, step by step."""
    settings = []
    for t, s in enumerate(scales):
        frame = acc.encode(_grad(t, s), name=name, round=t)
        entry = read_frame(frame).entries[0]
        settings.append((setting_of(entry)["rank"], acc.regime_of(entry)))
        assert gradwire.decode(frame).shape == SHAPE
    return settings


def test_switches_to_the_aggressive_setting_when_the_norm_settles_and_back_on_a_regime_change():
    acc = Accordion(low=PowerSGD(rank=2), high=PowerSGD(rank=1), threshold=0.5, interval=5)
    # 4 intervals at scale 1, then the gradient norm jumps to 4x (a regime change), then stays there.
    scales = [1.0] * 20 + [4.0] * 15
    settings = _run(acc, scales)
    # The first interval is critical (no previous norm), so it runs on the gentle setting.
    assert [d.critical for d in acc.log] == [True, False, False, False, True, False, False]
    assert [d.setting for d in acc.log] == ["low", "high", "high", "high", "low", "high", "high"]
    assert [d.step for d in acc.log] == [5, 10, 15, 20, 25, 30, 35]
    assert math.isinf(acc.log[0].ratio)
    assert acc.log[4].ratio == pytest.approx(3.0, rel=0.3)  # |n - 4n| / n
    assert all(d.ratio < 0.5 for i, d in enumerate(acc.log) if i not in (0, 4))
    # The setting in force is visible in every frame: rank 2 is "low", rank 1 is "high".
    expect = [(2, "low")] * 10 + [(1, "high")] * 15 + [(2, "low")] * 5 + [(1, "high")] * 5
    assert settings == expect


def test_decisions_are_per_layer():
    acc = Accordion(low=TopK(density=0.99), high=TopK(density=0.1), interval=3)
    for t in range(9):
        acc.compress(_grad(t), "steady")
        acc.compress(_grad(t, 1.0 if t < 6 else 5.0, seed=1), "jumpy")
    by_name = {}
    for d in acc.log:
        by_name.setdefault(d.name, []).append(d.setting)
    assert by_name == {"steady": ["low", "high", "high"], "jumpy": ["low", "high", "low"]}
    assert acc.setting("steady") == "high" and acc.setting("jumpy") == "low"
    assert acc.setting("never-seen") == "low"


def test_log_entries_hold_the_accumulated_norm():
    acc = Accordion(low=DCTCodec(topk=64), high=DCTCodec(topk=8), interval=4)
    grads = [_grad(t) for t in range(4)]
    for g in grads:
        acc.compress(g, "w")
    (d,) = acc.log
    assert isinstance(d, AccordionDecision)
    assert d.norm == pytest.approx(torch.stack(grads).sum(0).norm().item(), rel=1e-5)
    assert (d.step, d.name, d.critical, d.setting) == (4, "w", True, "low")
    step, name, norm, ratio, critical, setting = d  # a plain tuple too
    assert (step, norm, setting) == (4, d.norm, "low") and math.isinf(ratio)


def test_dct_topk_64_to_8_is_visible_in_the_frames():
    acc = Accordion(low=DCTCodec(topk=64), high=DCTCodec(topk=8), interval=2)
    ks = []
    for t in range(6):
        entry, recon = acc.compress(_grad(t), "w")
        ks.append(setting_of(entry)["topk"])
        assert torch.equal(gradwire.decode(gradwire.write_frame([entry])), recon)
    assert ks == [64, 64, 64, 64, 8, 8]  # two intervals of gentle: the first, and the one with no norm to compare


def test_composes_with_error_feedback_and_bundles():
    ef = ErrorFeedback(Accordion(low=PowerSGD(rank=4), high=PowerSGD(rank=1), interval=3))
    sum_in = {n: torch.zeros(SHAPE) for n in ("a", "b")}
    sum_out = {n: torch.zeros(SHAPE) for n in ("a", "b")}
    for t in range(12):
        grads = {"a": _grad(t) + 0.3, "b": _grad(t, seed=2) * 0.1}
        out = gradwire.decode_bundle(ef.encode_bundle(grads, round=t))
        for n in grads:
            sum_in[n] += grads[n]
            sum_out[n] += out[n]
    for n in ("a", "b"):
        gap = (sum_out[n] - sum_in[n]).norm().item()
        assert gap == pytest.approx(ef.residual(n).norm().item(), rel=1e-3)
    assert {d.name for d in ef.codec.log} == {"a", "b"}


def test_codecs_may_be_given_by_name():
    acc = Accordion(low={"codec": "topk", "density": 0.5}, high={"codec": "topk", "k": 3})
    assert isinstance(acc.low, TopK) and acc.high.k == 3
    # Accordion is a policy above the codecs, not a wire format: not a wire codec, but a name that
    # gradwire.make_codec builds like every name gradwire.codec_names() lists.
    assert "accordion" not in gradwire.CODECS and "accordion" in gradwire.codec_names()
    built = gradwire.make_codec("accordion", low={"codec": "topk", "k": 1}, high={"codec": "topk", "k": 1})
    assert isinstance(built, Accordion)
    with pytest.raises(ValueError, match="unknown codec 'accordion'"):
        gradwire.codecs.make_codec("accordion", low={"codec": "topk", "k": 1}, high={"codec": "topk", "k": 1})
    with pytest.raises(ValueError, match="'codec' key"):
        Accordion(low={"density": 0.5}, high=TopK(k=1))
    with pytest.raises(ValueError):
        Accordion(low=3, high=TopK(k=1))


@pytest.mark.parametrize("kwargs", [dict(threshold=0), dict(threshold=float("nan")), dict(interval=0)])
def test_bad_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        Accordion(low=TopK(k=2), high=TopK(k=1), **kwargs)


def test_regime_of_is_none_for_records_it_did_not_make_or_cannot_tell_apart():
    acc = Accordion(low=PowerSGD(rank=2), high=PowerSGD(rank=1), interval=1)
    foreign = PowerSGD(rank=3).compress(_grad(0), "w")[0]
    assert acc.regime_of(foreign) is None
    # A bias goes dense under both settings: the record cannot say which one was in force. (Seeded: the
    # second interval must come out non-critical so that both settings make a record.)
    g = torch.Generator().manual_seed(0)
    for _t in range(3):
        entry, _ = acc.compress(torch.randn(10, generator=g), "bias")
    assert {d.setting for d in acc.log} == {"low", "high"}
    assert acc.regime_of(entry) is None


def test_setting_of_reads_every_builtin_codec():
    x = _grad(0)
    cases = [
        (gradwire.IdentityCodec(torch.bfloat16), {"codec": "identity", "wire_dtype": "bfloat16"}),
        (gradwire.ThreeLC(1.5), {"codec": "3lc", "sparsity": 1.5}),
        (gradwire.OneBit(), {"codec": "onebit"}),
        (gradwire.SignSGD("none"), {"codec": "signsgd", "scale": "none"}),
        (TopK(k=10), {"codec": "topk", "k": 10, "density": 10 / x.numel()}),
        (gradwire.MinMaxUInt8(chunk=64), {"codec": "minmax", "chunk": 64}),
        (PowerSGD(rank=3), {"codec": "powersgd", "rank": 3, "dense": False}),
    ]
    for codec, expect in cases:
        assert setting_of(codec.compress(x)[0]) == expect
    assert setting_of(gradwire.RandomK(k=5, unbiased=False).compress(x)[0])["unbiased"] is False


def test_a_bundle_wide_budget_is_spent_per_setting():
    # Global top-k on both sides: the layers in one setting share that setting's k.
    acc = Accordion(low=TopK(k=40, scope="global"), high=TopK(k=4, scope="global"), interval=1)
    assert acc.bundle_budget and not Accordion(low=TopK(k=4), high=TopK(k=2)).bundle_budget
    grads = {"a": _grad(0), "b": _grad(1)}
    for _ in range(2):  # the first interval, and the one with no norm to compare, run on "low"
        out = acc.compress_bundle(grads)
        assert sum(setting_of(e)["k"] for e, _ in out.values()) == 40
    out = acc.compress_bundle(grads)  # the same norms again: both layers settle on "high"
    assert {acc.regime_of(e) for e, _ in out.values()} == {"high"}
    assert sum(setting_of(e)["k"] for e, _ in out.values()) == 4
    assert sum(int((r != 0).sum()) for _, r in out.values()) == 4
