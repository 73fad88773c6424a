"""One torch transport for every registered algorithm: :class:`AlgorithmOptimizer`, a ``torch.optim.Optimizer``
on torch.distributed (gloo, NCCL); ``gradwire.torch.DeMo`` and ``SparseLoCo`` are thin constructors over it.

It reaches an algorithm of :mod:`gradwire.algorithms` through its registered parts alone, never by its
name. A step is the node side's ``local_step`` (DeMo's momentum step, SparseLoCo's inner optimizer), with
each param group's hyperparameters as the group holds them now; on a step that sends, a **round**: the
node side's ``send``, the exact mean of every rank's records (sharded among owners or all-gathered:
:class:`~gradwire.torch.exchange_route.ExchangeRoute`), and the one commit point,
:meth:`AlgorithmOptimizer._commit`: ``Algorithm.apply`` — the function the server and every node of a
run apply a version with — on the node side's target, then ``synced``. Every rank decodes the same bytes
and applies the same elementwise float32 operations, so the replicas stay bit-identical.

Parameters are named by position, ``"g<group>.p<index>"`` (``"g0.p3"``: the fourth parameter of the first
group), so frames are the same whatever the modules are called; given ``named_parameters()`` or a module,
errors add the module path: ``"g0.p3 (h.0.attn.weight)"``. Under ``DistributedDataParallel`` the first
distributed step raises :class:`~gradwire.torch.ddp_guard.DenseAllReduceError` unless DDP's comm hook is
:func:`~gradwire.torch.ddp_guard.local_gradients_hook`. Without a process group it runs as a group of
one. FSDP2 ``DTensor`` parameters: each rank works on its shard (:mod:`gradwire.torch.dtensor`).

**The live state is per parameter**: ``opt.state[p]`` holds the node side's buffers (``"momentum"``,
``"error"``), its per-tensor state (``"anchor"``), the algorithm's (``"outer_momentum"``) and the
counters — the tensors the step updates, float32 in the parameter's local shape; the pieces the sharded
exchange sends and a whole-model record are views into them. The owners' error feedback of the sharded
exchange covers only the pieces a rank owns: it is in ``state_dict()["gradwire"]["owner"]``, by piece.
docs/DISTRIBUTED.md, section 4, has the protocol and the byte counters.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..algorithms import Algorithm, get_algorithm
from ..codecs.base import Codec
from ..frame import Entry, Limits, decode_entry
from ..model_record import model_record_codec
from ..registry import build_codec
from .all_gather_exchange import AllGatherExchange, ReportsFrameBytes
from .collectives import all_gather_bytes, comm_device
from .ddp_guard import check_not_all_reduced
from .dtensor import LocalTensors, is_dtensor, like_parameter, local_grad, local_tensor
from .exchange_route import ExchangeRoute, LiveTensor
from .launcher_check import refuse_single_rank_launch
from .outer import OuterOptimizerFactory, TorchOuterStep
from .overlap import DEFAULT_BUCKET_NUMEL, GradientBuckets
from .reshard import reshard_share
from .round_outcome import RoundNotCommitted
from .sharded import DEFAULT_PIECE_NUMEL, ShardedExchange
from .state_bytes import state_from_bytes, state_to_bytes

__all__ = ["AlgorithmOptimizer", "codec_arg"]

#: The key of a state dict's gradwire section.
STATE_KEY = "gradwire"
#: Under ``"gradwire"`` of a :meth:`AlgorithmOptimizer.full_state_dict`: every rank's share, in rank order.
FULL_KEY = "ranks"
#: Per-parameter state keys of an inner optimizer (SparseLoCo's) carry this prefix.
INNER = "inner."
_POSITION = re.compile(r"\bg(\d+)\.p(\d+)\b")


def _trainable(param_groups) -> list[tuple[str, torch.Tensor, dict]]:
    """``(position, parameter, group)`` for every parameter that requires a gradient."""
    return [
        (f"g{gi}.p{pi}", p, g)
        for gi, g in enumerate(param_groups)
        for pi, p in enumerate(g["params"])
        if p.requires_grad
    ]


def _positions(param_groups) -> dict[str, torch.Tensor]:
    """``{position: parameter}`` for every parameter, trainable or frozen, in torch's packed order."""
    return {f"g{gi}.p{pi}": p for gi, g in enumerate(param_groups) for pi, p in enumerate(g["params"])}


def _module_paths(*groups_lists) -> dict[int, str]:
    """``{id(parameter): module path}`` from the ``param_names`` torch keeps in a group built from
    ``named_parameters()``."""
    out: dict[int, str] = {}
    for param_groups in groups_lists:
        for group in param_groups:
            for p, name in zip(group["params"], group.get("param_names", ())):
                out.setdefault(id(p), name)
    return out


def _from_saved_indices(packed: Mapping, saved_groups) -> dict[str, dict]:
    """A saved state dict's ``"state"`` by position, its parameter ids read from its own ``param_groups``
    (as torch's ``load_state_dict`` maps them)."""
    name_of = {pid: f"g{gi}.p{pi}" for gi, g in enumerate(saved_groups) for pi, pid in enumerate(g["params"])}
    out = {}
    for pid, fields in packed.items():
        if pid not in name_of:
            raise ValueError(f"the checkpoint's state names parameter id {pid!r}, which none of its param groups holds")
        out[name_of[pid]] = dict(fields)
    return out


def _nonzero(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors of one kind, or none if all are zeros: a state dict holds zeros where no
    buffer exists yet (``torch.distributed.checkpoint`` loads only the keys it is given), and a zero buffer
    and none step alike."""
    return dict(tensors) if any(bool(t.any()) for t in tensors.values()) else {}


def _counter_of(per_param: Mapping[str, Mapping[str, Any]], key: str) -> int | None:
    """A counter kept per parameter (the same in each), ``None`` if none is kept."""
    values = {int(fields[key]) for fields in per_param.values() if key in fields}
    if len(values) > 1:
        raise ValueError(f"the checkpoint's parameters disagree on {key!r}: {sorted(values)[:4]}")
    return values.pop() if values else None


def _torch_form(state: Mapping[str, Any]) -> bool:
    """Whether an optimizer's state dict is torch's own form (spread over the parameters); another form
    (``MuonAdamW``'s) is kept whole."""
    return set(state) == {"state", "param_groups"}


def codec_arg(value, what: str) -> Codec | None:
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


class AlgorithmOptimizer(ReportsFrameBytes, torch.optim.Optimizer):
    """The registered algorithm ``algorithm`` (an :class:`~gradwire.algorithms.Algorithm` or a name of
    ``gradwire.algorithms.algorithm_names()`` whose versions publish a mean) over ``params`` (an iterable of
    parameters, named parameters or param groups, or a module), on torch.distributed (module docstring).

    ``config``: the algorithm's config (a dataclass or a JSON mapping, checked here); its
    :attr:`~gradwire.algorithms.Algorithm.group_fields` become the param groups' defaults, which each group
    may set and schedulers change. ``codec``: the uplink codec, or a name of ``gradwire.codec_names()``;
    default the algorithm's (``Algorithm.default_codec``). ``exchange``: ``"all_gather"`` (the default here)
    or ``"sharded"``; ``downlink_codec`` (the owners' codec, default the algorithm's downlink or the uplink's
    twin) and ``piece_numel`` (the largest piece) are the sharded exchange's. ``model_record=True`` sends
    the whole model as one record (docs/FORMAT.md section 9) where the algorithm takes one.
    ``overlap=True`` forms and exchanges each bucket of about ``bucket_numel`` elements during the backward
    pass, where the node side's records are per tensor (:mod:`gradwire.torch.overlap`). ``inner``: a torch
    optimizer over exactly these parameters that the node side steps locally (its param groups become
    this optimizer's). ``outer_optimizer``: where the algorithm's update is a step with the mean as the
    gradient, any torch optimizer built over the target tensors in its place
    (:class:`~gradwire.torch.outer.TorchOuterStep`). ``process_group``: the group to average over (default:
    the default group); ``limits`` bound what a peer's frame may announce.
    """

    def __init__(
        self,
        params: Iterable | nn.Module,
        algorithm: Algorithm | str,
        config: Any = None,
        *,
        codec: Codec | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        limits: Limits | None = None,
        exchange: str = "all_gather",
        model_record: bool = False,
        downlink_codec: Codec | str | None = None,
        piece_numel: int = DEFAULT_PIECE_NUMEL,
        overlap: bool = False,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        inner: torch.optim.Optimizer | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
    ):
        alg = algorithm if isinstance(algorithm, Algorithm) else get_algorithm(algorithm)
        if alg.publication != "mean":
            raise ValueError(
                f"algorithm {alg.name!r} publishes {alg.publication!r} versions, made by a server's "
                "optimizer: on torch.distributed only algorithms whose versions are a mean of the "
                "nodes' records run"
            )
        self.algorithm = alg
        self.config = alg.config(config)
        codec, downlink_codec = codec_arg(codec, "codec"), codec_arg(downlink_codec, "downlink_codec")
        if inner is not None and not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        if outer_optimizer is not None and not alg.applies_as_gradient:
            raise ValueError(f"algorithm {alg.name!r} applies its mean itself: it takes no outer_optimizer")
        if model_record and not alg.takes_model_record:
            raise ValueError(f"algorithm {alg.name!r} sends a record per tensor: it takes no model_record")
        module = params if isinstance(params, nn.Module) else None
        super().__init__(module.named_parameters() if module is not None else params, alg.group_defaults(self.config))
        self._paths = _module_paths(self.param_groups, inner.param_groups if inner is not None else ())
        if inner is not None:
            self._adopt_groups(inner)
        named = _trainable(self.param_groups)
        uplink = codec if codec is not None else self._default_codec()
        self._route = ExchangeRoute(
            exchange,
            named,
            model_record_codec(uplink) if model_record else uplink,
            codec,
            downlink_codec,
            self._default_downlink,
            process_group,
            limits,
            model_record,
            piece_numel,
        )
        self._exchange = self._route.exchange
        self._pieces = self._route.pieces
        self.model_record = self._route.model_record
        self._shards = self._route.shards
        # A node side that takes neither (an all-gathered algorithm written before them) is not given them.
        given = {"layout": self._route} if self._pieces is not None or self.model_record is not None else {}
        if inner is not None:
            given["inner"] = inner
        self.node = alg.node(
            self.config,
            self._route.codec,
            LocalTensors({n: p for n, p, _ in named}),
            module=module,
            **given,
        )
        if inner is None and self.node.inner is not None:  # the node side's own (SparseLoCo's AdamW from its config)
            self._adopt_groups(self.node.inner)
        self.node.loaded()  # the replica as it is now: where an algorithm with an anchor starts from
        self.algorithm_state: dict[str, Any] = {}
        self._outer_factory = outer_optimizer
        self._outer = TorchOuterStep(outer_optimizer, self.node.target()) if outer_optimizer is not None else None
        self.steps = 0
        self.rounds = 0
        self._live: dict[str, dict[str, LiveTensor]] = {}  # each buffer kind's per-parameter storage
        self._held: tuple[int, ...] | None = None  # what self.state was last built from (_holding)
        self._counters: dict[str, torch.Tensor] = {}
        self._ddp_checked = False
        self._buckets: GradientBuckets | None = None
        if overlap:
            self._start_overlap(bucket_numel)

    # -- construction ------------------------------------------------------------------------------

    def _adopt_groups(self, inner: torch.optim.Optimizer) -> None:
        """The inner optimizer's param groups become this optimizer's (the same dicts: an lr scheduler
        given this optimizer, as the HF Trainer gives it, sets the lr the local steps use)."""
        mine = [id(p) for g in self.param_groups for p in g["params"]]
        theirs = [id(p) for g in inner.param_groups for p in g["params"]]
        if sorted(mine) != sorted(theirs):
            raise ValueError(f"inner must optimize exactly the parameters given to {type(self).__name__}")
        if "_route" in self.__dict__ and mine != theirs:
            raise ValueError(
                f"the node side's inner optimizer orders the parameters otherwise than {type(self).__name__}: "
                "give inner= over the same parameters in the same order"
            )
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults

    def _default_codec(self) -> Codec:
        named = self.algorithm.default_codec(self.config)
        if named is None:
            raise ValueError(f"algorithm {self.algorithm.name!r} names no default codec: pass codec=")
        return build_codec(named[0], **named[1])

    def _default_downlink(self) -> Codec:
        """The owners' codec when none is given: the algorithm's downlink, or the uplink's twin."""
        named = self.algorithm.default_downlink(self.config)
        return build_codec(named[0], **named[1]) if named is not None else self._default_codec()

    def _start_overlap(self, bucket_numel: int) -> None:
        """``overlap=True``: each bucket's local step and records start when its gradients are ready."""
        name = type(self).__name__
        if not self.node.records_per_tensor:
            raise ValueError(
                f"overlap=True forms each bucket's records as its gradients arrive; algorithm "
                f"{self.algorithm.name!r} does not send records per tensor every step: build {name} with overlap=False"
            )
        if self.model_record is not None:
            raise ValueError(
                "overlap=True encodes buckets of parameters as their gradients arrive; "
                "model_record=True sends the whole model as one record, which waits for the last "
                f"gradient: build {name} with one or the other"
            )
        for codec in (self._route.codec, getattr(self._exchange, "downlink", None)):
            if getattr(codec, "bundle_budget", False):
                raise ValueError(
                    f"overlap=True encodes and exchanges each bucket on its own; {codec!r} spends one "
                    f"budget across all tensors at once: build {name} with overlap=False for it"
                )
        named = _trainable(self.param_groups)
        if any(is_dtensor(p) for _, p, _ in named):
            raise ValueError(
                "overlap=True is for replicated parameters (DDP or one process); FSDP2 shards "
                f"reduce their gradients after the backward hooks: build {name} with overlap=False"
            )
        self._overlap_named = named
        self._buckets = GradientBuckets(named, self._encode_bucket, bucket_numel, exchange=self._exchange_bucket)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, while the optimizer is being built; refused afterwards (a ``ValueError`` saying so): the
        frames name parameters by position and the exchange is laid out for them on every rank."""
        if "_route" in self.__dict__:
            name = type(self).__name__
            raise ValueError(
                f"{name}.add_param_group after construction is refused: every rank's frames name the parameters "
                f"by their position (g<group>.p<index>) and the exchange was laid out for them; build a new "
                f"{name} over every parameter group at once (torch.optim.Optimizer accepts a list of groups)"
            )
        super().add_param_group(param_group)

    # -- the step ----------------------------------------------------------------------------------

    @_names_parameters
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._first_step_checks()
        exchanged = self._follow_trainable()
        if self._buckets is not None:
            mean: dict[str, torch.Tensor] = {}
            for bucket_mean in self._buckets.collect():  # formed and exchanged during the backward pass
                mean.update(bucket_mean)
            self.steps += 1
            self._commit(mean)
        else:
            grads = None if self.node.reads_module_grads else {n: local_grad(p) for n, p, _ in exchanged}
            sends = self.node.local_step(grads, self._groups(exchanged))
            self.steps += 1
            if sends:
                self._round()
        self._settle()
        return loss

    @_names_parameters
    @torch.no_grad()
    def sync(self) -> None:
        """A round now: the node side's records of what it holds (SparseLoCo: the pseudo-gradient since the
        last sync), exchanged, and the mean applied (``step`` runs one on every step that sends)."""
        self._round()
        self._settle()

    def _round(self) -> None:
        entries = self.node.send()
        target = self.node.target()
        device = next(iter(target.values())).device if len(target) else None
        try:
            mean = self._route.mean(entries, self.rounds, device)
        except RoundNotCommitted:  # a round transport's round that does not count (use_round_transport)
            self.node.take_back({e.name: decode_entry(e, device) for e in entries})
            self.node.synced()  # back to the last synced version, as when a round is published without us
            return
        self._commit(mean)

    def use_round_transport(self, transport: AllGatherExchange | ShardedExchange) -> None:
        """Exchange every later round through ``transport`` in place of the exchange over ``process_group``:
        an :class:`AllGatherExchange` (every replica's records, in replica order) with
        ``exchange="all_gather"``, or a :class:`~gradwire.torch.sharded.ShardedExchange` over this optimizer's
        pieces with ``exchange="sharded"``; a round it refuses with
        :class:`~gradwire.torch.round_outcome.RoundNotCommitted` is given back to the node side. What
        :class:`gradwire.torch.FaultTolerant` sets: torchft's managed replica groups. Only with
        ``overlap=False``."""
        sharded = isinstance(transport, ShardedExchange)
        if self._buckets is not None or sharded != (self._pieces is not None):
            raise ValueError(
                f"a round transport carries the {'sharded' if sharded else 'all-gather'} exchange of whole rounds; "
                f"this optimizer has exchange={self.exchange!r}, overlap={self._buckets is not None}: build it "
                f"with exchange={'sharded' if sharded else 'all_gather'!r} and overlap=False"
            )
        if sharded and [p.name for p in transport.pieces.pieces] != [p.name for p in self._pieces.pieces]:
            raise ValueError("a sharded round transport must carry this optimizer's pieces (cut_pieces_for)")
        self._route.exchange = self._exchange = transport

    def cut_pieces_for(self, world: int) -> ShardedExchange:
        """Cut the sharded exchange's pieces for ``world`` owners (instead of the process group's size), before
        the first step: what :class:`gradwire.torch.FaultTolerant` does for a run of ``world`` replica groups,
        whose owners then follow each quorum. Returns the sharded exchange of the new pieces (over the process
        group, until :meth:`use_round_transport`). ``ValueError`` with ``exchange="all_gather"`` or after a step."""
        route = self._route
        if route.pieces is None:
            raise ValueError("exchange='all_gather' cuts no pieces")
        if self.steps or self.rounds or any(len(b) for b in self.node.buffers().values()):
            raise ValueError("the pieces are cut before the first step: the node's buffers are keyed by them")
        route.recut(int(world))
        self._pieces, self._exchange = route.pieces, route.exchange
        return route.exchange

    def _commit(self, mean: Mapping[str, torch.Tensor]) -> None:
        """The commit point of a round: the exchanged mean applied to the node side's target — by the
        algorithm's ``apply`` once per param-group config, or by the torch ``outer_optimizer`` — then
        ``node.synced()`` and the round counted. Before it only the node side's buffers have changed (less
        what it sent: ``node.take_back`` of the decoded records restores them), so a transport that may
        give a round up (a fault-tolerant group that does not commit) decides here."""
        target = self.node.target()
        if self._outer is not None:
            self._outer.apply(target, mean)
        else:
            for config, names in self._apply_groups(mean):
                weights = {n: target[n] for n in names}
                self.algorithm_state = self.algorithm.apply(
                    config, weights, {n: mean[n] for n in names}, self.algorithm_state
                )
        self.node.synced()
        self.rounds += 1

    def _groups(self, exchanged) -> list[tuple[Any, list[str]]]:
        """This step's param groups: each one's config and its exchanged tensors, in group order."""
        names: dict[int, list[str]] = {}
        for n, _, g in exchanged:
            names.setdefault(id(g), []).append(n)
        return [
            (self.algorithm.group_config(self.config, g), names[id(g)]) for g in self.param_groups if id(g) in names
        ]

    def _apply_groups(self, mean: Mapping[str, torch.Tensor]) -> list[tuple[Any, list[str]]]:
        """The tensors of ``mean`` by the config of their param group (groups of one config together)."""
        out: list[tuple[Any, list[str]]] = []
        for gi, group in enumerate(self.param_groups):
            names = [f"g{gi}.p{pi}" for pi in range(len(group["params"])) if f"g{gi}.p{pi}" in mean]
            if not names:
                continue
            config = self.algorithm.group_config(self.config, group)
            same = next((held for c, held in out if c == config), None)
            if same is None:
                out.append((config, names))
            else:
                same += names
        return out

    def _encode_bucket(self, indices: list[int]) -> list[Entry]:
        """One bucket's local step and records (run by the overlap worker)."""
        group = self._overlap_named[indices[0]][2]
        grads = {self._overlap_named[i][0]: local_grad(self._overlap_named[i][1]) for i in indices}
        self.node.local_step(grads, [(self.algorithm.group_config(self.config, group), list(grads))])
        return self.node.send()

    def _exchange_bucket(self, indices: list[int], entries: list[Entry]) -> dict[str, torch.Tensor]:
        """One bucket's exact mean, exchanged while the backward pass goes on (run by the exchange worker, in
        bucket order on every rank): the same means as one exchange of every tensor at the step."""
        names = [self._overlap_named[i][0] for i in indices]
        return self._route.mean(entries, self.rounds, self._overlap_named[indices[0]][1].device, tensors=names)

    def no_sync(self):
        """A context manager for the backward passes of gradient accumulation but the last: with
        ``overlap=True`` they only accumulate gradients (nothing is encoded until the last pass); without
        overlap it does nothing, so the same training loop serves both."""
        return self._buckets.no_sync() if self._buckets is not None else contextlib.nullcontext()

    def _first_step_checks(self) -> None:
        """Once, at the first step: not one of several launched ranks without a process group
        (:mod:`.launcher_check`); in a group of more than one rank, no DDP all-reduces these gradients."""
        if self._ddp_checked:
            return
        refuse_single_rank_launch(type(self).__name__, self.process_group, f"{type(self).__name__}.step() runs")
        self._ddp_checked = True
        if self._exchange.world() > 1:
            named = _trainable(self.param_groups)
            check_not_all_reduced(
                [p for _, p, _ in named], {id(p): self._label(n) for n, p, _ in named}, type(self).__name__
            )

    def _follow_trainable(self) -> list[tuple[str, torch.Tensor, dict]]:
        """The parameters that require a gradient now. One that began to since the last step joins the
        exchange (``node.joined``); one that stopped leaves a node side that is given gradients (it sends
        those it is given) and stays with one that reads them itself (SparseLoCo: its local steps before
        freezing are synced like any other's). With a fixed exchange (sharded pieces, a model record, the
        overlap's hooks) either is refused."""
        now = _trainable(self.param_groups)
        target = self.node.target()
        added = [(n, p) for n, p, _ in now if n not in target]
        live = {n for n, _, _ in now}
        removed = [] if self.node.reads_module_grads else [n for n in target if n not in live]
        if added or removed:
            if self._pieces is not None or self.model_record is not None or self._buckets is not None:
                self._refuse_changed_trainable([n for n, _ in added], removed)
            if added:
                self.node.joined({n: local_tensor(p) for n, p in added})
        return now

    def _refuse_changed_trainable(self, added: list[str], removed: list[str]) -> None:
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
        name = type(self).__name__
        rebuild = f"build a new {name}{' and its inner optimizer' if self.node.inner is not None else ''}"
        raise ValueError(
            f"{name}: {' and '.join(what)}; with {mode} the tensors exchanged are fixed when the "
            f"optimizer is built: {rebuild} after changing requires_grad, or build it with "
            "exchange='all_gather', model_record=False and overlap=False, which follow requires_grad as it changes"
        )

    # -- the live state ------------------------------------------------------------------------------

    def _settle(self) -> None:
        """After a step or a round: the node's buffers seated in one float32 tensor per parameter, and
        ``self.state[p]`` each parameter's live state (the node's buffers and tensors, the algorithm's
        per-tensor state, the counters). ``self.state`` is not empty after a step, so
        ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict``, which steps an optimizer whose
        ``state`` is empty (with zero gradients and learning rate 0) to create it, never steps this one
        once it has state (a DeMo step at learning rate 0 still decays and sends its momenta)."""
        if self._held != self._holding():  # new tensors since the last step (a first step, a load, a codec's copies)
            for kind, buffers in self.node.buffers().items():
                self._route.seat(buffers, self._live.setdefault(kind, {}))
            self._counters = {key: torch.tensor(0.0) for key in self.node.parameter_counters}
            at = _positions(self.param_groups)
            for n, fields in self._live_state().items():
                self.state[at[n]] = {**fields, **self._counters}
            self._held = self._holding()
        for key, c in self.node.parameter_counters.items():
            self._counters[key].fill_(float(self._counter(c)))  # in place, as torch's optimizers count "step"

    def _holding(self) -> tuple[int, ...]:
        """The identities of the tensors the live state is made of (equal from step to step once seated)."""
        held = [id(t) for buffers in self.node.buffers().values() for t in buffers.values()]
        held += [id(t) for tensors in self.node.tensors().values() for t in tensors.values()]
        by_kind, _ = self.algorithm.parameter_state(self.config, self.algorithm_state)
        held += [id(t) for tensors in by_kind.values() for t in tensors.values()]
        return (len(self.node.target()), *held)

    def _live_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{position: {kind: tensor}}``: the tensors the step updates, by parameter (not copies)."""
        out: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.node.target()}
        for kind, tensors in self.node.tensors().items():
            for n, t in tensors.items():
                out.setdefault(n, {})[kind] = t
        for kind, buffers in self.node.buffers().items():
            seated = {t: live for t, live in self._live.get(kind, {}).items() if _seated(live, buffers)}
            for n, t in self._route.per_parameter(seated).items():
                out.setdefault(n, {})[kind] = t
        for kind, tensors in self.algorithm.parameter_state(self.config, self.algorithm_state)[0].items():
            for n, t in tensors.items():
                out.setdefault(n, {})[kind] = t
        return out

    def _counter(self, which: str) -> int:
        return {"steps": self.steps, "rounds": self.rounds}[which]

    # -- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's form: under ``"state"`` each parameter's state by packed index — the node side's buffers
        (DeMo: ``"momentum"``; SparseLoCo: ``"error"``) and tensors (``"anchor"``), the algorithm's per-tensor
        state (``"outer_momentum"``), an inner optimizer's state with keys prefixed ``"inner."`` and the
        counters (``"step"``, SparseLoCo's ``"syncs"``): float32 copies in the parameter's local shape, a
        ``DTensor`` like the parameter for FSDP2, zeros where a buffer does not exist yet — the param groups;
        and ``"gradwire"``: the node side's own state (its codec's), the counters, the outer step's state
        (``"outer"``, where the algorithm's update takes one), the parameter shapes and the exchange's state
        (the byte counters; sharded, also the group's size, this rank, the pieces and the owner's error
        feedback, by piece).

        ``torch.distributed.checkpoint`` keeps ``"state"`` and ``"param_groups"`` only, so a state dict it
        hands back resumes without ``"gradwire"``: the per-parameter state and the counters restored, the
        owners' error feedback, the byte counters and a torch ``outer_optimizer``'s state started afresh, at
        any group size (docs/DISTRIBUTED.md, "Checkpoints")."""
        out = super().state_dict()
        at = _positions(self.param_groups)
        index = {n: i for i, n in enumerate(at)}  # torch's packed index
        names = list(self.node.target())
        per: dict[str, dict[str, Any]] = {n: {} for n in names}

        def put(kind: str, tensors: Mapping[str, torch.Tensor], zeros: bool) -> None:
            tensors = {n: t.detach().clone().contiguous() for n, t in tensors.items()}
            for n in names if zeros else ():
                if n not in tensors:
                    tensors[n] = torch.zeros_like(local_tensor(at[n]), dtype=torch.float32)
            for n, t in tensors.items():
                per.setdefault(n, {})[kind] = like_parameter(t, at[n])

        for kind, tensors in self.node.tensors().items():
            put(kind, tensors, zeros=False)
        for kind, buffers in self.node.buffers().items():
            put(kind, self._route.join(buffers), zeros=True)
        by_kind, rest = self.algorithm.parameter_state(self.config, self.algorithm_state)
        for kind, tensors in by_kind.items():
            put(kind, tensors, zeros=True)
        section: dict[str, Any] = {"node": self.node.torch_state()}
        inner = self.node.inner.state_dict() if self.node.inner is not None else None
        if inner is not None and _torch_form(inner):
            name_of = self._inner_positions()
            for i, fields in inner["state"].items():
                per.setdefault(name_of[int(i)], {}).update({INNER + k: v for k, v in fields.items()})
        elif inner is not None:
            section["inner"] = inner  # an inner optimizer of its own form, whole
        counters = {key: c for key, c in self.node.parameter_counters.items()}
        for fields in per.values():
            fields.update({key: torch.tensor(float(self._counter(c))) for key, c in counters.items()})
        out["state"] = {index[n]: fields for n, fields in per.items()}
        section.update({key: self._counter(c) for key, c in self.node.checkpoint_counters.items()})
        if self.algorithm.applies_as_gradient:
            section["outer"] = self._outer.state_dict() if self._outer is not None else {}
        if rest:
            section["algorithm_state"] = rest
        section.update(shapes=self._model_shapes(), **self._shards.state_dict(), **self._exchange.state_dict())
        out[STATE_KEY] = section
        return out

    @_names_parameters
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (or :meth:`full_state_dict`: this rank's share of it, at any group
        size; or what ``torch.distributed.checkpoint`` hands back: torch's part only); ``ValueError`` for a
        checkpoint of another model (parameter count or shapes), rank (sharded), exchange or outer step."""
        share, per_param, torch_part = self._split_state(state_dict)
        at = _positions(self.param_groups)
        devices = {n: local_tensor(p).device for n, p in at.items()}
        outer = dict(share["outer"]) if share is not None and "outer" in share else {}
        if self._outer_factory is None and "torch_optimizer" in outer:
            raise ValueError(
                f"this checkpoint's outer step is a torch optimizer: build {type(self).__name__} with the "
                "same outer_optimizer to resume it"
            )
        super().load_state_dict(torch_part)
        inner = self.node.inner
        if inner is not None:
            if share is not None and "inner" in share:
                inner.load_state_dict(share["inner"])
            elif _torch_form(inner.state_dict()):
                index = {n: i for i, n in self._inner_positions().items()}
                inner_state = {
                    index[n]: {k[len(INNER) :]: v for k, v in f.items() if k.startswith(INNER)}
                    for n, f in per_param.items()
                    if n in index
                }
                inner.load_state_dict(
                    {"state": {i: f for i, f in inner_state.items() if f}, "param_groups": torch_part["param_groups"]}
                )
            self.param_groups = inner.param_groups  # load_state_dict made new group dicts on both: one again

        def loaded(kind: str, zeros_are_none: bool) -> dict[str, torch.Tensor]:
            tensors = {n: f[kind] for n, f in per_param.items() if kind in f}
            tensors = _nonzero(tensors) if zeros_are_none else tensors
            return {n: t.detach().to(device=devices[n], dtype=torch.float32).clone() for n, t in tensors.items()}

        for kind, tensors in self.node.tensors().items():
            fresh = loaded(kind, zeros_are_none=False)
            tensors.clear()
            tensors.update(fresh)
        for kind, buffers in self.node.buffers().items():
            fresh = loaded(kind, zeros_are_none=True)
            buffers.clear()
            buffers.update({r: t.contiguous() for r, t in self._route.cut(fresh).items()} if fresh else {})
        by_kind, _ = self.algorithm.parameter_state(self.config, {})
        rest = dict(share.get("algorithm_state", {})) if share is not None else {}
        self.algorithm_state = self.algorithm.with_parameter_state(
            self.config, rest, {kind: loaded(kind, zeros_are_none=True) for kind in by_kind}
        )
        if share is not None:
            counted = {c: int(share[key]) for key, c in self.node.checkpoint_counters.items()}
        else:
            counted = {c: _counter_of(per_param, key) for key, c in self.node.parameter_counters.items()}
            counted = {c: v for c, v in counted.items() if v is not None}
        self.steps = counted.get("steps", counted.get("rounds", 0))
        self.rounds = counted.get("rounds", self.steps)
        self.node.load_torch_state(share["node"] if share is not None else self.node.torch_state(), self.steps)
        if self._outer_factory is not None:
            # A torch optimizer steps the tensors it was built over: build it over the loaded ones.
            self._outer = TorchOuterStep(self._outer_factory, self.node.target())
            if share is not None:  # (torch.distributed.checkpoint keeps no outer optimizer state: it starts afresh)
                self._outer.load_state_dict(outer)
        self._held = None  # torch's load_state_dict emptied self.state
        if per_param or self.steps:
            self._settle()

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
        out = self.state_dict()
        names = list(_positions(self.param_groups))
        mine = dict(out[STATE_KEY], params={names[int(i)]: dict(f) for i, f in out["state"].items()})
        if self._exchange._distributed():
            g = self.process_group
            shares = all_gather_bytes(
                state_to_bytes(mine), g, device=comm_device(g), limits=Limits(max_frame_bytes=1 << 46)
            )
            parts = [state_from_bytes(bytes(b)) for b in shares]
        else:
            parts = [mine]
        out["state"] = {}  # every rank's is in its share
        out[STATE_KEY] = {FULL_KEY: parts, "world": len(parts)}
        return out

    def _own_share(self, mine: dict) -> dict:
        """This rank's share of a :meth:`full_state_dict` (``mine`` as it is if it is one rank's already); of a
        full state saved by a group of another size, the share :func:`gradwire.torch.reshard.reshard_share`
        makes for this rank (each rank's buffers averaged, the owners' residual cut anew)."""
        if FULL_KEY not in mine:
            return mine
        parts = mine[FULL_KEY]
        world, rank = self._exchange.world(), self._exchange.rank()
        if len(parts) == world:
            return parts[rank]
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
            own=self._each_ranks_own,
        )

    def _each_ranks_own(self, key: str, value: Any) -> bool:
        """Whether a per-parameter entry is each rank's own (its node side's buffers, its inner optimizer's
        floating-point state: averaged when another group size resumes) or the same on every rank."""
        if key in self.node.buffers():
            return True
        return key.startswith(INNER) and key != INNER + "step" and torch.is_tensor(value) and value.is_floating_point()

    def _split_state(self, state_dict: Mapping[str, Any]) -> tuple[dict | None, dict[str, dict], dict]:
        """What ``load_state_dict`` does first: check the state dict (another model, shards, exchange, group
        or rank is refused before anything changes), load the exchange's part, and return ``(share,
        per-parameter state, torch's part)``: this rank's ``"gradwire"`` share (``None`` for a state dict
        without it: what ``torch.distributed.checkpoint`` hands back), the per-parameter state by position
        (from the share of a full state dict, else from ``"state"``) and ``{"state": {}, "param_groups":
        ...}`` for torch's own ``load_state_dict``."""
        state_dict = dict(state_dict)
        gw = state_dict.pop(STATE_KEY, None)
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

    def _check_param_state(self, per_param: Mapping[str, Mapping[str, Any]]) -> None:
        """``ValueError`` for per-parameter state of a parameter this optimizer lacks or of another shape."""
        at = _positions(self.param_groups)
        for n, fields in per_param.items():
            if n not in at:
                raise ValueError(
                    f"this checkpoint is of another model: it holds state of {n}, a parameter this "
                    "optimizer does not have"
                )
            shape = tuple(local_tensor(at[n]).shape)
            for k, t in fields.items():
                if isinstance(t, torch.Tensor) and t.ndim and not k.startswith(INNER) and tuple(t.shape) != shape:
                    raise ValueError(
                        f"this checkpoint is of another model: its {k} of {self._label(n)} has shape "
                        f"{tuple(t.shape)}, the parameter {shape}"
                    )

    def _model_shapes(self) -> dict[str, list[int]]:
        return {n: list(p.shape) for n, p in _positions(self.param_groups).items()}

    def _check_model_shapes(self, mine: Mapping[str, Any]) -> None:
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

    def _inner_positions(self) -> dict[int, str]:
        """Each index of the inner optimizer's packed state as a position (by parameter identity)."""
        at = {id(p): n for n, p in _positions(self.param_groups).items()}
        return {i: at[id(p)] for i, p in enumerate(p for g in self.node.inner.param_groups for p in g["params"])}

    # -- naming parameters ---------------------------------------------------------------------------

    def _describe(self, message: str) -> str:
        """``message`` with each position followed by its module path: ``"g0.p3"`` → ``"g0.p3 (h.0.attn.weight)"``."""
        at = _positions(self.param_groups)

        def label(m: re.Match) -> str:
            p = at.get(m.group(0))
            path = self._paths.get(id(p)) if p is not None else None
            return f"{m.group(0)} ({path})" if path and f"({path})" not in message else m.group(0)

        return _POSITION.sub(label, message)

    def _label(self, position: str) -> str:
        return self._describe(position)

    # -- what it reports -----------------------------------------------------------------------------

    @property
    def exchange(self) -> str:
        """``"sharded"`` or ``"all_gather"``."""
        return self._route.kind

    @property
    def codec(self) -> Codec:
        """The uplink codec (a model-record codec with ``model_record=True``)."""
        return self._route.codec

    @property
    def downlink_codec(self) -> Codec | None:
        """The owners' codec of the sharded exchange (``None`` with ``exchange="all_gather"``)."""
        return self._exchange.downlink if self._pieces is not None else None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._exchange.process_group


def _seated(live: LiveTensor, buffers: Mapping[str, torch.Tensor]) -> bool:
    """Whether the node's buffers are ``live``'s views now (not replaced by a load or a node side's own)."""
    return all(buffers.get(r) is v for r, v in live.records.items())
