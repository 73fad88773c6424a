"""Re-encoding a round's aggregate for the downlink, with the error buffer in the DCT coefficient domain
where the chunkings allow it.

A server that publishes a round's aggregate re-encoded (``RunConfig.publish = "aggregate"``) adds its error
buffer to the aggregate, compresses the sum with the downlink codec and keeps the rest
(:class:`~gradwire.ErrorFeedback`). In parameter space that costs, per round: one exact decode of every
node's records (an inverse transform each), the downlink's forward transform of the sum, the top-k, and
the exact decode of the result.

When the downlink is a :class:`~gradwire.DCTCodec` that cuts a tensor into the same chunks as the nodes'
float32 DCT records of it (the default of DeMo and SparseLoCo runs: the downlink is the nodes' codec with
another ``k`` and value width) and the rule is a weighted mean (no trim), :class:`ReencodeFeedback` runs
the same error feedback in the coefficient domain instead. The transform is linear and orthonormal, so

- the aggregate's coefficients are ``Σ wᵢ · (node i's sparse coefficients)``, scattered straight into the
  buffer (no decode of the node records, no forward transform);
- each chunk's ``k`` largest coefficients of the buffer are quantized with the downlink codec's grid and
  what receivers read for them (the dequantized values) is subtracted from the buffer;
- the published record's exact decode (``gradwire.dct.decode_levels``, what every node runs) is what the
  sender applies, so it holds the nodes' weights bit for bit.

Mode-0 chunks pad a tensor's tail with zeros that decoding drops; the buffer's last chunk of such a tensor
is projected back onto the tensor (inverse transform, padding zeroed, forward transform) after the
aggregate is added, so no kept coefficient is spent on what no receiver applies — as in parameter space.

It is the parameter-space feedback in another orthonormal basis: the same inputs give the same residual up
to float32 rounding (the one difference: the exact decode's rounding of its basis, below 10⁻⁴ of the
update, is not fed back), and every step is deterministic on one machine (a fixed order, no atomics), so a
replay from the same records reproduces the published bytes. Tensors whose records are cut otherwise
(another chunking, another codec, a dtype other than float32), and every tensor of a trimmed or median
round (coordinate-wise in parameter space), go through the parameter-space :class:`~gradwire.ErrorFeedback`;
a residual moves between the domains by one float transform when a tensor switches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import _native
from . import dct as _dct
from .aggregation import _by_name, exact_mean, exact_trimmed_mean, sender_weights
from .codecs import statedict as sd
from .codecs.base import Codec
from .codecs.dct import DCTCodec, dequantize_levels
from .codecs.dct_parse import ParsedRecord, parse_record
from .feedback import ErrorFeedback
from .frame import Entry

__all__ = ["STATE_FORMAT", "ReencodeFeedback"]

#: The ``"format"`` of :meth:`ReencodeFeedback.state_dict`: parameter-domain ``"residuals"`` (as
#: :class:`~gradwire.ErrorFeedback` keeps them) and coefficient-domain ``"coefficients"``, each tensor in
#: exactly one of them. A state without ``"format"`` is an :class:`~gradwire.ErrorFeedback` state (what
#: servers checkpointed before the coefficient domain): parameter-domain residuals, loaded as such.
STATE_FORMAT = "gradwire.reencode/1"


class ReencodeFeedback:
    """The downlink error feedback of a sender that re-encodes a weighted mean of node records: each
    tensor's residual in the DCT coefficient domain where its records allow (module docstring), else in
    parameter space (:attr:`feedback`)."""

    def __init__(self, codec: Codec):
        self.codec = codec
        #: The parameter-domain residuals (every codec; the tensors the coefficient domain cannot take).
        self.feedback = ErrorFeedback(codec)
        #: Coefficient-domain residuals: ``{name: (tensor shape, float32 (num_chunks, C))}``.
        self._coefficients: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}

    # -- a round ---------------------------------------------------------------------------------

    def reencode(
        self,
        records: Sequence[Sequence[Entry]],
        weights: Sequence[float] | None = None,
        trim: int = 0,
        device=None,
        lap: Callable[[str], None] | None = None,
    ) -> dict[str, tuple[Entry, torch.Tensor]]:
        """The senders' exact aggregate (``weights``, or the trimmed mean when ``trim`` > 0, as
        :func:`gradwire.aggregation.exact_aggregate`) plus the residuals, compressed with the codec:
        ``{name: (record, its exact decode, float32)}`` in name order; the residuals keep the rest.

        ``records`` as :func:`~gradwire.aggregation.exact_mean` takes them (``ValueError`` if senders
        disagree on names or shapes; :class:`~gradwire.FrameError` for a record that does not decode).
        ``lap("aggregate")`` is called once the aggregate is in, for a caller that times the parts.
        """
        weights = sender_weights(records, weights, "re-encoding")
        dev = torch.device("cpu") if device is None else torch.device(device)
        per_sender = _by_name(records)[1]
        names = sorted(per_sender[0])
        parsed: dict[str, list[ParsedRecord]] = {}
        if not trim:
            for name in names:
                same_chunks = self._coefficient_records(name, [mine[name] for mine in per_sender], dev)
                if same_chunks is not None:
                    parsed[name] = same_chunks
        rest = [name for name in names if name not in parsed]
        mean: dict[str, torch.Tensor] = {}
        if rest:
            rest_records = [[mine[name] for name in rest] for mine in per_sender]
            mean = exact_trimmed_mean(rest_records, trim, dev) if trim else exact_mean(rest_records, weights, dev)
        # Weights rounded to float32 once, as exact_mean rounds them.
        w32 = [float(torch.tensor(float(w), dtype=torch.float32)) for w in weights]
        sums = {name: self._add_aggregate(name, recs, w32, dev) for name, recs in parsed.items()}
        if lap is not None:
            lap("aggregate")
        done = self.reencode_mean({name: mean[name] for name in rest})
        done.update(self._reencode_coefficient_buffers(sums))
        return {name: done[name] for name in names}

    def _coefficient_records(
        self, name: str, entries: Sequence[Entry], device: torch.device
    ) -> list[ParsedRecord] | None:
        """``entries`` parsed, if the coefficient domain can take them: float32 DCT records all cut as
        the downlink codec cuts the tensor; ``None`` otherwise."""
        if not isinstance(self.codec, DCTCodec):
            return None
        if any(e.codec != DCTCodec.codec_id or e.dtype != torch.float32 for e in entries):
            return None
        plan = self.codec.plan(entries[0].shape)
        parsed = []
        for e in entries:
            p = parse_record(e, device)
            if p.plan != plan:
                return None
            parsed.append(p)
        return parsed

    def _add_aggregate(
        self, name: str, parsed: Sequence[ParsedRecord], w32: Sequence[float], device: torch.device
    ) -> torch.Tensor:
        """The residual's coefficients plus ``Σ wᵢ · parsed[i]``, added in place in sender order (one
        rounded multiply and one rounded add per coefficient, as :func:`exact_mean` combines its decoded
        tensors); ``(num_chunks, C)``."""
        plan = parsed[0].plan
        c = plan.chunk_numel
        buf = self._coefficient_residual(name, plan, device)
        flat = buf.reshape(-1)
        for p, w in zip(parsed, w32):
            if device.type == "cpu":
                _native.scatter_add_rows(
                    p.idx.contiguous().reshape(-1).numpy(),
                    p.values.contiguous().reshape(-1).numpy(),
                    p.k,
                    c,
                    w,
                    flat.numpy(),
                )
                continue
            pos = (p.idx + torch.arange(plan.num_chunks, device=device).unsqueeze(1) * c).reshape(-1)
            # A record's positions are distinct: no colliding writes, no atomics.
            flat.index_copy_(0, pos, flat.index_select(0, pos) + p.values.reshape(-1) * w)
        if plan.pad_count:
            _drop_padding(buf, plan)
        return buf

    def _reencode_coefficient_buffers(self, sums: Mapping[str, torch.Tensor]) -> dict[str, tuple[Entry, torch.Tensor]]:
        """Compress every buffer (a residual plus this round's aggregate) and keep in each what receivers
        do not get: the buffer less the dequantized values of its kept coefficients. Buffers of one chunk
        shape go together (one top-k, quantization, host copy and exact decode per chunk shape:
        :meth:`DCTCodec.compress_coefficient_groups <gradwire.DCTCodec.compress_coefficient_groups>`,
        whose records and decodes are byte for byte those of one buffer at a time)."""
        if not sums:
            return {}
        assert isinstance(self.codec, DCTCodec)
        groups: dict[tuple[int, ...], list[tuple[str, torch.dtype, _dct.ChunkPlan]]] = {}
        for name in sums:
            plan = self.codec.plan(self._coefficients[name][0])
            groups.setdefault(plan.chunk_shape, []).append((name, torch.float32, plan))
        items = [
            (members, torch.cat([sums[n] for n, _, _ in members]) if len(members) > 1 else sums[members[0][0]])
            for members in groups.values()
        ]
        done, kept = self.codec.compress_coefficient_groups(items)
        for (members, _), (idx, levels, scales, mins) in zip(items, kept):
            values = dequantize_levels(levels, scales, mins)
            row = 0
            for name, _, plan in members:
                rows = slice(row, row + plan.num_chunks)
                row += plan.num_chunks
                buf = sums[name]
                at = idx[rows].to(buf.device)
                # What receivers read for the kept coefficients leaves the buffer (as one buffer at a time).
                buf.scatter_(1, at, buf.gather(1, at).sub_(values[rows].to(buf.device)))
        return done

    def reencode_mean(self, mean: Mapping[str, torch.Tensor]) -> dict[str, tuple[Entry, torch.Tensor]]:
        """An aggregate computed already (``{name: tensor}``) plus the residuals, compressed in parameter
        space
        (:meth:`ErrorFeedback.compress_bundle_reconstructed <gradwire.ErrorFeedback.compress_bundle_reconstructed>`:
        one batch over every tensor, the path whose kernel count does not grow with the tensors on a GPU);
        a coefficient-domain residual moves back to parameter space first. ``{name: (record, its exact
        decode)}`` in ``mean``'s order."""
        for name, value in mean.items():
            if name in self._coefficients:
                self.feedback.set_residual(name, self._parameter_view(name).to(value.device))
                del self._coefficients[name]
        return self.feedback.compress_bundle_reconstructed(mean) if mean else {}

    def _coefficient_residual(self, name: str, plan: _dct.ChunkPlan, device: torch.device) -> torch.Tensor:
        """``name``'s coefficient-domain residual (stored, or the parameter-domain one transformed, or
        zeros), registered as the buffer this round adds into."""
        held = self._coefficients.get(name)
        if held is not None:
            shape, buf = held
            if shape != plan.shape or tuple(buf.shape) != (plan.num_chunks, plan.chunk_numel):
                raise ValueError(
                    f"tensor {name!r} has shape {plan.shape} but its coefficient residual was kept "
                    f"for shape {shape}; call reset(name) if the tensor changed"
                )
            buf = buf.to(device)
        else:
            r = self.feedback.residual(name)
            if r is None:
                buf = torch.zeros((plan.num_chunks, plan.chunk_numel), dtype=torch.float32, device=device)
            else:
                if tuple(r.shape) != plan.shape:
                    raise ValueError(
                        f"tensor {name!r} has shape {plan.shape} but its residual has "
                        f"{tuple(r.shape)}; call reset(name) if the tensor changed"
                    )
                buf = _dct.encode_chunks(r.to(device=device, dtype=torch.float32), plan).contiguous()
                self.feedback.reset(name)
        self._coefficients[name] = (plan.shape, buf)
        return buf

    def _parameter_view(self, name: str) -> torch.Tensor:
        shape, buf = self._coefficients[name]
        assert isinstance(self.codec, DCTCodec)
        plan = self.codec.plan(shape)
        return _dct.from_chunks(_dct.idct_chunks(buf.reshape(plan.num_chunks, *plan.chunk_shape)), plan)

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        """Add ``sent`` (``{name: parameter-space tensor}``) back into the residuals, as
        :meth:`ErrorFeedback.take_back <gradwire.ErrorFeedback.take_back>` does (a coefficient-domain
        residual takes its transform)."""
        rest = {}
        for name, value in sent.items():
            held = self._coefficients.get(name)
            if held is None:
                rest[name] = value
                continue
            assert isinstance(self.codec, DCTCodec)
            plan = self.codec.plan(held[0])
            held[1].add_(_dct.encode_chunks(value.to(device=held[1].device, dtype=torch.float32), plan))
        if rest:
            self.feedback.take_back(rest)

    # -- state -----------------------------------------------------------------------------------

    def residual(self, name: str) -> torch.Tensor | None:
        """``name``'s residual in parameter space (float32): the parameter-domain one, or the inverse
        transform of the coefficient-domain one (float, so within rounding of it); ``None`` before the
        tensor's first re-encoding."""
        if name in self._coefficients:
            return self._parameter_view(name)
        return self.feedback.residual(name)

    def coefficient_residual(self, name: str) -> torch.Tensor | None:
        """``name``'s coefficient-domain residual (float32 ``(num_chunks, C)``, the live buffer), or
        ``None`` if it is held in parameter space or not at all."""
        held = self._coefficients.get(name)
        return None if held is None else held[1]

    def names(self) -> list[str]:
        """Names with a residual, in either domain."""
        return sorted(set(self._coefficients) | set(self.feedback.names()))

    def reset(self, name: str | None = None) -> None:
        """Forget every residual, or only ``name``'s."""
        if name is None:
            self._coefficients.clear()
        else:
            self._coefficients.pop(name, None)
        self.feedback.reset(name)

    def state_dict(self) -> dict[str, Any]:
        """``{"format": STATE_FORMAT, "residuals": {name: parameter-domain residual}, "coefficients":
        {name: {"shape": [...], "chunks": (num_chunks, C)}}, "codec": codec state}`` (copies)."""
        inner = self.feedback.state_dict()
        return {
            "format": STATE_FORMAT,
            "residuals": inner["residuals"],
            "coefficients": {
                n: {"shape": list(shape), "chunks": buf.detach().clone().contiguous()}
                for n, (shape, buf) in self._coefficients.items()
            },
            "codec": inner["codec"],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: what :meth:`state_dict` returned, or an
        :class:`~gradwire.ErrorFeedback` state (no ``"format"``: parameter-domain residuals, as servers
        checkpointed them before :data:`STATE_FORMAT`). ``ValueError`` on anything else, an unknown
        format included."""
        state = sd.mapping(state, "ReencodeFeedback state")
        if "format" not in state:
            self.feedback.load_state_dict(state)
            self._coefficients = {}
            return
        if state["format"] != STATE_FORMAT:
            raise ValueError(
                f"ReencodeFeedback state of format {state['format']!r}: this gradwire reads "
                f"{STATE_FORMAT!r} and ErrorFeedback states (no format)"
            )
        state = sd.fields(state, "ReencodeFeedback state", ("format", "residuals", "coefficients", "codec"))
        coefficients = {}
        for name, held in sd.mapping(state["coefficients"], "ReencodeFeedback state 'coefficients'").items():
            what = f"coefficient residual {name!r}"
            held = sd.fields(held, what, ("shape", "chunks"))
            if not isinstance(self.codec, DCTCodec):
                raise ValueError(
                    f"{what}: a coefficient-domain residual needs a DCT downlink codec, this one is {self.codec!r}"
                )
            shape = tuple(sd.integer(d, f"{what} 'shape'") for d in sd.sequence(held["shape"], f"{what} 'shape'"))
            chunks = sd.tensor(held["chunks"], f"{what} 'chunks'", floating=True)
            plan = self.codec.plan(shape)
            if tuple(chunks.shape) != (plan.num_chunks, plan.chunk_numel):
                raise ValueError(
                    f"{what}: {tuple(chunks.shape)} coefficients, but the codec cuts shape {shape} "
                    f"into ({plan.num_chunks}, {plan.chunk_numel})"
                )
            coefficients[name] = (shape, chunks.detach().to(torch.float32).clone().contiguous())
        self.feedback.load_state_dict({"residuals": state["residuals"], "codec": state["codec"]})
        both = sorted(set(coefficients) & set(self.feedback.names()))
        if both:
            raise ValueError(f"ReencodeFeedback state holds {both[:5]} in both domains")
        self._coefficients = coefficients

    def __repr__(self) -> str:
        return (
            f"ReencodeFeedback({self.codec!r}, coefficient residuals={len(self._coefficients)}, "
            f"parameter residuals={len(self.feedback.names())})"
        )


def _drop_padding(buf: torch.Tensor, plan: _dct.ChunkPlan) -> None:
    """Project the last chunk of ``buf`` (mode 0, ``plan.pad_count`` > 0) onto the tensor: what decoding
    keeps of it, without the component only the dropped padding held."""
    c = plan.chunk_numel
    last = _dct.idct_chunks(buf[-1:].reshape(1, *plan.chunk_shape)).reshape(c)
    last[c - plan.pad_count :] = 0.0
    buf[-1] = _dct.dct_chunks(last.reshape(1, *plan.chunk_shape)).reshape(c)
