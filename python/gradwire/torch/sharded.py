"""The sharded exchange of :class:`gradwire.torch.DeMo` and :class:`gradwire.torch.SparseLoCo`.

With ``exchange="all_gather"`` every rank reads every rank's frame, so a rank's downlink grows with the
world size. The sharded exchange (the default) is a reduce-scatter of records followed by an all-gather
of re-encoded means, like a ring all-reduce made of frames:

1. **Pieces and owners.** The parameters are cut into pieces from their shapes and the uplink codec
   alone (:func:`cut_tensor`): a piece is a whole tensor or a block of rows of a large one, cut where the
   codec's chunks start, so a piece's chunks are exactly the whole tensor's chunks (with a DCT codec in
   tile mode a row block gets the whole tensor's tiles; in flat mode the flattened tensor is cut at
   multiples of the chunk size); with :class:`~gradwire.OneBit`, whose statistics are per column, a
   block of columns of the matrix view. :func:`assign_owners` gives the pieces to the ranks, largest first,
   each to the least loaded rank (ties to the lowest rank): the same on every rank.
2. **Phase 1, records to owners.** Each rank's node side compresses its pieces (the momentum or error
   buffer of a piece keeps what was not sent) and sends every owner one bundle frame holding its records
   for that owner's pieces, in one all-to-all of byte frames (:func:`~gradwire.torch.collectives.all_to_all_bytes`).
3. **The owner's mean.** An owner reads the frames (with :class:`~gradwire.Limits`; bundle, round and
   sender checked), takes the mean of its pieces over all ranks' records in rank order
   (weights ``1/world``), adds its own error feedback residual and re-encodes the sum with the downlink
   codec (:class:`gradwire.reencode.ReencodeFeedback`: in the DCT coefficient domain, where the records
   are cut as the downlink cuts, without decoding them; else :func:`gradwire.aggregation.exact_mean`'s
   mean under :class:`gradwire.ErrorFeedback`) into one bundle frame
   (``sender`` = the owner).
4. **Phase 2, means to everyone.** The owners' frames are all-gathered and every rank, the owner too,
   decodes those exact bytes, so every rank applies the same mean and holds bit-identical weights.

Every rank knows every piece's name and shape, and the codecs know the rest of a record's headers
(:meth:`~gradwire.codecs.base.Codec.record_template`), so both phases' frames are layout frames
(docs/FORMAT.md section 12): a record is its payloads and their lengths, about 9 bytes of headers where
a full record spends 110–140 (its params too, about 27 more, in the rare step whose Rice parameter is
not the predicted one). On a small model's 3 KB step those headers were a third of the bytes.

Per rank that is about one frame's worth of records out and in per phase, whatever the world size: a
rank receives ``(world − 1)/world`` of the model's records in each phase, under 2 frames in all, where
the all-gather receives ``world − 1`` frames.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..aggregation import exact_mean
from ..codecs.base import Codec, TensorPart
from ..errors import FrameError, error
from ..frame import DEFAULT_LIMITS, MIN_FRAME_BYTES, Entry, Limits, RecordTemplate, read_frame, write_frame
from ..reencode import ReencodeFeedback
from .collectives import GroupMember, all_gather_bytes, all_to_all_bytes, comm_device, gather_rows

__all__ = [
    "DEFAULT_PIECE_NUMEL",
    "Piece",
    "Pieces",
    "ShardedExchange",
    "assign_owners",
    "balanced_cut",
    "balanced_piece_numel",
    "cut_tensor",
]

#: The default largest piece, in elements (1 MiB of float32, 64 tiles of 64×64): a 1024×1024 weight is
#: cut into 4 pieces of 256 rows. Pieces much smaller than this add a record's headers (~137 bytes
#: with the DCT codec) for little gain in balance.
DEFAULT_PIECE_NUMEL = 1 << 18

#: What an owner sends in phase 2 when it refused the records it was sent: one byte, never a frame
#: (a frame has at least ``MIN_FRAME_BYTES``), so every rank raises instead of waiting.
_REFUSED = b"\x00"
assert len(_REFUSED) < MIN_FRAME_BYTES


@dataclass(frozen=True)
class Piece:
    """A part of one tensor, in ``shape``: elements ``start:stop`` of the flattened tensor, or, with
    ``columns``, columns ``start:stop`` of the tensor's matrix view ``(shape[0], numel / shape[0])``.

    ``name`` is the tensor's name for a whole tensor, else the tensor's name and the range cut:
    ``"g0.p3[0:256]"`` (rows 0 to 255) for a row block, elements for a cut of a flat-chunked tensor,
    ``"g0.p3[:,0:16]"`` for a column block.
    """

    name: str
    tensor: str
    start: int
    stop: int
    shape: tuple[int, ...]
    columns: bool = False

    @property
    def numel(self) -> int:
        return _numel(self.shape)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def cut_tensor(name: str, shape: Sequence[int], codec: Codec, piece_numel: int = DEFAULT_PIECE_NUMEL) -> list[Piece]:
    """How a tensor of ``shape`` is cut into pieces of at most about ``piece_numel`` elements: where the
    codec says its records allow (:meth:`Codec.cut <gradwire.codecs.base.Codec.cut>`), so a piece's
    record carries what the whole tensor's would have for those elements.

    A DCT codec cuts by its own chunk plan (:meth:`gradwire.DCTCodec.cut`): a flat-chunked tensor at
    multiples of the chunk size, a tiled one into blocks of whole tile rows. :class:`~gradwire.OneBit` (a
    sign per element and, per column of the matrix view, the mean of each side) cuts a tensor of two or
    more dimensions into blocks of whole columns (:meth:`gradwire.OneBit.cut`). Any other tensor is one
    piece named as the tensor.
    """
    shape = tuple(int(d) for d in shape)
    numel = _numel(shape)
    piece_numel = max(1, int(piece_numel))
    parts = codec.cut(shape, piece_numel) if numel > piece_numel else []
    if len(parts) <= 1:
        return [Piece(name, name, 0, numel, shape)]
    return [Piece(_piece_name(name, shape, p), name, p.start, p.stop, p.shape, p.columns) for p in parts]


def _piece_name(name: str, shape: tuple[int, ...], part: TensorPart) -> str:
    """``name[:,c0:c1]`` for a block of columns, ``name[r0:r1]`` (rows) for a block of rows of the tensor,
    ``name[e0:e1]`` (elements) for a 1-D part of the flattened tensor."""
    if part.columns:
        return f"{name}[:,{part.start}:{part.stop}]"
    row = _numel(shape[1:]) if len(part.shape) > 1 else 1
    return f"{name}[{part.start // row}:{part.stop // row}]"


def balanced_piece_numel(
    shapes: Sequence[Sequence[int]], piece_numel: int = DEFAULT_PIECE_NUMEL, world: int = 1
) -> int:
    """The largest piece of a balanced cut: at most ``piece_numel`` and at most 1.5 × ``total / world``.

    With only the fixed bound, a model whose largest tensor is under it kept that tensor whole: one rank
    owned it and received every rank's records of it, and ranks owned nothing (236 k parameters in 5
    tensors, 8 ranks: the busiest rank received 4.3× what it sent). Cut to a rank's share instead, the
    owners' loads differ by at most about one piece, so the busiest rank receives about ``2(n − 1)/n``
    times what it sends per step (both phases), at any model size, and the record headers this adds are
    about one per rank and tensor cut."""
    total = sum(_numel(s) for s in shapes)
    if world <= 1:
        return max(1, int(piece_numel))
    # 1.5 shares: pieces as large as balance allows (each piece is a record with its own headers, about
    # 137 bytes with the DCT codec), the largest-first assignment still within about half a share of even.
    share = -(-3 * total // (2 * int(world)))
    return max(1, min(int(piece_numel), share))


#: The piece bounds :func:`balanced_cut` tries, as fractions of one rank's share of the model.
_SHARE_FRACTIONS = (1.5, 1.25, 1.0, 0.75, 0.5)
#: About what a record costs beyond its payload: in full (name, shape, codec parameters, section headers:
#: docs/FORMAT.md section 3; 120–140 bytes for the DCT codec's pieces), and compact in a layout frame (its tag
#: and its sections' lengths, section 12: 5–9 bytes, and now and then its own params), where its codec gives
#: a template (:meth:`~gradwire.codecs.base.Codec.record_template`).
_RECORD_BYTES = 130
_COMPACT_RECORD_BYTES = 12


def balanced_cut(
    tensors: Sequence[tuple[str, Sequence[int]]], codec: Codec, piece_numel: int = DEFAULT_PIECE_NUMEL, world: int = 1
) -> tuple[int, dict[str, list[Piece]]]:
    """The piece bound and the pieces of every tensor that keep the busiest rank's bytes lowest.

    A piece is cut at chunk boundaries only (a 64-row tile's rows at least), so a bound of one rank's share
    can leave a piece over for one rank: a 2048×256 embedding and a 1536×256 weight at 8 ranks, cut at 1.5
    shares, gave one rank 1.39 shares and another 0.22, and the busiest rank then received 2.2× what it
    sent, where a ring all-reduce receives 1.75×. And every piece is a record with headers of its own in
    both phases (about 130 bytes in full, about 12 compact), which on a small model may outweigh a better
    balance. So each bound of :data:`_SHARE_FRACTIONS` of a share (at most ``piece_numel``; the first is
    :func:`balanced_piece_numel`) is tried: the tensors cut, the owners assigned (:func:`assign_owners`),
    and each rank's bytes received per step estimated (phase 1: its pieces' records from the ``world − 1``
    others; phase 2: every other owner's records, each record its elements times the codec's bytes per
    element plus its headers). The cut whose busiest rank receives least wins, the one with fewer pieces
    on a tie. Deterministic: every rank cuts the same."""
    shapes = [tuple(int(d) for d in s) for _, s in tensors]
    first = balanced_piece_numel(shapes, piece_numel, world)

    def cut(bound: int) -> dict[str, list[Piece]]:
        return {n: cut_tensor(n, s, codec, bound) for n, s in tensors}

    if world <= 1:
        return first, cut(first)
    total = sum(_numel(s) for s in shapes)
    per_element = codec.bytes_per_element()
    compact = bool(tensors) and codec.record_template(tensors[0][0], shapes[0]) is not None
    record_bytes = _COMPACT_RECORD_BYTES if compact else _RECORD_BYTES
    bounds = [first] + [max(1, min(int(piece_numel), -(-int(total * f) // world))) for f in _SHARE_FRACTIONS[1:]]
    best = None
    for bound in dict.fromkeys(bounds):  # distinct, in order: largest first
        by_tensor = cut(bound)
        pieces = [p for n, _ in tensors for p in by_tensor[n]]
        owned = [0.0] * world
        for p, o in zip(pieces, assign_owners(pieces, world)):
            owned[o] += p.numel * per_element + record_bytes
        everything = sum(owned)
        busiest = max((world - 1) * mine + everything - mine for mine in owned)
        key = (busiest, len(pieces))
        if best is None or key < best[0]:
            best = (key, bound, by_tensor)
    return best[1], best[2]


def assign_owners(pieces: Sequence[Piece], world: int) -> list[int]:
    """The owner rank of each piece: largest first (ties in piece order), each to the rank with the
    fewest elements so far (ties to the lowest rank). Deterministic: the same on every rank."""
    world = int(world)
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    loads = [0] * world
    owners = [0] * len(pieces)
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i].numel, i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += pieces[i].numel
    return owners


class Pieces:
    """The pieces of named tensors (in the order given, each tensor's pieces in row order), with the
    cutting of tensors into them and the joining of pieces back."""

    def __init__(
        self,
        tensors: Sequence[tuple[str, Sequence[int]]],
        codec: Codec,
        piece_numel: int = DEFAULT_PIECE_NUMEL,
        world: int = 1,
    ):
        if int(piece_numel) < 1:
            raise ValueError(f"piece_numel must be >= 1, got {piece_numel}")
        if int(world) < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.shapes = {n: tuple(int(d) for d in s) for n, s in tensors}
        #: The codec that cuts the tensors, the one that compresses the pieces.
        self.codec = codec
        #: The largest piece: ``piece_numel``, and at most about the model's share of one rank, so that every
        #: rank can own about 1/world of the model (a tensor larger than that is cut at its chunk
        #: boundaries; :func:`balanced_cut`). A function of the shapes, the codec and the world size alone:
        #: every rank cuts the same.
        self.piece_numel, self.by_tensor = balanced_cut(tensors, codec, int(piece_numel), int(world))
        self.pieces: list[Piece] = [p for n, _ in tensors for p in self.by_tensor[n]]
        self.tensor_of = {p.name: p.tensor for p in self.pieces}
        if len(self.tensor_of) != len(self.pieces):
            raise ValueError(
                "two pieces share a name: tensor names must not end in a [start:stop] or [:,start:stop] range"
            )

    def cut(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{piece name: view}`` of every piece of the tensors given (in piece order)."""
        out = {}
        for n, t in tensors.items():
            pieces = self.by_tensor[n]
            if len(pieces) == 1:
                out[pieces[0].name] = t
                continue
            if pieces[0].columns:
                matrix = t.reshape(t.shape[0], -1)
                for p in pieces:
                    out[p.name] = matrix[:, p.start : p.stop]  # a strided view: the codecs read it, none writes
                continue
            flat = t.reshape(-1)
            for p in pieces:
                out[p.name] = flat[p.start : p.stop].view(p.shape)
        return out

    def join(self, parts: Mapping[str, torch.Tensor], tensors: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """``{tensor name: tensor}`` from every piece's tensor (each tensor's pieces concatenated), of every
        tensor or of ``tensors``."""
        out = {}
        for n in self.by_tensor if tensors is None else tensors:
            pieces = self.by_tensor[n]
            if len(pieces) == 1:
                out[n] = parts[pieces[0].name].reshape(self.shapes[n])
            elif pieces[0].columns:
                out[n] = torch.cat([parts[p.name].reshape(p.shape) for p in pieces], dim=1).view(self.shapes[n])
            else:
                out[n] = torch.cat([parts[p.name].reshape(-1) for p in pieces]).view(self.shapes[n])
        return out

    def __len__(self) -> int:
        return len(self.pieces)


class ShardedExchange(GroupMember):
    """Phase 1 (records to owners), the owners' mean and downlink error feedback, phase 2 (means to
    all); the byte counters and the owner's state. ``model_record``: the pieces are of one model
    record, and a rank whose pieces differ is refused with ``FrameError`` ``model_spec_mismatch``."""

    name = "sharded"

    def __init__(
        self,
        pieces: Pieces,
        downlink: Codec,
        process_group: dist.ProcessGroup | None,
        limits: Limits | None,
        *,
        model_record: bool = False,
    ):
        self.pieces = pieces
        self.downlink = downlink
        self.feedback = ReencodeFeedback(downlink)
        self.process_group = process_group
        self.limits = limits or DEFAULT_LIMITS
        self.model_record = model_record
        self.bytes_sent = 0
        self.bytes_received = 0
        self._owners: list[int] | None = None
        self._owners_world = 0
        self._checked = False
        self._templates: dict[int, dict[str, RecordTemplate] | None] = {}

    # -- the group -------------------------------------------------------------------------------

    def owners(self) -> list[int]:
        """Each piece's owner rank (in piece order) for the group's size."""
        world = self.world()
        if self._owners is None or self._owners_world != world:
            self._owners = assign_owners(self.pieces.pieces, world)
            self._owners_world = world
        return self._owners

    def owned(self, rank: int) -> list[Piece]:
        """The pieces ``rank`` owns, in piece order."""
        return [p for p, o in zip(self.pieces.pieces, self.owners()) if o == rank]

    def templates(self, phase: int) -> dict[str, RecordTemplate] | None:
        """``{piece name: template}`` of phase 1's records (the uplink codec's) or phase 2's (the
        downlink's), or ``None`` where the codec gives none (its frames are then plain bundles). The
        same on every rank: from the pieces and the codec alone."""
        if phase not in self._templates:
            codec = self.pieces.codec if phase == 1 else self.downlink
            got = {p.name: codec.record_template(p.name, p.shape) for p in self.pieces.pieces}
            self._templates[phase] = None if any(t is None for t in got.values()) else got
        return self._templates[phase]

    def _frame_templates(self, phase: int, pieces: Sequence[Piece]) -> list[RecordTemplate] | None:
        """The templates of one frame of ``phase`` holding ``pieces``' records: writer and reader pass the
        same list (a compact record names its template by its place in it)."""
        by_name = self.templates(phase)
        return None if by_name is None else [by_name[p.name] for p in pieces]

    def _digest(self) -> bytes:
        layout = [[p.name, list(p.shape)] for p in self.pieces.pieces]
        # The templates too: a compact record's headers are the reader's, so every rank must hold the same.
        heads = [
            None
            if (t := self.templates(phase)) is None
            else [[*x.native()[:4], x.params.hex(), x.sections] for x in t.values()]
            for phase in (1, 2)
        ]
        blob = json.dumps([self.world(), self.pieces.piece_numel, layout, heads]).encode()
        return hashlib.blake2b(blob, digest_size=16).digest()

    def _check_layout(self) -> None:
        """Once, before the first exchange: every rank cut the same pieces (else every rank raises)."""
        if self._checked:
            return
        if self._distributed():
            rows = self._gather_digests(torch.tensor(list(self._digest()), dtype=torch.uint8))
            differ = [r for r in range(rows.shape[0]) if not torch.equal(rows[r], rows[0])]
            if differ:
                msg = (
                    f"ranks {differ} cut the parameters into other pieces than rank 0, or write other records "
                    "of them (different tensor shapes, codec settings or piece_numel): every rank must build "
                    "the optimizer over the same parameter shapes, with the same codecs"
                )
                if self.model_record:
                    raise error("model_spec_mismatch", "model record: " + msg)
                raise ValueError(msg)
        self._checked = True

    # -- the collectives: a subclass carries them over another transport (torchft's replica groups) --

    def _gather_digests(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's layout digest, ``(world, 16)`` uint8 on the host."""
        g = self.process_group
        return gather_rows(mine.to(comm_device(g)), g).cpu()

    def _all_to_all(self, payloads: Sequence[bytes]) -> Sequence:
        """Phase 1's collective: ``payloads[r]`` to rank ``r``; what each rank sent this one, in rank order."""
        if self._distributed() and self.world() > 1:
            g = self.process_group
            return all_to_all_bytes(payloads, g, device=comm_device(g), limits=self.limits)
        return [payloads[self.rank()]]

    def _all_gather(self, frame: bytes) -> Sequence:
        """Phase 2's collective: every rank's frame, in rank order."""
        if self._distributed() and self.world() > 1:
            g = self.process_group
            return all_gather_bytes(frame, g, device=comm_device(g), limits=self.limits)
        return [frame]

    def _senders(self, got: Sequence, round: int, me: int, pieces: Sequence[Piece], mine: Mapping[str, Entry]):
        """The owner's inputs: every rank's records of its ``pieces`` in rank order (its own as they are, the
        others' read from ``got`` as hostile input) and their weights (``None``: ``1/world`` each). A frame
        that does not read raises: the owner refuses the round (a subclass may leave the sender out)."""
        records = [
            [mine[p.name] for p in pieces]
            if s == me
            else self._read(got[s], round, s, pieces, "records for its pieces", phase=1)
            for s in range(self.world())
        ]
        return records, None

    @staticmethod
    def _is_refusal(data) -> bool:
        """Whether an owner's phase-2 bytes are the refusal marker (one byte: never a frame)."""
        return len(data) == len(_REFUSED) and bytes(data[: len(_REFUSED)]) == _REFUSED

    def _owners_means(
        self, frames: Sequence, round: int, me: int, owned: Sequence[Sequence[Piece]]
    ) -> tuple[list[Entry], list[Piece]]:
        """Every other owner's records of its re-encoded mean, read from phase 2's ``frames``, and the pieces
        left without a mean (none here: a refusal marker or a frame that does not read raises on every rank
        alike; a subclass may leave an owner out, its pieces' mean then zero on every rank)."""
        for r, data in enumerate(frames):
            if self._is_refusal(data):
                raise FrameError(f"rank {r} refused the records it was sent for its pieces (round {round})")
        theirs: list[Entry] = []
        for r, data in enumerate(frames):
            if not owned[r]:
                if len(data):
                    raise FrameError(f"rank {r} owns no piece but sent {len(data)} bytes")
                continue
            if r != me:
                theirs += self._read(data, round, r, owned[r], "its re-encoded mean", phase=2)
        return theirs, []

    # -- one exchange ----------------------------------------------------------------------------

    def __call__(
        self, entries: Sequence[Entry], round: int, device=None, tensors: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """This rank's records of every piece in; the mean of every tensor (pieces joined) out. With
        ``tensors``, of those tensors' pieces only (one bucket of an overlapped step: the same owners, so
        the same means as one exchange of every piece; every rank must pass the same tensors, in the same
        order of calls)."""
        self._check_layout()
        me, world = self.rank(), self.world()
        mine = {e.name: e for e in entries}
        if tensors is None:
            subset = None
            expected = [p.name for p in self.pieces.pieces]
        else:
            subset = {p.name for n in tensors for p in self.pieces.by_tensor[n]}
            expected = [p.name for p in self.pieces.pieces if p.name in subset]
        if sorted(mine) != sorted(expected) or len(mine) != len(entries):
            raise ValueError(
                f"the records name other pieces than the layout's ({len(entries)} records, {len(expected)} pieces)"
            )
        owned = [[p for p in self.owned(r) if subset is None or p.name in subset] for r in range(world)]

        # Phase 1: one bundle frame per owner, holding this rank's records of its pieces (its own pieces'
        # records stay in memory: they are not sent, and the owner takes them as they are below).
        payloads = [
            write_frame(
                [mine[p.name] for p in owned[r]],
                round=round,
                sender=me,
                bundle=True,
                templates=self._frame_templates(1, owned[r]),
            )
            if owned[r] and r != me
            else b""
            for r in range(world)
        ]
        got = self._all_to_all(payloads)
        sent = sum(len(p) for r, p in enumerate(payloads) if r != me)
        received = sum(len(f) for s, f in enumerate(got) if s != me)

        # The owner's mean of its pieces, re-encoded with its error feedback; or the refusal marker.
        refusal: BaseException | None = None
        out_frame = b""
        mine_decoded: dict[str, torch.Tensor] = {}
        try:
            if owned[me]:
                records, weights = self._senders(got, round, me, owned[me], mine)
                # The mean of every rank's records (1/world each, in rank order) plus the owner's residual,
                # re-encoded. On the CPU in the DCT coefficient domain where the records are cut as the
                # downlink cuts (gradwire.reencode: no decode of the records, no forward transform; a DeMo
                # step at 10.5 M parameters went from 1.49x to 1.04x DeMo's reference with it). On a GPU
                # in parameter space, every piece in one batch (exact_mean, then one compress_bundle):
                # record by record, the coefficient domain's kernels would grow with the pieces.
                # Its own records are its codec's objects, not bytes read back: their parse is skipped (the
                # codec hands over what it kept of them, own_records); every other rank's are parsed as
                # hostile input.
                if torch.device("cpu" if device is None else device).type == "cpu":
                    own = self.pieces.codec.own_records([mine[p.name] for p in owned[me]], device)
                    done = self.feedback.reencode(records, weights, device=device, own_records=own)
                else:
                    mean = exact_mean(records, weights, device=device)
                    done = self.feedback.reencode_mean({p.name: mean[p.name] for p in owned[me]})
                out_frame = write_frame(
                    [done[p.name][0] for p in owned[me]],
                    round=round,
                    sender=me,
                    bundle=True,
                    templates=self._frame_templates(2, owned[me]),
                )
                # What every rank decodes from this frame, bit for bit (the codec's reconstruction): the
                # owner need not decode its own frame in phase 2.
                mine_decoded = {
                    n: r.to(device=device, dtype=torch.float32) if device is not None else r.to(torch.float32)
                    for n, (_, r) in done.items()
                }
            elif any(len(f) for f in got):
                raise FrameError(f"rank {me} owns no piece but was sent records")
        except (FrameError, ValueError) as exc:
            refusal, out_frame = exc, _REFUSED

        # Phase 2: every owner's frame to every rank; every rank decodes the same bytes.
        frames = self._all_gather(out_frame)
        if refusal is not None:
            raise refusal
        # exact_mean of one record at weight 1 is its decode, which this rank holds already (its own frame,
        # written above, needs no reading back).
        parts: dict[str, torch.Tensor] = dict(mine_decoded)
        theirs, left_out = self._owners_means(frames, round, me, owned)
        for p in left_out:
            parts[p.name] = torch.zeros(p.shape, dtype=torch.float32, device=device)
        if theirs:
            # Every owner's records decoded in one batch (their pieces' names are distinct): one "sender"
            # at weight 1, the same bits as owner by owner.
            parts.update(exact_mean([theirs], weights=[1.0], device=device))
        sent += len(out_frame)
        received += sum(len(f) for r, f in enumerate(frames) if r != me)
        self.bytes_sent += sent
        self.bytes_received += received
        return self.pieces.join(parts, tensors)

    def _read(self, data, round: int, sender: int, pieces: Sequence[Piece], what: str, phase: int) -> list[Entry]:
        """The records of a frame of ``phase`` from ``sender``, checked: a bundle of ``round`` from ``sender``
        holding exactly ``pieces`` (names, shapes, order)."""
        if len(data) == 0:
            raise FrameError(f"rank {sender} sent no frame; expected {what} ({len(pieces)} pieces)")
        got = read_frame(data, limits=self.limits, templates=self._frame_templates(phase, pieces))
        if not got.bundle or got.round != round or got.sender != sender:
            raise FrameError(
                f"rank {sender} sent a {'bundle' if got.bundle else 'tensor'} frame for round {got.round} from"
                f" sender {got.sender}; expected a bundle frame for round {round} from {sender}"
            )
        names = [e.name for e in got.entries]
        want = [p.name for p in pieces]
        if names != want:
            kind = "model_spec_mismatch" if self.model_record else None
            msg = f"rank {sender} sent records {names[:4]}… as {what}; expected {want[:4]}… ({len(want)})"
            raise error(kind, msg) if kind else FrameError(msg)
        for e, p in zip(got.entries, pieces):
            if tuple(e.shape) != p.shape:
                raise FrameError(f"rank {sender} sent {p.name!r} with shape {tuple(e.shape)}, expected {p.shape}")
        return list(got.entries)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The byte counters, the group's size and this rank, the pieces' names and the owner's error
        feedback."""
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "exchange": self.name,
            "world": self.world(),
            "rank": self.rank(),
            "pieces": [p.name for p in self.pieces.pieces],
            "owner": self.feedback.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], devices: Mapping[str, torch.device] | None = None) -> None:
        """Continue from :meth:`state_dict`; ``ValueError`` for a checkpoint of another exchange, group
        size or rank (the pieces would have other owners), or of pieces cut otherwise (another
        ``piece_numel`` or uplink codec: the node's buffers are the pieces')."""
        saved = state.get("exchange", "all_gather")
        if saved != self.name:
            raise ValueError(
                f"this checkpoint was saved with exchange={saved!r}; this optimizer uses exchange={self.name!r} "
                f"(build it with exchange={saved!r} to resume it)"
            )
        world, rank = self.world(), self.rank()
        if int(state["world"]) != world:
            raise ValueError(
                f"this checkpoint was saved by a group of {int(state['world'])} ranks, this group has {world}: "
                "with exchange='sharded' the pieces' owners (and the owners' error feedback) depend on the group "
                "size, so a sharded checkpoint resumes only in a group of the same size"
            )
        if int(state["rank"]) != rank:
            raise ValueError(
                f"this checkpoint is rank {int(state['rank'])}'s; this is rank {rank}: with exchange='sharded' "
                "each rank resumes from its own checkpoint (it holds that rank's owner error feedback)"
            )
        names = [p.name for p in self.pieces.pieces]
        saved_names = list(state.get("pieces", names))  # absent before pieces were saved: the owner check below
        if saved_names != names:
            i = next(
                (i for i, (a, b) in enumerate(zip(saved_names, names)) if a != b), min(len(saved_names), len(names))
            )

            def at(xs: list[str]) -> str:
                return repr(xs[i]) if i < len(xs) else "none"

            raise ValueError(
                f"this checkpoint's pieces are cut otherwise ({len(saved_names)} pieces, "
                f"this optimizer's {len(names)}; "
                f"the first to differ is #{i}: {at(saved_names)} saved, {at(names)} here): build the optimizer with "
                "the piece_numel and codec it was saved with"
            )
        feedback = ReencodeFeedback(self.downlink)
        feedback.load_state_dict(state["owner"])
        owned = {p.name for p in self.owned(rank)}
        stray = sorted(set(feedback.names()) - owned)
        if stray:
            raise ValueError(f"the checkpoint's owner error feedback holds pieces this rank does not own: {stray[:4]}")
        if devices:
            for n in feedback.feedback.names():  # (a coefficient-domain residual moves when it is next used)
                feedback.feedback.set_residual(
                    n, feedback.feedback.residual(n).to(devices.get(self.pieces.tensor_of[n], "cpu"))
                )
        self.feedback = feedback
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_received = int(state["bytes_received"])
