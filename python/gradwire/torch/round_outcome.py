"""The one outcome of a round a transport may report besides its mean: the round does not count.

A fault-tolerant transport (:class:`gradwire.torch.FaultTolerant`, on torchft's managed replica groups) raises
:class:`RoundNotCommitted` from its exchange when the round may not be applied (a peer failed during it, or
torchft's ``should_commit`` said no). :class:`~gradwire.torch.AlgorithmOptimizer` then gives what it sent back
to the node side and returns the replica to the last synced version, as when a server publishes a round
without this node.
"""

from __future__ import annotations

__all__ = ["RoundNotCommitted"]


class RoundNotCommitted(RuntimeError):
    """This round's exchange happened (or failed) but the round does not count on this replica."""
