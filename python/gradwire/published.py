"""What the server publishes for a round of a frame-averaging algorithm (DeMo, SparseLoCo).

Those algorithms apply the *mean of the nodes' frames* (``gradwire.algorithms.exact_mean``), not a
server-side optimizer step compressed again. So the server publishes the round's node frames
themselves — the very bytes the nodes submitted, no second lossy compression, never more coefficients
than the union of theirs — after a small header frame that says how to weigh them. Version ``v`` is
``1 + n`` concatenated frames (docs/FORMAT.md, "Published aggregates"):

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
from dataclasses import dataclass
from typing import Any, Mapping, MutableMapping, Optional, Sequence

import torch

from .algorithms import OuterStep, demo_update, exact_aggregate
from .codecs.identity import IdentityCodec
from .errors import FrameError
from .frame import SERVER_SENDER, Frame, Limits, decode_entry, frame_length, read_frame, write_frame
from .model_record import expand_model_mean, run_spec
from .wire import BytesLike, as_u8

__all__ = ["HEADER_RECORD", "TRIM_RECORD", "Published", "apply_mean", "read_published", "write_published"]

#: The name of the header frame's first record: the node frames' weights.
HEADER_RECORD = "@aggregate"
#: The name of the header frame's optional second record: values dropped from each end per coordinate.
TRIM_RECORD = "@trim"


@dataclass
class Published:
    """One published version: the node frames (parsed) and the weight of each."""

    version: int
    frames: list[Frame]
    weights: list[float]
    nbytes: int  #: bytes of the whole version on the wire (header and node frames)
    trim: int = 0  #: values dropped from each end per coordinate (0: the weighted mean)

    def records(self) -> list[list]:
        """Each node frame's records, in frame order: what ``exact_mean`` takes."""
        return [f.entries for f in self.frames]

    def mean(self, device=None) -> dict[str, torch.Tensor]:
        """What this version applies: the weighted exact mean of the node frames, or their exact
        trimmed mean when ``trim`` > 0 (``gradwire.algorithms.exact_aggregate``)."""
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

    ``config`` is the run's configuration as JSON (its ``demo`` / ``sparseloco`` sections); ``state`` the
    algorithm's state before this version (SparseLoCo's outer momentum, ``{"outer": …}``; nothing for
    DeMo). Returns the state after it. A ``mean`` keyed by the weights' model record (runs with
    ``model_record``: docs/FORMAT.md section 9) is first cut back into the tensors
    (:func:`gradwire.model_record.expand_model_mean` with :func:`~gradwire.model_record.run_spec`).
    """
    mean = expand_model_mean(mean, run_spec(weights))
    if algorithm == "demo":
        demo = config["demo"]
        demo_update(weights, mean, float(demo["lr"]), float(demo.get("weight_decay", 0.0)))
        return {}
    if algorithm == "sparseloco":
        sl = config["sparseloco"]
        outer = OuterStep(float(sl["outer_lr"]), float(sl.get("outer_momentum", 0.0)), bool(sl.get("nesterov", False)))
        outer.load_state_dict(state.get("outer", {"buffers": {}}))
        outer.apply(weights, mean)
        return {"outer": outer.state_dict()}
    raise ValueError(f"algorithm {algorithm!r} does not publish frames to average (demo, sparseloco do)")


def write_published(
    version: int, node_frames: Sequence[bytes], weights: Sequence[float], trim: int = 0
) -> bytes:
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


def read_published(data: BytesLike, *, limits: Optional[Limits] = None) -> list[Published]:
    """Every version in ``data`` (concatenated published versions), each fully checked.

    Raises :class:`~gradwire.FrameError` for bytes that are not whole versions: a bad frame, a header
    that is not exactly one float64 ``"@aggregate"`` record of non-negative finite weights, fewer node
    frames than it announces, or a node frame that claims to be the server's.
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
        weights, trim = _header(header)
        frames = []
        for i in range(len(weights)):
            if offset >= len(buf):
                raise FrameError(f"version {header.round}: the header announces {len(weights)} node frames, "
                                 f"only {i} follow")
            frame, n = next_frame(f"version {header.round}: node frame {i}")
            if frame.sender == SERVER_SENDER or not frame.bundle:
                raise FrameError(f"version {header.round}: node frame {i} must be a bundle from a node, "
                                 f"got sender {frame.sender:#x}, bundle={frame.bundle}")
            frames.append(frame)
            total += n
        out.append(Published(header.round, frames, weights, total, trim))
    return out


def _header(header: Frame) -> tuple[list[float], int]:
    """The header's weights and trim, every field checked."""
    if header.sender != SERVER_SENDER or not header.bundle or len(header.entries) not in (1, 2):
        raise FrameError(f"a published version starts with the server's header frame (one or two records, "
                         f"sender {SERVER_SENDER:#x}), got sender {header.sender:#x} with "
                         f"{len(header.entries)} record(s)")
    entry = header.entries[0]
    if entry.name != HEADER_RECORD or entry.codec != IdentityCodec.codec_id or entry.dtype != torch.float64 \
            or len(entry.shape) != 1 or entry.shape[0] < 1:
        raise FrameError(f"the header record must be {HEADER_RECORD!r}: identity, float64, shape (n,) with n >= 1; "
                         f"got {entry.name!r}, codec {entry.codec}, {entry.dtype}, shape {tuple(entry.shape)}")
    weights = [float(w) for w in decode_entry(entry).tolist()]
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise FrameError(f"the header's weights must be finite and non-negative, got {weights}")
    if len(header.entries) == 1:
        return weights, 0
    entry = header.entries[1]
    if entry.name != TRIM_RECORD or entry.codec != IdentityCodec.codec_id or entry.dtype != torch.float64 \
            or tuple(entry.shape) != (1,):
        raise FrameError(f"the header's second record must be {TRIM_RECORD!r}: identity, float64, shape (1,); "
                         f"got {entry.name!r}, codec {entry.codec}, {entry.dtype}, shape {tuple(entry.shape)}")
    value = float(decode_entry(entry)[0])
    if not (math.isfinite(value) and value == int(value)):
        raise FrameError(f"the header's trim must be a whole number, got {value}")
    trim = int(value)
    if not 0 <= 2 * trim < len(weights):
        raise FrameError(f"the header's trim {trim} must satisfy 0 <= 2·trim < {len(weights)} (the node frames)")
    return weights, trim
