"""Training algorithms written once, for every transport.

Each algorithm is split into its *node side* (form a frame's records from local state; apply a received
aggregate) and its *aggregation side* (combine the senders' records). The node side keeps its own state
(momenta, error buffers, the outer optimizer) with ``state_dict()`` / ``load_state_dict()``; the
aggregation side is :func:`exact_mean`, a fixed sequence of elementwise float32 operations, so every
process that applies the same frames in the same order holds the same bits.

- DeMo (:mod:`.demo`): :class:`DeMoState` (momentum, DCT top-k of it sent, the rest kept),
  :func:`demo_update` (``-lr * sign(mean)`` plus decoupled weight decay).
- SparseLoCo (:mod:`.sparseloco`): :class:`SparseLoCoState` (pseudo-gradient into a decaying error
  buffer, its compressed part sent), :class:`OuterStep` (the outer optimizer from the last synced weights).
- :func:`exact_mean` (:mod:`gradwire.aggregation`, re-exported here): the bit-exact average of the
  senders' records; :func:`exact_trimmed_mean` its coordinate-wise robust counterpart (trimmed mean,
  median). That module holds every aggregation rule, for the server too.

The transports (``gradwire.torch.DeMo`` / ``SparseLoCo`` on torch.distributed, the server, the client's
``Node``) only move frames; docs/ALGORITHMS.md gives the exactness argument.
"""

from __future__ import annotations

from ..aggregation import exact_aggregate, exact_mean, exact_trimmed_mean, trim_count
from .demo import DeMoState, default_demo_codec, demo_update
from .sparseloco import OuterStep, SparseLoCoState, default_sparseloco_codec

__all__ = [
    "DeMoState",
    "OuterStep",
    "SparseLoCoState",
    "default_demo_codec",
    "default_sparseloco_codec",
    "demo_update",
    "exact_aggregate",
    "exact_mean",
    "exact_trimmed_mean",
    "trim_count",
]
