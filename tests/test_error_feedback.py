"""gradwire.ErrorFeedback: residuals carried across steps around any codec."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire import DCTCodec, ErrorFeedback, IdentityCodec

SHAPE = (128, 128)  # 64x64 chunks, 4 of them


def _grad(t, shape=SHAPE, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 100003 + t)
    # A drift plus noise, like a gradient: the drift is what must not get lost.
    return (torch.randn(shape, generator=g) + 0.3).to(dtype)


def _run(steps, feedback: bool, codec):
    ef = ErrorFeedback(codec)
    sum_in = torch.zeros(SHAPE)
    sum_dec = torch.zeros(SHAPE)
    residual_norms, gaps = [], []
    for t in range(steps):
        g = _grad(t)
        frame = ef.encode(g, "w", round=t) if feedback else codec.encode(g, name="w", round=t)
        sum_in += g
        sum_dec += gradwire.decode(frame)
        gaps.append((sum_dec - sum_in).norm().item())
        if feedback:
            residual_norms.append(ef.residual("w").norm().item())
    return ef, gaps, residual_norms


def test_decoded_updates_track_the_inputs_over_200_steps():
    codec = DCTCodec(chunk_shape=(64, 64), topk=64)
    ef, gaps, rnorms = _run(200, True, codec)
    _, gaps_plain, _ = _run(200, False, codec)
    g_norm = _grad(0).norm().item()

    # Nothing is lost, only delayed: sum(decoded) = sum(inputs) - final residual.
    assert gaps[-1] == pytest.approx(rnorms[-1], rel=1e-3)
    # The residual stays bounded: it levels off instead of growing with the step count.
    assert max(rnorms[100:]) <= 1.15 * max(rnorms[50:100])
    assert max(rnorms) < 5 * g_norm
    # Without feedback the gap keeps growing, and ends far above the residual.
    assert gaps_plain[199] > 1.3 * gaps_plain[99]
    assert gaps_plain[-1] > 3 * gaps[-1]


def test_each_residual_is_input_plus_residual_minus_what_receivers_decode():
    codec = DCTCodec(chunk_shape=(64, 64), topk=16)
    ef = ErrorFeedback(codec)
    assert ef.residual("w") is None
    prev = torch.zeros(SHAPE)
    for t in range(5):
        g = _grad(t, seed=1)
        dec = gradwire.decode(ef.encode(g, "w"))
        r = ef.residual("w")
        assert r.dtype == torch.float32 and r.device == g.device
        assert torch.equal(r, (g + prev) - dec)
        prev = r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tensors_keep_their_dtype_and_a_float32_residual(dtype):
    ef = ErrorFeedback(DCTCodec(topk=32))
    prev = torch.zeros(SHAPE)
    for t in range(3):
        g = _grad(t, seed=2, dtype=dtype)
        frame = ef.encode(g, "w")
        dec = gradwire.decode(frame)
        assert dec.dtype == dtype and gradwire.read_frame(frame).entries[0].dtype == dtype
        r = ef.residual("w")
        assert r.dtype == torch.float32
        # The residual accounts for the receivers' final rounding to dtype too.
        assert torch.equal(r, (g.float() + prev) - dec.float())
        prev = r


def test_bundle_of_several_named_tensors():
    codec = DCTCodec(chunk_shape=(64, 64), topk=32)
    ef = ErrorFeedback(codec)
    shapes = {"layer.0.weight": (64, 96), "layer.0.bias": (96,), "conv": (16, 8, 3, 3)}
    sums_in = {n: torch.zeros(s) for n, s in shapes.items()}
    sums_dec = {n: torch.zeros(s) for n, s in shapes.items()}
    for t in range(30):
        grads = {n: _grad(t, s, seed=i + 3) for i, (n, s) in enumerate(shapes.items())}
        frame = ef.encode_bundle(grads, round=t, sender=7)
        f = gradwire.read_frame(frame)
        assert f.bundle and f.round == t and f.sender == 7 and [e.name for e in f.entries] == list(shapes)
        for n, d in gradwire.decode_bundle(frame).items():
            sums_in[n] += grads[n]
            sums_dec[n] += d
    assert sorted(ef.names()) == sorted(shapes)
    for n in shapes:
        torch.testing.assert_close(sums_in[n] - sums_dec[n], ef.residual(n), atol=1e-3, rtol=1e-4)


def test_wraps_any_codec():
    codec = IdentityCodec(wire_dtype=torch.float16)
    ef = ErrorFeedback(codec)
    total_in = torch.zeros(SHAPE)
    total_dec = torch.zeros(SHAPE)
    for t in range(50):
        g = _grad(t, seed=4) * 1e-3
        total_in += g
        total_dec += gradwire.decode(ef.encode(g, "w"))
    r = ef.residual("w")
    torch.testing.assert_close(total_in - total_dec, r, atol=1e-6, rtol=1e-4)
    assert r.abs().max() < 4e-6  # at most half an fp16 step of values of a few 1e-3


def test_compress_returns_an_entry_and_codecs_stay_stateless():
    codec = DCTCodec(topk=8)
    ef = ErrorFeedback(codec)
    entry = ef.compress(_grad(0), "w")
    assert isinstance(entry, gradwire.Entry) and entry.name == "w" and entry.codec == 1
    # The codec itself keeps no residual: the same input gives the same frame.
    assert codec.encode(_grad(0)) == codec.encode(_grad(0))


def test_reset_forgets_residuals():
    ef = ErrorFeedback(DCTCodec(topk=8))
    ef.compress(_grad(0), "a")
    ef.compress(_grad(1, (10,)), "b")
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
    ef.reset()
    assert ef.residual("b") is None and ef.names() == []


def test_shape_change_without_reset_is_an_error():
    ef = ErrorFeedback(DCTCodec(topk=8))
    ef.compress(_grad(0), "w")
    with pytest.raises(ValueError, match="reset"):
        ef.compress(_grad(0, (64, 64)), "w")


def test_state_dict_round_trips_through_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    codec = DCTCodec(topk=8)
    a = ErrorFeedback(codec)
    for t in range(3):
        a.encode_bundle({"x.weight": _grad(t), "y": _grad(t, (50,))})
    state = a.state_dict()
    assert state["codec"] == {}  # DCT keeps no state between calls
    save_file(state["residuals"], str(tmp_path / "ef.safetensors"))

    b = ErrorFeedback(codec)
    # The flat {name: residual} form (residuals only) is accepted as well as the nested one.
    b.load_state_dict(load_file(str(tmp_path / "ef.safetensors")))
    assert sorted(b.names()) == ["x.weight", "y"]
    # Both continue identically.
    g = {"x.weight": _grad(9), "y": _grad(9, (50,))}
    assert a.encode_bundle(g, round=3) == b.encode_bundle(g, round=3)
    for n in g:
        assert torch.equal(a.residual(n), b.residual(n))


def test_state_dict_is_a_copy():
    ef = ErrorFeedback(DCTCodec(topk=8))
    ef.compress(_grad(0), "w")
    sd = ef.state_dict()
    sd["residuals"]["w"].zero_()
    assert ef.residual("w").abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_residuals_live_on_the_tensor_device():
    ef = ErrorFeedback(DCTCodec(topk=8))
    g = _grad(0).cuda()
    frame = ef.encode(g, "w")
    r = ef.residual("w")
    assert r.device == g.device and r.dtype == torch.float32
    assert torch.equal(r, g - gradwire.decode(frame, device=g.device))


def test_error_feedback_gives_a_global_topk_budget_across_the_bundle():
    from gradwire.codecs.sparse import TopK

    g = torch.Generator().manual_seed(5)
    big = torch.randn(1000, generator=g) * 10.0  # holds every large value
    small = torch.randn(1000, generator=g) * 0.01
    fb = ErrorFeedback(TopK(k=50, scope="global"))
    out = gradwire.decode_bundle(fb.encode_bundle({"big": big, "small": small}))
    assert int((out["big"] != 0).sum()) == 50 and int((out["small"] != 0).sum()) == 0
    # the small tensor's gradient is kept whole in its residual, and the big one's dropped part in its own
    assert torch.equal(fb.residual("small"), small)
    torch.testing.assert_close(fb.residual("big") + out["big"], big)


def test_take_back_returns_a_frame_that_never_counted_to_the_residual():
    ef = ErrorFeedback(gradwire.DCTCodec(chunk_shape=(16,), topk=2))
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    frame = ef.encode_bundle({"w": x})
    ef.take_back(gradwire.decode_bundle(frame))
    # As if nothing had been sent: the whole input waits in the residual.
    torch.testing.assert_close(ef.residual("w"), x, rtol=0, atol=1e-6)
    with pytest.raises(KeyError, match="never compressed"):
        ef.take_back({"other": torch.zeros(3)})


def test_set_residual_replaces_one_residual_and_keeps_the_codec_state():
    ef = ErrorFeedback(gradwire.PowerSGD(rank=1))
    ef.encode_bundle({"a": torch.randn(8, 8), "b": torch.randn(8, 8)})
    codec_state = ef.state_dict()["codec"]
    ef.set_residual("a", torch.ones(8, 8, dtype=torch.float16))
    assert ef.residual("a").dtype == torch.float32 and torch.equal(ef.residual("a"), torch.ones(8, 8))
    assert set(ef.names()) == {"a", "b"}
    after = ef.state_dict()["codec"]
    assert all(torch.equal(after["q"][n], codec_state["q"][n]) for n in codec_state["q"])
    with pytest.raises(ValueError):
        ef.set_residual("a", torch.ones(3, dtype=torch.int64))
