"""What the server publishes for a round of an algorithm whose versions publish a mean (DeMo, SparseLoCo).

Those algorithms apply the *aggregate of the nodes' records* (``gradwire.aggregation``), not a
server-side optimizer step. A version takes one of two forms (docs/FORMAT.md, "Published aggregates"):

**Re-encoded** (``RunConfig.publish = "aggregate"``, the default): the server computes the round's exact
(robust) aggregate, adds its own error buffer, compresses that with the run's downlink codec and keeps
the rest in the buffer (:class:`gradwire.ErrorFeedback`); the version is a header frame holding one
identity record ``"@reencoded"`` (float64, shape ``(1,)``: how many node frames were aggregated) and one
bundle frame from the server (``sender = 0xFFFFFFFF``, ``round = v``) with the compressed aggregate
(:func:`write_published_aggregate`). Its size does not grow with the number of nodes. Every receiver
decodes that frame exactly and applies it with the algorithm's one apply function.

**Verbatim** (``publish = "frames"``): the round's node frames themselves — the very bytes the nodes
submitted, no second lossy compression, never more coefficients than the union of theirs — after a small
header frame that says how to weigh them. Version ``v`` is ``1 + n`` concatenated frames:

- the header: a bundle frame with ``round = v`` and ``sender = 0xFFFFFFFF`` holding an identity record
  named ``"@aggregate"``, dtype float64, shape ``(n,)``: the weight of each node frame, in order; and, for
  the coordinate-wise rules (trimmed mean, median), a second identity record ``"@trim"``, float64, shape
  ``(1,)``, a whole number: how many values each coordinate drops from each end before the unweighted mean;
- the ``n`` node frames, ordered by (node id, round), each a bundle frame from a node
  (``sender != 0xFFFFFFFF``).

Every receiver computes ``exact_mean`` of the node frames' records with those weights (or
``exact_trimmed_mean`` with that trim) — the same elementwise operations in the same order as the
server — and applies it with :func:`apply_mean`, the one function the server runs too, and so holds the
same bits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .aggregation import exact_aggregate
from .algorithms import get_algorithm
from .binding import strip_binding
from .codecs.identity import IdentityCodec
from .errors import FrameError
from .frame import SERVER_SENDER, Entry, Frame, Limits, decode_entry, frame_length, read_frame, write_frame
from .model_record import expand_model_mean, run_spec
from .wire import BytesLike, as_u8

__all__ = [
    "HEADER_RECORD",
    "REENCODED_RECORD",
    "TRIM_RECORD",
    "Published",
    "apply_mean",
    "read_published",
    "write_published",
    "write_published_aggregate",
]

#: The name of the header frame's first record: the node frames' weights.
HEADER_RECORD = "@aggregate"
#: The name of a re-encoded version's one header record: how many node frames were aggregated.
REENCODED_RECORD = "@reencoded"
#: The name of the header frame's optional second record: values dropped from each end per coordinate.
TRIM_RECORD = "@trim"


@dataclass
class Published:
    """One published version: the frames (parsed) and the weight of each — the node frames of a verbatim
    version, or the server's one frame (weight 1) of a re-encoded one."""

    version: int
    frames: list[Frame]
    weights: list[float]
    nbytes: int  #: bytes of the whole version on the wire (header and frames)
    trim: int = 0  #: values dropped from each end per coordinate (0: the weighted mean)
    #: A re-encoded version: how many node frames the server aggregated (0: the node frames verbatim).
    reencoded_from: int = 0

    def records(self) -> list[list]:
        """Each frame's records, in frame order: what ``exact_mean`` takes."""
        return [f.entries for f in self.frames]

    def mean(self, device=None) -> dict[str, torch.Tensor]:
        """What this version applies: the weighted exact mean of the node frames, or their exact
        trimmed mean when ``trim`` > 0 (``gradwire.aggregation.exact_aggregate``); for a re-encoded version
        the server frame's records decoded exactly (its one weight is 1, so the mean is the decode)."""
        return exact_aggregate(self.records(), self.weights, self.trim, device=device)


def apply_mean(
    algorithm: str,
    config: Mapping[str, Any],
    weights: MutableMapping[str, torch.Tensor],
    mean: Mapping[str, torch.Tensor],
    state: Mapping[str, Any],
) -> dict[str, Any]:
    """Apply one version's ``mean`` to ``weights`` in place, as run ``config`` says; the server and every
    node call this one function, so they hold the same bits.

    ``algorithm`` names a registered algorithm whose versions publish a mean
    (:func:`gradwire.algorithms.get_algorithm`; its :meth:`~gradwire.algorithms.Algorithm.apply` does the
    work); ``config`` is the run's configuration as JSON (the algorithm reads its own section) or that
    section as the algorithm's config dataclass; ``state`` the algorithm's state before this version
    (SparseLoCo's outer momentum, ``{"outer": …}``; nothing for DeMo). Returns the state after it, whose
    tensors may be the given state's, updated in place as the weights are. A
    ``mean`` keyed by the weights' model record (runs with ``model_record``: docs/FORMAT.md section 9) is
    first cut back into the tensors (:func:`gradwire.model_record.expand_model_mean` with
    :func:`~gradwire.model_record.run_spec`).
    """
    algo = get_algorithm(algorithm)
    if algo.publication != "mean":
        raise ValueError(f"algorithm {algorithm!r} does not publish frames to average")
    section = config if isinstance(config, algo.config_type) else algo.run_config(config)
    mean = expand_model_mean(mean, run_spec(weights))
    return algo.apply(section, weights, mean, state)


def write_published(version: int, node_frames: Sequence[bytes], weights: Sequence[float], trim: int = 0) -> bytes:
    """The bytes that publish ``version``: the header (the weights, and ``trim`` when it is not 0), then
    ``node_frames`` verbatim."""
    n = len(node_frames)
    if not node_frames:
        raise ValueError("a published version needs at least one node frame")
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} node frames")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    if not 0 <= 2 * trim < n:
        raise ValueError(f"cannot drop {trim} values from each end of {n}: need 0 <= 2·trim < n")
    identity = IdentityCodec()
    entries = [identity.compress(torch.tensor(list(weights), dtype=torch.float64), HEADER_RECORD)[0]]
    if trim:
        entries.append(identity.compress(torch.tensor([float(trim)], dtype=torch.float64), TRIM_RECORD)[0])
    header = write_frame(entries, round=version, sender=SERVER_SENDER, bundle=True)
    return header + b"".join(bytes(f) for f in node_frames)


def write_published_aggregate(version: int, entries: Sequence[Entry], senders: int) -> bytes:
    """The bytes that publish ``version`` re-encoded: the header (``"@reencoded"`` = ``senders``, the node
    frames aggregated) and one bundle frame from the server holding ``entries``, the compressed aggregate."""
    senders = int(senders)
    if senders < 1:
        raise ValueError(f"a re-encoded version aggregates at least one node frame, got {senders}")
    if not entries:
        raise ValueError("a re-encoded version needs at least one record")
    record = IdentityCodec().compress(torch.tensor([float(senders)], dtype=torch.float64), REENCODED_RECORD)[0]
    header = write_frame([record], round=version, sender=SERVER_SENDER, bundle=True)
    return header + write_frame(list(entries), round=version, sender=SERVER_SENDER, bundle=True)


def read_published(data: BytesLike, *, limits: Limits | None = None) -> list[Published]:
    """Every version in ``data`` (concatenated published versions), each fully checked.

    Raises :class:`~gradwire.FrameError` for bytes that are not whole versions: a bad frame, a header
    that is neither a float64 ``"@aggregate"`` record of non-negative finite weights (and an optional
    ``"@trim"``) nor one ``"@reencoded"`` count, fewer frames than it announces, a node frame that claims
    to be the server's, a re-encoded version whose frame is not the server's bundle for that round, or
    frames of one version that name a tensor twice or disagree on their tensors' names or shapes.
    """
    buf = as_u8(data)
    out: list[Published] = []
    offset = 0

    def next_frame(what: str) -> tuple[Frame, int]:
        nonlocal offset
        try:
            n = frame_length(buf[offset:])
        except FrameError as exc:
            raise FrameError(f"{what} at byte {offset}: {exc}") from None
        frame = read_frame(buf[offset : offset + n], limits=limits)
        offset += n
        return frame, n

    while offset < len(buf):
        header, total = next_frame(f"version {len(out)}: header")
        senders = _reencoded_header(header)
        if senders:
            if offset >= len(buf):
                raise FrameError(f"version {header.round}: the re-encoded aggregate's frame is missing")
            frame, n = next_frame(f"version {header.round}: the re-encoded aggregate")
            if frame.sender != SERVER_SENDER or not frame.bundle or frame.round != header.round:
                raise FrameError(
                    f"version {header.round}: a re-encoded aggregate must be the server's bundle frame "
                    f"for round {header.round}, got sender {frame.sender:#x}, round {frame.round}, "
                    f"bundle={frame.bundle}"
                )
            _same_tensors(header.round, [frame])
            out.append(Published(header.round, [frame], [1.0], total + n, 0, reencoded_from=senders))
            continue
        weights, trim = _header(header)
        frames = []
        for i in range(len(weights)):
            if offset >= len(buf):
                raise FrameError(
                    f"version {header.round}: the header announces {len(weights)} node frames, only {i} follow"
                )
            frame, n = next_frame(f"version {header.round}: node frame {i}")
            if frame.sender == SERVER_SENDER or not frame.bundle:
                raise FrameError(
                    f"version {header.round}: node frame {i} must be a bundle from a node, "
                    f"got sender {frame.sender:#x}, bundle={frame.bundle}"
                )
            # A node frame's run binding (FORMAT.md section 10) is the server's to check, not part of the mean.
            frames.append(strip_binding(frame))
            total += n
        _same_tensors(header.round, frames)
        out.append(Published(header.round, frames, weights, total, trim))
    return out


def _same_tensors(version: int, frames: Sequence[Frame]) -> None:
    """The frames of a version each name a tensor once, and all the same tensors with the same shapes (the
    server publishes no other round); ``FrameError`` otherwise, before anything is decoded."""
    first: dict[str, tuple[int, ...]] | None = None
    for i, frame in enumerate(frames):
        layout: dict[str, tuple[int, ...]] = {}
        for entry in frame.entries:
            if entry.name in layout:
                raise FrameError(f"version {version}: frame {i} holds tensor {entry.name[:80]!r} twice")
            layout[entry.name] = tuple(entry.shape)
        if first is None:
            first = layout
        elif layout != first:
            raise FrameError(f"version {version}: frame {i} holds other tensors (names or shapes) than frame 0")


def _reencoded_header(header: Frame) -> int:
    """The node-frame count of a re-encoded version's header; 0 for a header of another form."""
    if not header.entries or header.entries[0].name != REENCODED_RECORD:
        return 0
    entry = header.entries[0]
    if (
        header.sender != SERVER_SENDER
        or not header.bundle
        or len(header.entries) != 1
        or entry.codec != IdentityCodec.codec_id
        or entry.dtype != torch.float64
        or tuple(entry.shape) != (1,)
    ):
        raise FrameError(
            f"a re-encoded version's header is the server's bundle frame with one record "
            f"{REENCODED_RECORD!r}: identity, float64, shape (1,); got sender {header.sender:#x}, "
            f"{len(header.entries)} record(s), codec {entry.codec}, {entry.dtype}, shape {tuple(entry.shape)}"
        )
    value = float(decode_entry(entry)[0])
    if not (math.isfinite(value) and value == int(value) and value >= 1):
        raise FrameError(f"the header's {REENCODED_RECORD!r} must be a whole number >= 1, got {value}")
    return int(value)


def _header(header: Frame) -> tuple[list[float], int]:
    """The header's weights and trim, every field checked."""
    if header.sender != SERVER_SENDER or not header.bundle or len(header.entries) not in (1, 2):
        raise FrameError(
            f"a published version starts with the server's header frame (one or two records, "
            f"sender {SERVER_SENDER:#x}), got sender {header.sender:#x} with "
            f"{len(header.entries)} record(s)"
        )
    entry = header.entries[0]
    if (
        entry.name != HEADER_RECORD
        or entry.codec != IdentityCodec.codec_id
        or entry.dtype != torch.float64
        or len(entry.shape) != 1
        or entry.shape[0] < 1
    ):
        raise FrameError(
            f"the header record must be {HEADER_RECORD!r}: identity, float64, shape (n,) with n >= 1; "
            f"got {entry.name!r}, codec {entry.codec}, {entry.dtype}, shape {tuple(entry.shape)}"
        )
    weights = [float(w) for w in decode_entry(entry).tolist()]
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise FrameError(f"the header's weights must be finite and non-negative, got {weights}")
    if len(header.entries) == 1:
        return weights, 0
    entry = header.entries[1]
    if (
        entry.name != TRIM_RECORD
        or entry.codec != IdentityCodec.codec_id
        or entry.dtype != torch.float64
        or tuple(entry.shape) != (1,)
    ):
        raise FrameError(
            f"the header's second record must be {TRIM_RECORD!r}: identity, float64, shape (1,); "
            f"got {entry.name!r}, codec {entry.codec}, {entry.dtype}, shape {tuple(entry.shape)}"
        )
    value = float(decode_entry(entry)[0])
    if not (math.isfinite(value) and value == int(value)):
        raise FrameError(f"the header's trim must be a whole number, got {value}")
    trim = int(value)
    if not 0 <= 2 * trim < len(weights):
        raise FrameError(f"the header's trim {trim} must satisfy 0 <= 2·trim < {len(weights)} (the node frames)")
    return weights, trim
