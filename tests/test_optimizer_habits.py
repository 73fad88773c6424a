"""DeMo and SparseLoCo under what real training loops do (issue 20 item 2), on 2 gloo ranks.

A GPT-style model (tests/gpt_toys.py: tied embedding and head, a frozen position embedding, a parameter
without a gradient on odd steps), named parameter groups with their own lr, gradient accumulation over two
micro-batches, an lr scheduler driving the optimizer (as the HF Trainer does), a checkpoint halfway and a
resume from it: the ranks stay bit-identical, the resumed run equals the uninterrupted one bit for bit,
and bf16 and fp16 parameters train too. Then the checkpoints of another world size or another model, and
parameters unfrozen or frozen after the optimizer was built.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradwire.torch as gt
from distributed_toys import all_ranks_equal, checkpoint_roundtrip, flat_parameters
from gpt_toys import lm_loss, make_gpt, param_groups, token_batches

STEPS, HALF, SYNC_EVERY = 6, 3, 2


def _build(model: nn.Module, which: str, exchange: str, dtype: torch.dtype):
    if which == "demo":
        opt = gt.DeMo(param_groups(model, 0.01), lr=0.01, beta=0.9, exchange=exchange)
    else:
        # fp16 needs an eps it can hold (1e-8 rounds to 0 and 0/0 is NaN where a gradient is 0): the inner
        # optimizer is the user's, and so is this choice.
        eps = 1e-6 if dtype == torch.float16 else 1e-8
        inner = torch.optim.AdamW(param_groups(model, 3e-3), lr=3e-3, eps=eps)
        opt = gt.SparseLoCo(
            model.named_parameters(),
            inner,
            sync_every=SYNC_EVERY,
            exchange=exchange,
            outer_lr=0.7,
            outer_momentum=0.9,
            nesterov=True,
        )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    return opt, sched


def _train(model, opt, sched, batches, start: int, which: str) -> tuple[list[float], bool]:
    losses, identical = [], True
    for t, micros in enumerate(batches, start):
        opt.zero_grad()
        total = 0.0
        for seq in micros:  # gradient accumulation: two micro-batches per optimizer step
            loss = lm_loss(model, seq, use_extra=t % 2 == 0) / len(micros)
            loss.backward()
            total += loss.item()
        opt.step()
        sched.step()
        losses.append(total)
        if dist.is_initialized() and (which == "demo" or (t + 1) % SYNC_EVERY == 0):
            identical &= all_ranks_equal(flat_parameters(model))
    return losses, identical


def _habits_run(rank: int, world: int, which: str, exchange: str) -> dict:
    batches = token_batches(rank, STEPS)
    out: dict = {}

    # Uninterrupted, fp32.
    model = make_gpt()
    frozen_before = model.wpe.weight.detach().clone()
    opt, sched = _build(model, which, exchange, torch.float32)
    losses, identical = _train(model, opt, sched, batches, 0, which)
    whole = flat_parameters(model)
    counters = (opt.bytes_sent, opt.bytes_received)
    out.update(
        losses=losses,
        identical=identical,
        frozen_kept=torch.equal(model.wpe.weight, frozen_before),
        lrs=[g["lr"] for g in opt.param_groups],
    )
    if which == "sparseloco":
        out["inner_lrs"] = [g["lr"] for g in opt.inner.param_groups]

    # Half, a checkpoint through torch.save / torch.load(weights_only=True), then a fresh process's resume.
    model = make_gpt()
    opt, sched = _build(model, which, exchange, torch.float32)
    _train(model, opt, sched, batches[:HALF], 0, which)
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    saved = checkpoint_roundtrip(saved)
    model = make_gpt(seed=1)  # other weights: everything must come from the checkpoint
    opt, sched = _build(model, which, exchange, torch.float32)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    _, identical_resumed = _train(model, opt, sched, batches[HALF:], HALF, which)
    out.update(
        resumed_equal=torch.equal(flat_parameters(model), whole),
        identical_resumed=identical_resumed,
        counters_equal=(opt.bytes_sent, opt.bytes_received) == counters,
    )

    # bf16 and fp16 parameters.
    for dtype in (torch.bfloat16, torch.float16):
        model = make_gpt(dtype=dtype)
        opt, sched = _build(model, which, exchange, dtype)
        losses, identical = _train(model, opt, sched, batches[:4], 0, which)
        params = flat_parameters(model)
        out[str(dtype)] = dict(
            identical=identical,
            finite=bool(torch.isfinite(params.float()).all()),
            dtype=str(params.dtype),
            losses=losses,
        )
    return out


@pytest.mark.parametrize("which, exchange", [("demo", "sharded"), ("sparseloco", "all_gather")])
def test_gpt_habits_on_two_ranks(which, exchange):
    results = gt.spawn(_habits_run, 2, (which, exchange))
    for r in results:
        assert r["identical"], "ranks differ after some step"
        assert r["frozen_kept"], "the frozen position embedding moved"
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["resumed_equal"] and r["identical_resumed"], "the resumed run left the uninterrupted one"
        assert r["counters_equal"], "the byte counters did not resume"
        # The scheduler (given the optimizer itself, as the HF Trainer does) set each group's own lr.
        factor = 1.0 / (1.0 + 0.1 * STEPS)
        base = 0.01 if which == "demo" else 3e-3
        assert r["lrs"] == pytest.approx([base * factor, base / 2 * factor])
        if which == "sparseloco":
            assert r["inner_lrs"] == r["lrs"]
        for dtype in ("torch.bfloat16", "torch.float16"):
            d = r[dtype]
            assert d["identical"] and d["finite"] and d["dtype"] == dtype, d
    assert results[0]["losses"] != results[1]["losses"]  # each rank its own data


@pytest.mark.parametrize("which, exchange", [("demo", "sharded"), ("sparseloco", "all_gather")])
def test_checkpoint_of_another_world_size_is_refused(which, exchange, tmp_path):
    gt.spawn(_save_run, 2, (which, exchange, str(tmp_path)))
    state = torch.load(tmp_path / "rank0.pt", weights_only=True)
    model = make_gpt()
    opt, _ = _build(model, which, exchange, torch.float32)  # no process group: a group of one
    with pytest.raises(ValueError, match="group of 2 ranks, this group has 1"):
        opt.load_state_dict(state)


def _save_run(rank: int, world: int, which: str, exchange: str, ckpt_dir: str) -> None:
    model = make_gpt()
    opt, sched = _build(model, which, exchange, torch.float32)
    _train(model, opt, sched, token_batches(rank, SYNC_EVERY), 0, which)
    torch.save(opt.state_dict(), os.path.join(ckpt_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("which", ["demo", "sparseloco"])
def test_checkpoint_of_another_model_is_refused_naming_the_parameter(which):
    model = make_gpt()
    opt, sched = _build(model, which, "all_gather", torch.float32)
    _train(model, opt, sched, token_batches(0, 2), 0, which)
    state = checkpoint_roundtrip(opt.state_dict())

    torch.manual_seed(0)
    other = make_gpt()
    other.blocks[1].mlp[2] = nn.Linear(4 * 32, 32, bias=False)  # one parameter fewer
    opt2, _ = _build(other, which, "all_gather", torch.float32)
    with pytest.raises(ValueError, match="another model"):
        opt2.load_state_dict(state)

    wider = make_gpt()
    wider.wpe = nn.Embedding(24, 32)  # a longer context: same count, another shape
    wider.wpe.weight.requires_grad_(False)
    opt3, _ = _build(wider, which, "all_gather", torch.float32)
    with pytest.raises(
        ValueError, match=r"another model: g0\.p1 \(wpe\.weight\) has shape \(16, 32\) in it, \(24, 32\) here"
    ):
        opt3.load_state_dict(state)


def test_sparseloco_follows_a_parameter_unfrozen_later_with_all_gather():
    model = make_gpt()
    opt, sched = _build(model, "sparseloco", "all_gather", torch.float32)
    batches = token_batches(0, 6)
    _train(model, opt, sched, batches[:3], 0, "sparseloco")  # mid-interval: a local step since the sync
    frozen = model.wpe.weight.detach().clone()
    model.wpe.weight.requires_grad_(True)
    _train(model, opt, sched, batches[3:], 3, "sparseloco")
    assert not torch.equal(model.wpe.weight, frozen)  # it trains now
    # and it is synced: after the last sync the weights are the anchor, the position embedding's too
    assert torch.equal(opt.anchor["g0.p1"], model.wpe.weight.detach())
    # freezing again keeps it in the exchange (its local steps are synced like any other's)
    model.wpe.weight.requires_grad_(False)
    _train(model, opt, sched, token_batches(0, 2), 6, "sparseloco")
    assert torch.equal(opt.anchor["g0.p1"], model.wpe.weight.detach())


@pytest.mark.parametrize("which", ["demo", "sparseloco"])
def test_unfreezing_with_sharded_exchange_says_what_to_do_naming_the_module(which):
    model = make_gpt()
    opt, sched = _build(model, which, "sharded", torch.float32)
    _train(model, opt, sched, token_batches(0, 1), 0, which)
    model.wpe.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"g0\.p1 \(wpe\.weight\) now requires a gradient.*exchange='all_gather'"):
        _train(model, opt, sched, token_batches(0, 1), 1, which)


def test_errors_from_inside_the_step_name_parameters_by_module_path():
    model = make_gpt()
    opt = gt.DeMo(model.named_parameters(), lr=0.01, exchange="all_gather")
    for _ in range(2):
        opt.zero_grad()
        lm_loss(model, token_batches(0, 1)[0][0]).backward()
        opt.step()
    opt.node.momenta["g0.p0"] = torch.zeros(3)  # a momentum that no longer fits its parameter
    with pytest.raises(ValueError, match=r"'g0\.p0 \(wte\.weight\)' has shape \(96, 32\), its momentum \(3,\)"):
        opt.step()


def test_torch_compiled_model_trains_and_its_checkpoint_resumes_the_eager_model():
    # backend="aot_eager": dynamo and AOTAutograd without codegen (inductor compiles C++ for ~35 s on this
    # CPU: tried by hand, it trains the same way). One compile: a fresh model would compile again.
    batches = token_batches(0, 3)
    model = make_gpt()
    compiled = torch.compile(model, backend="aot_eager")
    opt = gt.DeMo(compiled.named_parameters(), lr=0.01, beta=0.9)
    losses = []
    for t, micros in enumerate(batches):
        opt.zero_grad()
        loss = lm_loss(compiled, micros[0])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if t == 1:
            saved = checkpoint_roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert losses[-1] < losses[0], losses
    # compile wraps the module (names gain "_orig_mod."), the positions stay: the eager model resumes
    eager = make_gpt(seed=1)
    eager.load_state_dict(saved["model"])
    resumed = gt.DeMo(eager.named_parameters(), lr=0.01, beta=0.9)
    resumed.load_state_dict(saved["opt"])
    assert resumed.steps == 2
    assert set(resumed.node.momenta) == set(opt.node.momenta)


def _hf_gpt2(dtype: torch.dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # No dropout: its random draws would differ between the uninterrupted and the resumed run.
    config = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=17,
        vocab_size=96,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config).to(dtype)


def _hf_gpt2_run(rank: int, world: int) -> dict:
    batches = token_batches(rank, 4)
    out = {}
    for which in ("demo", "sparseloco"):

        def build(model, which=which):
            if which == "demo":
                return gt.DeMo(model.named_parameters(), lr=0.01, beta=0.9)
            inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
            return gt.SparseLoCo(model.named_parameters(), inner, sync_every=SYNC_EVERY)

        def train(model, opt, part):
            for micros in part:
                opt.zero_grad()
                for seq in micros:
                    (model(input_ids=seq, labels=seq).loss / len(micros)).backward()
                opt.step()

        runs = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = _hf_gpt2(dtype)
            opt = build(model)
            train(model, opt, batches)
            runs[str(dtype)] = flat_parameters(model)
        half = _hf_gpt2(torch.float32)
        opt = build(half)
        train(half, opt, batches[:2])
        saved = checkpoint_roundtrip({"model": half.state_dict(), "opt": opt.state_dict()})
        resumed = _hf_gpt2(torch.float32)
        resumed.load_state_dict(saved["model"])
        opt = build(resumed)
        opt.load_state_dict(saved["opt"])
        train(resumed, opt, batches[2:])
        out[which] = dict(
            tied=resumed.lm_head.weight is resumed.transformer.wte.weight,
            identical={k: all_ranks_equal(v) for k, v in runs.items()},
            resumed_equal=torch.equal(flat_parameters(resumed), runs["torch.float32"]),
        )
    return out


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_transformers_gpt2_from_a_config_both_optimizers_bf16_and_resume():
    for r in gt.spawn(_hf_gpt2_run, 2, ()):
        for which in ("demo", "sparseloco"):
            got = r[which]
            assert got["tied"], got
            assert all(got["identical"].values()), got
            assert got["resumed_equal"], got


@pytest.mark.parametrize(
    "which, exchange, model_record",
    [("demo", "sharded", False), ("demo", "all_gather", True), ("sparseloco", "sharded", False)],
)
def test_the_live_state_is_per_parameter_where_torch_users_look(which, exchange, model_record):
    model = make_gpt()
    if which == "demo":
        opt = gt.DeMo(model.parameters(), lr=0.01, exchange=exchange, model_record=model_record, piece_numel=1024)
        kinds = {"momentum", "step"}
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
        opt = gt.SparseLoCo(model.parameters(), inner, sync_every=1, outer_momentum=0.9, exchange=exchange)
        kinds = {"anchor", "error", "outer_momentum", "step", "syncs"}
    batches = token_batches(0, 3)
    trained = [(i, p) for i, p in enumerate(model.parameters()) if p.requires_grad]
    _, (i, p) = max(enumerate(trained), key=lambda t: t[1][1].numel())  # the largest: cut into pieces
    for t, micros in enumerate(batches):
        opt.zero_grad()
        lm_loss(model, micros[0]).backward()
        opt.step()
        if t == 0:
            state = opt.state[p]
            assert set(state) == kinds and all(state[k].dtype == torch.float32 for k in kinds - {"step", "syncs"})
            held = {k: state[k] for k in kinds - {"step", "syncs"}}
            before = {k: v.clone() for k, v in held.items()}
    # The tensors read after the first step are the memory the later steps updated (not copies), and they
    # hold what state_dict() saves.
    saved = opt.state_dict()["state"][i]
    for k, live in held.items():
        assert tuple(live.shape) == tuple(p.shape) and live.data_ptr() == opt.state[p][k].data_ptr(), k
        assert torch.equal(live, saved[k]) and not torch.equal(live, before[k]), k
