"""DeMo and SparseLoCo as ``torch.optim.Optimizer`` s on torch.distributed (gloo, NCCL).

Both are thin transports around :mod:`gradwire.algorithms`: the node side forms this rank's records and
the ranks exchange them in one of two ways (``exchange=``):

- ``"sharded"`` (the default, :mod:`gradwire.torch.sharded`): the parameters are cut into pieces, each
  owned by one rank; every rank sends each owner its records of that owner's pieces (one all-to-all of
  bundle frames), each owner averages them exactly, re-encodes the mean with the downlink codec under
  its own error feedback, and the owners' frames are all-gathered and decoded by every rank. A rank's
  traffic stays under two frames' worth of records per step whatever the world size.
- ``"all_gather"``: one bundle frame per rank (``round`` = the step or sync counter, ``sender`` = the
  group rank) goes through :func:`~gradwire.torch.collectives.all_gather_bytes`, every rank reads every
  rank's frame (with :class:`~gradwire.Limits`) and averages them with
  :func:`~gradwire.algorithms.exact_mean` in rank order; a rank receives ``world − 1`` frames.

Either way every rank applies the update to the same decoded mean. ``exact_mean``, the decode and the
updates are fixed sequences of elementwise float32 operations on exactly decoded records, so all ranks
hold bit-identical weights afterwards (given that they started from the same weights, as DDP ensures
by broadcasting them).

Parameters are named by position, ``"g<group>.p<index>"`` (``"g0.p3"``: the fourth parameter of the
first group), so frames are the same whatever the modules are called; every rank must build its
optimizer over the same parameter list. Given ``model.named_parameters()`` (as torch's optimizers
accept it), errors name a parameter by its module path too: ``"h.0.attn.weight (g0.p3)"``.

Under ``DistributedDataParallel`` (the HF Trainer, Accelerate and Lightning wrap the model in it) the
first distributed step raises :class:`~gradwire.torch.ddp_guard.DenseAllReduceError` unless the DDP
module's comm hook is :func:`~gradwire.torch.ddp_guard.local_gradients_hook`: DDP's dense all-reduce
would otherwise run beside these frames and spend every byte they save (docs/RECIPES.md).

Counters (cumulative, frame bytes only — the length words and padding of the collectives are not
counted): ``bytes_sent`` is the length of this rank's own frames, ``bytes_received`` the total length of
the other ranks' frames this rank read. Sharded, ``bytes_sent`` counts this rank's phase-1 frames to the
other owners and its re-encoded frame (once, as the all-gather path counts its frame once), and
``bytes_received`` the frames the other ranks sent it in phase 1 and their re-encoded frames in phase 2.

Without an initialized process group (and no ``process_group``) both run as a group of one: the frame
is still written, read back and applied, so single-process code behaves as rank 0 of one.

Parameters may be FSDP2 ``DTensor`` s (``fully_shard``): each rank encodes, exchanges and updates its own
shard (:mod:`gradwire.torch.dtensor`), and ``process_group`` must join the replicas of that shard, e.g.
the replicate group of a ``(replicate, shard)`` mesh whose shard dimension FSDP runs over (checked when
the optimizer is built; docs/DISTRIBUTED.md, "Sharded models").
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..algorithms import (
    DEFAULT_SYNC_EVERY,
    DeMoState,
    OuterStep,
    SparseLoCoState,
    default_demo_codec,
    default_sparseloco_codec,
    default_sparseloco_downlink,
    demo_update,
    exact_mean,
)
from ..codecs.base import Codec
from ..errors import FrameError
from ..frame import DEFAULT_LIMITS, Entry, Limits, read_frame, write_frame
from ..model_record import ModelSpec, check_model_entries, model_record_codec
from ..registry import build_codec
from .collectives import GroupMember, all_gather_bytes, comm_device, group_world_size
from .ddp_guard import check_not_all_reduced
from .dtensor import ShardLayout, local_grad, local_tensor
from .sharded import DEFAULT_PIECE_NUMEL, Pieces, ShardedExchange
from .outer import OuterOptimizerFactory, TorchOuterStep
from .state_bytes import state_from_bytes, state_to_bytes

__all__ = ["DeMo", "SparseLoCo"]

_STATE_KEY = "gradwire"
#: Under ``"gradwire"`` of a :meth:`_ExchangesFrames.full_state_dict`: every rank's share, in rank order.
_FULL_KEY = "ranks"
#: The two ways of exchanging records; the first is the default.
EXCHANGES = ("sharded", "all_gather")


class _Exchange(GroupMember):
    """One bundle frame per rank, all-gathered and read back in rank order; the byte counters."""

    def __init__(self, process_group: Optional[dist.ProcessGroup], limits: Optional[Limits]):
        self.process_group = process_group
        self.limits = limits or DEFAULT_LIMITS
        self.bytes_sent = 0
        self.bytes_received = 0

    def __call__(self, entries: list[Entry], round: int) -> list[list[Entry]]:
        """Every rank's records, in rank order (this rank's read back from its own frame too)."""
        rank = self.rank()
        frame = write_frame(entries, round=round, sender=rank, bundle=True)
        if self._distributed():
            g = self.process_group
            frames = all_gather_bytes(frame, g, device=comm_device(g), limits=self.limits)
        else:
            frames = [frame]
        out = []
        received = 0
        for r, data in enumerate(frames):
            got = read_frame(data, limits=self.limits)
            if not got.bundle or got.round != round or got.sender != r:
                raise FrameError(
                    f"rank {r} sent a {'bundle' if got.bundle else 'tensor'} frame for round {got.round} from"
                    f" sender {got.sender}; expected a bundle frame for round {round} from {r}"
                )
            if r != rank:
                received += len(data)
            out.append(got.entries)
        self.bytes_sent += len(frame)
        self.bytes_received += received
        return out

    def state_dict(self) -> dict[str, int]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "world": self.world()}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("exchange", "all_gather")
        if saved != "all_gather":
            raise ValueError(
                f"this checkpoint was saved with exchange={saved!r}; this optimizer uses exchange='all_gather' "
                f"(build it with exchange={saved!r} to resume it)"
            )
        world = self.world()
        if int(state.get("world", world)) != world:
            raise ValueError(
                f"this checkpoint was saved by a group of {int(state['world'])} ranks, this group has {world}: the "
                "momenta and error buffers it holds are one rank's share of that group's exchange (resume in a "
                "group of the same size, each rank from its own checkpoint)"
            )
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_received = int(state["bytes_received"])


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


class _ModelRecord:
    """The whole-model record of an optimizer's parameters (docs/FORMAT.md section 9): every tensor
    flattened in parameter order into one float32 vector that travels as one record named after the
    spec's hash, so a step's frame has one record's overhead whatever the number of tensors."""

    def __init__(self, named: list[tuple[str, torch.Tensor, dict]]):
        self.spec = ModelSpec([(n, torch.float32, tuple(local_tensor(p).shape)) for n, p, _ in named])
        self.name = self.spec.record_name

    def flatten(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.name: self.spec.flatten({n: t.to(torch.float32) for n, t in tensors.items()})}

    def mean(self, per_rank: list[list[Entry]], device) -> dict[str, torch.Tensor]:
        """The exact mean of every rank's model record, as views per parameter name; ``FrameError``
        (``model_spec_mismatch`` / ``invalid_model_record``) if a rank sent anything else."""
        for entries in per_rank:
            check_model_entries(entries, self.spec)
        return self.spec.unflatten(exact_mean(per_rank, device=device)[self.name])


class _ExchangesFrames:
    """What both optimizers report: their codec, process group and cumulative frame bytes; how they set
    up their exchange; the checks of their first step and of a checkpoint; how errors name parameters."""

    node: Any
    _exchange: Any
    _pieces: Optional[Pieces] = None
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
        """Whether the set of exchanged tensors is fixed at construction (sharded pieces, a model record)."""
        return self._pieces is not None or self.model_record is not None

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
        mode = "exchange='sharded'" if self._pieces is not None else "model_record=True"
        raise ValueError(
            f"{type(self).__name__}: {' and '.join(what)}; with {mode} the tensors exchanged are fixed when the "
            f"optimizer is built: {rebuild}, or build it with exchange='all_gather' and model_record=False, "
            "which follow requires_grad as it changes"
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

    def _setup_exchange(self, exchange: str, codec: Codec, downlink_codec: Optional[Codec], default_downlink,
                        process_group, limits, model_record: bool, piece_numel: int) -> None:
        """``self._exchange`` (and, sharded, ``self._pieces``: what the node side's buffers are keyed by);
        ``self._shards``: the FSDP shards this rank holds, checked against ``process_group``."""
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGES))}, got {exchange!r}")
        named = _named(self.param_groups)
        self._shards = ShardLayout([(n, p) for n, p, _ in named], process_group)
        if exchange == "all_gather":
            if downlink_codec is not None:
                raise ValueError("downlink_codec is the owners' codec of exchange='sharded'; all_gather has none")
            self._exchange = _Exchange(process_group, limits)
            return
        if model_record:
            tensors = [(self.model_record.name, (self.model_record.spec.numel,))]
        else:
            tensors = [(n, tuple(local_tensor(p).shape)) for n, p, _ in named]
        self._pieces = Pieces(tensors, self.node.codec, piece_numel, group_world_size(process_group))
        if downlink_codec is None:
            # The uplink's twin: the same class and parameters, a state of its own.
            downlink_codec = default_downlink() if codec is None else copy.deepcopy(codec)
        if model_record:
            downlink_codec = model_record_codec(downlink_codec)
        self._exchange = ShardedExchange(self._pieces, downlink_codec, process_group, limits,
                                         model_record=model_record)

    def _device_of(self, name: str, devices: dict, first) -> Any:
        """The device of the parameter a node buffer (named by parameter, piece or model record) belongs to."""
        if self._pieces is not None:
            name = self._pieces.tensor_of.get(name, name)
        return devices.get(name, first)

    def full_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` with every rank's share under ``"gradwire"`` (collective: every rank of the
        process group calls it, as FSDP's full optimizer state dict). Any rank's :meth:`load_state_dict`
        of it takes that rank's own share, so one file resumes every rank; what the HF Trainer saves from
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
        """This rank's share of a :meth:`full_state_dict` (``mine`` as it is if it is one rank's already);
        ``ValueError`` for a full state of another group size."""
        if _FULL_KEY not in mine:
            return mine
        parts = mine[_FULL_KEY]
        world, rank = self._exchange.world(), self._exchange.rank()
        if len(parts) != world:
            raise ValueError(
                f"this full checkpoint holds the state of {len(parts)} ranks, this group has {world}: each rank's "
                "momenta and error buffers are its share of that group's exchange (resume in a group of the "
                "same size)")
        return parts[rank]

    def _load_exchange(self, mine: dict, devices: dict) -> None:
        self._shards.check_state(mine.get("shards"))
        if self._pieces is not None:
            self._exchange.load_state_dict(mine, devices)
        else:
            self._exchange.load_state_dict(mine)

    @property
    def exchange(self) -> str:
        """``"sharded"`` or ``"all_gather"``."""
        return "sharded" if self._pieces is not None else "all_gather"

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


class DeMo(_ExchangesFrames, torch.optim.Optimizer):
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
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        *,
        codec: Optional[Codec] = None,
        beta: float = 0.999,
        weight_decay: float = 0.0,
        process_group: Optional[dist.ProcessGroup] = None,
        limits: Optional[Limits] = None,
        model_record: bool = False,
        exchange: str = "sharded",
        downlink_codec: Optional[Codec] = None,
        piece_numel: int = DEFAULT_PIECE_NUMEL,
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
        self.model_record = _ModelRecord(_named(self.param_groups)) if model_record else None
        self._setup_exchange(exchange, codec, downlink_codec, default_demo_codec, process_group, limits,
                             model_record, piece_numel)

    @_names_parameters
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
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
        pieces = self._pieces
        if pieces is not None:
            # Sharded: the node's buffers are the pieces'; the exchange hands back each tensor's mean.
            if self.model_record is not None:
                mr = self.model_record
                scaled = {n: torch.mul(local_grad(p).to(torch.float32), g["lr"]) for n, p, g in named}
                entries = self.node.compress(pieces.cut(mr.flatten(scaled)), 1.0)
                mean = mr.spec.unflatten(self._exchange(entries, self.steps, device)[mr.name])
            else:
                for group in self.param_groups:
                    grads = {n: local_grad(p) for n, p, g in named if g is group}
                    if grads:
                        entries += self.node.compress(pieces.cut(grads), group["lr"])
                mean = self._exchange(entries, self.steps, device)
        elif self.model_record is not None:
            # One record: each group's lr·grad (the same product compress would take), lr 1 after it.
            scaled = {n: torch.mul(local_grad(p).to(torch.float32), g["lr"]) for n, p, g in named}
            entries = self.node.compress(self.model_record.flatten(scaled), 1.0)
            mean = self.model_record.mean(self._exchange(entries, self.steps), device)
        else:
            for gi, group in enumerate(self.param_groups):
                grads = {n: local_grad(p) for n, p, g in named if g is group}
                if grads:
                    entries += self.node.compress(grads, group["lr"])
            mean = exact_mean(self._exchange(entries, self.steps), device=device)
        for group in self.param_groups:
            params = {n: local_tensor(p) for n, p, g in named if g is group}
            if params:
                demo_update(params, {n: mean[n] for n in params}, group["lr"], group["weight_decay"])
        self.steps += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (param groups) plus ``"gradwire"``: the momenta and codec state, the
        step counter and the byte counters; sharded, also the group's size, this rank and the owner's
        error feedback (a sharded checkpoint resumes only in a group of the same size, on the same rank)."""
        out = super().state_dict()
        out[_STATE_KEY] = {"node": self.node.state_dict(), "steps": self.steps, "shapes": self._model_shapes(),
                           **self._shards.state_dict(),
                           **self._exchange.state_dict()}
        return out

    @_names_parameters
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (or :meth:`full_state_dict`: this rank's share of it);
        ``ValueError`` for a checkpoint of another model (parameter count or shapes), group size, rank
        (sharded) or exchange."""
        state_dict = dict(state_dict)
        mine = self._own_share(state_dict.pop(_STATE_KEY))
        self._check_model_shapes(mine)
        named = _named(self.param_groups)
        devices = {n: p.device for n, p, _ in named}
        first = named[0][1].device if named else None
        self._load_exchange(mine, devices)  # first: a checkpoint of another exchange or group is refused as is
        super().load_state_dict(state_dict)
        self.node.load_state_dict(mine["node"])
        self.node.momenta = {
            n: m.to(self._device_of(n, devices, first) or m.device) for n, m in self.node.momenta.items()
        }
        self.steps = int(mine["steps"])


class SparseLoCo(_ExchangesFrames, torch.optim.Optimizer):
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

    def __init__(
        self,
        params: Iterable,
        inner: torch.optim.Optimizer,
        *,
        sync_every: int = DEFAULT_SYNC_EVERY,
        codec: Optional[Codec] = None,
        outer_lr: float = 1.0,
        error_decay: float = 0.95,
        process_group: Optional[dist.ProcessGroup] = None,
        outer_momentum: float = 0.0,
        nesterov: bool = False,
        limits: Optional[Limits] = None,
        model_record: bool = False,
        exchange: str = "sharded",
        downlink_codec: Optional[Codec] = None,
        piece_numel: int = DEFAULT_PIECE_NUMEL,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
    ):
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        if outer_optimizer is not None and (outer_lr != 1.0 or outer_momentum != 0.0 or nesterov):
            raise ValueError("give either outer_optimizer or outer_lr/outer_momentum/nesterov: the outer "
                             "optimizer carries its own learning rate and momentum")
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
        self.outer = (OuterStep(outer_lr, outer_momentum, nesterov) if outer_optimizer is None
                      else TorchOuterStep(outer_optimizer, self.anchor))
        self.model_record = _ModelRecord(_named(self.param_groups)) if model_record else None
        self._setup_exchange(exchange, codec, downlink_codec, lambda: default_sparseloco_downlink(sync_every),
                             process_group, limits, model_record, piece_numel)

    @_names_parameters
    def step(self, closure: Optional[Callable[[], Any]] = None):
        self._first_step_checks()
        self._follow_requires_grad()
        loss = self.inner.step(closure)
        self.local_steps += 1
        if self.local_steps % self.sync_every == 0:
            self.sync()
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
        pieces = self._pieces
        if pieces is not None:
            # Sharded: the node's error buffers are the pieces'; the exchange hands back each tensor's mean.
            mr = self.model_record
            if mr is not None:
                entries = self.node.compress(pieces.cut(mr.flatten(self.anchor)), pieces.cut(mr.flatten(current)))
                mean = mr.spec.unflatten(self._exchange(entries, self.syncs, device)[mr.name])
            else:
                entries = self.node.compress(pieces.cut(self.anchor), pieces.cut(current))
                mean = self._exchange(entries, self.syncs, device)
        elif self.model_record is not None:
            # Elementwise, the flat pseudo-gradient and error buffer are the per-tensor ones, concatenated.
            mr = self.model_record
            entries = self.node.compress(mr.flatten(self.anchor), mr.flatten(current))
            mean = mr.mean(self._exchange(entries, self.syncs), device)
        else:
            entries = self.node.compress(self.anchor, current)
            mean = exact_mean(self._exchange(entries, self.syncs), device=device)
        self.outer.apply(self.anchor, mean)
        if current:
            # One _foreach_copy_ (exact copies, the same bits as tensor by tensor).
            torch._foreach_copy_(list(current.values()), [self.anchor[n] for n in current])
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the anchor, error buffers and codec state, the outer optimizer's
        state, the step and sync counters and the byte counters (under ``"gradwire"``); sharded, also the
        group's size, this rank and the owner's error feedback, as in :meth:`DeMo.state_dict`."""
        out = super().state_dict()
        out[_STATE_KEY] = {
            "inner": self.inner.state_dict(),
            "anchor": {n: a.clone() for n, a in self.anchor.items()},
            "node": self.node.state_dict(),
            "outer": self.outer.state_dict(),
            "local_steps": self.local_steps,
            "syncs": self.syncs,
            "shapes": self._model_shapes(),
            **self._shards.state_dict(),
            **self._exchange.state_dict(),
        }
        return out

    @_names_parameters
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (or :meth:`full_state_dict`: this rank's share of it);
        ``ValueError`` for a checkpoint of another model (parameter count or shapes), group size, rank
        (sharded) or exchange."""
        state_dict = dict(state_dict)
        mine = self._own_share(state_dict.pop(_STATE_KEY))
        self._check_model_shapes(mine)
        devices = {n: p.device for n, p in _positions(self.param_groups).items()}
        unknown = [n for n in mine["anchor"] if n not in devices]
        if unknown:
            raise ValueError(f"the saved anchor names parameters this optimizer does not have: {unknown[:5]}")
        self._load_exchange(mine, devices)  # first: a checkpoint of another exchange or group is refused as is
        super().load_state_dict(state_dict)
        self.inner.load_state_dict(mine["inner"])
        self.param_groups = self.inner.param_groups  # load_state_dict made new group dicts on both: one again
        self.anchor = {n: a.detach().to(device=devices[n], dtype=torch.float32).clone() for n, a in mine["anchor"].items()}
        self.node.load_state_dict(mine["node"])
        first = next(iter(devices.values()), None)
        self.node.errors = {
            n: e.to(self._device_of(n, devices, first) or e.device) for n, e in self.node.errors.items()
        }
        if self._outer_factory is not None:
            # A torch optimizer steps the anchor tensors it was built over: build it over the loaded ones.
            self.outer = TorchOuterStep(self._outer_factory, self.anchor)
            self.outer.load_state_dict(mine["outer"])
        else:
            if "torch_optimizer" in mine["outer"]:
                raise ValueError("this checkpoint's outer step is a torch optimizer: build SparseLoCo with the "
                                 "same outer_optimizer to resume it")
            self.outer.load_state_dict(mine["outer"])
            self.outer.buffers = {n: b.to(devices.get(n, b.device)) for n, b in self.outer.buffers.items()}
        self.local_steps = int(mine["local_steps"])
        self.syncs = int(mine["syncs"])
