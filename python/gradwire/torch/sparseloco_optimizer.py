"""SparseLoCo as a ``torch.optim.Optimizer`` on torch.distributed (see :mod:`gradwire.torch.optimizers`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..algorithms import (
    DEFAULT_SYNC_EVERY,
    OuterStep,
    SparseLoCoState,
    default_sparseloco_codec,
    default_sparseloco_downlink,
)
from ..codecs.base import Codec
from ..frame import Limits
from ..model_record import model_record_codec
from .constructor_checks import SPARSELOCO_REFERENCE_NAMES, checked_constructor
from .dtensor import local_tensor
from .optimizer_base import (
    _STATE_KEY,
    INNER,
    ExchangingOptimizer,
    _codec_arg,
    _module_paths,
    _named,
    _names_parameters,
    _nonzero,
    _packed_index,
    _positions,
    _step_of,
)
from .outer import OuterOptimizerFactory, TorchOuterStep
from .sharded import DEFAULT_PIECE_NUMEL

__all__ = ["SparseLoCo"]


class SparseLoCo(ExchangingOptimizer, torch.optim.Optimizer):
    """SparseLoCo: local steps with ``inner``, every ``sync_every`` steps a compressed outer step.

    :meth:`step` steps ``inner`` (an optimizer over exactly these parameters, e.g. ``torch.optim.AdamW``)
    and counts; at every ``sync_every``-th step it forms the pseudo-gradient (the weights at the last
    sync minus now), adds it to the error buffer decayed by ``error_decay``, sends the compressed buffer
    (``codec``, default :func:`gradwire.algorithms.default_sparseloco_codec`: top-k DCT with 2-bit values,
    ≥ 300× fewer bytes than fp32 per local step; ``sync_every`` 8 and that codec are the benches' best
    measured setting at 300×, docs/ALGORITHMS.md), keeps the rest, averages all ranks' frames exactly and
    applies the outer step to the last synced weights (the anchor, kept as float32 copies); the result
    becomes every rank's weights.

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

    @checked_constructor(SPARSELOCO_REFERENCE_NAMES)  # reference names, the launcher, topk, dtypes
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
        codec, downlink_codec = _codec_arg(codec, "codec"), _codec_arg(downlink_codec, "downlink_codec")
        super().__init__(params, {})
        mine = [id(p) for g in self.param_groups for p in g["params"]]
        theirs = [id(p) for g in inner.param_groups for p in g["params"]]
        if sorted(mine) != sorted(theirs):
            raise ValueError("inner must optimize exactly the parameters given to SparseLoCo")
        self._paths = _module_paths(self.param_groups, inner.param_groups)
        # The param groups are the inner optimizer's own dicts: an lr scheduler given SparseLoCo (as the HF
        # Trainer gives it the optimizer) sets the lr, and any group's hyperparameters, the inner steps use.
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.inner = inner
        self.sync_every = sync_every
        uplink = codec if codec is not None else default_sparseloco_codec(sync_every)
        self.node = SparseLoCoState(model_record_codec(uplink) if model_record else uplink, error_decay=error_decay)
        self.local_steps = 0
        self.syncs = 0
        with torch.no_grad():
            self.anchor = {
                n: local_tensor(p).detach().to(torch.float32).clone() for n, p, _ in _named(self.param_groups)
            }
        self._outer_factory = outer_optimizer
        self.outer = (
            OuterStep(outer_lr, outer_momentum, nesterov)
            if outer_optimizer is None
            else TorchOuterStep(outer_optimizer, self.anchor)
        )
        self._setup_exchange(
            exchange,
            codec,
            downlink_codec,
            lambda: default_sparseloco_downlink(sync_every),
            process_group,
            limits,
            model_record,
            piece_numel,
        )

    @_names_parameters
    def step(self, closure: Callable[[], Any] | None = None):
        self._first_step_checks()
        self._follow_requires_grad()
        loss = self.inner.step(closure)
        self.local_steps += 1
        if self.local_steps % self.sync_every == 0:
            self.sync()
        self._mark_state(self.local_steps)
        return loss

    @torch.no_grad()
    def _follow_requires_grad(self) -> None:
        """A parameter unfrozen since the last step joins the exchange with its weights now as its anchor
        (its weights at the last sync: the inner optimizer has not stepped it since); one frozen since
        stays in the exchange, so its local steps before freezing are synced like any other's."""
        added, _ = self._changed_trainable(self.anchor)
        if not added:
            return
        if self._fixed_exchange():
            self._refuse_changed_trainable(added, [], "build SparseLoCo and its inner optimizer after unfreezing")
        positions = _positions(self.param_groups)
        for n in added:
            self.anchor[n] = local_tensor(positions[n]).detach().to(torch.float32).clone()

    @_names_parameters
    @torch.no_grad()
    def sync(self) -> None:
        """The outer step now (``step`` calls it every ``sync_every`` local steps)."""
        # Every anchored parameter: those that trained since the optimizer was built, frozen since or not.
        positions = _positions(self.param_groups)
        current = {n: local_tensor(positions[n]) for n in self.anchor}
        device = next(iter(current.values())).device if current else None
        entries = self.node.compress(self._route.prepare(self.anchor), self._route.prepare(current))
        mean = self._route.mean(entries, self.syncs, device)
        self.outer.apply(self.anchor, mean)
        if current:
            # One _foreach_copy_ (exact copies, the same bits as tensor by tensor).
            torch._foreach_copy_(list(current.values()), [self.anchor[n] for n in current])
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        """torch's form: under ``"state"`` each parameter's ``"anchor"``, ``"error"`` (its error buffer),
        ``"outer_momentum"`` (with the built-in outer step's momentum), its inner optimizer's state with
        keys prefixed ``"inner."`` and the counters ``"step"`` (local steps) and ``"syncs"``; the param
        groups (the inner optimizer's); and ``"gradwire"``: the codec's state, a torch ``outer_optimizer``'s
        state, the counters, the parameter shapes and the exchange's state, as in :meth:`DeMo.state_dict`.

        A state dict from ``torch.distributed.checkpoint`` (torch's part only) resumes with a fresh owner
        error feedback and byte counters, and a torch ``outer_optimizer`` without its state."""
        out = super().state_dict()
        index = _packed_index(self.param_groups)
        name_of = {i: n for n, i in index.items()}
        per: dict[str, dict[str, Any]] = {}
        for n, a in self._like_parameters({n: a.detach().clone() for n, a in self.anchor.items()}).items():
            per.setdefault(n, {})["anchor"] = a
        for n, e in self._like_parameters(self._with_zeros(self._per_param(self.node.errors), self.anchor)).items():
            per.setdefault(n, {})["error"] = e
        outer = self.outer.state_dict()
        if isinstance(self.outer, OuterStep):
            buffers = outer.pop("buffers")
            if self.outer.momentum:
                buffers = self._with_zeros(buffers, self.anchor)
            for n, b in self._like_parameters(buffers).items():
                per.setdefault(n, {})["outer_momentum"] = b
        inner = self.inner.state_dict()
        if _torch_form(inner):
            for i, fields in inner["state"].items():
                per.setdefault(name_of[int(i)], {}).update({INNER + k: v for k, v in fields.items()})
        for fields in per.values():
            fields["step"] = torch.tensor(float(self.local_steps))
            fields["syncs"] = torch.tensor(float(self.syncs))
        out["state"] = {index[n]: fields for n, fields in per.items()}
        out[_STATE_KEY] = {
            "node": {"codec": self.node.codec.state_dict()},
            "outer": outer,
            "local_steps": self.local_steps,
            "syncs": self.syncs,
            **({} if _torch_form(inner) else {"inner": inner}),  # an inner optimizer of its own form, whole
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
        devices = {n: p.device for n, p in _positions(self.param_groups).items()}
        legacy = share is not None and "anchor" in share  # from before the per-parameter state
        anchor = share["anchor"] if legacy else {n: f["anchor"] for n, f in per_param.items() if "anchor" in f}
        unknown = [n for n in anchor if n not in devices]
        if unknown:
            raise ValueError(f"the saved anchor names parameters this optimizer does not have: {unknown[:5]}")
        super().load_state_dict(torch_part)
        if share is not None and "inner" in share:
            self.inner.load_state_dict(share["inner"])
        elif _torch_form(self.inner.state_dict()):
            index = _packed_index(self.param_groups)
            inner_state = {
                index[n]: {k[len(INNER) :]: v for k, v in f.items() if k.startswith(INNER)}
                for n, f in per_param.items()
            }
            self.inner.load_state_dict(
                {"state": {i: f for i, f in inner_state.items() if f}, "param_groups": torch_part["param_groups"]}
            )
        self.param_groups = self.inner.param_groups  # load_state_dict made new group dicts on both: one again
        self.anchor = {n: a.detach().to(device=devices[n], dtype=torch.float32).clone() for n, a in anchor.items()}
        node = share["node"] if share is not None else {"codec": self.node.codec.state_dict()}
        errors = (
            node["errors"]
            if "errors" in node
            else self._node_buffers({n: f["error"] for n, f in per_param.items() if "error" in f})
        )
        self.node.load_state_dict({"errors": errors, "codec": node["codec"]})
        first = next(iter(devices.values()), None)
        self.node.errors = {
            n: e.to(self._device_of(n, devices, first) or e.device) for n, e in self.node.errors.items()
        }
        outer = dict(share["outer"]) if share is not None else {}
        if self._outer_factory is not None:
            # A torch optimizer steps the anchor tensors it was built over: build it over the loaded ones.
            self.outer = TorchOuterStep(self._outer_factory, self.anchor)
            if share is not None:  # (torch.distributed.checkpoint keeps no outer optimizer state: it starts afresh)
                self.outer.load_state_dict(outer)
        else:
            if "torch_optimizer" in outer:
                raise ValueError(
                    "this checkpoint's outer step is a torch optimizer: build SparseLoCo with the "
                    "same outer_optimizer to resume it"
                )
            if "buffers" not in outer:
                outer["buffers"] = _nonzero(
                    {n: f["outer_momentum"] for n, f in per_param.items() if "outer_momentum" in f}
                )
            self.outer.load_state_dict(outer)
            self.outer.buffers = {n: b.to(devices.get(n, b.device)) for n, b in self.outer.buffers.items()}
        if share is not None:
            self.local_steps, self.syncs = int(share["local_steps"]), int(share["syncs"])
        else:
            self.local_steps, self.syncs = _step_of(per_param), _step_of(per_param, "syncs")
        if self.local_steps:
            self._mark_state(self.local_steps)


def _torch_form(state: dict) -> bool:
    """Whether an optimizer's state dict is torch's own form (``"state"`` by packed index and
    ``"param_groups"``), which SparseLoCo spreads over its parameters; another form (``MuonAdamW``'s)
    is kept whole under ``"gradwire"``."""
    return set(state) == {"state", "param_groups"}
