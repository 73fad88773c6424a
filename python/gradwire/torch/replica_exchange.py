"""The all-gather exchange across torchft's replica groups: one bundle frame per group over the Manager's
reconfigurable gloo process group, refused frames left out alike on every group, and the round counted only
when torchft's ``should_commit`` says so.

Replica groups are sites, not ranks, so the exchange across them is the all-gather one (every group reads
every frame). torchft's gloo process group carries ``allgather``, ``alltoall_base`` and ``broadcast`` (not
``reduce_scatter``), so the sharded exchange's collectives would pass; its owners and their downlink
residuals are cut for one group size, and moving them at a quorum change is not built
(docs/FAULT_TOLERANCE.md).

A frame another group sent is checked as hostile input before anything of it is used: it must parse under
``limits``, be a bundle for this round from that group's rank, and carry records of exactly this group's
names that decode to this group's shapes. One that does not is left out of the mean and counted in
:attr:`ReplicaExchange.refusals`; every group reads the same frames, so every group leaves out the same ones
and computes the same mean, and the group that sent it keeps training with the others.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from ..errors import FrameError
from ..frame import DEFAULT_LIMITS, Entry, Limits, decode_entry, read_frame, write_frame
from .all_gather_exchange import AllGatherExchange
from .round_outcome import RoundNotCommitted

__all__ = ["ReplicaExchange"]


class ReplicaExchange(AllGatherExchange):
    """One group's side of the exchange over ``manager``'s process group ``pg`` (torchft's). ``refusals``:
    ``(step, rank, reason)`` of every frame left out; ``given_up``: the rounds that did not commit."""

    def __init__(self, manager: Any, pg: Any, limits: Limits | None):
        super().__init__(None, limits)
        self.manager = manager
        self.pg = pg
        self.refusals: list[tuple[int, int, str]] = []
        self.given_up = 0
        self.kept_last = 0  # the groups whose frames made the last committed round's mean

    def rank(self) -> int:
        r = self.manager.participating_rank()
        return 0 if r is None else int(r)

    def world(self) -> int:
        return max(1, int(self.manager.num_participants()))

    def __call__(self, entries: list[Entry], round: int) -> list[list[Entry]]:
        step = int(self.manager.current_step())  # every group of the quorum is at the same step (healed)
        rank = self.rank()
        frame = self._own_frame(entries, step, rank)
        try:
            frames = self._all_gather(frame)
        except Exception as exc:  # a peer died or hung in the collective: this round does not count
            self.manager.report_error(exc)
            frames = None
        kept = self._checked(frames, entries, step) if frames is not None else []
        if not self.manager.should_commit():
            self.given_up += 1
            raise RoundNotCommitted(f"round at step {step} did not commit (torchft should_commit: False)")
        if not kept:  # every frame refused, alike on every group: nothing to apply
            self.given_up += 1
            raise RoundNotCommitted(f"round at step {step}: every group's frame was refused")
        self.bytes_sent += len(frame)
        self.bytes_received += sum(len(f) for r, f in enumerate(frames) if r != rank)
        self.kept_last = len(kept)
        return kept

    def _own_frame(self, entries: list[Entry], step: int, rank: int) -> bytes:
        return write_frame(entries, round=step, sender=rank, bundle=True)

    def _all_gather(self, frame: bytes) -> list[bytes]:
        """Every group's frame, in group rank order: the lengths, then the frames padded to the longest."""
        world = self.world()
        mine = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if frame else torch.zeros(0, dtype=torch.uint8)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        self.pg.allgather([lengths], [torch.tensor([mine.numel()], dtype=torch.int64)], AllgatherOptions()).wait()
        sizes = [int(t.item()) for t in lengths]
        for r, n in enumerate(sizes):
            if not 0 <= n <= self.limits.max_frame_bytes:
                raise FrameError(
                    f"group rank {r} announced a frame of {n} bytes, outside 0..{self.limits.max_frame_bytes}"
                )
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: mine.numel()] = mine
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        self.pg.allgather([out], [padded], AllgatherOptions()).wait()
        return [t[:n].numpy().tobytes() for t, n in zip(out, sizes)]

    def _checked(self, frames: list[bytes], mine: list[Entry], step: int) -> list[list[Entry]]:
        shapes = {e.name: tuple(decode_entry(e).shape) for e in mine}
        kept = []
        for r, data in enumerate(frames):
            try:
                got = read_frame(data, limits=self.limits or DEFAULT_LIMITS)
                if not got.bundle or got.round != step or got.sender != r:
                    raise FrameError(
                        f"a {'bundle' if got.bundle else 'tensor'} frame for step {got.round} from sender "
                        f"{got.sender}; expected a bundle for step {step} from {r}"
                    )
                names = [e.name for e in got.entries]
                if sorted(names) != sorted(shapes):
                    raise FrameError(f"records {sorted(names)[:4]}, expected {sorted(shapes)[:4]}")
                for e in got.entries:
                    shape = tuple(decode_entry(e).shape)
                    if shape != shapes[e.name]:
                        raise FrameError(f"record {e.name!r} decodes to {shape}, expected {shapes[e.name]}")
            except Exception as exc:  # hostile or broken: left out here and, alike, on every group
                self.refusals.append((step, r, f"{type(exc).__name__}: {exc}"))
                continue
            kept.append(got.entries)
        return kept

    def state_dict(self) -> dict[str, int]:
        # No group size: a joiner loads a healthy group's state whatever the quorum's size.
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("exchange", "all_gather")
        if saved != "all_gather":
            raise ValueError(f"this state was saved with exchange={saved!r}; across replica groups it is 'all_gather'")
