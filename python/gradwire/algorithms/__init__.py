"""Training algorithms written once, for every transport, found through one registry.

Each algorithm is one :class:`Algorithm` object registered under its name (:mod:`.base`): its config
type (which the server's ``RunConfig`` reuses), its node side (:class:`NodeSide`: form a frame's records
from local state, with ``state_dict()``), what a version publishes and how a version is applied. The
transports — ``gradwire.torch.AlgorithmOptimizer`` on torch.distributed (``DeMo`` / ``SparseLoCo`` are thin
constructors over it), the server, the client's ``Node``, :mod:`gradwire.published` — look algorithms up
with :func:`get_algorithm` and never test a name.

- AdamW on the server (:mod:`.adamw`, ``"adamw"``): :class:`AdamWConfig`; nodes send gradients with
  error feedback, the server publishes its compressed weight diff.
- DeMo (:mod:`.demo`, ``"demo"``): :class:`DeMoConfig`, :class:`DeMoState` (momentum, DCT top-k of it
  sent, the rest kept), :func:`demo_update` (``-lr * sign(mean)`` plus decoupled weight decay).
- SparseLoCo (:mod:`.sparseloco`, ``"sparseloco"``): :class:`SparseLoCoConfig`,
  :class:`SparseLoCoState` (pseudo-gradient into a decaying error buffer, its compressed part sent),
  :class:`OuterStep` (the outer optimizer from the last synced weights).

The aggregation side is :mod:`gradwire.aggregation` (the bit-exact mean, the robust rules), re-exported
here; docs/ALGORITHMS.md gives the exactness argument.
"""

from __future__ import annotations

from ..aggregation import exact_aggregate, exact_mean, exact_trimmed_mean, trim_count
from .adamw import ADAMW, AdamWConfig
from .base import (
    DEFAULT_ALGORITHM,
    Algorithm,
    NodeSide,
    RecordLayout,
    WholeModelLayout,
    algorithm_names,
    algorithms,
    config_from_json,
    get_algorithm,
    record_layout,
    register,
)
from .demo import DEMO, DeMoConfig, DeMoState, default_demo_codec, demo_update
from .sparseloco import (
    DEFAULT_SYNC_EVERY,
    SPARSELOCO,
    OuterStep,
    SparseLoCoConfig,
    SparseLoCoState,
    default_sparseloco_codec,
    default_sparseloco_downlink,
)

__all__ = [
    "ADAMW",
    "DEFAULT_ALGORITHM",
    "DEFAULT_SYNC_EVERY",
    "Algorithm",
    "AdamWConfig",
    "DEMO",
    "DeMoConfig",
    "DeMoState",
    "NodeSide",
    "OuterStep",
    "RecordLayout",
    "SPARSELOCO",
    "SparseLoCoConfig",
    "SparseLoCoState",
    "WholeModelLayout",
    "algorithm_names",
    "algorithms",
    "config_from_json",
    "default_demo_codec",
    "default_sparseloco_codec",
    "default_sparseloco_downlink",
    "demo_update",
    "exact_aggregate",
    "exact_mean",
    "exact_trimmed_mean",
    "get_algorithm",
    "record_layout",
    "register",
    "trim_count",
]
