"""SparseLoCo as a ``torch.optim.Optimizer`` on torch.distributed: a thin constructor over the one torch
transport (:class:`gradwire.torch.AlgorithmOptimizer`) with the registered ``"sparseloco"`` algorithm."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..algorithms import DEFAULT_SYNC_EVERY, SPARSELOCO, SparseLoCoConfig
from ..codecs.base import Codec
from ..frame import Limits
from .algorithm_optimizer import AlgorithmOptimizer
from .constructor_checks import SPARSELOCO_REFERENCE_NAMES, checked_constructor
from .outer import OuterOptimizerFactory
from .sharded import DEFAULT_PIECE_NUMEL

__all__ = ["SparseLoCo"]


class SparseLoCo(AlgorithmOptimizer):
    """SparseLoCo: local steps with ``inner``, every ``sync_every`` steps a compressed outer step.

    :meth:`step` steps ``inner`` (an optimizer over exactly these parameters, e.g. ``torch.optim.AdamW``)
    and counts; at every ``sync_every``-th step it forms the pseudo-gradient (the weights at the last
    sync minus now), adds it to the error buffer decayed by ``error_decay``, sends the compressed buffer
    (``codec``, default :func:`gradwire.algorithms.default_sparseloco_codec`: top-k DCT with 2-bit values,
    ≥ 300× fewer bytes than fp32 per local step; ``sync_every`` 8 and that codec are the benches' best
    measured setting at 300×, docs/ALGORITHMS.md), keeps the rest, averages all ranks' frames exactly and
    applies the outer step to the last synced weights (the anchor, kept as float32 copies); the result
    becomes every rank's weights. ``opt.state[p]`` holds the live ``"anchor"``, ``"error"`` and (with
    momentum, after the first sync) ``"outer_momentum"`` of each parameter; ``opt.inner.state[p]`` the inner
    optimizer's.

    The outer step is SGD with learning rate ``outer_lr``; ``outer_momentum`` (and ``nesterov``) add
    momentum — DiLoCo's recipe is ``outer_lr=0.7, outer_momentum=0.9, nesterov=True``. Or any torch
    optimizer: ``outer_optimizer`` builds it over the anchor tensors it is given
    (:class:`gradwire.torch.outer.TorchOuterStep`), e.g. ``lambda ps: torch.optim.Adam(ps, lr=1e-2)``.
    The inner optimizer's state stays local. The param groups are ``inner``'s own dicts (``params``
    must be the same parameters), so an lr scheduler built on this optimizer — as the HF Trainer builds
    it — or on ``inner`` sets the lr the local steps use. Parameters are exchanged by position in those
    groups. With ``exchange="all_gather"`` and no model record, a parameter unfrozen later joins the
    exchange at its next step (its weights then are its anchor) and one frozen later stays in it; with
    the sharded exchange or a model record the set is fixed when the optimizer is built (``ValueError``).
    ``model_record=True`` sends the whole model's error buffer as one record, as in :class:`DeMo`.
    ``exchange`` (``"sharded"``, the default, or ``"all_gather"``), ``downlink_codec`` and ``piece_numel``
    are :class:`DeMo`'s; the owners' error feedback holds what their re-encoded means left out.
    """

    @checked_constructor(SPARSELOCO_REFERENCE_NAMES)  # reference names, topk, dtypes
    def __init__(
        self,
        params: Iterable,
        inner: torch.optim.Optimizer,
        *,
        sync_every: int = DEFAULT_SYNC_EVERY,
        codec: Codec | None = None,
        outer_lr: float = 1.0,
        error_decay: float = 0.95,
        process_group: dist.ProcessGroup | None = None,
        outer_momentum: float = 0.0,
        nesterov: bool = False,
        limits: Limits | None = None,
        model_record: bool = False,
        exchange: str = "sharded",
        downlink_codec: Codec | None = None,
        piece_numel: int = DEFAULT_PIECE_NUMEL,
        outer_optimizer: OuterOptimizerFactory | None = None,
    ):
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        if outer_optimizer is not None and (outer_lr != 1.0 or outer_momentum != 0.0 or nesterov):
            raise ValueError(
                "give either outer_optimizer or outer_lr/outer_momentum/nesterov: the outer "
                "optimizer carries its own learning rate and momentum"
            )
        sync_every = int(sync_every)
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        config = SparseLoCoConfig(
            sync_every=sync_every,
            error_decay=float(error_decay),
            outer_lr=float(outer_lr),
            outer_momentum=float(outer_momentum),
            nesterov=bool(nesterov),
        )
        config.outer_step()  # nesterov without momentum is refused here, where it is given
        super().__init__(
            params,
            SPARSELOCO,
            config,
            codec=codec,
            process_group=process_group,
            limits=limits,
            exchange=exchange,
            model_record=model_record,
            downlink_codec=downlink_codec,
            piece_numel=piece_numel,
            inner=inner,
            outer_optimizer=outer_optimizer,
        )

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The inner optimizer, which the local steps step."""
        return self.node.inner

    @property
    def sync_every(self) -> int:
        return self.config.sync_every

    @property
    def local_steps(self) -> int:
        """Local steps taken (every :meth:`step`)."""
        return self.steps

    @property
    def syncs(self) -> int:
        """Outer steps taken (every sync)."""
        return self.rounds

    @property
    def anchor(self) -> dict[str, torch.Tensor]:
        """The float32 weights of the last sync, by position (what the outer step steps)."""
        return self.node.anchor
