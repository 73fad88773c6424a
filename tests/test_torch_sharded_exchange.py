"""The sharded exchange of gradwire.torch.DeMo and SparseLoCo (exchange="sharded", the default).

Pieces get exactly the whole tensors' chunks; the byte all-to-all; on real gloo groups of up to 8
forked ranks: bit-identical replicas, a rank's downlink that stays under two frames' worth whatever the
world size, exchange="all_gather" as before, checkpoints (owner error feedback included) that resume
bit-identically and are refused in a group of another size, and a refusal that reaches every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradwire
import gradwire.torch as gt
import gradwire.torch.all_gather_exchange as all_gather_exchange
import gradwire.torch.sharded as sharded
from distributed_toys import CLASSES, IN, all_ranks_equal, checkpoint_roundtrip, flat_parameters, gather, shard
from gradwire.aggregation import exact_mean
from gradwire.algorithms import DeMoState, default_demo_codec, default_sparseloco_downlink, demo_update
from gradwire.errors import FrameError
from gradwire.frame import MIN_FRAME_BYTES, Limits, read_frame, write_frame
from gradwire.model_record import model_record_codec
from gradwire.state import state_hash
from gradwire.torch.collectives import all_gather_bytes, all_to_all_bytes
from gradwire.torch.sharded import Piece, assign_owners

PIECE = 4096  # small pieces, so the toy model's weights are cut


class Net(nn.Module):
    """32 → 256 → 256 → 8 with biases (76,808 parameters): with pieces of 4096 elements, 10 pieces."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(IN, 256)
        self.mid = nn.Linear(256, 256)
        self.head = nn.Linear(256, CLASSES)

    def forward(self, x):
        return self.head(torch.relu(self.mid(torch.relu(self.body(x)))))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _make(which: str, model: nn.Module, **kw):
    if which == "demo":
        return gt.DeMo(model.parameters(), lr=0.005, beta=0.9, **kw)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    if which == "onebit":  # 1-bit SGD's codec both ways (docs/ALGORITHMS.md, "One bit both ways")
        down = {"downlink_codec": gradwire.OneBit()} if kw.get("exchange") == "sharded" else {}
        return gt.SparseLoCo(
            model.parameters(), inner, sync_every=2, codec=gradwire.OneBit(), error_decay=1.0, **down, **kw
        )
    return gt.SparseLoCo(model.parameters(), inner, sync_every=2, **kw)


def _synced(which: str, t: int) -> bool:
    return which == "demo" or t % 2 == 0


def _hash_identical(model: nn.Module) -> bool:
    h = state_hash({k: v.detach() for k, v in model.state_dict().items()})
    parts = gather(torch.tensor(list(bytes.fromhex(h)), dtype=torch.uint8))
    return all(torch.equal(parts[0], p) for p in parts[1:])


# -- pieces -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, piece_numel, codec_kind, expected_pieces",
    [
        ((256, 96), 4096, "dct", 4),  # 64×32 tiles: 64-row blocks
        ((1024, 1024), 1 << 18, "dct", 4),  # 4 blocks of 256 rows
        ((1000, 64), 8000, "dct", 10),  # 50-row tiles: 100-row blocks keep them (150 rows would get 50, 300 60)
        ((640, 8, 8), 4096, "dct", 10),  # 3-D: the matrix view (640, 64)
        ((8192,), 1000, "dct", 9),  # a vector's 64-element tiles
        ((2003, 64), 20000, "dct", 1),  # 2003 is prime: flat chunks, kept whole
        ((300_000,), 1 << 16, "record", 5),  # a model record: the flat vector cut at multiples of 4096
        ((256, 96), 4096, "onebit", 6),  # OneBit: blocks of 16 whole columns
        ((1024, 1000), 1 << 18, "onebit", 4),  # 256 columns a block, the last one 232
        ((640, 8, 8), 4096, "onebit", 11),  # 3-D: columns of the matrix view (640, 64), 6 a block
        ((5000, 8), 4096, "onebit", 8),  # more rows than piece_numel: one column a piece
        ((8192,), 1000, "onebit", 1),  # a vector is one column: kept whole
    ],
)
def test_pieces_carry_exactly_the_whole_tensors_records(shape, piece_numel, codec_kind, expected_pieces):
    codec = {
        "dct": default_demo_codec,
        "record": lambda: model_record_codec(default_demo_codec()),
        "onebit": gradwire.OneBit,
    }[codec_kind]()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    layout = sharded.Pieces([("t", shape)], codec, piece_numel)
    pieces = layout.by_tensor["t"]
    assert len(pieces) == expected_pieces
    assert sum(p.numel for p in pieces) == x.numel()
    columns = codec_kind == "onebit" and len(pieces) > 1
    total = x.numel() // shape[0] if columns else x.numel()  # columns of the matrix view, or elements
    assert pieces[0].start == 0 and pieces[-1].stop == total
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
    if len(pieces) > 1:
        if columns:
            assert [p.name for p in pieces] == [f"t[:,{p.start}:{p.stop}]" for p in pieces]
        else:  # rows of a row block, elements of a flat cut
            assert all(p.name == f"t[{p.name[2:-1]}]" and ":," not in p.name for p in pieces)
        assert max(p.numel for p in pieces) <= max(piece_numel, 64 * x.numel() // shape[0], shape[0])
    entry, whole = codec.compress(x, "t")
    views = layout.cut({"t": x})
    records = {n: codec.compress(v, n) for n, v in views.items()}
    joined = layout.join({n: recon for n, (_, recon) in records.items()})["t"]
    if codec_kind == "onebit":
        # The same signs and column means; a mean's float32 column sum may round an ulp apart, as torch
        # orders a reduction by the matrix's width. (Every rank cuts alike, so replicas stay identical.)
        assert torch.allclose(joined, whole, rtol=2.0**-22, atol=0.0)
    else:
        assert torch.equal(joined, whole)  # same chunks, same kept coefficients, same bits
    sent = sum(
        len(e.sections[k]) if isinstance(e.sections[k], bytes) else e.sections[k].nbytes
        for e, _ in records.values()
        for k in e.sections
    )
    alone = sum(len(v) if isinstance(v, bytes) else v.nbytes for v in entry.sections.values())
    if codec_kind == "onebit":  # the same sign bits and column means, whatever the cut (bit packing aside)
        assert sent - alone <= len(pieces)


def test_owners_balance_elements_deterministically():
    pieces = [Piece(f"p{i}", f"p{i}", 0, n, (n,)) for i, n in enumerate([100, 300, 300, 50, 200, 100, 10])]
    owners = assign_owners(pieces, 3)
    assert owners == assign_owners(pieces, 3)
    loads = [sum(p.numel for p, o in zip(pieces, owners) if o == r) for r in range(3)]
    # largest first, each to the least loaded: 300, 300, 200 + 100, then 100, 50, 10 to the lightest
    assert loads == [400, 350, 310]
    assert assign_owners(pieces, 1) == [0] * len(pieces)
    assert sorted(set(assign_owners(pieces, 20))) == list(range(len(pieces)))  # one each, the rest own none


# -- the byte all-to-all ------------------------------------------------------------------------------


def _a2a_run(rank: int, world: int) -> dict:
    out = {}
    for method in ("auto", "pairwise"):
        payloads = [bytes([rank, r]) * (rank + r) if (rank + r) % 3 else b"" for r in range(world)]
        got = all_to_all_bytes(payloads, method=method)
        out[method] = all(
            bytes(got[s]) == (bytes([s, rank]) * (s + rank) if (s + rank) % 3 else b"")
            for s in range(world)
            if s != rank
        )
        out[method] &= bytes(got[rank]) == payloads[rank]
    # nothing to move at all: no payload collective
    out["empty"] = all(len(f) == 0 for f in all_to_all_bytes([b""] * world))
    # one rank announces too much: every rank refuses, before anything is allocated
    big = [b"x" * (200 if rank == 1 and r == 2 else 10) for r in range(world)]
    try:
        all_to_all_bytes(big, limits=Limits(max_frame_bytes=100))
        out["refused"] = False
    except FrameError as e:
        out["refused"] = "rank 1 (to rank 2)" in str(e)
    return out


def test_all_to_all_bytes_moves_uneven_payloads_and_refuses_together():
    for r in gt.spawn(_a2a_run, 3, (), timeout_s=60):
        assert r == {"auto": True, "pairwise": True, "empty": True, "refused": True}


# -- replicas, bytes and loss on 8 and 2 ranks ---------------------------------------------------------


def _spy():
    """Count every frame the sharded exchange moves, by phase, independently of its counters."""
    seen = {"p1_sent": 0, "p1_received": 0, "p2_sent": 0, "p2_received": 0}
    real_a2a, real_ag = sharded.all_to_all_bytes, sharded.all_gather_bytes

    def a2a(payloads, group=None, **kw):
        out = real_a2a(payloads, group, **kw)
        me = dist.get_rank(group)
        seen["p1_sent"] += sum(len(p) for r, p in enumerate(payloads) if r != me)
        seen["p1_received"] += sum(len(f) for s, f in enumerate(out) if s != me)
        return out

    def ag(payload, group=None, **kw):
        out = real_ag(payload, group, **kw)
        me = dist.get_rank(group)
        seen["p2_sent"] += len(payload)
        seen["p2_received"] += sum(len(f) for r, f in enumerate(out) if r != me)
        return out

    sharded.all_to_all_bytes, sharded.all_gather_bytes = a2a, ag
    return seen


def _train_run(rank: int, world: int, steps: int) -> dict:
    seen = _spy()
    x, y = shard(rank)
    out = {}
    for which in ("demo", "sparseloco", "onebit"):
        for exchange in ("sharded", "all_gather"):
            model = _net()
            opt = _make(which, model, exchange=exchange, piece_numel=PIECE)
            before = dict(seen)
            losses, identical = [], True
            for t in range(1, steps + 1):
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if _synced(which, t):
                    identical &= all_ranks_equal(flat_parameters(model)) and _hash_identical(model)
            with torch.no_grad():
                final = nn.functional.cross_entropy(model(x), y).item()
            exchanges = steps if which == "demo" else steps // 2
            out[f"{which}/{exchange}"] = dict(
                identical=identical,
                first=losses[0],
                final=final,
                sent=opt.bytes_sent / exchanges,
                received=opt.bytes_received / exchanges,
                seen={k: seen[k] - before[k] for k in seen},
                pieces=len(opt._pieces) if opt._pieces else 0,
                owned=len(opt._exchange.owned(rank)) if opt._pieces else 0,
            )
    return out


@pytest.fixture(scope="module")
def trained():
    steps = 10
    return {world: gt.spawn(_train_run, world, (steps,), timeout_s=60) for world in (8, 2)}


@pytest.mark.parametrize("which", ["demo", "sparseloco", "onebit"])
def test_sharded_replicas_stay_bit_identical_and_loss_goes_down(trained, which):
    for world, results in trained.items():
        for r in results:
            s = r[f"{which}/sharded"]
            assert s["identical"], (world, "parameters differ between ranks after some exchange")
            assert s["final"] < 0.9 * s["first"], (world, s["first"], s["final"])  # measured 0.56–0.82
            # DCT codecs cut the weights at chunk boundaries into 10 pieces; OneBit cuts them into blocks
            # of 16 whole columns (256 rows × 16 = 4096 elements): 2 + 16 of the two large weights, 22 in all.
            assert s["pieces"] == (22 if which == "onebit" else 10)
        pieces = results[0][f"{which}/sharded"]["pieces"]
        assert sum(r[f"{which}/sharded"]["owned"] for r in results) == pieces
        if world == 8:  # every rank owns a piece where there are enough
            assert sum(r[f"{which}/sharded"]["owned"] == 0 for r in results) == max(0, 8 - pieces)


@pytest.mark.parametrize("which", ["demo", "sparseloco", "onebit"])
def test_sharded_bytes_are_counted_per_phase(trained, which):
    for world, results in trained.items():
        seen = [r[f"{which}/sharded"]["seen"] for r in results]
        for r, s in zip(results, seen):
            exchanges = 10 if which == "demo" else 5
            mine = r[f"{which}/sharded"]
            assert mine["sent"] * exchanges == s["p1_sent"] + s["p2_sent"]
            assert mine["received"] * exchanges == s["p1_received"] + s["p2_received"]
        # phase 1 is point to point: what was sent arrived; phase 2: every owner's frame at the w − 1 others
        assert sum(s["p1_sent"] for s in seen) == sum(s["p1_received"] for s in seen)
        assert sum(s["p2_received"] for s in seen) == (world - 1) * sum(s["p2_sent"] for s in seen)


@pytest.mark.parametrize("which", ["demo", "sparseloco", "onebit"])
def test_a_ranks_downlink_does_not_grow_with_the_world(trained, which):
    def per_rank(world, exchange, key="received"):
        return [r[f"{which}/{exchange}"][key] for r in trained[world]]

    def mean(xs):
        return sum(xs) / len(xs)

    # One rank's records of every piece: what a rank sends on 2 ranks (half to the other owner, half as
    # its re-encoded means). Sharded, a rank receives (world − 1)/world of that in each phase: about 2 of
    # it whatever the world size, plus each frame's own 36 bytes, 2(world − 1) frames, which on this toy
    # model's 920-byte step (DeMo, layout frames) are a quarter of what a rank receives at 8 ranks
    # (measured: 1.0 on 2 ranks, 2.17 on 8, the most loaded rank 2.44; SparseLoCo 1.0, 1.94, 2.36;
    # OneBit, in full records cut into column blocks: 1.0, 1.77, 2.48).
    one = max(per_rank(2, "sharded", "sent"))
    assert max(per_rank(2, "sharded")) < 1.1 * one
    assert mean(per_rank(8, "sharded")) < 2.3 * one
    assert max(per_rank(8, "sharded")) < 2.6 * one
    # the all-gather's grows with the world: world − 1 frames (measured 7.0× from 2 to 8 ranks)
    assert max(per_rank(8, "all_gather")) > 6 * max(per_rank(2, "all_gather"))
    assert mean(per_rank(8, "sharded")) < 0.4 * mean(per_rank(8, "all_gather"))
    assert max(per_rank(8, "sharded")) < 0.5 * min(per_rank(8, "all_gather"))
    # and what a rank sends stays about one frame's worth (its records to their owners, its means once),
    # beside the headers of its 8 frames where it sent 2 (measured with them: DeMo 1.25, SparseLoCo 1.11)
    headers = MIN_FRAME_BYTES
    assert max(per_rank(8, "sharded", "sent")) - 8 * headers < 1.2 * (one - 2 * headers)


@pytest.mark.parametrize("which", ["demo", "sparseloco", "onebit"])
def test_all_gather_still_trains_bit_identically(trained, which):
    for results in trained.values():
        for r in results:
            a = r[f"{which}/all_gather"]
            assert a["identical"] and a["final"] < a["first"]
            assert a["seen"] == {"p1_sent": 0, "p1_received": 0, "p2_sent": 0, "p2_received": 0}
            assert a["pieces"] == 0


# -- with a lossless codec the two exchanges are the same arithmetic -----------------------------------


def _lossless_run(rank: int, world: int) -> dict:
    x, y = shard(rank)
    params = {}
    for exchange in ("sharded", "all_gather"):
        model = _net()
        codec = gradwire.build_codec("identity")
        _train(gt.DeMo(model.parameters(), lr=0.005, codec=codec, exchange=exchange), model, x, y, 3)
        params[exchange] = flat_parameters(model)
    return dict(same=torch.equal(params["sharded"], params["all_gather"]))


def test_with_a_lossless_codec_sharded_equals_all_gather_bit_for_bit():
    # identity records, exact_mean at 1/world on the owner, a lossless re-encode: the all-gather's mean
    assert all(r["same"] for r in gt.spawn(_lossless_run, 3, (), timeout_s=60))


# -- exchange="all_gather" is the former exchange, bit for bit -------------------------------------------


def _all_gather_reference_run(rank: int, world: int, steps: int) -> dict:
    """DeMo with exchange="all_gather" against the former step written out by hand."""
    x, y = shard(rank)
    model, ref = _net(), _net()
    frames = []
    real = all_gather_exchange.all_gather_bytes

    def spy(payload, group=None, **kw):
        frames.append(bytes(payload))
        return real(payload, group, **kw)

    all_gather_exchange.all_gather_bytes = spy
    opt = gt.DeMo(model.parameters(), lr=0.01, beta=0.9, weight_decay=0.1, exchange="all_gather")
    node = DeMoState(default_demo_codec(), beta=0.9)
    same, sent, received = True, 0, 0
    for step in range(steps):
        for m in (model, ref):
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        named = {f"g0.p{i}": p for i, p in enumerate(ref.parameters())}
        entries = node.compress({n: p.grad for n, p in named.items()}, 0.01)
        frame = write_frame(entries, round=step, sender=rank, bundle=True)
        same &= frame == frames[-1]
        got = all_gather_bytes(frame)
        sent += len(frame)
        received += sum(len(f) for r, f in enumerate(got) if r != rank)
        with torch.no_grad():
            demo_update(named, exact_mean([read_frame(f).entries for f in got]), 0.01, 0.1)
        same &= torch.equal(flat_parameters(model), flat_parameters(ref))
    sd = opt.state_dict()
    return dict(
        same=same,
        counters=[opt.bytes_sent, opt.bytes_received] == [sent, received],
        keys=sorted(sd["gradwire"]),
        momenta=sorted(i for i, f in sd["state"].items() if "momentum" in f),
    )


def test_all_gather_exchange_is_the_former_one_bit_for_bit():
    for r in gt.spawn(_all_gather_reference_run, 2, (4,), timeout_s=60):
        assert r["same"] and r["counters"]
        # the former checkpoint, and the model's shapes and the group's size that a resume is checked against
        assert r["keys"] == ["bytes_received", "bytes_sent", "node", "shapes", "steps", "world"]
        assert r["momenta"] == list(range(6))  # each parameter's momentum in torch's "state", by index


# -- checkpoints ------------------------------------------------------------------------------------------


def _train(opt, model, x, y, steps):
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


@dataclass
class Interrupted:
    """One model trained uninterrupted and again stopped, checkpointed and resumed (:func:`interrupted_run`)."""

    whole: nn.Module
    opt_whole: Any
    first: Any  # the optimizer that was stopped
    saved: dict
    resumed: nn.Module
    opt_resumed: Any


def interrupted_run(make, x, y, checkpoint, steps: int = 6, at: int = 4) -> Interrupted:
    """``make(model)``'s optimizer trained ``steps`` steps, and again from the same start stopped after ``at``:
    ``checkpoint(optimizer)`` is what a fresh optimizer over the stopped model's weights loads to train the
    rest."""
    whole = _net()
    opt_whole = make(whole)
    _train(opt_whole, whole, x, y, steps)
    first = _net()
    opt_first = make(first)
    _train(opt_first, first, x, y, at)
    saved = checkpoint(opt_first)
    resumed = _net()
    resumed.load_state_dict(first.state_dict())
    opt_resumed = make(resumed)
    opt_resumed.load_state_dict(saved)
    _train(opt_resumed, resumed, x, y, steps - at)
    return Interrupted(whole, opt_whole, opt_first, saved, resumed, opt_resumed)


def _resume_run(rank: int, world: int, which: str, model_record: bool) -> dict:
    x, y = shard(rank)
    kw = dict(piece_numel=PIECE, model_record=model_record)
    run = interrupted_run(lambda m: _make(which, m, **kw), x, y, lambda o: checkpoint_roundtrip(o.state_dict()))
    whole, opt_whole, opt_first, saved = run.whole, run.opt_whole, run.first, run.saved
    resumed, opt_resumed = run.resumed, run.opt_resumed
    held = saved["gradwire"]["owner"]  # the owner's residuals, in parameter space or in the DCT coefficient domain
    owner = {**held["residuals"], **{n: c["chunks"] for n, c in held.get("coefficients", {}).items()}}
    out = dict(
        same=torch.equal(flat_parameters(whole), flat_parameters(resumed)),
        counters=[opt_whole.bytes_sent, opt_whole.bytes_received]
        == [opt_resumed.bytes_sent, opt_resumed.bytes_received],
        owner=sorted(owner),
        owned=[p.name for p in opt_first._exchange.owned(rank)],
        residual=any(bool(r.abs().sum() > 0) for r in owner.values()),
        coefficient_domain=sorted(held.get("coefficients", {})),
        identical=all_ranks_equal(flat_parameters(resumed)),
    )
    # In a group of another size the same checkpoint is refused (the pieces have other owners).
    pair = dist.new_group([0, 1])
    if rank < 2:
        other = _make(which, _net(), process_group=pair, **kw)
        try:
            other.load_state_dict(saved)
            out["other_world"] = None
        except ValueError as e:
            out["other_world"] = str(e)
    dist.barrier()
    return out


@pytest.mark.parametrize(
    "which, model_record",
    [("demo", False), ("sparseloco", False), ("onebit", False), ("demo", True)],
    ids=["demo", "sparseloco", "onebit-column-pieces", "demo-model-record"],
)
def test_sharded_checkpoint_resumes_bit_identically_and_only_in_a_group_of_its_size(which, model_record):
    results = gt.spawn(_resume_run, 3, (which, model_record), timeout_s=60)
    for rank, r in enumerate(results):
        assert r["same"] and r["counters"] and r["identical"]
        assert r["owner"] == sorted(r["owned"])  # the owner error feedback travels in the checkpoint
        if rank < 2:
            assert "group of 3 ranks, this group has 2" in r["other_world"], r["other_world"]
    assert any(r["residual"] for r in results)
    # On the CPU an owner keeps a DCT downlink's residuals in the coefficient domain (gradwire.reencode: the
    # records' coefficients summed, never decoded); OneBit's stay in parameter space.
    for r in results:
        assert r["coefficient_domain"] == ([] if which == "onebit" else r["owner"])
    if model_record:
        assert all(n.startswith("@model:") and n.endswith("]") for r in results for n in r["owned"])


def test_single_process_checkpoints_are_refused_across_exchanges_and_ranks():
    x, y = shard(0)
    model = _net()
    opt = _make("demo", model, piece_numel=PIECE)
    _train(opt, model, x, y, 2)
    saved = checkpoint_roundtrip(opt.state_dict())
    assert saved["gradwire"]["exchange"] == "sharded" and saved["gradwire"]["world"] == 1
    with pytest.raises(ValueError, match="exchange='sharded'"):
        _make("demo", _net(), exchange="all_gather").load_state_dict(saved)
    legacy = _make("demo", _net(), exchange="all_gather")
    _train(legacy, model, x, y, 1)
    with pytest.raises(ValueError, match="exchange='all_gather'"):
        _make("demo", _net()).load_state_dict(checkpoint_roundtrip(legacy.state_dict()))
    other_rank = dict(saved, gradwire=dict(saved["gradwire"], rank=1))
    with pytest.raises(ValueError, match="rank 1's"):
        _make("demo", _net(), piece_numel=PIECE).load_state_dict(other_rank)
    # pieces cut otherwise: the node's momenta are the pieces', so the checkpoint names other buffers
    with pytest.raises(
        ValueError,
        match=r"pieces are cut otherwise \(10 pieces, this optimizer's 6;.*'g0.p0\[0:128\]' saved, 'g0.p0' here",
    ):
        _make("demo", _net(), piece_numel=1 << 18).load_state_dict(saved)
    net = _net()
    onebit = _make("onebit", net, piece_numel=PIECE)
    _train(onebit, net, x, y, 2)
    with pytest.raises(ValueError, match=r"'g0.p0\[:,0:16\]' saved, 'g0.p0' here"):
        _make("onebit", _net()).load_state_dict(checkpoint_roundtrip(onebit.state_dict()))
    with pytest.raises(ValueError, match="exchange must be one of"):
        _make("demo", _net(), exchange="ring")
    with pytest.raises(ValueError, match="downlink_codec"):
        _make("demo", _net(), exchange="all_gather", downlink_codec=default_demo_codec())


def test_downlink_codec_defaults_to_the_algorithms_downlink_or_the_uplinks_twin():
    assert repr(_make("demo", _net()).downlink_codec) == repr(default_demo_codec())
    # SparseLoCo's default: the nodes' bytes at 4-bit values (the server's default downlink too).
    assert repr(_make("sparseloco", _net()).downlink_codec) == repr(default_sparseloco_downlink(2))
    codec = default_demo_codec()
    codec.topk = 8
    opt = gt.DeMo(_net().parameters(), lr=0.01, codec=codec)
    assert opt.downlink_codec is not codec and repr(opt.downlink_codec) == repr(codec)
    down = default_demo_codec()
    assert gt.DeMo(_net().parameters(), lr=0.01, downlink_codec=down).downlink_codec is down
    assert _make("demo", _net(), exchange="all_gather").downlink_codec is None


# -- refusals reach every rank ---------------------------------------------------------------------------


def _refusal_run(rank: int, world: int, case: str) -> dict:
    x, y = shard(rank)
    if case == "bad-frame" and rank == 1:
        real = sharded.write_frame

        def wrong_round(entries, *, round=0, **kw):  # a broken peer: the wrong round
            return real(entries, round=round + 7, **kw)

        sharded.write_frame = wrong_round
    if case == "hostile-record" and rank == 1:
        real = sharded.write_frame

        def negative_scales(entries, **kw):  # a hostile peer: records its codec never wrote, scales < 0
            return real([replace(e, sections={**e.sections, "scale": -e.sections["scale"]}) for e in entries], **kw)

        sharded.write_frame = negative_scales
    model = _net() if case in ("bad-frame", "hostile-record") else nn.Sequential(nn.Linear(IN, CLASSES + rank))
    opt = gt.DeMo(model.parameters(), lr=0.01, piece_numel=PIECE)
    loss = model(x).square().mean()
    loss.backward()
    try:
        opt.step()
        err = None
    except (FrameError, ValueError) as e:
        err = type(e).__name__ + ": " + str(e)
    dist.barrier()
    return dict(err=err)


@pytest.mark.parametrize("case", ["bad-frame", "other-shapes", "hostile-record"])
def test_a_refusal_reaches_every_rank_instead_of_a_hang(case):
    results = gt.spawn(_refusal_run, 3, (case,), timeout_s=30)
    assert all(r["err"] for r in results), results
    if case == "hostile-record":
        # the owners took their own records as kept and parsed rank 1's, of the same pieces, as hostile
        assert all("scales must be > 0" in r["err"] or "refused" in r["err"] for r in results), results
        assert sum("scales must be > 0" in r["err"] for r in results) >= 1, results
    if case == "other-shapes":
        assert all("other pieces than rank 0" in r["err"] for r in results)
