"""How the torch transport (:class:`gradwire.torch.AlgorithmOptimizer`) exchanges a step's tensors: which
exchange (sharded or all-gather), whether the model travels as one record, and the one place that turns
the node's tensors into what it compresses and the exchanged records back into a mean per parameter.

The four combinations (sharded or all-gather, model record or not) differ in two places only, so
:class:`ExchangeRoute` holds both and each optimizer's step reads the same three lines whatever the
combination: ``route.cut`` the tensors (the node side's layout), the node compresses them, ``route.mean``
of its records. The route also seats the node's buffers in one float32 tensor per parameter
(:meth:`ExchangeRoute.seat`), so that the per-parameter state a torch user reads is the state the
step updates.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..algorithms import exact_mean
from ..codecs.base import Codec
from ..frame import Entry, Limits
from ..model_record import ModelSpec, check_model_entries, model_record_codec
from .all_gather_exchange import AllGatherExchange
from .collectives import group_world_size
from .dtensor import ShardLayout, local_tensor
from .sharded import Pieces, ShardedExchange

__all__ = ["EXCHANGES", "ExchangeRoute", "LiveTensor", "ModelRecordLayout"]

#: The two ways of exchanging records; the first is the default.
EXCHANGES = ("sharded", "all_gather")


class ModelRecordLayout:
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


@dataclass(frozen=True)
class LiveTensor:
    """One exchanged tensor's buffer, seated: the float32 tensor (``whole``), the views its records are
    (by record name) and the views its parameters are (by parameter name)."""

    whole: torch.Tensor
    records: dict[str, torch.Tensor]
    parameters: dict[str, torch.Tensor]


class ExchangeRoute:
    """One optimizer's exchange: built once from its parameters (``named``: ``(name, parameter, group)``
    by position), it owns the exchange (``exchange``: a :class:`~gradwire.torch.sharded.ShardedExchange`
    or an :class:`~gradwire.torch.all_gather_exchange.AllGatherExchange`), the sharded ``pieces`` (what
    the node's buffers are keyed by; ``None`` all-gathered), the ``model_record`` layout (``None``:
    per-tensor records) and ``shards``, the FSDP shards this rank holds (checked against
    ``process_group``)."""

    def __init__(
        self,
        kind: str,
        named: Sequence[tuple[str, torch.Tensor, dict]],
        node_codec: Codec,
        codec: Codec | None,
        downlink_codec: Codec | None,
        default_downlink: Callable[[], Codec],
        process_group: dist.ProcessGroup | None,
        limits: Limits | None,
        model_record: bool,
        piece_numel: int,
    ):
        if kind not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGES))}, got {kind!r}")
        self.kind = kind
        #: The node side's (uplink) codec: the pieces are cut at its chunks.
        self.codec = node_codec
        self.model_record = ModelRecordLayout(list(named)) if model_record else None
        #: The float32 shape of each tensor the records are cut from (the model record: one vector).
        self._shapes = (
            {self.model_record.name: (self.model_record.spec.numel,)}
            if self.model_record is not None
            else {n: tuple(local_tensor(p).shape) for n, p, _ in named}
        )
        self._record_names: dict[str, list[str]] | None = None
        self.shards = ShardLayout([(n, p) for n, p, _ in named], process_group)
        self.pieces: Pieces | None = None
        self.exchange: Any
        if kind == "all_gather":
            if downlink_codec is not None:
                raise ValueError("downlink_codec is the owners' codec of exchange='sharded'; all_gather has none")
            self.exchange = AllGatherExchange(process_group, limits)
            return
        tensors = list(self._shapes.items())
        self._cut = (tensors, node_codec, piece_numel)
        self.pieces = Pieces(tensors, node_codec, piece_numel, group_world_size(process_group))
        if downlink_codec is None:
            # The uplink's twin: the same class and parameters, a state of its own.
            downlink_codec = default_downlink() if codec is None else copy.deepcopy(codec)
        if self.model_record is not None:
            downlink_codec = model_record_codec(downlink_codec)
        self.exchange = ShardedExchange(self.pieces, downlink_codec, process_group, limits, model_record=model_record)

    @property
    def joins_tensors(self) -> bool:
        """Whether the tensors travel as one model record (a :class:`~gradwire.algorithms.RecordLayout`'s
        attribute: a node side then cuts every tensor at once)."""
        return self.model_record is not None

    def pieces_for(self, world: int) -> Pieces:
        """The pieces a group of ``world`` ranks cuts this optimizer's tensors into (sharded only)."""
        if self.pieces is None:
            raise ValueError("exchange='all_gather' cuts no pieces")
        tensors, codec, piece_numel = self._cut
        return Pieces(tensors, codec, piece_numel, world)

    def recut(self, world: int) -> None:
        """The pieces cut anew for ``world`` owners, and a sharded exchange of them (the same downlink codec,
        group and limits): before the node side holds buffers keyed by the old pieces."""
        old = self.exchange
        self.pieces = self.pieces_for(world)
        self._record_names = None
        self.exchange = ShardedExchange(
            self.pieces, old.downlink, old.process_group, old.limits, model_record=old.model_record
        )

    def cut(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the node compresses for these per-parameter tensors: as they are, the model flattened
        into one vector, cut into the sharded exchange's pieces (views), or both. The node side's layout
        (:class:`~gradwire.algorithms.RecordLayout`)."""
        if self.model_record is not None:
            tensors = self.model_record.flatten(tensors)
        return self.pieces.cut(tensors) if self.pieces is not None else dict(tensors)

    def join(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`cut` undone: a node's buffers (by record name) as one tensor per parameter name (pieces
        joined, a model record unflattened)."""
        if not buffers:
            return {}
        if self.pieces is not None:
            buffers = self.pieces.join(buffers)
        if self.model_record is not None:
            buffers = self.model_record.spec.unflatten(buffers[self.model_record.name])
        return dict(buffers)

    # -- the live state: a node's buffers, one float32 tensor per parameter --------------------------

    def seat(self, buffers: MutableMapping[str, torch.Tensor], storage: dict[str, LiveTensor]) -> None:
        """Make the node's ``buffers`` (by record name) views of one float32 tensor per exchanged tensor
        (``storage``, kept by the caller): a parameter's buffer is then one tensor, which the node's
        in-place steps update through its pieces (or through the model record it is a part of). A record
        that is its tensor whole is adopted as it is; a buffer the node replaced (a codec whose records may
        view their input is stepped on copies) is copied into its view. A tensor some of whose records
        have no buffer yet is left alone."""
        for t, records in self._records_by_tensor().items():
            held = [buffers.get(r) for r in records]
            if any(h is None for h in held):
                continue
            live = storage.get(t)
            if live is None or live.whole.device != held[0].device:
                adopt = records == [t] and held[0].dtype == torch.float32 and held[0].is_contiguous()
                whole = held[0] if adopt else torch.empty(self._shapes[t], dtype=torch.float32, device=held[0].device)
                live = storage[t] = LiveTensor(whole, self._views(t, whole), self._parameters(t, whole))
            for r, view in live.records.items():
                if buffers[r] is not view:
                    view.copy_(buffers[r])
                    buffers[r] = view

    def per_parameter(self, storage: Mapping[str, LiveTensor]) -> dict[str, torch.Tensor]:
        """The seated buffers as one tensor per parameter name (views of ``storage``: live)."""
        out: dict[str, torch.Tensor] = {}
        for live in storage.values():
            out.update(live.parameters)
        return out

    def _records_by_tensor(self) -> dict[str, list[str]]:
        """The record names of each tensor the records are cut from (parameters, or the model record)."""
        if self._record_names is None:
            if self.pieces is not None:
                self._record_names = {t: [p.name for p in ps] for t, ps in self.pieces.by_tensor.items()}
            elif self.model_record is not None:
                self._record_names = {self.model_record.name: [self.model_record.name]}
            else:
                self._record_names = {n: [n] for n in self._shapes}
        return self._record_names

    def _views(self, t: str, whole: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.pieces.cut({t: whole}) if self.pieces is not None else {t: whole}

    def _parameters(self, t: str, whole: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.model_record.spec.unflatten(whole) if self.model_record is not None else {t: whole}

    def mean(
        self, entries: list[Entry], round: int, device, tensors: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Every rank's exact mean of these records, per parameter name, on ``device`` (collective). With
        ``tensors`` (per-tensor records only), the records are those tensors' alone: one bucket of an
        overlapped step, whose means are those one exchange of every tensor gives."""
        mr = self.model_record
        if tensors is not None and mr is not None:
            raise ValueError("a bucket's exchange is of per-tensor records; the model record travels whole")
        if self.pieces is not None:
            mean = self.exchange(entries, round, device, tensors)  # each tensor's (or the model vector's) mean
            return mr.spec.unflatten(mean[mr.name]) if mr is not None else mean
        per_rank = self.exchange(entries, round)
        return mr.mean(per_rank, device) if mr is not None else exact_mean(per_rank, device=device)

    def load_state_dict(self, mine: dict, devices: dict) -> None:
        """The exchange's part of a checkpoint; ``ValueError`` for another exchange, group or shards."""
        self.shards.check_state(mine.get("shards"))
        if self.pieces is not None:
            self.exchange.load_state_dict(mine, devices)
        else:
            self.exchange.load_state_dict(mine)
