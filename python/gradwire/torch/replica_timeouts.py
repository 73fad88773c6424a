"""Every timeout of a fault-tolerant run across replica groups, the order they must keep, and defaults.

A torchft run has several clocks that only work together in one order (torchft PR #75: a join timeout
shorter than a recovery, and recovering groups never rejoin). :class:`ReplicaTimeouts` holds all of them in
seconds; :meth:`ReplicaTimeouts.check` (run at construction) refuses a setting that breaks a rule with
:class:`TimeoutOrderError` naming the rule and the values. docs/FAULT_TOLERANCE.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta

__all__ = ["TIMEOUT_RULES", "ReplicaTimeouts", "TimeoutOrderError"]


class TimeoutOrderError(ValueError):
    """A :class:`ReplicaTimeouts` setting that breaks one of :data:`TIMEOUT_RULES`; ``rule`` names it."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


#: ``(name, smaller, larger, factor, why)``: each rule holds when ``factor * smaller < larger``.
TIMEOUT_RULES: tuple[tuple[str, str, str, float, str], ...] = (
    (
        "heartbeat_interval<heartbeat_timeout/2",
        "heartbeat_interval",
        "heartbeat_timeout",
        2.0,
        "a live group's manager heartbeats at least twice before the lighthouse counts it dead",
    ),
    (
        "quorum_tick<heartbeat_timeout",
        "quorum_tick",
        "heartbeat_timeout",
        1.0,
        "the lighthouse looks at its heartbeats more often than it lets one lapse",
    ),
    (
        "state_download<process_group",
        "state_download",
        "process_group",
        1.0,
        "the healthy groups wait in the round's collective while a joiner downloads the state",
    ),
    (
        "process_group<operation",
        "process_group",
        "operation",
        1.0,
        "a collective with a dead peer fails before the step's should_commit gives up",
    ),
    (
        "state_download<join",
        "state_download",
        "join",
        1.0,
        "a recovery fits in the lighthouse's join window (torchft PR #75), or a recovering group never rejoins",
    ),
    (
        "heartbeat_timeout<join",
        "heartbeat_timeout",
        "join",
        1.0,
        "a dead group is dropped before the lighthouse stops waiting for stragglers",
    ),
    (
        "join<quorum",
        "join",
        "quorum",
        1.0,
        "a manager waits for its quorum longer than the lighthouse waits for late joiners",
    ),
    (
        "connect<quorum",
        "connect",
        "quorum",
        1.0,
        "connecting to the lighthouse and the managers fits in one quorum's wait",
    ),
)


@dataclass(frozen=True)
class ReplicaTimeouts:
    """The timeouts of a fault-tolerant run, in seconds. ``heartbeat_interval``: how often a group's manager
    tells the lighthouse it lives; ``heartbeat_timeout``: how long the lighthouse waits for one before it drops
    the group; ``quorum_tick``: how often the lighthouse re-evaluates the quorum; ``join``: how long it waits
    for a heartbeating group that has not asked for the quorum yet; ``quorum``: how long a manager waits for a
    quorum; ``connect``: an RPC connection (lighthouse, managers); ``process_group``: one collective of the
    replica groups' process group (gloo); ``operation``: torchft's own operations (``should_commit``, the
    checkpoint address); ``state_download``: gradwire's own, a joiner's download of the state from a healthy
    group. The defaults fit sites on the internet and keep every rule."""

    heartbeat_interval: float = 0.1
    heartbeat_timeout: float = 2.0
    quorum_tick: float = 0.1
    join: float = 60.0
    quorum: float = 120.0
    connect: float = 10.0
    process_group: float = 30.0
    operation: float = 60.0
    state_download: float = 20.0

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """:class:`TimeoutOrderError` for a value that is not a positive number or a broken rule."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise TimeoutOrderError(
                    "positive", f"ReplicaTimeouts.{f.name} must be a positive number of seconds, got {v!r}"
                )
        for name, small, large, factor, why in TIMEOUT_RULES:
            a, b = getattr(self, small), getattr(self, large)
            if not factor * a < b:
                scaled = f"{factor:g} × {small}" if factor != 1 else small
                raise TimeoutOrderError(
                    name,
                    f"ReplicaTimeouts breaks rule {name}: {scaled} must be < {large} ({why}); "
                    f"got {small}={a:g} s, {large}={b:g} s",
                )

    def delta(self, name: str) -> timedelta:
        """One timeout as a ``timedelta`` (what torchft takes)."""
        return timedelta(seconds=float(getattr(self, name)))

    def ms(self, name: str) -> int:
        """One timeout in whole milliseconds (what torchft's lighthouse takes), at least 1."""
        return max(1, round(float(getattr(self, name)) * 1000))

    @property
    def fault_to_commit_bound(self) -> float:
        """The issue's bound on the time from a group's death to the survivors' next committed round (the
        target of bench/elastic.py): twice the heartbeat timeout plus the quorum tick. A dead peer's sockets
        close, so the round it broke fails at once; a peer that hangs instead adds ``process_group``."""
        return 2.0 * (self.heartbeat_timeout + self.quorum_tick)
