"""Re-encoding a round's aggregate for the downlink, with the error buffer in the DCT coefficient domain
where the chunkings allow it.

A server that publishes a round's aggregate re-encoded (``RunConfig.publish = "aggregate"``) adds its error
buffer to the aggregate, compresses the sum with the downlink codec and keeps the rest
(:class:`~gradwire.ErrorFeedback`). In parameter space that costs, per round: one exact decode of every
node's records (an inverse transform each), the downlink's forward transform of the sum, the top-k, and
the exact decode of the result.

When the downlink codec has a coefficient domain (:meth:`Codec.coefficient_domain
<gradwire.codecs.base.Codec.coefficient_domain>`: the :class:`~gradwire.DCTCodec`'s,
:class:`gradwire.dct.CoefficientDomain`) that takes the nodes' records of a tensor (float32 DCT records cut
into the same chunks as the downlink cuts it: the default of DeMo and SparseLoCo runs, where the downlink is
the nodes' codec with another ``k`` and value width) and the rule is a weighted mean (no trim),
:class:`ReencodeFeedback` runs the same error feedback in the coefficient domain instead. The DCT is linear
and orthonormal, so

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

from .aggregation import _by_name, exact_mean, exact_trimmed_mean, sender_weights
from .codecs import statedict as sd
from .codecs.base import Codec
from .dct.domain import joined
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
    tensor's residual in the codec's coefficient domain where its records allow (module docstring), else
    in parameter space (:attr:`feedback`)."""

    def __init__(self, codec: Codec):
        self.codec = codec
        #: The codec's coefficient domain (``None``: every residual in parameter space).
        self.domain = codec.coefficient_domain()
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
        own_records: Any = None,
    ) -> dict[str, tuple[Entry, torch.Tensor]]:
        """The senders' exact aggregate (``weights``, or the trimmed mean when ``trim`` > 0, as
        :func:`gradwire.aggregation.exact_aggregate`) plus the residuals, compressed with the codec:
        ``{name: (record, its exact decode, float32)}`` in name order; the residuals keep the rest.

        ``records`` as :func:`~gradwire.aggregation.exact_mean` takes them (``ValueError`` if senders
        disagree on names or shapes; :class:`~gradwire.FrameError` for a record that does not decode).
        ``lap("aggregate")`` is called once the aggregate is in, for a caller that times the parts.
        ``own_records``: what the caller's codec kept of the records it wrote itself (:meth:`Codec.own_records
        <gradwire.codecs.base.Codec.own_records>`), which the coefficient domain takes as kept; every
        other record is parsed as hostile input.
        """
        weights = sender_weights(records, weights, "re-encoding")
        dev = torch.device("cpu") if device is None else torch.device(device)
        per_sender = _by_name(records)[1]
        names = sorted(per_sender[0])
        parsed: dict[str, list] = {}
        if not trim and self.domain is not None:
            for name in names:
                same_chunks = self.domain.parse([mine[name] for mine in per_sender], dev, own_records)
                if same_chunks is not None:
                    parsed[name] = same_chunks
        rest = [name for name in names if name not in parsed]
        mean: dict[str, torch.Tensor] = {}
        if rest:
            rest_records = [[mine[name] for name in rest] for mine in per_sender]
            mean = exact_trimmed_mean(rest_records, trim, dev) if trim else exact_mean(rest_records, weights, dev)
        # Weights rounded to float32 once, as exact_mean rounds them.
        w32 = [float(torch.tensor(float(w), dtype=torch.float32)) for w in weights]
        sums = {}
        for name, recs in parsed.items():
            shape = tuple(per_sender[0][name].shape)
            sums[name] = (shape, self._coefficient_residual(name, shape, dev))
            self.domain.add(sums[name][1], recs, w32)
        if lap is not None:
            lap("aggregate")
        done = self.reencode_mean({name: mean[name] for name in rest})
        done.update(self.domain.compress(sums) if sums else {})
        return {name: done[name] for name in names}

    def reencode_sums(
        self,
        coefficient_sums: Mapping[str, tuple[tuple[int, ...], torch.Tensor]],
        scale: float,
        mean: Mapping[str, torch.Tensor],
        device=None,
    ) -> dict[str, tuple[Entry, torch.Tensor]]:
        """:meth:`reencode` of an aggregate summed already: ``scale`` × each of ``coefficient_sums`` (``{name:
        (tensor shape, its coefficients in this codec's domain, flat float32)}``, a server's running sum of
        the round: ``gradwire_server.round_sum``) added into its coefficient residual, and ``mean`` (``{name:
        tensor}``: the tensors summed in parameter space) into the parameter-domain residuals; then both
        compressed. ``{name: (record, its exact decode)}`` in name order."""
        if coefficient_sums and self.domain is None:
            raise ValueError(
                f"coefficient-domain sums need a downlink codec with a coefficient domain, not {self.codec!r}"
            )
        dev = torch.device("cpu") if device is None else torch.device(device)
        self._pack([(name, tuple(shape)) for name, (shape, _) in coefficient_sums.items()], dev)
        sums = {}
        for name, (shape, total) in coefficient_sums.items():
            buf = self._coefficient_residual(name, tuple(shape), dev)
            buf.reshape(-1).add_(total.to(dev), alpha=scale)
            self.domain.project_padding(buf, self.codec.plan(shape))
            sums[name] = (tuple(shape), buf)
        done = self.reencode_mean(mean)
        done.update(self.domain.compress(sums) if sums else {})
        return {name: done[name] for name in sorted(done)}

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

    def _pack(self, tensors: Sequence[tuple[str, tuple[int, ...]]], device: torch.device) -> None:
        """The coefficient residuals of ``tensors`` (``(name, shape)``, in the order the compression groups
        them), each chunk shape's laid out one after another in one buffer, so that compressing them takes
        a view of it and not a copy (:func:`gradwire.dct.domain.joined`). A no-op once they are."""
        groups: dict[tuple[int, ...], list[tuple[str, tuple[int, ...]]]] = {}
        for name, shape in tensors:
            groups.setdefault(self.codec.plan(shape).chunk_shape, []).append((name, shape))
        for members in groups.values():
            bufs = [self._coefficient_residual(name, shape, device) for name, shape in members]
            block = joined(bufs)
            if block.data_ptr() != bufs[0].data_ptr():  # a copy: from now on the residuals' one buffer
                row = 0
                for (name, shape), b in zip(members, bufs):
                    self._coefficients[name] = (shape, block[row : row + b.shape[0]])
                    row += b.shape[0]

    def _coefficient_residual(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``name``'s coefficient-domain residual (stored, or the parameter-domain one transformed, or
        zeros), registered as the buffer this round adds into."""
        layout = self.domain.layout(shape)
        held = self._coefficients.get(name)
        if held is not None:
            kept_shape, buf = held
            if kept_shape != shape or tuple(buf.shape) != layout:
                raise ValueError(
                    f"tensor {name!r} has shape {shape} but its coefficient residual was kept "
                    f"for shape {kept_shape}; call reset(name) if the tensor changed"
                )
            buf = buf.to(device)
        else:
            r = self.feedback.residual(name)
            if r is None:
                buf = torch.zeros(layout, dtype=torch.float32, device=device)
            else:
                if tuple(r.shape) != shape:
                    raise ValueError(
                        f"tensor {name!r} has shape {shape} but its residual has "
                        f"{tuple(r.shape)}; call reset(name) if the tensor changed"
                    )
                buf = self.domain.forward(r.to(device), shape)
                self.feedback.reset(name)
        self._coefficients[name] = (shape, buf)
        return buf

    def _parameter_view(self, name: str) -> torch.Tensor:
        shape, buf = self._coefficients[name]
        return self.domain.inverse(buf, shape)

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
            held[1].add_(self.domain.forward(value.to(held[1].device), held[0]))
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
            if self.domain is None:
                raise ValueError(
                    f"{what}: a coefficient-domain residual needs a downlink codec with a coefficient domain"
                    f" (the DCT codec), this one is {self.codec!r}"
                )
            shape = tuple(sd.integer(d, f"{what} 'shape'") for d in sd.sequence(held["shape"], f"{what} 'shape'"))
            chunks = sd.tensor(held["chunks"], f"{what} 'chunks'", floating=True)
            layout = self.domain.layout(shape)
            if tuple(chunks.shape) != layout:
                raise ValueError(
                    f"{what}: {tuple(chunks.shape)} coefficients, but the codec cuts shape {shape} into {layout}"
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
