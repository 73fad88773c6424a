"""The all-gather exchange of the DeMo and SparseLoCo optimizers (``exchange="all_gather"``): one bundle
frame per rank, all-gathered, every rank's read back in rank order, with the byte counters."""

from __future__ import annotations

import torch.distributed as dist

from ..errors import FrameError
from ..frame import DEFAULT_LIMITS, Entry, Limits, read_frame, write_frame
from .collectives import GroupMember, all_gather_bytes, comm_device

__all__ = ["AllGatherExchange", "ReportsFrameBytes"]


class AllGatherExchange(GroupMember):
    """One bundle frame per rank, all-gathered and read back in rank order; the byte counters."""

    def __init__(self, process_group: dist.ProcessGroup | None, limits: Limits | None):
        self.process_group = process_group
        self.limits = limits or DEFAULT_LIMITS
        self.bytes_sent = 0
        self.bytes_received = 0

    def __call__(self, entries: list[Entry], round: int) -> list[list[Entry]]:
        """Every rank's records, in rank order (this rank's read back from its own frame too)."""
        rank = self.rank()
        frame = write_frame(entries, round=round, sender=rank, bundle=True)
        if self._distributed():
            g = self.process_group
            frames = all_gather_bytes(frame, g, device=comm_device(g), limits=self.limits)
        else:
            frames = [frame]
        out = []
        received = 0
        for r, data in enumerate(frames):
            got = read_frame(data, limits=self.limits)
            if not got.bundle or got.round != round or got.sender != r:
                raise FrameError(
                    f"rank {r} sent a {'bundle' if got.bundle else 'tensor'} frame for round {got.round} from"
                    f" sender {got.sender}; expected a bundle frame for round {round} from {r}"
                )
            if r != rank:
                received += len(data)
            out.append(got.entries)
        self.bytes_sent += len(frame)
        self.bytes_received += received
        return out

    def state_dict(self) -> dict[str, int]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "world": self.world()}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("exchange", "all_gather")
        if saved != "all_gather":
            raise ValueError(
                f"this checkpoint was saved with exchange={saved!r}; this optimizer uses exchange='all_gather' "
                f"(build it with exchange={saved!r} to resume it)"
            )
        world = self.world()
        if int(state.get("world", world)) != world:
            raise ValueError(
                f"this checkpoint was saved by a group of {int(state['world'])} ranks, this group has {world}: the "
                "momenta and error buffers it holds are one rank's share of that group's exchange (resume in a "
                "group of the same size, each rank from its own checkpoint)"
            )
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_received = int(state["bytes_received"])


class ReportsFrameBytes:
    """``bytes_sent`` / ``bytes_received`` of an optimizer, read from its exchange (``self._exchange``)."""

    _exchange: AllGatherExchange

    @property
    def bytes_sent(self) -> int:
        """This rank's frame bytes, cumulative."""
        return self._exchange.bytes_sent

    @property
    def bytes_received(self) -> int:
        """The other ranks' frame bytes this rank read, cumulative."""
        return self._exchange.bytes_received
