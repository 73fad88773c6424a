"""gradwire.GComp (id 3): Huffman-coded exponents with a cap and an escape, zero pruning, four-level
mantissa truncation chosen by the paper's δ, codebooks carried only when they change (FORMAT.md §5.4)."""

from __future__ import annotations

import copy
import struct

import numpy as np
import pytest
import torch

import gradwire
from gradwire import ErrorFeedback, FrameError, GComp, GCompDecoderState, wire
from gradwire.codecs import gcomp
from gradwire.codecs.gcomp import DROPS, block_levels, quantization_metric, unpack_params
from gradwire.frame import write_frame

CUDA = torch.cuda.is_available()


def _rand(shape, seed=0, dtype=torch.float32, scale=1e-3):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _fields(x: torch.Tensor):
    bits = x.reshape(-1).to(torch.float32).view(torch.int32)
    return (bits >> 31) & 1, (bits >> 23) & 0xFF, bits & 0x7FFFFF


def _levels(entry, numel):
    block = unpack_params(entry.params)["block"]
    return wire.unpack_bits_exact(entry.sections["level"], 2, -(-numel // block))


# ------------------------------------------------------------------------------------------------
# Lossless at level 0, the layout of the record


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1000,), (33, 17), (), (1,), (0, 4)], ids=str)
def test_without_a_parameter_every_block_is_lossless(dtype, shape):
    x = _rand(shape, 1, dtype)
    entry, recon = GComp().compress(x, "w")
    assert torch.equal(recon, x)
    assert torch.equal(gradwire.decode(write_frame([entry])), x)
    assert unpack_params(entry.params)["format"] == (1 if dtype == torch.bfloat16 else 0)


def test_sections_are_the_exponent_code_levels_signs_and_mantissas():
    x = _rand((700,), 2)
    x[::5] = 0.0
    x[3] = 1e-41  # a denormal: pruned like a zero
    entry, recon = GComp(block=100).compress(x, "w")
    assert list(entry.sections) == ["book", "exp", "level", "sign", "mant"]
    sign, exp, mant = _fields(x)
    exp = torch.where(exp == 0, 0, exp)
    book = entry.sections["book"].tobytes()
    counts = np.bincount(exp.numpy(), minlength=256).astype(np.uint64)
    assert book == wire.huffman_book(counts, 12)
    assert entry.sections["exp"].tobytes() == wire.huffman_encode(exp.numpy().astype(np.uint8), book)
    nz = exp != 0
    assert entry.sections["level"].tobytes() == wire.pack_bits(np.zeros(7, np.uint32), 2)
    assert entry.sections["sign"].tobytes() == wire.pack_bits(sign[nz].numpy().astype(np.uint32), 1)
    assert entry.sections["mant"].tobytes() == wire.pack_bits(mant[nz].numpy().astype(np.uint32), 23)
    # Zeros and the denormal cost only their exponent code and decode to zero.
    assert entry.sections["sign"].size == (int(nz.sum()) + 7) // 8
    assert recon[3] == 0.0 and torch.equal(recon[nz], x[nz])


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_each_level_keeps_23_minus_drop_bits_and_restores_the_middle(level):
    x = _rand((4096,), 3)
    entry, recon = GComp(fixed_level=level).compress(x, "w")
    d = DROPS[0][level]
    assert entry.sections["mant"].size == (4096 * (23 - d) + 7) // 8
    rel = ((recon - x).abs() / x.abs()).max().item()
    assert rel <= 2.0 ** (d - 24) * 1.0001  # half of the dropped range, relative to 2^exponent
    if d:
        # Midpoint reconstruction: the errors are centred, unlike plain truncation (always toward zero).
        assert abs(float(((recon - x) / x).mean())) < 2.0 ** (d - 24) / 10
    assert torch.equal(gradwire.decode(write_frame([entry])), recon)


def test_bf16_levels_drop_0_2_4_6_of_7_bits():
    x = _rand((2048,), 4, torch.bfloat16)
    for level, d in enumerate(DROPS[1]):
        entry, recon = GComp(fixed_level=level).compress(x, "w")
        assert entry.sections["mant"].size == (2048 * (7 - d) + 7) // 8
        assert torch.equal(gradwire.decode(write_frame([entry])), recon)
        assert recon.dtype == torch.bfloat16


def test_long_exponent_codes_are_escaped():
    # One outlier exponent among thousands: with cap 3 it is escaped (escape code + 8 raw bits).
    x = _rand((4000,), 5)
    x[17] = 1e30
    entry, recon = GComp(cap=3).compress(x, "w")
    cap, lengths = wire.huffman_book_lengths(entry.sections["book"])
    assert cap == 3 and lengths.max() <= 3
    big = int(_fields(x[17:18])[1][0])
    assert lengths[big] == 0 and lengths[256] > 0
    assert torch.equal(recon, x)
    assert torch.equal(gradwire.decode(write_frame([entry])), x)


# ------------------------------------------------------------------------------------------------
# δ and the levels


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-2),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    "nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=1e-3),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=1e-2),
}


def _trained(kind, steps=6, dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(dtype)
    opt = OPTIMIZERS[kind](model.parameters())
    x, y = torch.randn(128, 32, dtype=dtype), torch.randint(0, 10, (128,))
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if s < steps - 1:
            opt.step()
    return model, opt


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_delta_is_the_ratio_of_the_rest_of_the_update_to_the_gradients_part(kind):
    # δ from Table 2 against the optimizer itself: stepping with g and with (1 + ε) g, the parameter
    # moves by the gradient's part times ε; the update subtracts that part, so δ = −θ_rest / part with
    # θ_rest = θ_t − part.
    model, opt = _trained(kind, dtype=torch.float64)  # float64, so the finite difference is exact enough
    codec = GComp.from_optimizer(opt, model.named_parameters())
    p = next(model.parameters())
    delta = quantization_metric(p.grad, p, opt.state[p], codec._group_configs[id(p)])

    def step_with(scale):
        m, o = copy.deepcopy(model), None
        o = OPTIMIZERS[kind](m.parameters())
        o.load_state_dict(copy.deepcopy(opt.state_dict()))
        for q, q0 in zip(m.parameters(), model.parameters()):
            q.grad = q0.grad * scale
        o.step()
        return next(m.parameters()).detach()

    eps = 1e-6
    t1, t2 = step_with(1.0), step_with(1.0 + eps)
    part = (t2 - t1) / eps  # ∂θ_t/∂g · g (Adam's v_t depends on g too; Table 2 takes it as given)
    rest = t1 - part
    ok = (part.abs() > 1e-9) & (rest.abs() > 1e-6)
    ratio = (delta[ok] / (-rest[ok] / part[ok])).double()
    if kind in ("adam", "adamw", "rmsprop", "adagrad"):
        # Table 2 holds the second moment fixed (here it moves with g too, which shrinks the gradient's
        # part) and, for Adam, leaves out its bias correction, which makes δ smaller early in training.
        # Table 2's δ must never promise more room than the optimizer gives: δ ≤ the measured ratio.
        assert float((ratio > 0).double().mean()) > 0.9
        assert float((ratio[ratio > 0] < 1.05).double().mean()) > 0.95
    else:
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=2e-2, atol=0)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_at_zero_tolerance_the_optimizer_step_is_unchanged(kind):
    # Near-lossless: stepping with the decoded gradients leaves (almost) every parameter bit-identical.
    model, opt = _trained(kind)
    codec = GComp.from_optimizer(opt, model.named_parameters(), block=16, tolerance_bits=0)
    state = copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    decoded = {n: codec.compress(p.grad, n)[1] for n, p in model.named_parameters()}
    opt.step()
    exact = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    opt.load_state_dict(state)
    for n, p in model.named_parameters():
        p.grad = decoded[n]
    opt.step()
    same = sum(int((a == p).sum()) for a, p in zip(exact, model.parameters()))
    total = sum(a.numel() for a in exact)
    # Each change is below half a unit in the last place: a parameter flips only when its exact
    # update lands that close to a rounding boundary.
    assert same / total > 0.99


def test_levels_follow_delta_and_the_tolerance():
    delta = torch.tensor([2.0**8, 2.0**14, 2.0**20, 2.0**30, 2.0**30, 1.0, float("nan"), 2.0**30], dtype=torch.float64)
    nonzero = torch.tensor([True, True, True, True, False, True, True, True])
    # One element per block: thresholds 2^(d + 1) for f32 gradients and parameters.
    assert block_levels(delta, nonzero, 1, 0, 24).tolist() == [1, 2, 3, 3, 3, 0, 0, 3]
    assert block_levels(delta, nonzero, 1, 0, 24, tolerance_bits=6).tolist() == [2, 3, 3, 3, 3, 0, 0, 3]
    # A block takes the level its worst nonzero element allows; zeros do not count.
    assert block_levels(delta, nonzero, 4, 0, 24).tolist() == [1, 0]


def _hostile_grad(like: torch.Tensor, seed: int) -> torch.Tensor:
    """A gradient with zeros, denormals and extreme magnitudes (δ of ±inf, NaN, overflow)."""
    g = torch.randn(like.shape, generator=torch.Generator().manual_seed(seed)).to(like.dtype) * 1e-3
    flat = g.view(-1)
    flat[::5] = 0.0
    flat[1::7] = 1e-41 if like.dtype != torch.float16 else 0.0
    flat[2::11] = 1e-37 if like.dtype != torch.float16 else 1e-7
    flat[3::13] = 3e4
    return g


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("trained", [False, True], ids=["first step", "trained"])
def test_rust_delta_is_torchs_operation_for_operation(kind, trained, monkeypatch):
    # The CPU encoder's levels come from the Rust kernel; quantization_metric is the reference (and
    # what other devices use): the same f64 operations in the same order, so the same bits, ±inf and
    # NaN included. One difference: Rust's square root is IEEE's, correctly rounded, and torch's
    # vectorised float64 sqrt is not always (an ulp off now and then, which later operations can
    # grow). The reference here takes numpy's square root, which is IEEE's.
    model, opt = _trained(kind, steps=6 if trained else 1)
    codec = GComp.from_optimizer(opt, model.named_parameters())
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda t: torch.from_numpy(np.sqrt(t.numpy())))
    for i, p in enumerate(model.parameters()):
        g = _hostile_grad(p, i)
        state = opt.state.get(p, {})
        cfg = codec._group_configs[id(p)]
        want = quantization_metric(g, p, state, cfg).reshape(-1)
        native = gcomp._native_metric(g, p, state, cfg)
        assert native is not None
        bits = g.reshape(-1).view(torch.int32).numpy().view(np.uint32)
        got = torch.from_numpy(wire.gcomp_metric(native[0], bits, *native[1], **native[2]))
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        both = ~torch.isnan(want)
        assert torch.equal(got.view(torch.int64)[both], want.view(torch.int64)[both])


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_encoder_levels_are_those_of_the_torch_metric(kind, dtype):
    # f32 and bf16 models take the Rust kernel, float64 ones the torch code; both give the levels of
    # block_levels(quantization_metric(...)).
    model, opt = _trained(kind, dtype=dtype)
    for tol, block in [(0, 16), (8, 7), (16, 64), (-2.5, 1)]:
        codec = GComp.from_optimizer(opt, model.named_parameters(), block=block, tolerance_bits=tol)
        for i, (n, p) in enumerate(model.named_parameters()):
            g = _hostile_grad(p, 10 + i)
            entry, recon = codec.compress(g, n)
            delta = quantization_metric(g, p, opt.state[p], codec._group_configs[id(p)])
            nonzero = _fields(g)[1] != 0
            precision = 53 if dtype == torch.float64 else (8 if dtype == torch.bfloat16 else 24)
            fmt = 1 if dtype == torch.bfloat16 else 0
            want = block_levels(delta, nonzero, block, fmt, precision, tol)
            assert _levels(entry, g.numel()).tolist() == want.tolist()
            assert torch.equal(gradwire.decode(write_frame([entry])), recon)


def test_bound_codec_reaches_higher_levels_and_compresses_more():
    model, opt = _trained("sgd")
    loose = GComp.from_optimizer(opt, model.named_parameters(), block=16, tolerance_bits=12)
    strict = GComp.from_optimizer(opt, model.named_parameters(), block=16, tolerance_bits=0)
    w = model[0].weight
    e_loose, _ = loose.compress(w.grad, "0.weight")
    e_strict, _ = strict.compress(w.grad, "0.weight")
    assert _levels(e_loose, w.numel()).mean() > _levels(e_strict, w.numel()).mean()
    assert e_loose.sections["mant"].nbytes < e_strict.sections["mant"].nbytes
    # Explicit param/state work without binding, and ErrorFeedback finds bound parameters by name.
    plain = GComp("sgd", lr=0.1, weight_decay=1e-2, block=16, tolerance_bits=12)
    e_plain, _ = plain.compress(w.grad, "0.weight", param=w, state=opt.state.get(w, {}))
    assert e_plain.sections["mant"].tobytes() == e_loose.sections["mant"].tobytes()
    ef = ErrorFeedback(GComp.from_optimizer(opt, model.named_parameters(), block=16, tolerance_bits=12))
    entry = ef.compress(w.grad, "0.weight")
    assert _levels(entry, w.numel()).max() > 0
    torch.testing.assert_close(ef.residual("0.weight"), w.grad - gradwire.decode_entry(entry))


# ------------------------------------------------------------------------------------------------
# Codebooks: rebuilt every N steps, carried only when changed, kept by receivers


def test_books_are_carried_only_when_they_change_and_receivers_keep_them():
    codec = GComp(rebuild_every=3)
    state = GCompDecoderState()
    xs = [_rand((2000,), 10 + t) for t in range(6)] + [_rand((2000,), 20 + t, scale=1e3) for t in range(6)]
    carried, ids = [], []
    for t, x in enumerate(xs):
        frame = codec.encode(x, name="w", round=t, sender=4)
        entry = gradwire.read_frame(frame).entry()
        carried.append("book" in entry.sections)
        ids.append(unpack_params(entry.params)["book_id"])
        assert torch.equal(state.decode(frame), x)
        if not carried[-1]:
            with pytest.raises(FrameError, match="codebook not carried"):
                gradwire.decode(frame)
    # Built at the first step; rebuilt after steps 3, 6, 9 from the counts of the last three: the
    # scale change (step 6) makes the books of steps 9 and 12 differ.
    assert carried[0] and not any(carried[1:3])
    assert ids == sorted(ids) and ids[-1] >= 1
    assert all(c == (i == 0 or ids[i] != ids[i - 1]) for i, c in enumerate(carried))


def test_always_carry_makes_every_frame_decodable_alone():
    codec = GComp(carry_book="always")
    for t in range(3):
        frame = codec.encode(_rand((500,), t), name="w")
        assert "book" in gradwire.read_frame(frame).entry().sections
        gradwire.decode(frame)


def test_receiver_state_is_per_sender_and_checks_the_book_id():
    a, b = GComp(), GComp()
    state = GCompDecoderState()
    x = _rand((300,), 30)
    state.decode(a.encode(x, name="w", sender=1))
    second = a.encode(x, name="w", sender=1)
    assert torch.equal(state.decode(second), x)
    # The same bytes from another sender: that stream has no book.
    other = gradwire.write_frame([gradwire.read_frame(second).entry()], sender=2)
    with pytest.raises(FrameError, match="none received from sender 2"):
        state.decode(other)
    # A record naming a book id the stream has not received.
    entry = gradwire.read_frame(second).entry()
    entry.params = struct.pack("<BII", 0, 256, 7)
    with pytest.raises(FrameError, match="names book_id 7, the last received from sender 1 is 0"):
        state.decode(write_frame([entry], sender=1))
    # Bundles mix codecs: other records decode as usual.
    frame = b.encode_bundle({"w": x, "v": x[:10]}, sender=3)
    out = state.decode_bundle(frame)
    assert torch.equal(out["w"], x) and torch.equal(out["v"], x[:10])


# ------------------------------------------------------------------------------------------------
# Hostile records


def _entry(**kw):
    return GComp(block=64, **kw).compress(_rand((500,), 40), "w")[0]


def _decode(entry):
    return gradwire.decode(write_frame([entry]))


@pytest.mark.parametrize(
    "edit,rule",
    [
        (lambda e: setattr(e, "params", struct.pack("<BII", 2, 64, 0)) or e, "format must be 0"),
        (lambda e: setattr(e, "params", struct.pack("<BII", 1, 64, 0)) or e, "format 1 \\(bf16\\) needs dtype"),
        (lambda e: setattr(e, "params", struct.pack("<BII", 0, 0, 0)) or e, "block must be >= 1"),
        (lambda e: setattr(e, "params", struct.pack("<BII", 0, 1 << 31, 0)) or e, "section 'level' must hold"),
        (lambda e: setattr(e, "params", b"\0" * 8) or e, "params must be 9 bytes"),
        (lambda e: e.sections.update(book=np.array([4, 0, 0, 0, 0], np.uint8)) or e, "section 'exp'.*no codeword"),
        (lambda e: e.sections.update(exp=e.sections["exp"][:-3]) or e, "section 'exp'"),
        (lambda e: e.sections.update(level=e.sections["level"][:-1]) or e, "section 'level' must hold"),
        (lambda e: e.sections.update(sign=e.sections["sign"][:-1]) or e, "section 'sign' must hold"),
        (lambda e: e.sections.update(mant=e.sections["mant"][:-1]) or e, "section 'mant' must hold"),
        (lambda e: (e.sections.pop("book"), e)[1], "codebook not carried"),
    ],
)
def test_malformed_records_raise_frame_error(edit, rule):
    with pytest.raises(FrameError, match=rule):
        _decode(edit(_entry()))


def test_sections_out_of_order_and_bad_types_are_rejected():
    e = _entry()
    e.sections = {k: e.sections[k] for k in ("exp", "book", "level", "sign", "mant")}
    with pytest.raises(FrameError):
        _decode(e)
    e = _entry()
    e.sections["sign"] = e.sections["sign"].view(np.int8)
    with pytest.raises(FrameError, match="section 'sign' must have element type uint8"):
        _decode(e)


def test_an_exponent_of_255_is_rejected():
    e = _entry()
    counts = np.zeros(256, np.uint64)
    counts[255] = 1
    book = wire.huffman_book(counts, 4)
    e.sections["book"] = np.frombuffer(book, np.uint8)
    e.sections["exp"] = np.frombuffer(wire.huffman_encode(np.full(500, 255, np.uint8), book), np.uint8)
    with pytest.raises(FrameError, match="exponent 255"):
        _decode(e)


def test_encoder_rejects_non_finite_and_bad_settings():
    with pytest.raises(ValueError, match="non-finite"):
        GComp().compress(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="optimizer"):
        GComp("lamb")
    with pytest.raises(ValueError, match="cap"):
        GComp(cap=16)
    with pytest.raises(ValueError, match="carry_book"):
        GComp(carry_book="never")
    with pytest.raises(ValueError, match="fixed_level"):
        GComp(fixed_level=4)
    with pytest.raises(ValueError, match="shape"):
        GComp("sgd").compress(torch.ones(3), "w", param=torch.ones(4))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_tensors_compress_on_their_device():
    model, opt = _trained("adamw")
    model.cuda()
    x = _rand((4096,), 50).cuda()
    codec = GComp(fixed_level=2)
    entry, recon = codec.compress(x, "w")
    assert recon.device == x.device
    out = gradwire.decode(write_frame([entry]), device="cuda")
    assert torch.equal(out, recon)
    cpu_entry, _ = GComp(fixed_level=2).compress(x.cpu(), "w")
    assert all(np.array_equal(entry.sections[k], cpu_entry.sections[k]) for k in entry.sections)


def test_golden_vector_re_encodes_byte_for_byte():
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    here = Path(__file__).parent / "vectors"
    meta = json.loads((here / "manifest.json").read_text())["gcomp_levels_bundle"]
    frame = (here / "gcomp_levels_bundle.gwf").read_bytes()
    tensors = load_file(str(here / "gcomp_levels_bundle.safetensors"))
    entries = []
    for name, config in meta["records"].items():
        params = {k: v for k, v in config.items() if k != "codec"}
        entries.append(GComp(**params).compress(tensors[f"input/{name}"], name)[0])
    again = gradwire.write_frame(entries, round=meta["round"], sender=meta["sender"], bundle=True)
    assert again == frame
