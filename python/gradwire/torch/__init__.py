"""gradwire on torch.distributed: no server, the collectives the job already runs on (gloo, NCCL).

- :func:`ddp_hook` — a DDP communication hook for any gradwire codec (frames all-gathered, decoded in
  rank order, averaged; every rank ends bit-identical).
- :func:`powersgd_hook` / :class:`PowerSGDState` — PowerSGD's collective form (factors all-reduced).
- :class:`AlgorithmOptimizer` — the one torch transport: any registered algorithm whose versions publish a
  mean, through its node side and ``apply`` alone (sharded or all-gathered exchange, overlap with the
  backward pass, model records, FSDP2, checkpoints); a new algorithm needs no optimizer class of its own.
- :class:`DeMo` / :class:`SparseLoCo` — thin constructors over it for the two algorithms of
  :mod:`gradwire.algorithms` (every rank ends bit-identical); under DDP, its comm hook must be
  :func:`local_gradients_hook` (:func:`skip_ddp_all_reduce`), else :class:`DenseAllReduceError`;
  :func:`average_buffers` for BatchNorm's running statistics.
- :class:`MuonAdamW` / :func:`muon_split` — Muon on the hidden matrices and AdamW on the rest as one optimizer,
  e.g. SparseLoCo's inner optimizer; :class:`MuLoCo` — that SparseLoCo, one bit both ways, a sync every 11
  steps: the README's headline recipe as one constructor.
- :class:`LowPrecisionDecentralized` — Bagua's low-precision decentralized SGD over fixed peers.
- :func:`register_hook` — any of these, torch's fp16 and PowerSGD hooks, or plain DDP, by name.
- :func:`spawn` / :func:`init_from_env` — local worker processes, or ``torchrun``'s environment; under a
  launcher of several ranks with no process group, every optimizer here raises :class:`NoProcessGroupError`
  at its first step (:mod:`gradwire.torch.launcher_check`) instead of training each rank alone.

Import it as ``import gradwire.torch`` or ``from gradwire.torch import ddp_hook``; the package
``gradwire`` itself does not import it, so its name never stands in for the real ``torch``.
"""

from __future__ import annotations

from .algorithm_optimizer import AlgorithmOptimizer
from .buffers import average_buffers
from .collectives import all_gather_bytes, exchange_bytes
from .ddp_guard import DenseAllReduceError, local_gradients_hook, skip_ddp_all_reduce
from .ddp_hook import GradwireHookState, ddp_hook, gradwire_hook
from .decentralized import LowPrecisionDecentralized, ring_peers
from .demo_optimizer import DeMo
from .fault_tolerant import FaultTolerant
from .hooks import RegisteredHook, hook_names, register_hook
from .launch import NoLauncherError, default_backend, init_from_env, spawn
from .launcher_check import NoProcessGroupError
from .muloco import MuLoCo
from .muon import MuonAdamW, muon_split
from .powersgd import PowerSGDState, powersgd_hook
from .replica_timeouts import ReplicaTimeouts, TimeoutOrderError
from .replicas import replicas_agree
from .sparseloco_optimizer import SparseLoCo

__all__ = [
    "AlgorithmOptimizer",
    "DeMo",
    "DenseAllReduceError",
    "FaultTolerant",
    "GradwireHookState",
    "LowPrecisionDecentralized",
    "MuLoCo",
    "MuonAdamW",
    "PowerSGDState",
    "RegisteredHook",
    "ReplicaTimeouts",
    "SparseLoCo",
    "TimeoutOrderError",
    "all_gather_bytes",
    "average_buffers",
    "ddp_hook",
    "default_backend",
    "exchange_bytes",
    "gradwire_hook",
    "hook_names",
    "init_from_env",
    "NoLauncherError",
    "NoProcessGroupError",
    "local_gradients_hook",
    "muon_split",
    "powersgd_hook",
    "register_hook",
    "replicas_agree",
    "ring_peers",
    "skip_ddp_all_reduce",
    "spawn",
]
