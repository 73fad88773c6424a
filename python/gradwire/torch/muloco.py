"""MuLoCo: the README's headline recipe as one constructor.

:class:`MuLoCo` is :class:`~gradwire.torch.SparseLoCo` whose inner optimizer is
:class:`~gradwire.torch.MuonAdamW` (torch's Muon on the hidden weight matrices, AdamW on the rest), with the
settings of the headline rows (bench/convergence_nodes.py's ``signloco+muon/agg``, docs/ALGORITHMS.md
"MuLoCo"): one bit both ways (:class:`gradwire.OneBit` up and for the owners' re-encoded mean down),
``sync_every=11`` local steps per sync, ``error_decay=1.0`` (1-bit SGD's error feedback keeps the whole
residual), the plain outer step (``outer_lr=1``), no weight decay. About 303× fewer bytes than fp32 up and
301× down per local step; at 16 nodes +1.2 % held-out loss against dense AdamW on the byte LM (lr 0.04,
2 seeds; docs/results/convergence-nodes.md).

It adds nothing to either class: an instance *is* a ``SparseLoCo`` (its state dict, checkpoints, byte
counters, ``sync()``) whose ``inner`` is a ``MuonAdamW``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..codecs.base import Codec
from ..codecs.sign import OneBit
from .muon import MuonAdamW, muon_split
from .sparseloco_optimizer import SparseLoCo

__all__ = ["MULOCO_SYNC_EVERY", "MuLoCo"]

#: The headline's local steps per sync: one bit per parameter per sync makes about 32 × 11 ≈ 350× before the
#: column scales, 303× with them.
MULOCO_SYNC_EVERY = 11


def _split(params: Any, exclude: Sequence[nn.Module] | None) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(matrices, others)`` from a model (``muon_split``, the head excluded) or from ``muon_split``'s pair."""
    if isinstance(params, nn.Module):
        if exclude is None:
            # The headline runs' rule (bench/convergence.py): the model's last nn.Linear is its output head,
            # which Muon's authors leave to AdamW.
            linears = [m for m in params.modules() if isinstance(m, nn.Linear)]
            exclude = linears[-1:]
        return muon_split(params, exclude=exclude)
    if exclude is not None:
        raise TypeError("exclude= is for a model given as params: muon_split(model, exclude=...) already split these")
    if isinstance(params, tuple) and len(params) == 2 and all(isinstance(part, list) for part in params):
        return params
    raise TypeError(
        f"MuLoCo takes the model itself (its weight matrices go to Muon, the rest and its head to AdamW) or "
        f"the (matrices, others) pair of gradwire.torch.muon_split(model), got {type(params).__name__}: "
        "e.g. MuLoCo(model, lr=0.02)"
    )


class MuLoCo(SparseLoCo):
    """SparseLoCo with :class:`MuonAdamW` inside and one bit both ways (see the module docstring).

    ``params``: the model (``nn.Module``), split by :func:`~gradwire.torch.muon_split` with ``exclude``
    (default: the model's last ``nn.Linear``, its output head; ``exclude=[]`` gives every weight matrix to
    Muon), or the ``(matrices, others)`` pair ``muon_split`` returns. ``lr`` and ``weight_decay`` are
    ``MuonAdamW``'s (one lr for both halves). ``codec`` and ``downlink_codec`` default to
    :class:`gradwire.OneBit`; every other keyword is :class:`SparseLoCo`'s (``process_group``, ``exchange``,
    ``outer_lr``, ``model_record``, ...). Every rank must build it over the same model.

    >>> opt = gradwire.torch.MuLoCo(model, lr=0.02)   # doctest: +SKIP
    >>> loss.backward(); opt.step(); opt.zero_grad()    # doctest: +SKIP
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        *,
        exclude: Sequence[nn.Module] | None = None,
        weight_decay: float = 0.0,
        sync_every: int = MULOCO_SYNC_EVERY,
        codec: Codec | None = None,
        downlink_codec: Codec | None = None,
        error_decay: float = 1.0,
        **sparseloco: Any,
    ):
        matrices, others = _split(params, exclude)
        inner = MuonAdamW(matrices, others, lr=lr, weight_decay=weight_decay)
        super().__init__(
            matrices + others,
            inner,
            sync_every=sync_every,
            codec=OneBit() if codec is None else codec,
            downlink_codec=OneBit() if downlink_codec is None else downlink_codec,
            error_decay=error_decay,
            **sparseloco,
        )
