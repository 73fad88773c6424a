"""What the DeMo and SparseLoCo optimizers share (:class:`ExchangingOptimizer`): naming parameters by
position (``"g<group>.p<index>"``) and by module path in errors, their exchange route, the checks of
their first step and of a checkpoint, the full state dict, and the properties they report (codec,
process group, frame bytes). See :mod:`gradwire.torch.optimizers` for the optimizers themselves."""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..codecs.base import Codec
from ..frame import Limits
from ..registry import build_codec
from .collectives import all_gather_bytes, comm_device
from .ddp_guard import check_not_all_reduced
from .exchange_route import ExchangeRoute, ModelRecordLayout
from .reshard import reshard_share
from .sharded import Pieces
from .state_bytes import state_from_bytes, state_to_bytes

__all__ = ["ExchangingOptimizer"]

_STATE_KEY = "gradwire"
#: Under ``"gradwire"`` of a :meth:`ExchangingOptimizer.full_state_dict`: every rank's share, in rank order.
_FULL_KEY = "ranks"


def _codec_arg(value, what: str) -> Optional[Codec]:
    """``codec=`` / ``downlink_codec=``: a codec, ``None`` (the algorithm's default), or a name of
    :func:`gradwire.codec_names` built with its defaults (``"dct"``); anything else refused here, at
    construction, rather than at the first step."""
    if value is None or isinstance(value, Codec):
        return value
    if isinstance(value, str):
        return build_codec(value)  # ValueError listing the known names for an unknown one
    raise TypeError(f"{what} must be a gradwire codec (e.g. gradwire.DCTCodec(...)) or a name of "
                    f"gradwire.codec_names(), got {type(value).__name__}")


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


class ExchangingOptimizer:
    """What both optimizers report: their codec, process group and cumulative frame bytes; how they set
    up their exchange; the checks of their first step and of a checkpoint; how errors name parameters."""

    node: Any
    _exchange: Any
    _pieces: Optional[Pieces] = None
    model_record: Optional[ModelRecordLayout] = None
    _buckets: Optional[Any] = None  # DeMo's GradientBuckets with overlap=True
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
                f"{name} over every parameter group at once (torch.optim.Optimizer accepts a list of groups)")
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
            what.append(f"{', '.join(map(self._label, added[:3]))} now require{'s' if len(added) == 1 else ''} a gradient")
        if removed:
            what.append(f"{', '.join(map(self._label, removed[:3]))} no longer require{'s' if len(removed) == 1 else ''} one")
        mode = ("exchange='sharded'" if self._pieces is not None else "model_record=True"
                if self.model_record is not None else "overlap=True")
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

    def _setup_exchange(self, exchange: str, codec: Optional[Codec], downlink_codec: Optional[Codec],
                        default_downlink, process_group, limits, model_record: bool, piece_numel: int) -> None:
        """The optimizer's :class:`~gradwire.torch.exchange_route.ExchangeRoute` (``self._route``) and the
        names the rest of the class reads: ``_exchange``, ``_pieces``, ``model_record``, ``_shards``."""
        self._route = ExchangeRoute(exchange, _named(self.param_groups), self.node.codec, codec, downlink_codec,
                                    default_downlink, process_group, limits, model_record, piece_numel)
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
        process group calls it, as FSDP's full optimizer state dict). Any rank's :meth:`load_state_dict`
        of it takes that rank's own share, so one file resumes every rank (in a group of another size too:
        :mod:`gradwire.torch.reshard`); what the HF Trainer saves from
        rank 0 only (the callback :class:`gradwire.torch.hf_trainer.FullOptimizerState` writes this form there). The shares
        cross ranks as bytes (:mod:`gradwire.torch.state_bytes`), never pickled."""
        out = self.state_dict()  # type: ignore[attr-defined]
        mine = out[_STATE_KEY]
        if self._exchange._distributed():
            g = self.process_group
            shares = all_gather_bytes(state_to_bytes(mine), g, device=comm_device(g),
                                      limits=Limits(max_frame_bytes=1 << 46))
            parts = [state_from_bytes(bytes(b)) for b in shares]
        else:
            parts = [mine]
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
        return reshard_share(parts, kind=route.kind, world=world, rank=rank,
                             old_pieces=route.pieces_for(len(parts)) if sharded else None,
                             new_pieces=route.pieces if sharded else None,
                             owned=[p.name for p in self._exchange.owned(rank)] if sharded else [])

    def _load_exchange(self, mine: dict, devices: dict) -> None:
        self._route.load_state_dict(mine, devices)

    @property
    def exchange(self) -> str:
        """``"sharded"`` or ``"all_gather"``."""
        return self._route.kind

    @property
    def codec(self) -> Codec:
        return self.node.codec

    @property
    def downlink_codec(self) -> Optional[Codec]:
        """The owners' codec of the sharded exchange (``None`` with ``exchange="all_gather"``)."""
        return self._exchange.downlink if self._pieces is not None else None

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return self._exchange.process_group

    @property
    def bytes_sent(self) -> int:
        """This rank's frame bytes, cumulative."""
        return self._exchange.bytes_sent

    @property
    def bytes_received(self) -> int:
        """The other ranks' frame bytes this rank read, cumulative."""
        return self._exchange.bytes_received
