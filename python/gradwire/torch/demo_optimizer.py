"""DeMo as a ``torch.optim.Optimizer`` on torch.distributed (see :mod:`gradwire.torch.optimizers`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..algorithms import DeMoState, default_demo_codec, demo_update
from ..codecs.base import Codec
from ..frame import Entry, Limits
from ..model_record import model_record_codec
from .constructor_checks import DEMO_REFERENCE_NAMES, checked_constructor
from .dtensor import is_dtensor, local_grad, local_tensor
from .optimizer_base import (
    _STATE_KEY,
    ExchangingOptimizer,
    _codec_arg,
    _module_paths,
    _named,
    _names_parameters,
    _packed_index,
    _step_of,
)
from .overlap import DEFAULT_BUCKET_NUMEL, GradientBuckets
from .sharded import DEFAULT_PIECE_NUMEL

__all__ = ["DeMo"]


class DeMo(ExchangingOptimizer, torch.optim.Optimizer):
    """DeMo (Peng et al. 2024): decoupled momentum, its DCT top-k exchanged, sign step.

    After ``backward()``, :meth:`step` adds ``lr·grad`` to each parameter's decayed momentum
    (``beta``), encodes the momenta with ``codec`` (default :func:`gradwire.algorithms.default_demo_codec`:
    22 coefficients per full 64×64 tile and a smaller chunk's share of them, ≥ 300× fewer bytes than fp32
    per step sent and received on a 240 k-parameter embedding-and-linears model, ≈ 456× on a 1024×1024
    weight, 356× on a 6.8 M GPT-2 whose embedding has 29×64 tiles: bench/gpt2_bytes.py,
    docs/RECIPES.md), subtracts what it sent, all-gathers
    the frames, averages them exactly and applies ``−lr·sign(mean)`` plus decoupled weight decay
    (``p *= 1 − lr·weight_decay``). ``lr`` and ``weight_decay`` are read from each param group at every
    step, so LR schedulers work. A parameter whose ``grad`` is ``None`` counts as a zero gradient (every
    rank must send the same tensors); parameters with ``requires_grad=False`` are left alone.

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

    @checked_constructor(DEMO_REFERENCE_NAMES)  # reference names, the launcher, topk, dtypes
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
        codec, downlink_codec = _codec_arg(codec, "codec"), _codec_arg(downlink_codec, "downlink_codec")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self._paths = _module_paths(self.param_groups)
        self._exchanged = [n for n, _, _ in _named(self.param_groups)]
        uplink = codec if codec is not None else default_demo_codec()
        self.node = DeMoState(model_record_codec(uplink) if model_record else uplink, beta=beta)
        self.steps = 0
        self._setup_exchange(
            exchange, codec, downlink_codec, default_demo_codec, process_group, limits, model_record, piece_numel
        )
        if overlap:
            self._start_overlap(bucket_numel)

    def _start_overlap(self, bucket_numel: int) -> None:
        """``overlap=True``: each bucket's momentum step and encode start when its gradients are ready."""
        if self.model_record is not None:
            raise ValueError(
                "overlap=True encodes buckets of parameters as their gradients arrive; "
                "model_record=True sends the whole model as one record, which waits for the last "
                "gradient: build DeMo with one or the other"
            )
        for codec in (self.node.codec, getattr(self._route.exchange, "downlink", None)):
            if getattr(codec, "bundle_budget", False):
                raise ValueError(
                    f"overlap=True encodes and exchanges each bucket on its own; {codec!r} spends one "
                    "budget across all tensors at once: build DeMo with overlap=False for it"
                )
        named = _named(self.param_groups)
        if any(is_dtensor(p) for _, p, _ in named):
            raise ValueError(
                "overlap=True is for replicated parameters (DDP or one process); FSDP2 shards "
                "reduce their gradients after the backward hooks: build DeMo with overlap=False"
            )
        self._overlap_named = named
        self._buckets = GradientBuckets(named, self._encode_bucket, bucket_numel, exchange=self._exchange_bucket)

    def _encode_bucket(self, indices: list[int]) -> list[Entry]:
        """One bucket's momentum step and records (run by the overlap worker)."""
        group = self._overlap_named[indices[0]][2]
        grads = {self._overlap_named[i][0]: local_grad(self._overlap_named[i][1]) for i in indices}
        return self.node.compress(self._route.prepare(grads), group["lr"])

    def _exchange_bucket(self, indices: list[int], entries: list[Entry]) -> dict[str, torch.Tensor]:
        """One bucket's exact mean, exchanged while the backward pass goes on (run by the exchange worker, in
        bucket order on every rank): the same means as one exchange of every tensor at the step."""
        names = [self._overlap_named[i][0] for i in indices]
        return self._route.mean(entries, self.steps, self._overlap_named[indices[0]][1].device, tensors=names)

    def no_sync(self):
        """A context manager for the backward passes of gradient accumulation but the last: with
        ``overlap=True`` they only accumulate gradients (nothing is encoded until the last pass); without
        overlap it does nothing, so the same training loop serves both."""
        return self._buckets.no_sync() if self._buckets is not None else contextlib.nullcontext()

    @_names_parameters
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._first_step_checks()
        if self._fixed_exchange():
            added, removed = self._changed_trainable(self._exchanged)
            if added or removed:
                self._refuse_changed_trainable(added, removed, "build a new DeMo after changing requires_grad")
        named = _named(self.param_groups)
        device = named[0][1].device if named else None
        entries: list[Entry] = []
        mean: dict[str, torch.Tensor] = {}
        if self._buckets is not None:
            for bucket_mean in self._buckets.collect():  # encoded and exchanged during the backward pass
                mean.update(bucket_mean)
        elif self.model_record is not None:
            # One record: each group's lr·grad (the same product compress would take), lr 1 after it.
            scaled = {n: torch.mul(local_grad(p).to(torch.float32), g["lr"]) for n, p, g in named}
            entries = self.node.compress(self._route.prepare(scaled), 1.0)
        else:
            for group in self.param_groups:
                grads = {n: local_grad(p) for n, p, g in named if g is group}
                if grads:
                    entries += self.node.compress(self._route.prepare(grads), group["lr"])
        if self._buckets is None:
            mean = self._route.mean(entries, self.steps, device)
        for group in self.param_groups:
            params = {n: local_tensor(p) for n, p, g in named if g is group}
            if params:
                demo_update(params, {n: mean[n] for n in params}, group["lr"], group["weight_decay"])
        self.steps += 1
        self._mark_state(self.steps)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's form: each parameter's ``"momentum"`` (float32, the parameter's local shape) and
        ``"step"`` under ``"state"``, the param groups; and ``"gradwire"``: the codec's state, the step
        counter, the parameter shapes and the exchange's state (the byte counters; sharded, also the group's
        size, this rank, the pieces and the owner's error feedback, by piece).

        ``torch.distributed.checkpoint`` keeps ``"state"`` and ``"param_groups"`` only, so a state dict it
        hands back resumes without ``"gradwire"``: momenta and step restored, the owners' error feedback
        and byte counters started afresh, at any group size (docs/DISTRIBUTED.md, "Checkpoints")."""
        out = super().state_dict()
        index = _packed_index(self.param_groups)
        step = torch.tensor(float(self.steps))
        momenta = self._like_parameters(
            self._with_zeros(self._per_param(self.node.momenta), [n for n, _, _ in _named(self.param_groups)])
        )
        out["state"] = {index[n]: {"momentum": m, "step": step.clone()} for n, m in momenta.items()}
        out[_STATE_KEY] = {
            "node": {"codec": self.node.codec.state_dict()},
            "steps": self.steps,
            "shapes": self._model_shapes(),
            **self._shards.state_dict(),
            **self._exchange.state_dict(),
        }
        return out

    @_names_parameters
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (or :meth:`full_state_dict`: this rank's share of it, at any
        group size; or what ``torch.distributed.checkpoint`` hands back: torch's part only); ``ValueError``
        for a checkpoint of another model (parameter count or shapes), rank (sharded) or exchange."""
        share, per_param, torch_part = self._split_state(state_dict)
        named = _named(self.param_groups)
        devices = {n: p.device for n, p, _ in named}
        first = named[0][1].device if named else None
        super().load_state_dict(torch_part)
        node = share["node"] if share is not None else {"codec": self.node.codec.state_dict()}
        if "momenta" in node:  # a checkpoint from before the per-parameter state: the node's own buffers
            momenta = node["momenta"]
        else:
            momenta = self._node_buffers({n: f["momentum"] for n, f in per_param.items() if "momentum" in f})
        self.node.load_state_dict({"momenta": momenta, "codec": node["codec"]})
        self.node.momenta = {
            n: m.to(self._device_of(n, devices, first) or m.device) for n, m in self.node.momenta.items()
        }
        self.steps = int(share["steps"]) if share is not None else _step_of(per_param)
        if per_param or self.steps:
            self._mark_state(self.steps)
