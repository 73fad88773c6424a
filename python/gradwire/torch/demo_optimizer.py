"""DeMo as a ``torch.optim.Optimizer`` on torch.distributed: a thin constructor over the one torch transport
(:class:`gradwire.torch.AlgorithmOptimizer`) with the registered ``"demo"`` algorithm."""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from ..algorithms import DEMO, DeMoConfig
from ..codecs.base import Codec
from ..frame import Limits
from .algorithm_optimizer import AlgorithmOptimizer
from .constructor_checks import DEMO_REFERENCE_NAMES, checked_constructor
from .overlap import DEFAULT_BUCKET_NUMEL
from .sharded import DEFAULT_PIECE_NUMEL

__all__ = ["DeMo"]


class DeMo(AlgorithmOptimizer):
    """DeMo (Peng et al. 2024): decoupled momentum, its DCT top-k exchanged, sign step.

    After ``backward()``, :meth:`step` adds ``lr·grad`` to each parameter's decayed momentum
    (``beta``), encodes the momenta with ``codec`` (default :func:`gradwire.algorithms.default_demo_codec`:
    22 coefficients per full 64×64 tile and a smaller chunk's share of them, ≥ 300× fewer bytes than fp32
    per step sent and received on a 240 k-parameter embedding-and-linears model, ≈ 456× on a 1024×1024
    weight, 356× on a 6.8 M GPT-2 whose embedding has 29×64 tiles: bench/gpt2_bytes.py,
    docs/RECIPES.md), subtracts what it sent, exchanges the records, averages them exactly and applies
    ``−lr·sign(mean)`` plus decoupled weight decay (``p *= 1 − lr·weight_decay``). ``lr`` and
    ``weight_decay`` are read from each param group at every step, so LR schedulers work. A parameter
    whose ``grad`` is ``None`` counts as a zero gradient (every rank must send the same tensors);
    parameters with ``requires_grad=False`` are left alone. ``opt.state[p]["momentum"]`` is the live
    momentum (float32, the parameter's local shape).

    ``process_group``: the group to average over (default: the default group). ``limits`` bound what a
    peer's frame may announce. ``model_record=True`` sends the whole model as one record (its momenta
    flattened in parameter order, named after the model spec's hash: docs/FORMAT.md section 9), so the
    per-record overhead of a frame no longer grows with the number of tensors; the codec's chunks then
    run across tensor boundaries (a tile-mode DCT codec cuts the vector into flat chunks of its
    ``chunk_shape``), and every rank must hold the same parameter shapes (a rank whose spec
    differs is refused with ``FrameError`` of kind ``model_spec_mismatch``).

    ``exchange``: ``"sharded"`` (the default: each rank owns pieces of the parameters, receives every
    rank's records of them, averages them and sends the mean re-encoded with ``downlink_codec`` — by
    default the uplink codec's twin — under its own error feedback; see :mod:`gradwire.torch.sharded`)
    or ``"all_gather"`` (every rank reads every rank's frame). ``piece_numel`` bounds a piece of the
    sharded exchange, in elements (tensors above it are cut at the codec's chunk boundaries).

    ``overlap=True`` starts each bucket's momentum step and encode (about ``bucket_numel`` elements, in
    backward order) as soon as the backward pass has produced its gradients, on a worker thread (and a side
    stream on a GPU), as DDP's communication hooks do, and exchanges each bucket (its collectives and the
    owners' mean) on a second worker, in bucket order, while the backward pass goes on; :meth:`step` then
    waits for the last bucket and applies the means. On the CPU the records, and so the weights, are those
    without overlap. Run the earlier backward passes of gradient accumulation inside ``with
    opt.no_sync():``; clipping or unscaling the gradients between ``backward()`` and ``step()`` does not
    reach what was encoded (:mod:`gradwire.torch.overlap`).
    """

    @checked_constructor(DEMO_REFERENCE_NAMES)  # reference names, topk, dtypes
    def __init__(
        self,
        params: Iterable,
        lr: float,
        *,
        codec: Codec | None = None,
        beta: float = 0.999,
        weight_decay: float = 0.0,
        process_group: dist.ProcessGroup | None = None,
        limits: Limits | None = None,
        model_record: bool = False,
        exchange: str = "sharded",
        downlink_codec: Codec | None = None,
        piece_numel: int = DEFAULT_PIECE_NUMEL,
        overlap: bool = False,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    ):
        if not lr > 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(
            params,
            DEMO,
            DeMoConfig(lr=lr, beta=beta, weight_decay=weight_decay),
            codec=codec,
            process_group=process_group,
            limits=limits,
            exchange=exchange,
            model_record=model_record,
            downlink_codec=downlink_codec,
            piece_numel=piece_numel,
            overlap=overlap,
            bucket_numel=bucket_numel,
        )
