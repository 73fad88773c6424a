"""Any registered algorithm on torch.distributed, through the registry alone.

:class:`AlgorithmOptimizer` is the transport the client's ``Node`` is, over a process group instead of a
server: it looks the algorithm up by name (:func:`gradwire.algorithms.get_algorithm`), builds its node
side (:meth:`Algorithm.node`), and each step sends what the node side's ``records`` return, all-gathers
every rank's frame, averages them exactly in rank order and applies the mean with the algorithm's own
``apply`` — the function the server and every node of a run apply a version with — to the node side's
``target``, then calls ``synced``. So a new algorithm runs on torch.distributed once its module is
registered: its config, node side and ``apply``, and its tests; no optimizer class of its own.

Its hyperparameters are its config's (``config=``, a dataclass or a JSON mapping, checked when the
optimizer is built), not the param groups', so an lr scheduler does not reach them. ``gradwire.torch.DeMo``
and ``SparseLoCo`` are the same algorithms with what a torch training job wants beyond this: per-group
learning rates, the sharded exchange, overlap with the backward pass, per-parameter checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..aggregation import exact_mean
from ..algorithms import get_algorithm
from ..codecs.base import Codec
from ..frame import Limits
from ..registry import build_codec
from .all_gather_exchange import AllGatherExchange, ReportsFrameBytes
from .ddp_guard import check_not_all_reduced
from .launcher_check import refuse_single_rank_launch

__all__ = ["AlgorithmOptimizer"]


class AlgorithmOptimizer(ReportsFrameBytes, torch.optim.Optimizer):
    """The registered algorithm ``algorithm`` (a name of ``gradwire.algorithms.algorithm_names()`` whose
    versions publish a mean) over ``module``'s trainable parameters, named by their module paths; every
    rank all-gathers every rank's frame (module docstring). ``codec``: the uplink codec, or a name of
    ``gradwire.codec_names()``; default the algorithm's (``Algorithm.default_codec``)."""

    def __init__(
        self,
        module: nn.Module,
        algorithm: str,
        config: Any = None,
        *,
        codec: Codec | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        limits: Limits | None = None,
    ):
        alg = get_algorithm(algorithm)
        if alg.publication != "mean":
            raise ValueError(
                f"algorithm {algorithm!r} publishes {alg.publication!r} versions, made by a server's "
                "optimizer: on torch.distributed only algorithms whose versions are a mean of the "
                "nodes' records run"
            )
        self.algorithm = alg
        self.config = alg.config(config)
        if codec is None:
            default = alg.default_codec(self.config)
            if default is None:
                raise ValueError(f"algorithm {algorithm!r} names no default codec: pass codec=")
            codec = build_codec(default[0], **default[1])
        elif isinstance(codec, str):
            codec = build_codec(codec)
        elif not isinstance(codec, Codec):
            raise TypeError(
                f"codec must be a gradwire codec or a name of gradwire.codec_names(), got {type(codec).__name__}"
            )
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError("the module has no parameter that requires a gradient")
        super().__init__(list(self.params.values()), {})
        self.side = alg.node(self.config, codec, self.params, module=module)
        self.side.loaded()  # the replica as it is now: where an algorithm with an anchor starts from
        self.algorithm_state: dict[str, Any] = {}
        self._exchange = AllGatherExchange(process_group, limits)
        self.rounds = 0
        self._checked = False

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._checked:
            refuse_single_rank_launch(type(self).__name__, self._exchange.process_group, "its first step()")
            self._checked = True
            if self._exchange.world() > 1:
                check_not_all_reduced(
                    list(self.params.values()), {id(p): n for n, p in self.params.items()}, type(self).__name__
                )
        grads = None
        if not self.side.reads_module_grads:
            grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.params.items()}
        entries = self.side.records(grads)
        if entries is None:  # a local step: nothing to send
            return loss
        device = next(iter(self.params.values())).device
        mean = exact_mean(self._exchange(entries, self.rounds), device=device)
        self.algorithm_state = self.algorithm.apply(self.config, self.side.target(), mean, self.algorithm_state)
        self.side.synced()
        self.rounds += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's param groups and ``"gradwire"``: the algorithm's name, its node side's and its own state,
        the round counter and the exchange's counters (this rank's: resume in a group of the same size)."""
        out = super().state_dict()
        out["gradwire"] = {
            "algorithm": self.algorithm.name,
            "node": self.side.state_dict(),
            "algorithm_state": self.algorithm_state,
            "rounds": self.rounds,
            **self._exchange.state_dict(),
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        mine = state_dict.pop("gradwire")
        if mine.get("algorithm") != self.algorithm.name:
            raise ValueError(
                f"this checkpoint is of algorithm {mine.get('algorithm')!r}, this optimizer runs "
                f"{self.algorithm.name!r}"
            )
        self._exchange.load_state_dict(mine)
        super().load_state_dict(state_dict)
        self.side.load_state_dict(mine["node"])
        self.algorithm_state = dict(mine["algorithm_state"])
        self.rounds = int(mine["rounds"])
