"""The sharded exchange across torchft's replica groups: the pieces cut once for the run's expected number of
groups, their owners re-cut from every quorum's membership, the collectives over the Manager's reconfigurable
gloo process group, hostile groups left out alike on every group, and the round counted only when torchft's
``should_commit`` says so.

Where the all-gather exchange (:mod:`gradwire.torch.replica_exchange`) makes every group receive every other
group's frame (n − 1 frames per sync), this is the sharded exchange of :mod:`gradwire.torch.sharded`: each
group owns about 1/n of the pieces, receives the other groups' records of its pieces (phase 1, one
``alltoall_base``) and every owner's re-encoded mean (phase 2, one ``allgather``): about (n − 1)/n of a frame
each way per phase. What a group-size change does:

- **Owners follow the quorum.** Every round the owners are assigned over the quorum's participants, in
  torchft's participating-rank order (:func:`~gradwire.torch.sharded.assign_owners`: the same on every
  group). The pieces themselves stay as cut for ``groups`` (the node side's buffers are keyed by them).
- **An owner's residual is its own.** The downlink error feedback of a piece lives with its owner; a group
  that stops owning a piece drops that piece's residual (what it had not yet sent of the piece's means is
  lost, as with a dead owner), and a new owner starts from zero. Every group still decodes the same bytes,
  so the replicas stay bit-identical; a joiner does not take a healthy group's residuals
  (:meth:`ReplicaShardedExchange.state_dict` holds none).
- **Hostile or broken groups are left out.** Every round the groups all-gather their layout digests
  (pieces, codecs' templates); a group whose digest is not the most common one is left out as a sender and
  as an owner, and raises itself. An owner leaves out a sender whose records do not read (the mean is over
  the others); every group leaves out an owner whose frame does not read, alike (its pieces' mean is zero
  this round). Each is counted in :attr:`ReplicaShardedExchange.refusals`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

from ..errors import FrameError
from ..frame import Entry, Limits, decode_entry
from .round_outcome import RoundNotCommitted
from .sharded import Piece, ShardedExchange

__all__ = ["ReplicaShardedExchange"]


class ReplicaShardedExchange(ShardedExchange):
    """One group's side of the sharded exchange over ``manager``'s process group ``pg`` (torchft's), with the
    pieces, downlink codec and limits of ``base`` (the optimizer's own sharded exchange, cut for the run's
    groups). ``refusals``: ``(step, rank, reason)`` of every frame or digest left out; ``given_up``: the
    rounds that did not commit; ``kept_last``: the senders the last committed round's owners averaged (this
    group's own pieces)."""

    name = "sharded"

    def __init__(self, base: ShardedExchange, manager: Any, pg: Any, limits: Limits | None = None):
        super().__init__(base.pieces, base.downlink, None, limits or base.limits)
        self.manager = manager
        self.pg = pg
        self.refusals: list[tuple[int, int, str]] = []
        self.given_up = 0
        self.kept_last = 0
        self._left_out: set[int] = set()
        self._step = 0

    # -- the group: torchft's quorum -------------------------------------------------------------

    def rank(self) -> int:
        r = self.manager.participating_rank()
        return 0 if r is None else int(r)

    def world(self) -> int:
        return max(1, int(self.manager.num_participants()))

    def _distributed(self) -> bool:
        return True

    # -- one round ---------------------------------------------------------------------------------

    def __call__(
        self, entries: Sequence[Entry], round: int, device=None, tensors: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        step = self._step = int(self.manager.current_step())  # every group of the quorum is at the same step
        owned = {p.name for p in self.owned(self.rank())}
        for name in self.feedback.names():  # a piece this group no longer owns: its residual goes
            if name not in owned:
                self.feedback.reset(name)
        self._checked = False  # the membership may have changed: the digests every round
        mean = None
        try:
            mean = super().__call__(entries, step, device, tensors)
        except (FrameError, ValueError):  # this group's own refusal (_LeftOut among them): not a peer's fault
            raise
        except Exception as exc:  # a peer died or hung in a collective: this round does not count
            self.manager.report_error(exc)
        if not self.manager.should_commit() or mean is None:
            self.given_up += 1
            raise RoundNotCommitted(f"round at step {step} did not commit (torchft should_commit: False)")
        return mean

    def _check_layout(self) -> None:
        """Every group's digest; those not the most common (ties: the lowest rank's) are left out this round,
        and a group that is one of them raises :class:`ValueError` itself."""
        rows = self._gather_digests(torch.tensor(list(self._digest()), dtype=torch.uint8))
        digests = [bytes(rows[r].tolist()) for r in range(rows.shape[0])]
        counts = Counter(digests)
        common = max(counts, key=lambda d: (counts[d], -digests.index(d)))
        self._left_out = {r for r, d in enumerate(digests) if d != common}
        for r in sorted(self._left_out):
            self.refusals.append((self._step, r, "its pieces or codecs differ from the quorum's (layout digest)"))
        if self.rank() in self._left_out:
            raise _LeftOut(
                "this replica group cut the parameters into other pieces, or writes other records of them, than "
                "the quorum's other groups (different tensor shapes, codec settings or piece_numel)"
            )
        self._checked = True

    # -- the collectives over torchft's process group -----------------------------------------------

    def _allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world())]
        self.pg.allgather([out], [tensor], AllgatherOptions()).wait()
        return out

    def _gather_digests(self, mine: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._allgather(mine))

    def _checked_length(self, n: int, who: str) -> int:
        if not 0 <= n <= self.limits.max_frame_bytes:
            raise FrameError(
                f"group rank {who} announced a frame of {n} bytes, outside 0..{self.limits.max_frame_bytes}"
            )
        return n

    def _all_to_all(self, payloads: Sequence[bytes]) -> list[bytes]:
        world, me = self.world(), self.rank()
        if world == 1:
            return [payloads[me]]
        row = torch.tensor([0 if r == me else len(p) for r, p in enumerate(payloads)], dtype=torch.int64)
        rows = self._allgather(row)  # every group checks every announced length before receiving anything
        for s in range(world):
            for r in range(world):
                self._checked_length(int(rows[s][r]), str(s))
        incoming = [int(rows[s][me]) for s in range(world)]
        send = b"".join(b"" if r == me else bytes(p) for r, p in enumerate(payloads))
        out = torch.empty(sum(incoming), dtype=torch.uint8)
        inp = torch.frombuffer(bytearray(send), dtype=torch.uint8) if send else torch.zeros(0, dtype=torch.uint8)
        self.pg.alltoall_base(out, inp, incoming, [int(x) for x in row], AllToAllOptions()).wait()
        got, at = [], 0
        for s, n in enumerate(incoming):
            got.append(payloads[me] if s == me else out[at : at + n].numpy().tobytes())
            at += n
        return got

    def _all_gather(self, frame: bytes) -> list[bytes]:
        world = self.world()
        if world == 1:
            return [frame]
        sizes = [int(t.item()) for t in self._allgather(torch.tensor([len(frame)], dtype=torch.int64))]
        for r, n in enumerate(sizes):
            self._checked_length(n, str(r))
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        if frame:
            padded[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        return [t[:n].numpy().tobytes() for t, n in zip(self._allgather(padded), sizes)]

    # -- the owners' reading: a group that does not read is left out, alike everywhere ----------------

    def _senders(self, got: Sequence, round: int, me: int, pieces: Sequence[Piece], mine: Mapping[str, Entry]):
        records = []
        for s in range(self.world()):
            if s == me:
                records.append([mine[p.name] for p in pieces])
                continue
            if s in self._left_out:
                continue
            try:
                theirs = self._read(got[s], round, s, pieces, "records for its pieces", phase=1)
                # Decoded here, each sender alone: a record that parses as a frame but not as its codec's
                # (negative scales, say) must leave its sender out now, not fail the owner's mean after the
                # other groups have moved on to phase 2 (twice the owner's decode work; a run of sites is
                # bound by its links).
                for e in theirs:
                    decode_entry(e)
                records.append(theirs)
            except (FrameError, ValueError) as exc:  # hostile or broken: the mean is over the others
                self.refusals.append((round, s, f"{type(exc).__name__}: {exc}"))
        self.kept_last = len(records)
        return records, [1.0 / len(records)] * len(records)

    def _owners_means(
        self, frames: Sequence, round: int, me: int, owned: Sequence[Sequence[Piece]]
    ) -> tuple[list[Entry], list[Piece]]:
        theirs: list[Entry] = []
        left_out: list[Piece] = []
        for r, data in enumerate(frames):
            if r == me or not owned[r]:
                continue
            try:
                if r in self._left_out:
                    raise FrameError("left out by the layout digests")
                if self._is_refusal(data):
                    raise FrameError("it refused the records it was sent")
                theirs += self._read(data, round, r, owned[r], "its re-encoded mean", phase=2)
            except (FrameError, ValueError) as exc:  # every group reads the same bytes: left out alike
                self.refusals.append((round, r, f"owner: {type(exc).__name__}: {exc}"))
                left_out += owned[r]
        return theirs, left_out

    # -- state: no group size and no residuals (a joiner loads a healthy group's state) ---------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "exchange": self.name,
            "pieces": [p.name for p in self.pieces.pieces],
        }

    def load_state_dict(self, state: Mapping[str, Any], devices: Mapping[str, torch.device] | None = None) -> None:
        saved = state.get("exchange", "all_gather")
        if saved != self.name:
            raise ValueError(f"this state was saved with exchange={saved!r}; this group's exchange is 'sharded'")
        names = [p.name for p in self.pieces.pieces]
        if list(state.get("pieces", names)) != names:
            raise ValueError("this state's pieces are cut otherwise: every group must cut them for the same groups")
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_received = int(state["bytes_received"])


class _LeftOut(ValueError):
    """This group is the one whose layout digest differs from the quorum's."""
