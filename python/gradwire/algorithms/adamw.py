"""AdamW on the server (Panthalia's path): nodes send their gradients compressed with error feedback;
the server aggregates them, steps AdamW on its fp32 master weights and publishes the weight diff
compressed with its own error feedback; every node adds the decoded diff to its replica.

The library owns the config (:class:`AdamWConfig`, also SparseLoCo's inner optimizer) and the node side;
the AdamW arithmetic on the master weights is the server's (``gradwire_server.optim``).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

import torch

from ..codecs.base import Codec
from ..feedback import ErrorFeedback
from ..frame import Entry
from .base import Algorithm, NodeSide, check_number, frozen_config, ordered, register, same_names

__all__ = ["ADAMW", "AdamWConfig"]


@frozen_config
class AdamWConfig:
    """AdamW with linear warm-up, then a constant or cosine schedule."""

    lr: float = 1e-3
    """The learning rate (> 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """The moments' decay rates, each in [0, 1)."""
    eps: float = 1e-8
    """Added to the second moment's root (> 0)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (>= 0)."""
    warmup_rounds: int = 0
    """Steps of linear warm-up from 0 to ``lr``."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: ``lr`` throughout, or a cosine decay to 0 at ``total_rounds``."""
    total_rounds: int | None = None
    """The step the cosine schedule ends at (needed by ``schedule='cosine'``)."""

    def __post_init__(self) -> None:
        check_number(self.lr, "lr", low=0.0, low_open=True)
        if len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers, got {self.betas!r}")
        for b in self.betas:
            check_number(b, "each of betas", low=0.0, high=1.0, high_open=True)
        check_number(self.eps, "eps", low=0.0, low_open=True)
        check_number(self.weight_decay, "weight_decay", low=0.0)
        check_number(self.warmup_rounds, "warmup_rounds", low=0, integer=True)
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if self.total_rounds is not None:
            check_number(self.total_rounds, "total_rounds", low=1, integer=True)
        if self.schedule == "cosine" and self.total_rounds is None:
            raise ValueError("schedule 'cosine' needs total_rounds")

    def torch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.optim.AdamW`` for this config (the schedule aside)."""
        return {
            "lr": float(self.lr),
            "betas": tuple(float(b) for b in self.betas),
            "eps": float(self.eps),
            "weight_decay": float(self.weight_decay),
        }


class AdamWNode(NodeSide):
    """A node of an AdamW run: the gradients go through the uplink codec inside :class:`ErrorFeedback`;
    published diffs are added to the replica."""

    def __init__(self, codec: Codec, params: MutableMapping[str, torch.Tensor]):
        self.feedback = ErrorFeedback(codec)
        self.params = params

    def records(self, grads: Mapping[str, torch.Tensor] | None) -> list[Entry]:
        if grads is None:
            raise ValueError("an AdamW node sends gradients every step: pass them")
        same_names(list(grads), list(self.params), "gradients")
        return self.feedback.compress_bundle(ordered(grads))

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        self.feedback.take_back(sent)

    def target(self) -> MutableMapping[str, torch.Tensor]:
        return self.params

    def state_dict(self) -> dict[str, Any]:
        return {"feedback": self.feedback.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.feedback.load_state_dict(state["feedback"])


class AdamWAlgorithm(Algorithm):
    name = "adamw"
    config_field = "optimizer"
    config_type = AdamWConfig
    publication = "diff"
    summary = (
        "the server steps AdamW on the aggregate gradient and publishes the compressed weight diff (Panthalia's path)"
    )

    def node(self, config, codec, params, module=None, model_spec=None) -> AdamWNode:
        if model_spec is not None:
            raise ValueError("adamw runs send a record per tensor, not a whole-model record")
        return AdamWNode(codec, params)


ADAMW = register(AdamWAlgorithm())
