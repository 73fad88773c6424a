"""Replayed updates: a node's records that repeat records an earlier round took, refused (409 ``replayed_update``).

A frame is bound to its run and round (docs/FORMAT.md section 10), so a captured frame is refused
verbatim everywhere else. Whoever holds a node token of the run can still take another node's records of
an earlier round and submit them again under a fresh header and binding: the old update then counts a
second time, stale. docs/results/reliability.md measured such a replay costing an AdamW run 9 % of held-out loss
and a re-encoded SparseLoCo run 6 %. An honest node never sends the same non-zero records for two
rounds — its gradients change with every step — so the server remembers a digest of the records of
every update it took in the run's last :data:`REPLAY_WINDOW` rounds and refuses an update whose records
were taken for another round. An all-zero update is exempt (a node with nothing to send may send the
same empty update every round, and it moves nothing).

A copy within the same round (another node's records of this round, resubmitted as one's own) is *not*
refused: the copier may have reached the server first, and refusing the owner would leave the round
one update short, a quorum that never fills. Both count toward the quorum, and the round's aggregate
counts the records once (:func:`.aggregate.counted_once`: the later sender's weight is 0).

The digest covers every record except the run binding: name, codec, dtype, shape, parameters and each
section's bytes (BLAKE2b-128). It is kept in memory: after a restart the open round's updates are
remembered again (they are replayed from the store), the closed rounds' are not, so a replay across a
restart is bounded by the run's rule alone, as any crafted update is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from gradwire.frame import Entry

from .errors import Reason, Rejected

__all__ = ["REPLAY_WINDOW", "RecentRecords", "records_digest", "update_digest"]

#: How many rounds back an update's records are remembered.
REPLAY_WINDOW = 64


def records_digest(entries: Sequence[Entry]) -> bytes:
    """BLAKE2b-128 of ``entries`` (the binding record already stripped): each record's name, codec,
    dtype, shape, parameters and sections, length-prefixed so no two record lists share a digest."""
    h = hashlib.blake2b(digest_size=16, person=b"gradwire-recs-v1")

    def put(b: bytes) -> None:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    for e in entries:
        put(e.name.encode("utf-8"))
        put(f"{e.codec}|{e.dtype}|{tuple(e.shape)}".encode())
        put(bytes(e.params))
        for name in sorted(e.sections):
            put(name.encode("utf-8"))
            put(e.sections[name].tobytes())
    return h.digest()


def update_digest(entries: Sequence[Entry], norm: float) -> bytes | None:
    """What an update is remembered and compared by: :func:`records_digest` of its records, or ``None``
    for an all-zero update (``norm`` 0), which is never a replay or a copy of anything."""
    return records_digest(entries) if norm > 0.0 else None


@dataclass
class RecentRecords:
    """The digests of the records a run took in its last ``window`` rounds: ``{digest: (node, round)}``."""

    window: int = REPLAY_WINDOW
    seen: dict[bytes, tuple[int, int]] = field(default_factory=dict)

    def check(self, digest: bytes | None, node_id: int, round: int) -> None:
        """:class:`Rejected` (``replayed_update``) if these records were taken for another round."""
        if digest is None:
            return
        first = self.seen.get(digest)
        if first is not None and first[1] != round:
            raise Rejected(
                Reason.REPLAYED_UPDATE,
                f"node {node_id}'s update for round {round} repeats the records node {first[0]} sent "
                f"for round {first[1]}: an update is taken once",
            )

    def add(self, digest: bytes | None, node_id: int, round: int) -> None:
        if digest is not None:
            self.seen.setdefault(digest, (node_id, round))

    def forget_before(self, round: int) -> None:
        """Drop what was sent for rounds before ``round − window`` (at every round close)."""
        oldest = round - self.window
        if any(r < oldest for _, r in self.seen.values()):
            self.seen = {d: nr for d, nr in self.seen.items() if nr[1] >= oldest}
