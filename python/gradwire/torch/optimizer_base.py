"""What the DeMo and SparseLoCo optimizers share (:class:`ExchangingOptimizer`): naming parameters by
position (``"g<group>.p<index>"``) and by module path in errors, their exchange route, the checks of
their first step and of a checkpoint, the full state dict, and the properties they report (codec,
process group, frame bytes). See :mod:`gradwire.torch.optimizers` for the optimizers themselves."""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
import torch.distributed as dist

from ..codecs.base import Codec
from ..frame import Limits
from ..registry import build_codec
from .all_gather_exchange import ReportsFrameBytes
from .collectives import all_gather_bytes, comm_device
from .ddp_guard import check_not_all_reduced
from .dtensor import like_parameter, local_tensor
from .exchange_route import ExchangeRoute, ModelRecordLayout
from .launcher_check import refuse_single_rank_launch
from .reshard import reshard_share
from .sharded import Pieces
from .state_bytes import state_from_bytes, state_to_bytes

__all__ = ["ExchangingOptimizer"]

_STATE_KEY = "gradwire"
#: Under ``"gradwire"`` of a :meth:`ExchangingOptimizer.full_state_dict`: every rank's share, in rank order.
_FULL_KEY = "ranks"


def _codec_arg(value, what: str) -> Codec | None:
    """``codec=`` / ``downlink_codec=``: a codec, ``None`` (the algorithm's default), or a name of
    :func:`gradwire.codec_names` built with its defaults (``"dct"``); anything else refused here, at
    construction, rather than at the first step."""
    if value is None or isinstance(value, Codec):
        return value
    if isinstance(value, str):
        return build_codec(value)  # ValueError listing the known names for an unknown one
    raise TypeError(
        f"{what} must be a gradwire codec (e.g. gradwire.DCTCodec(...)) or a name of "
        f"gradwire.codec_names(), got {type(value).__name__}"
    )


def _named(param_groups) -> list[tuple[str, torch.Tensor, dict]]:
    """``(name, parameter, group)`` for every parameter that requires a gradient, by position."""
    out = []
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            if p.requires_grad:
                out.append((f"g{gi}.p{pi}", p, group))
    return out


def _positions(param_groups) -> dict[str, torch.Tensor]:
    """``{"g<group>.p<index>": parameter}`` for every parameter, trainable or frozen."""
    return {f"g{gi}.p{pi}": p for gi, group in enumerate(param_groups) for pi, p in enumerate(group["params"])}


def _module_paths(*groups_lists) -> dict[int, str]:
    """``{id(parameter): module path}`` from the ``param_names`` torch keeps in a group built from
    ``named_parameters()``."""
    out: dict[int, str] = {}
    for param_groups in groups_lists:
        for group in param_groups:
            for p, name in zip(group["params"], group.get("param_names", ())):
                out.setdefault(id(p), name)
    return out


_POSITION = re.compile(r"\bg(\d+)\.p(\d+)\b")


def _names_parameters(method):
    """Re-raise a ``ValueError`` or ``TypeError`` of ``method`` with each position it names (``g0.p3``)
    followed by the parameter's module path, where the optimizer knows it; the exception keeps its type
    (and a ``FrameError`` its ``kind``)."""

    @functools.wraps(method)
    def named(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (ValueError, TypeError) as e:
            if e.args and isinstance(e.args[0], str):
                e.args = (self._describe(e.args[0]),) + e.args[1:]
            raise

    return named


#: Per-parameter state keys of the inner optimizer (SparseLoCo) carry this prefix.
INNER = "inner."


def _packed_index(param_groups) -> dict[str, int]:
    """Each parameter position's index in torch's packed ``state_dict()["state"]`` (parameters counted in
    group order)."""
    out, i = {}, 0
    for gi, group in enumerate(param_groups):
        for pi, _ in enumerate(group["params"]):
            out[f"g{gi}.p{pi}"] = i
            i += 1
    return out


def _by_position(packed: dict, param_groups) -> dict[str, dict]:
    """torch's packed ``"state"`` (by index) as ``{position name: state}``."""
    name_of = {i: n for n, i in _packed_index(param_groups).items()}
    return {name_of[int(i)]: dict(fields) for i, fields in packed.items()}


def _from_saved_indices(packed: dict, saved_groups) -> dict[str, dict]:
    """The ``"state"`` of a saved state dict by position name, its parameter ids read from its own
    ``param_groups`` (as torch's ``load_state_dict`` maps them)."""
    name_of = {pid: f"g{gi}.p{pi}" for gi, g in enumerate(saved_groups) for pi, pid in enumerate(g["params"])}
    out = {}
    for pid, fields in packed.items():
        if pid not in name_of:
            raise ValueError(f"the checkpoint's state names parameter id {pid!r}, which none of its param groups holds")
        out[name_of[pid]] = dict(fields)
    return out


def _nonzero(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The buffers of a checkpoint, or none if every one is all zeros (what a state dict holds before the
    buffers exist: a zero buffer and none step alike)."""
    return buffers if any(bool(t.any()) for t in buffers.values()) else {}


def _step_of(per_param: dict[str, dict], key: str = "step") -> int:
    """The step counter kept per parameter (the same in each): 0 if none is kept."""
    steps = {int(fields[key]) for fields in per_param.values() if key in fields}
    if len(steps) > 1:
        raise ValueError(f"the checkpoint's parameters disagree on {key!r}: {sorted(steps)[:4]}")
    return steps.pop() if steps else 0


class ExchangingOptimizer(ReportsFrameBytes):
    """What both optimizers report: their codec, process group and cumulative frame bytes; how they set
    up their exchange; the checks of their first step and of a checkpoint; how errors name parameters."""

    node: Any
    _exchange: Any
    _pieces: Pieces | None = None
    model_record: ModelRecordLayout | None = None
    _buckets: Any | None = None  # DeMo's GradientBuckets with overlap=True
    _paths: dict[int, str]
    _ddp_checked = False

    def add_param_group(self, param_group: dict) -> None:
        """torch's, while the optimizer is being built; refused afterwards (a ``ValueError`` saying so): the
        frames name parameters by position and the exchange is laid out for them on every rank."""
        if "_exchange" in self.__dict__:
            name = type(self).__name__
            raise ValueError(
                f"{name}.add_param_group after construction is refused: every rank's frames name the parameters "
                f"by their position (g<group>.p<index>) and the exchange was laid out for them; build a new "
                f"{name} over every parameter group at once (torch.optim.Optimizer accepts a list of groups)"
            )
        super().add_param_group(param_group)  # type: ignore[misc]

    def _describe(self, message: str) -> str:
        """``message`` with each position followed by its module path: ``"g0.p3"`` → ``"g0.p3 (h.0.attn.weight)"``."""
        positions = _positions(self.param_groups)

        def label(m: re.Match) -> str:
            p = positions.get(m.group(0))
            path = self._paths.get(id(p)) if p is not None else None
            return f"{m.group(0)} ({path})" if path and f"({path})" not in message else m.group(0)

        return _POSITION.sub(label, message)

    def _label(self, position: str) -> str:
        return self._describe(position)

    def _first_step_checks(self) -> None:
        """Once, at the first step in a group of more than one rank: no DDP all-reduces these gradients."""
        if self._ddp_checked:
            return
        refuse_single_rank_launch(type(self).__name__, self.process_group, f"{type(self).__name__}.step() runs")
        self._ddp_checked = True
        if self._exchange.world() > 1:
            params = [p for _, p, _ in _named(self.param_groups)]
            labels = {id(p): self._label(n) for n, p, _ in _named(self.param_groups)}
            check_not_all_reduced(params, labels, type(self).__name__)

    def _fixed_exchange(self) -> bool:
        """Whether the set of exchanged tensors is fixed at construction (sharded pieces, a model record,
        the overlap's hooks)."""
        return self._pieces is not None or self.model_record is not None or self._buckets is not None

    def _changed_trainable(self, exchanged) -> tuple[list[str], list[str]]:
        """The parameters that require a gradient now but are not exchanged, and the reverse."""
        trainable = [n for n, _, _ in _named(self.param_groups)]
        have, now = set(exchanged), set(trainable)
        return [n for n in trainable if n not in have], [n for n in exchanged if n not in now]

    def _refuse_changed_trainable(self, added: list[str], removed: list[str], rebuild: str) -> None:
        what = []
        if added:
            what.append(
                f"{', '.join(map(self._label, added[:3]))} now require{'s' if len(added) == 1 else ''} a gradient"
            )
        if removed:
            what.append(
                f"{', '.join(map(self._label, removed[:3]))} no longer require{'s' if len(removed) == 1 else ''} one"
            )
        mode = (
            "exchange='sharded'"
            if self._pieces is not None
            else "model_record=True"
            if self.model_record is not None
            else "overlap=True"
        )
        raise ValueError(
            f"{type(self).__name__}: {' and '.join(what)}; with {mode} the tensors exchanged are fixed when the "
            f"optimizer is built: {rebuild}, or build it with exchange='all_gather', model_record=False and "
            "overlap=False, which follow requires_grad as it changes"
        )

    def _model_shapes(self) -> dict[str, list[int]]:
        return {n: list(p.shape) for n, p in _positions(self.param_groups).items()}

    def _check_model_shapes(self, mine: dict) -> None:
        """A checkpoint of another model (other parameter count or shapes) is refused, naming the first difference."""
        saved = mine.get("shapes")
        if saved is None:
            return  # a checkpoint from before the shapes were saved
        here = self._model_shapes()
        if list(saved) != list(here):
            raise ValueError(
                f"this checkpoint is of another model: it holds {len(saved)} parameters, this optimizer has {len(here)}"
            )
        for n, shape in here.items():
            if [int(d) for d in saved[n]] != shape:
                raise ValueError(
                    f"this checkpoint is of another model: {self._label(n)} has shape {tuple(saved[n])} in it, "
                    f"{tuple(shape)} here"
                )

    def _setup_exchange(
        self,
        exchange: str,
        codec: Codec | None,
        downlink_codec: Codec | None,
        default_downlink,
        process_group,
        limits,
        model_record: bool,
        piece_numel: int,
    ) -> None:
        """The optimizer's :class:`~gradwire.torch.exchange_route.ExchangeRoute` (``self._route``) and the
        names the rest of the class reads: ``_exchange``, ``_pieces``, ``model_record``, ``_shards``."""
        self._route = ExchangeRoute(
            exchange,
            _named(self.param_groups),
            self.node.codec,
            codec,
            downlink_codec,
            default_downlink,
            process_group,
            limits,
            model_record,
            piece_numel,
        )
        self._exchange = self._route.exchange
        self._pieces = self._route.pieces
        self.model_record = self._route.model_record
        self._shards = self._route.shards

    def _device_of(self, name: str, devices: dict, first) -> Any:
        """The device of the parameter a node buffer (named by parameter, piece or model record) belongs to."""
        if self._pieces is not None:
            name = self._pieces.tensor_of.get(name, name)
        return devices.get(name, first)

    def full_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` with every rank's share under ``"gradwire"`` (collective: every rank of the
        process group calls it, as FSDP's full optimizer state dict). A share is that rank's ``"gradwire"``
        section with its per-parameter state under ``"params"`` (by position name). Any rank's
        :meth:`load_state_dict` of it takes that rank's own share, so one file resumes every rank (in a
        group of another size too: :mod:`gradwire.torch.reshard`); what the HF Trainer saves from rank 0
        only (the callback :class:`gradwire.torch.hf_trainer.FullOptimizerState` writes this form there).
        The shares cross ranks as bytes (:mod:`gradwire.torch.state_bytes`), never pickled."""
        if self._shards.state_dict():
            raise ValueError(
                "full_state_dict gathers every rank's state into one file; these parameters are FSDP2 "
                "shards: save them with torch.distributed.checkpoint (get_optimizer_state_dict), which "
                "keeps each shard's state with its shard"
            )
        out = self.state_dict()  # type: ignore[attr-defined]
        mine = dict(out[_STATE_KEY], params=_by_position(out["state"], self.param_groups))
        if self._exchange._distributed():
            g = self.process_group
            shares = all_gather_bytes(
                state_to_bytes(mine), g, device=comm_device(g), limits=Limits(max_frame_bytes=1 << 46)
            )
            parts = [state_from_bytes(bytes(b)) for b in shares]
        else:
            parts = [mine]
        out["state"] = {}  # every rank's is in its share
        out[_STATE_KEY] = {_FULL_KEY: parts, "world": len(parts)}
        return out

    def _own_share(self, mine: dict) -> dict:
        """This rank's share of a :meth:`full_state_dict` (``mine`` as it is if it is one rank's already); of a
        full state saved by a group of another size, the share :func:`gradwire.torch.reshard.reshard_share`
        makes for this rank (each rank's buffers averaged, the owners' residual cut anew)."""
        if _FULL_KEY not in mine:
            return mine
        parts = mine[_FULL_KEY]
        world, rank = self._exchange.world(), self._exchange.rank()
        if len(parts) == world:
            return parts[rank]
        # Another group size: each rank's buffers become their mean, the owners' residuals are cut anew.
        route = self._route
        sharded = route.pieces is not None
        return reshard_share(
            parts,
            kind=route.kind,
            world=world,
            rank=rank,
            old_pieces=route.pieces_for(len(parts)) if sharded else None,
            new_pieces=route.pieces if sharded else None,
            owned=[p.name for p in self._exchange.owned(rank)] if sharded else [],
            downlink=self._exchange.downlink if sharded else None,
        )

    def _split_state(self, state_dict: dict[str, Any]) -> tuple[dict | None, dict[str, dict], dict]:
        """What both optimizers' ``load_state_dict`` do first: check the state dict (another model, shards,
        exchange, group or rank is refused before anything changes), load the exchange's part, and return
        ``(share, per-parameter state, torch's part)``: this rank's ``"gradwire"`` share (``None`` for a
        state dict without it: what ``torch.distributed.checkpoint`` hands back), the per-parameter state
        by position name (from the share of a full state dict, else from ``"state"``) and
        ``{"state": {}, "param_groups": ...}`` for torch's own ``load_state_dict``."""
        state_dict = dict(state_dict)
        gw = state_dict.pop(_STATE_KEY, None)
        share = self._own_share(gw) if gw is not None else None
        if share is not None:
            self._check_model_shapes(share)
            self._shards.check_state(share.get("shards"))
        if share is not None and "params" in share:
            per_param = dict(share["params"])
        else:
            per_param = _from_saved_indices(state_dict.get("state", {}), state_dict["param_groups"])
        # gradwire's own per-parameter state of an FSDP parameter is a DTensor in the state dict: its shard here.
        per_param = {
            n: {k: (local_tensor(v) if not k.startswith(INNER) else v) for k, v in f.items()}
            for n, f in per_param.items()
        }
        self._check_param_state(per_param)
        if share is not None:
            devices = {n: p.device for n, p in _positions(self.param_groups).items()}
            self._route.load_state_dict(share, devices)
        return share, per_param, {"state": {}, "param_groups": state_dict["param_groups"]}

    def _check_param_state(self, per_param: dict[str, dict]) -> None:
        """``ValueError`` for per-parameter state of a parameter this optimizer lacks or of another shape."""
        positions = _positions(self.param_groups)
        for n, fields in per_param.items():
            if n not in positions:
                raise ValueError(
                    f"this checkpoint is of another model: it holds state of {n}, a parameter this "
                    "optimizer does not have"
                )
            shape = tuple(local_tensor(positions[n]).shape)
            for k, t in fields.items():
                if isinstance(t, torch.Tensor) and t.ndim and not k.startswith(INNER) and tuple(t.shape) != shape:
                    raise ValueError(
                        f"this checkpoint is of another model: its {k} of {self._label(n)} has shape "
                        f"{tuple(t.shape)}, the parameter {shape}"
                    )

    def _mark_state(self, step: int) -> None:
        """``self.state[p]["step"]`` for every trainable parameter, as torch's optimizers keep it.

        The buffers themselves live with the node side, cut as the exchange sends them (pieces, a model
        record); :meth:`state_dict` presents them per parameter. ``self.state`` is not empty after a step,
        so ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict``, which steps an optimizer whose
        ``state`` is empty (with zero gradients and learning rate 0) to create its state, never steps
        this one once it has state (a DeMo step at learning rate 0 still decays and sends its momenta)."""
        t = torch.tensor(float(step))  # one tensor, shared: the step's operations do not grow with the tensors
        for _, p, _ in _named(self.param_groups):
            self.state[p]["step"] = t

    def _per_param(self, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Node buffers (keyed by piece, model record or parameter) as one float32 tensor per parameter
        position, copies: pieces joined, a model record unflattened."""
        if not buffers:
            return {}
        route = self._route
        if route.pieces is not None:
            buffers = route.pieces.join(buffers)
        if route.model_record is not None:
            buffers = route.model_record.spec.unflatten(buffers[route.model_record.name])
        return {n: t.detach().clone().contiguous() for n, t in buffers.items()}

    def _like_parameters(self, per_param: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-parameter state as its parameter is: a ``DTensor`` for an FSDP parameter (``like_parameter``)."""
        positions = _positions(self.param_groups)
        return {n: like_parameter(t, positions[n]) for n, t in per_param.items()}

    def _with_zeros(self, per_param: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
        """``per_param`` with a float32 zero buffer for each of ``names`` it lacks: a state dict has the same
        keys before a buffer exists as after (``torch.distributed.checkpoint`` loads only the keys of the
        state dict it loads into); a zero buffer is loaded as none (:func:`_nonzero`)."""
        positions = _positions(self.param_groups)
        out = dict(per_param)
        for n in names:
            if n not in out:
                out[n] = torch.zeros_like(local_tensor(positions[n]), dtype=torch.float32)
        return out

    def _node_buffers(self, per_param: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`_per_param` undone: per-parameter tensors as the node's buffers (float32 copies, on each
        parameter's device)."""
        per_param = _nonzero(per_param)
        if not per_param:
            return {}
        positions = _positions(self.param_groups)
        on_device = {
            n: t.detach().to(device=local_tensor(positions[n]).device, dtype=torch.float32)
            for n, t in per_param.items()
        }
        return {n: t.clone().contiguous() for n, t in self._route.prepare(on_device).items()}

    @property
    def exchange(self) -> str:
        """``"sharded"`` or ``"all_gather"``."""
        return self._route.kind

    @property
    def codec(self) -> Codec:
        return self.node.codec

    @property
    def downlink_codec(self) -> Codec | None:
        """The owners' codec of the sharded exchange (``None`` with ``exchange="all_gather"``)."""
        return self._exchange.downlink if self._pieces is not None else None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._exchange.process_group
