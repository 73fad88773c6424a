"""gradwire.algorithms: DeMo's and SparseLoCo's node sides, the outer step and the exact mean."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest
import torch

import gradwire
from gradwire.algorithms import (
    DeMoState,
    OuterStep,
    SparseLoCoState,
    default_sparseloco_codec,
    demo_update,
    exact_mean,
)
from gradwire.frame import write_frame


def _tensors(seed: int, shapes=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or {"b.weight": (96, 128), "a.bias": (96,), "c.emb": (103, 64)}
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


# -- DeMo ------------------------------------------------------------------------------------------


def test_demo_compress_momentum_identity():
    state = DeMoState(beta=0.9)
    lr = 0.01
    g1, g2 = _tensors(1), _tensors(2)
    recs = state.compress(g1, lr)
    assert [e.name for e in recs] == sorted(g1)
    for e in recs:
        m = torch.add(torch.mul(torch.zeros_like(g1[e.name]), 0.9), torch.mul(g1[e.name], lr))
        assert torch.equal(state.momenta[e.name], torch.sub(m, gradwire.decode_entry(e)))
    before = {n: m.clone() for n, m in state.momenta.items()}
    recs = state.compress(g2, lr)
    for e in recs:
        m = torch.add(torch.mul(before[e.name], 0.9), torch.mul(g2[e.name], lr))
        assert torch.equal(state.momenta[e.name], torch.sub(m, gradwire.decode_entry(e)))


def test_demo_update_sign_step_and_weight_decay():
    p = {"w": torch.tensor([1.0, -2.0, 3.0, 0.5]), "v": torch.tensor([[4.0, 4.0]])}
    mean = {"w": torch.tensor([0.3, -1e-9, 0.0, -5.0]), "v": torch.tensor([[-1.0, 2.0]])}
    demo_update(p, mean, lr=0.1)
    assert torch.equal(p["w"], torch.tensor([1.0 - 0.1, -2.0 + 0.1, 3.0, 0.5 + 0.1]))
    assert torch.equal(p["v"], torch.tensor([[4.0 + 0.1, 4.0 - 0.1]]))
    q = {"w": torch.tensor([1.0, -2.0])}
    demo_update(q, {"w": torch.tensor([1.0, 1.0])}, lr=0.1, weight_decay=0.5)
    want = torch.tensor([1.0, -2.0]) * (1 - 0.1 * 0.5) - 0.1
    assert torch.equal(q["w"], want)
    with pytest.raises(ValueError):
        demo_update({"w": torch.zeros(2)}, {}, lr=0.1)


def test_default_demo_codec_ratio_on_large_weight():
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    (entry,) = DeMoState().compress({"w": w}, 0.01)
    frame = write_frame([entry], bundle=True)
    ratio = 4 * w.numel() / len(frame)
    assert ratio >= 300, (len(frame), ratio)


# -- SparseLoCo ------------------------------------------------------------------------------------


def test_sparseloco_error_feedback_identity_and_invariant():
    d = 0.9
    state = SparseLoCoState(error_decay=d)
    anchor = _tensors(10)
    pgs, sends = [], []
    T = 5
    for t in range(T):
        current = {n: a - 0.1 * x for (n, a), x in zip(anchor.items(), _tensors(20 + t).values())}
        before = {n: e.clone() for n, e in state.errors.items()}
        recs = state.compress(anchor, current)
        assert [e.name for e in recs] == sorted(anchor)
        dec = {e.name: gradwire.decode_entry(e) for e in recs}
        for n in anchor:
            pg = torch.sub(anchor[n], current[n])
            e = pg if n not in before else torch.add(torch.mul(before[n], d), pg)
            assert torch.equal(state.errors[n], torch.sub(e, dec[n]))  # exact, step by step
        pgs.append({n: torch.sub(anchor[n], current[n]) for n in anchor})
        sends.append(dec)
    # Over T syncs: e_T + Σ_t d^(T-t) s_t = Σ_t d^(T-t) pg_t (exact in real arithmetic; float64 check).
    for n in anchor:
        lhs = state.errors[n].double() + sum(d ** (T - 1 - t) * sends[t][n].double() for t in range(T))
        rhs = sum(d ** (T - 1 - t) * pgs[t][n].double() for t in range(T))
        assert torch.allclose(lhs, rhs, rtol=0, atol=1e-5), float((lhs - rhs).abs().max())


def test_outer_step_plain_and_nesterov_by_hand():
    a = {"w": torch.tensor([1.0, 2.0])}
    OuterStep(outer_lr=0.5).apply(a, {"w": torch.tensor([0.2, -0.4])})
    assert torch.equal(a["w"], torch.tensor([1.0, 2.0]) - torch.tensor([0.2, -0.4]) * 0.5)

    mu, lr = 0.9, 0.7
    d1, d2 = torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.25])
    for nesterov in (False, True):
        step = OuterStep(outer_lr=lr, momentum=mu, nesterov=nesterov)
        a = {"w": torch.tensor([0.0, 0.0])}
        step.apply(a, {"w": d1})
        step.apply(a, {"w": d2})
        b1 = d1
        b2 = mu * b1 + d2
        s1, s2 = (d1 + mu * b1, d2 + mu * b2) if nesterov else (b1, b2)
        assert torch.allclose(a["w"], -lr * s1 - lr * s2, atol=1e-7)
        # and it is torch's SGD with the delta as gradient
        p = torch.zeros(2, requires_grad=True)
        sgd = torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=nesterov)
        for d in (d1, d2):
            p.grad = d.clone()
            sgd.step()
        assert torch.allclose(a["w"], p.detach(), atol=1e-7)
    with pytest.raises(ValueError):
        OuterStep(nesterov=True)


def test_outer_steps_run_side_by_side_on_threads():
    # Nodes step their own anchors on threads at once (the server tests' nodes do): the one-pass kernel
    # borrows only the caller's arrays, so nothing is "borrowed elsewhere" between them.
    import concurrent.futures

    def node(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        a = {"w": torch.randn(300_000, generator=g)}
        for rule in (OuterStep(outer_lr=0.7), OuterStep(outer_lr=0.7, momentum=0.9, nesterov=True)):
            for _ in range(20):
                rule.apply(a, {"w": torch.randn(300_000, generator=g)})
        return a["w"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(node, range(8)))
    assert all(torch.equal(t, node(i)) for i, t in enumerate(together))


@pytest.mark.parametrize(
    "lr, mu, nesterov", [(1.0, 0.0, False), (0.7, 0.0, False), (0.7, 0.9, False), (1.0, 0.9, True), (0.7, 0.9, True)]
)
def test_the_one_pass_outer_step_holds_the_bits_of_the_torch_operations(lr, mu, nesterov):
    # Contiguous float32 CPU weights go through gradwire._native.outer_step (threads share them at this
    # size); a transposed view of the same values takes the torch operations. Same bits every step,
    # the first step's −0.0 deltas included (a zero buffer plus −0.0 would be +0.0).
    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 384, generator=g)
    native = OuterStep(outer_lr=lr, momentum=mu, nesterov=nesterov)
    ops = OuterStep(outer_lr=lr, momentum=mu, nesterov=nesterov)
    a_native = {"w": w.clone()}
    a_ops = {"w": w.t().contiguous().t()}  # the same values, not contiguous
    assert a_native["w"].is_contiguous() and not a_ops["w"].is_contiguous()
    probe = OuterStep(outer_lr=lr, momentum=mu, nesterov=nesterov)
    assert probe._stepped_natively("w", w.clone(), torch.zeros_like(w))  # the one-pass kernel ran
    assert not probe._stepped_natively("v", w.t(), torch.zeros_like(w.t()))  # this one takes torch's
    for i in range(3):
        d = torch.randn(512, 384, generator=g)
        if i == 0:
            d[::7] = -0.0
        native.apply(a_native, {"w": d})
        ops.apply(a_ops, {"w": d})
        assert torch.equal(a_native["w"].view(torch.int32), a_ops["w"].contiguous().view(torch.int32))
        if mu:
            assert torch.equal(native.buffers["w"].view(torch.int32), ops.buffers["w"].view(torch.int32))
    # the buffers as state: loaded without a copy, they go on stepping in place
    again = OuterStep(outer_lr=lr, momentum=mu, nesterov=nesterov)
    again.load_state_dict(native.state_dict(), copy=False)
    d = torch.randn(512, 384, generator=g)
    again.apply(a_native, {"w": d})
    ops.apply(a_ops, {"w": d})
    assert torch.equal(a_native["w"], a_ops["w"])


@pytest.mark.parametrize(
    "lr, mu, nesterov",
    [(1.0, 0.0, False), (0.7, 0.0, False), (1.0, 0.9, False), (0.7, 0.9, False), (1.0, 0.9, True), (0.7, 0.9, True)],
)
def test_outer_step_rounds_as_its_formulas_once_rounded_op_by_op(lr, mu, nesterov):
    # In place or not, each multiply and add is rounded once, in the documented order: every node and the
    # server hold the same bits. The deltas given are left as they were.
    g = torch.Generator().manual_seed(0)
    anchor = {"w": torch.randn(1000, generator=g)}
    expected, b = anchor["w"].clone(), None
    step = OuterStep(outer_lr=lr, momentum=mu, nesterov=nesterov)
    for _ in range(4):
        d = torch.randn(1000, generator=g)
        kept = d.clone()
        step.apply(anchor, {"w": d})
        assert torch.equal(d, kept)
        if mu:
            b = d.clone() if b is None else torch.add(torch.mul(b, mu), d)
            s = torch.add(d, torch.mul(b, mu)) if nesterov else b
        else:
            s = d
        expected = torch.sub(expected, torch.mul(s, lr))
    assert torch.equal(anchor["w"], expected)


def test_default_sparseloco_codec_ratio_per_local_step():
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    for sync_every in (32, 8, 1):
        state = SparseLoCoState(default_sparseloco_codec(sync_every))
        (entry,) = state.compress({"w": w}, {"w": torch.zeros_like(w)})
        frame = write_frame([entry], bundle=True)
        ratio = 4 * w.numel() * sync_every / len(frame)
        assert ratio >= 300, (sync_every, len(frame), ratio)


# -- exact_mean ------------------------------------------------------------------------------------


def _senders(n: int = 3) -> list:
    out = []
    for i in range(n):
        st = DeMoState(beta=0.9)
        out.append(st.compress(_tensors(100 + i), 0.05))
    return out


def test_exact_mean_is_sum_of_decodes_over_n_and_repeatable():
    records = _senders(3)
    mean = exact_mean(records)
    again = exact_mean(records)
    for name, m in mean.items():
        assert m.dtype == torch.float32
        dec = [gradwire.decode_entry(next(e for e in recs if e.name == name)) for recs in records]
        w = float(torch.tensor(1 / 3, dtype=torch.float32))
        want = dec[0] * w + dec[1] * w + dec[2] * w
        assert torch.equal(m, want)
        assert torch.equal(m, again[name])
        assert torch.allclose(m, sum(dec) / 3, atol=1e-6)
    weighted = exact_mean(records, weights=[1.0, 0.0, 0.0])
    for name, m in weighted.items():
        assert torch.equal(m, gradwire.decode_entry(next(e for e in records[0] if e.name == name)))


def test_exact_mean_rejects_disagreeing_senders():
    records = _senders(2)
    with pytest.raises(ValueError, match="names"):
        exact_mean([records[0], records[1][:-1]])
    other = DeMoState().compress({**_tensors(1), "b.weight": torch.randn(8, 8)}, 0.1)
    with pytest.raises(ValueError, match="shape"):
        exact_mean([records[0], other])
    with pytest.raises(ValueError):
        exact_mean([])
    with pytest.raises(ValueError):
        exact_mean(records, weights=[1.0])


_SUBPROCESS = textwrap.dedent(
    """
    import io, sys, hashlib, torch
    from gradwire.algorithms import exact_mean
    import gradwire
    torch.set_num_threads(int(sys.argv[1]))
    frames = torch.load(io.BytesIO(sys.stdin.buffer.read()), weights_only=False)
    records = [gradwire.read_frame(f).entries for f in frames]
    mean = exact_mean(records)
    h = hashlib.sha256()
    for n in sorted(mean):
        h.update(n.encode()); h.update(mean[n].numpy().tobytes())
    print(h.hexdigest())
    """
)


def test_exact_mean_bit_identical_in_a_subprocess_with_other_thread_count():
    import hashlib

    shapes = {"w": (256, 320), "e": (103, 64), "v": (431,)}
    records = []
    for i in range(3):
        st = DeMoState(beta=0.9)
        records.append(st.compress(_tensors(200 + i, shapes), 0.05))
    frames = [write_frame(r, bundle=True) for r in records]
    mean = exact_mean(records)
    h = hashlib.sha256()
    for n in sorted(mean):
        h.update(n.encode())
        h.update(mean[n].numpy().tobytes())
    data = _save(frames)
    # The subprocess imports gradwire as this process did (the installed package, or PYTHONPATH as given).
    threads = 1 if torch.get_num_threads() > 1 else 2
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, str(threads)], input=data, capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == h.hexdigest()


# -- state -----------------------------------------------------------------------------------------


def test_state_dicts_round_trip_and_continue_identically():
    lr = 0.05
    a, b = DeMoState(beta=0.9), DeMoState(beta=0.9)
    a.compress(_tensors(1), lr)
    b.load_state_dict(_load(_save(a.state_dict())))
    ra, rb = a.compress(_tensors(2), lr), b.compress(_tensors(2), lr)
    assert write_frame(ra, bundle=True) == write_frame(rb, bundle=True)

    anchor = _tensors(3)
    cur1 = {n: t * 0.9 for n, t in anchor.items()}
    cur2 = {n: t * 0.8 for n, t in anchor.items()}
    s, t = SparseLoCoState(), SparseLoCoState()
    s.compress(anchor, cur1)
    t.load_state_dict(_load(_save(s.state_dict())))
    assert write_frame(s.compress(anchor, cur2), bundle=True) == write_frame(t.compress(anchor, cur2), bundle=True)

    o1 = OuterStep(0.7, 0.9, nesterov=True)
    a1 = {n: x.clone() for n, x in anchor.items()}
    o1.apply(a1, cur1)
    o2 = OuterStep(0.7, 0.9, nesterov=True)
    o2.load_state_dict(_load(_save(o1.state_dict())))
    a2 = {n: x.clone() for n, x in a1.items()}
    o1.apply(a1, cur2)
    o2.apply(a2, cur2)
    assert all(torch.equal(a1[n], a2[n]) for n in a1)

    with pytest.raises(ValueError):
        DeMoState().load_state_dict({"momenta": {}})
    with pytest.raises(ValueError):
        SparseLoCoState().load_state_dict({"errors": {"x": torch.zeros(2, dtype=torch.int32)}, "codec": {}})


def test_take_back_restores_the_buffers_as_if_nothing_was_sent():
    shapes = {"w": (64, 64), "b": (64,)}
    demo = DeMoState(beta=0.9)
    grads = _tensors(7, shapes)
    entries = demo.compress(grads, 0.05)
    demo.take_back({e.name: gradwire.decode_entry(e) for e in entries})
    for n, g in grads.items():  # the momentum holds all of lr·grad again
        torch.testing.assert_close(demo.momenta[n], torch.mul(g, 0.05), rtol=0, atol=1e-7)

    sl = SparseLoCoState(error_decay=0.95)
    anchor, current = _tensors(8, shapes), _tensors(9, shapes)
    entries = sl.compress(anchor, current)
    sl.take_back({e.name: gradwire.decode_entry(e) for e in entries})
    for n in anchor:
        torch.testing.assert_close(sl.errors[n], anchor[n] - current[n], rtol=0, atol=1e-6)
    with pytest.raises(KeyError, match="never sent"):
        sl.take_back({"other": torch.zeros(2)})
