"""A gradwire optimizer across torchft's fault-tolerant replica groups: sites that fail and come back
without stopping the others (docs/FAULT_TOLERANCE.md).

:class:`FaultTolerant` wraps a :class:`~gradwire.torch.SparseLoCo` or a :class:`~gradwire.torch.DeMo`
(``exchange="all_gather"``). Each sync interval (SparseLoCo's ``sync_every`` local steps; DeMo's every step,
since each of its steps sends) begins with a torchft quorum through the Lighthouse (who is in, and a joiner
healed); the interval's sync exchanges one frame per group over torchft's managed gloo process group
(:class:`~gradwire.torch.replica_exchange.ReplicaExchange`) and counts only when ``should_commit`` says so; a
round that does not count goes back to the node side and the replica to its last synced version. A group
that joins (a restart, a late site) downloads the whole state from a healthy group at that quorum — weights,
anchor, error buffers or momenta, the inner and outer optimizers' state — as gradwire's state bytes
(:class:`~gradwire.torch.state_transport.StateBytesTransport`, never pickled) and contributes at that
interval's sync. A round that does not commit is given back to the node side (what its frame carried is
added back to the error buffers or momenta) and applies nothing. DeMo's quorum is at every step, so a joiner
heals at a step's start and contributes at that step: its momenta are the healthy group's, its weights the
same bits as every group's. Within a group, FSDP2/HSDP runs as without torchft (``rank``/``world_size`` there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..frame import Limits
from .demo_optimizer import DeMo
from .replica_exchange import ReplicaExchange
from .replica_sharded import ReplicaShardedExchange
from .replica_timeouts import ReplicaTimeouts
from .sparseloco_optimizer import SparseLoCo
from .state_bytes import StateBytesError
from .state_transport import StateBytesTransport
from .torchft_extra import torchft_modules

__all__ = ["FaultTolerant"]


class FaultTolerant:
    """``optimizer`` (a :class:`~gradwire.torch.SparseLoCo` or :class:`~gradwire.torch.DeMo` over ``module``,
    ``overlap=False``) as one replica group ``replica_id`` of a run whose quorum the torchft Lighthouse at
    ``lighthouse`` (``host:port``) keeps. ``timeouts``: :class:`~gradwire.torch.replica_timeouts.ReplicaTimeouts`
    (checked: ``TimeoutOrderError``); ``min_replicas``: the fewest groups a round commits with; ``limits``
    bound a peer's frame; ``host``: the address this group serves its state at. ``groups``: with
    ``exchange="sharded"``, the number of replica groups the run expects (the pieces are cut for that many
    owners once; the owners follow each quorum: :mod:`gradwire.torch.replica_sharded`); with
    ``exchange="all_gather"`` every group reads every frame (:mod:`gradwire.torch.replica_exchange`).
    ``rank``/``world_size``: this process within its group; ``store_addr``/``store_port``: the group's
    TCPStore (made here for a group of one process). Call :meth:`step` where the loop called
    ``optimizer.step()``."""

    def __init__(
        self,
        optimizer: SparseLoCo | DeMo,
        module: nn.Module,
        *,
        lighthouse: str,
        replica_id: str,
        timeouts: ReplicaTimeouts | None = None,
        min_replicas: int = 1,
        limits: Limits | None = None,
        host: str = "127.0.0.1",
        groups: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        store_addr: str | None = None,
        store_port: int | None = None,
    ):
        if not isinstance(optimizer, (SparseLoCo, DeMo)):
            raise TypeError(
                f"FaultTolerant wraps a gradwire.torch.SparseLoCo or DeMo, got {type(optimizer).__name__} "
                "(docs/FAULT_TOLERANCE.md)"
            )
        if optimizer.exchange == "sharded" and groups is None:
            raise ValueError(
                f"this {type(optimizer).__name__} has exchange='sharded': pass groups=, the number of replica groups "
                "the run expects (its pieces are cut for that many owners; the owners then follow each quorum), "
                "or build it with exchange='all_gather'"
            )
        if groups is not None and int(groups) < 1:
            raise ValueError(f"groups must be >= 1, got {groups!r}")
        if int(min_replicas) < 1:
            raise ValueError(f"min_replicas must be >= 1, got {min_replicas!r}")
        ft = torchft_modules("gradwire.torch.FaultTolerant")
        self.timeouts = timeouts if timeouts is not None else ReplicaTimeouts()
        self.timeouts.check()
        self.optimizer = optimizer
        self.module = module
        self._store = None
        if store_addr is None:
            self._store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = host, self._store.port
        t = self.timeouts
        self.transport = StateBytesTransport(host, state_download=t.state_download)
        self.pg = ft.ProcessGroupGloo(timeout=t.delta("process_group"))
        self.manager = ft.Manager(
            pg=self.pg,
            load_state_dict=self._load_state,
            state_dict=self._state,
            min_replica_size=int(min_replicas),
            use_async_quorum=False,  # a joiner heals before the interval's first step, and contributes at its sync
            timeout=t.delta("operation"),
            quorum_timeout=t.delta("quorum"),
            connect_timeout=t.delta("connect"),
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
            hostname=host,
            heartbeat_interval=t.delta("heartbeat_interval"),
            checkpoint_transport=self.transport,
            init_sync=True,
        )
        self.exchange: ReplicaExchange | ReplicaShardedExchange
        if optimizer.exchange == "sharded":
            pieces = optimizer.cut_pieces_for(int(groups))
            self.exchange = ReplicaShardedExchange(pieces, self.manager, self.pg, limits)
        else:
            self.exchange = ReplicaExchange(self.manager, self.pg, limits)
        optimizer.use_round_transport(self.exchange)
        self.healed = 0  # the states this group loaded from a healthy one

    @property
    def sync_every(self) -> int:
        """Local steps per sync interval: SparseLoCo's ``sync_every``; 1 for DeMo, whose every step sends."""
        return int(getattr(self.optimizer, "sync_every", 1))

    def at_interval_start(self) -> bool:
        """Whether the next :meth:`step` starts a sync interval (and a quorum)."""
        return self.optimizer.steps % self.sync_every == 0

    def step(self) -> None:
        """One optimizer step; at the first step of a sync interval, the quorum first (a joiner heals)."""
        if self.at_interval_start():
            self.manager.start_quorum()
            if self.manager.errored() is not None:
                raise RuntimeError(f"torchft quorum failed: {self.manager.errored()}")
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def commits(self) -> int:
        """The rounds committed in this run (torchft's step: a joiner takes the healthy groups' count)."""
        return int(self.manager.current_step())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # -- the state a joiner downloads -----------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _load_state(self, state: Any) -> None:
        if not isinstance(state, dict) or sorted(state) != ["module", "optimizer"]:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise StateBytesError(f"a replica group's state holds 'module' and 'optimizer', got {keys}")
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.healed += 1
