"""The DDP hook's overlap with backward, on real gloo process groups (2 local ranks, forked).

What is checked is behaviour, never time: the futures the hook hands DDP are still pending when it
returns (the exchange really is asynchronous) while ``overlap=False`` hands them back done; models cut
into many buckets of different sizes train to the same bits as a reference that exchanges and decodes
every bucket by hand, outside DDP, one collective at a time; and no layout of buckets (one bucket, a
tiny last one, one per parameter) leaves a rank waiting (every collective is bounded by ``timeout_s``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire
import gradwire.torch as gt
from distributed_toys import all_ranks_equal, flat_parameters, make_model, shard
from gradwire.algorithms import exact_mean
from gradwire.feedback import ErrorFeedback
from gradwire.frame import read_frame, write_frame

# A hang fails the test within this many seconds instead of blocking the suite.
TIMEOUT_S = 30.0


def _tower(seed: int = 0) -> nn.Module:
    """32 → 40 → 24 → 56 → 8: layers of different sizes, so small buckets differ in size too."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 40), nn.ReLU(), nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 56), nn.ReLU(), nn.Linear(56, 8)
    )


def _codec(name: str) -> gradwire.Codec:
    return gradwire.build_codec(name, **(dict(chunk_shape=(64,), topk=8) if name == "dct" else {}))


# -- (a) the futures are pending on return -------------------------------------------------------


def _futures_at_return(rank: int, world: int, overlap: bool, steps: int) -> dict:
    model = DDP(_tower(), bucket_cap_mb=0.002)
    state, hook = gt.ddp_hook(_codec("dct"), overlap=overlap)
    seen: list[tuple[bool, bool, torch.futures.Future]] = []
    pending_when_next_bucket_starts: list[bool] = []

    def noting_hook(s, bucket):
        if seen:
            # The previous bucket's frames are launched by this very hook: until then they cannot
            # have been decoded, so its future must still be pending (a blocking hook's is done).
            pending_when_next_bucket_starts.append(not seen[-1][2].done())
        fut = hook(s, bucket)
        seen.append((bucket.is_last(), fut.done(), fut))
        return fut

    model.register_comm_hook(state, noting_hook)
    x, y = shard(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    per_step = []
    for _ in range(steps):
        seen.clear()
        pending_when_next_bucket_starts.clear()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        per_step.append(
            dict(
                buckets=len(seen),
                non_final_pending_at_return=[not done for last, done, _ in seen if not last],
                pending_when_next_bucket_starts=list(pending_when_next_bucket_starts),
                all_done_after_backward=all(f.done() for _, _, f in seen),
            )
        )
        opt.step()
    return dict(steps=per_step, identical=all_ranks_equal(flat_parameters(model.module)))


def test_futures_of_non_final_buckets_are_pending_when_the_hook_returns():
    for r in gt.spawn(_futures_at_return, 2, (True, 4), timeout_s=TIMEOUT_S):
        assert r["identical"]
        for step in r["steps"][1:]:  # after DDP's rebuild
            assert step["buckets"] >= 3, step
            assert step["non_final_pending_at_return"] and all(step["non_final_pending_at_return"]), step
            assert all(step["pending_when_next_bucket_starts"]), step
            assert step["all_done_after_backward"], step


def test_blocking_hook_hands_back_completed_futures():
    # The same observation on overlap=False: what the test above would see without the overlap.
    for r in gt.spawn(_futures_at_return, 2, (False, 3), timeout_s=TIMEOUT_S):
        assert r["identical"]
        for step in r["steps"][1:]:
            assert step["non_final_pending_at_return"] and not any(step["non_final_pending_at_return"]), step
            assert not any(step["pending_when_next_bucket_starts"]), step


# -- (b) many buckets: the same bits as a by-hand, one-collective-at-a-time reference ----------------


class _Reference:
    """The hook's arithmetic without DDP and without overlap: per bucket (the layout DDP used that step),
    flat gradient + per-parameter residual pieces → ErrorFeedback → frame → ``all_gather_bytes`` (blocking)
    → every rank's record summed exactly in rank order (the CPU path) → ÷ world."""

    def __init__(self, model: nn.Module, codec: gradwire.Codec, lr: float):
        self.model = model
        self.params = list(model.parameters())
        self.feedback = ErrorFeedback(codec)
        self.pieces: dict[int, torch.Tensor] = {}  # parameter position → its residual
        self.opt = torch.optim.SGD(self.params, lr=lr)

    def step(self, x, y, buckets: list[list[int]], round: int, rank: int, world: int) -> None:
        self.opt.zero_grad()
        nn.functional.cross_entropy(self.model(x), y).backward()
        for index, positions in enumerate(buckets):
            name = f"bucket{index}"
            grads = [self.params[i].grad.reshape(-1) for i in positions]
            flat = torch.cat(grads)
            self.feedback.reset(name)
            if any(i in self.pieces for i in positions):
                self.feedback.set_residual(
                    name, torch.cat([self.pieces.get(i, torch.zeros_like(g)) for i, g in zip(positions, grads)])
                )
            frame = write_frame([self.feedback.compress(flat, name)], round=round, sender=rank)
            entries = [read_frame(data).entries[0] for data in gt.all_gather_bytes(frame)]
            total = exact_mean([[e] for e in entries], [1.0] * world)[name]  # on the CPU: exactly
            mean = total.div_(world)
            residual, offset = self.feedback.residual(name), 0
            for i, g in zip(positions, grads):
                self.params[i].grad.copy_(mean[offset : offset + g.numel()].view_as(self.params[i].grad))
                self.pieces[i] = residual[offset : offset + g.numel()]
                offset += g.numel()
        self.opt.step()


def _many_buckets(rank: int, world: int, codec_name: str, bucket_mb: float, steps: int) -> dict:
    lr = 0.3
    nets = {}
    layouts: list[list[int]] = []
    for overlap in (True, False):
        model = DDP(_tower(), bucket_cap_mb=bucket_mb)
        state, hook = gt.ddp_hook(_codec(codec_name), overlap=overlap)
        if overlap:
            position = {id(p): i for i, p in enumerate(model.module.parameters())}

            def noting_hook(s, bucket, hook=hook, position=position):
                layouts.append([position[id(p)] for p in bucket.parameters()])
                return hook(s, bucket)

            model.register_comm_hook(state, noting_hook)
        else:
            model.register_comm_hook(state, hook)
        nets[overlap] = (model, torch.optim.SGD(model.parameters(), lr=lr), state)
    reference = _Reference(_tower(), _codec(codec_name), lr)
    x, y = shard(rank)
    bucket_counts, bucket_sizes = [], set()
    for step in range(steps):
        layouts.clear()
        for model, opt, _ in nets.values():
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        bucket_counts.append(len(layouts))
        bucket_sizes |= {sum(reference.params[i].numel() for i in b) for b in layouts}
        reference.step(x, y, list(layouts), step, rank, world)
    overlapped, blocking, by_hand = (
        flat_parameters(m) for m in (nets[True][0].module, nets[False][0].module, reference.model)
    )
    return dict(
        overlap_vs_blocking=torch.equal(overlapped, blocking),
        overlap_vs_reference=torch.equal(overlapped, by_hand),
        max_diff=float((overlapped - by_hand).abs().max()),
        moved=float((overlapped - flat_parameters(_tower())).abs().max()),
        identical=all_ranks_equal(overlapped),
        buckets=bucket_counts,
        sizes=sorted(bucket_sizes),
        steps=nets[True][2].steps,
    )


@pytest.mark.parametrize("codec_name", ["dct", "3lc"])
def test_many_buckets_train_to_the_reference_bits_on_every_rank(codec_name):
    steps = 5
    for r in gt.spawn(_many_buckets, 2, (codec_name, 0.0001, steps), timeout_s=TIMEOUT_S):
        assert max(r["buckets"]) >= 4 and len(r["sizes"]) >= 3, r  # several buckets, of different sizes
        assert r["steps"] == steps
        assert r["moved"] > 1e-3, r
        assert r["identical"], "parameters differ between ranks"
        assert r["overlap_vs_blocking"], r
        assert r["overlap_vs_reference"], r


# -- (c) no layout of buckets leaves a rank waiting ----------------------------------------------


def _layout_run(rank: int, world: int, bucket_mb: float, per_parameter: bool, steps: int) -> dict:
    model = DDP(make_model(), bucket_cap_mb=bucket_mb)
    state, hook = gt.ddp_hook(_codec("dct"), per_parameter=per_parameter)
    counts: list[int] = []

    def counting_hook(s, bucket):
        counts.append(bucket.index())
        return hook(s, bucket)

    model.register_comm_hook(state, counting_hook)
    x, y = shard(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # Half the shard on odd steps: frame lengths change from step to step and differ between ranks.
    for step in range(steps):
        n = len(y) if step % 2 == 0 else len(y) // 2 + 17 * rank
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[:n]), y[:n]).backward()
        opt.step()
    return dict(
        steps=state.steps,
        buckets_last_step=max(counts) + 1,
        identical=all_ranks_equal(flat_parameters(model.module)),
        pending=state._waiting is not None,
    )


@pytest.mark.parametrize(
    "bucket_mb, per_parameter, buckets",
    # DDP closes a bucket once it reaches the cap, so the small biases ride with the next weight.
    [(25.0, False, 1), (0.0001, False, 3), (0.0001, True, 3), (0.0015, False, 2)],
    ids=["one-bucket", "bucket-per-weight", "bucket-per-weight-bundles", "two-uneven-buckets"],
)
def test_no_bucket_layout_hangs(bucket_mb, per_parameter, buckets):
    steps = 4
    for r in gt.spawn(_layout_run, 2, (bucket_mb, per_parameter, steps), timeout_s=TIMEOUT_S):
        assert r["steps"] == steps
        assert r["buckets_last_step"] == buckets, r
        assert r["identical"]
        assert not r["pending"]  # nothing left for the next step to launch
