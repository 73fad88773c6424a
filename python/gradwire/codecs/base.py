"""The protocol every codec follows.

A codec turns a tensor into a frame record (:class:`~gradwire.frame.Entry`) and reports the dense
reconstruction a receiver will decode from it, so error feedback can carry the difference to the next
step without decoding twice. Decoding needs nothing but the bytes: each codec registers a decoder
under its id with :func:`gradwire.frame.register_decoder`.

The protocol also declares:

- :meth:`Codec.compress_bundle`: all the tensors of a bundle at once. The default compresses them one by
  one; a codec whose budget spans the bundle (global top-k) overrides it and says so with
  :attr:`Codec.bundle_budget`. :class:`~gradwire.ErrorFeedback` and :meth:`Codec.encode_bundle` always
  go through it.
- :meth:`Codec.state_dict` / :meth:`Codec.load_state_dict`: what a codec keeps between calls (warm
  starts, random generators, codebooks), as a nested dict with str keys whose leaves are tensors or
  JSON-plain values. A fresh codec built with the same arguments and given that state continues exactly
  as the original would. Stateless codecs return ``{}`` and refuse anything else.
- The write side, what the layers above ask of a codec's records before they exist, so that none of
  them needs to know which codec it holds: :meth:`Codec.cut` (the parts of a tensor whose records are
  the whole tensor's, for the sharded exchange), :meth:`Codec.bytes_per_element` (about what a record
  costs), :meth:`Codec.flat_vector_codec` (the codec for a model record's flat vector),
  :meth:`Codec.coefficient_domain` (a domain where a weighted mean of its records is re-encoded without
  decoding them), :meth:`Codec.own_records` (what it kept of records it wrote, for its readers) and
  :meth:`Codec.record_template` (a record's headers, for readers that know its tensor). The defaults suit
  any codec: whole tensors, dense float32's cost, itself, no coefficient domain, nothing kept, no
  template.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..frame import Entry, Frame, decode, decode_bundle, write_frame

__all__ = ["Codec", "TensorPart"]


@dataclass(frozen=True)
class TensorPart:
    """A part of a tensor, in ``shape``: elements ``start:stop`` of the flattened tensor, or, with
    ``columns``, columns ``start:stop`` of the tensor's matrix view ``(shape[0], numel / shape[0])``."""

    start: int
    stop: int
    shape: tuple[int, ...]
    columns: bool = False


class Codec:
    """Base class: subclasses set ``codec_id`` and ``name`` and implement :meth:`compress`."""

    codec_id: ClassVar[int]
    name: ClassVar[str]
    #: Whether the codec spends one budget over all the tensors of a bundle (global top-k), so that
    #: :meth:`compress_bundle` differs from compressing the tensors one by one. A codec may answer per
    #: instance (``TopK`` does, by its ``scope``).
    bundle_budget: bool = False

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        """The record for ``tensor`` and the dense tensor a receiver decodes from it.

        The reconstruction has ``tensor``'s shape, lives on ``tensor``'s device and equals
        ``decode_entry(entry)`` on that device.
        """
        raise NotImplementedError

    def compress_bundle(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[Entry, torch.Tensor]]:
        """``{name: (record, reconstruction)}`` for every named tensor, in the mapping's order.

        The default compresses them one by one; codecs with :attr:`bundle_budget` spread their budget
        over all of them.
        """
        return {n: self.compress(t, n) for n, t in tensors.items()}

    def compress_bundle_keep_rest(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Entry]:
        """``{name: record}`` for every named tensor, in the mapping's order, each tensor left holding
        what its record does not carry (``tensor − reconstruction``, in place): error feedback's send in
        one call, where a codec can form the rest without a decoded temporary (the DCT codec subtracts
        the kept coefficients in its transform domain). The tensors must be the caller's own float32
        buffers; a codec whose records may view their input (:meth:`records_copy_input` false) refuses
        them (``TypeError``), since writing the input would change the records' bytes. The default is
        :meth:`compress_bundle` and one in-place subtraction."""
        says = getattr(self, "records_copy_input", None)
        if not (callable(says) and says()):
            raise TypeError(
                f"{type(self).__name__}'s records may view their input: compress_bundle_keep_rest would "
                "change their bytes (use compress_bundle and subtract into new tensors)"
            )
        done = self.compress_bundle(tensors)
        bufs = list(tensors.values())
        recons = [done[n][1].to(device=t.device, dtype=t.dtype) for n, t in tensors.items()]
        if bufs:
            torch._foreach_sub_(bufs, recons)
        return {n: done[n][0] for n in tensors}

    def state_dict(self) -> dict[str, Any]:
        """What the codec keeps between calls, as a nested dict of tensors (copies) and plain values.

        ``{}`` for a stateless codec (the default).
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (what :meth:`state_dict` returned); ``ValueError`` on a bad state.

        The default, for stateless codecs, accepts only ``{}``.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"{type(self).__name__} state must be a dict, got {type(state).__name__}")
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {', '.join(map(repr, state))}")

    # -- the write side: what the layers above ask of the records before they exist ------------------

    def cut(self, shape: Sequence[int], max_numel: int) -> list[TensorPart]:
        """How a tensor of ``shape`` may be cut into parts of at most about ``max_numel`` elements whose
        records carry exactly what the whole tensor's record would for those elements (the sharded
        exchange gives the parts to different owners, :func:`gradwire.torch.sharded.cut_tensor`), in
        order; one part, the whole tensor, where it may not be cut. The default never cuts."""
        shape = tuple(int(d) for d in shape)
        return [TensorPart(0, math.prod(shape), shape)]

    def bytes_per_element(self) -> float:
        """About how many bytes a record spends per element of its tensor, its headers aside: what the
        sharded exchange weighs a cut's balance against its records' headers with
        (:func:`gradwire.torch.sharded.balanced_cut`). The default is dense float32's 4.0."""
        return 4.0

    def flat_vector_codec(self) -> Codec:
        """The codec for one flat vector of a whole model (a model record, :mod:`gradwire.model_record`):
        the default is this codec itself."""
        return self

    def coefficient_domain(self) -> Any:
        """A domain where a weighted mean of this codec's records is re-encoded without decoding them
        (:class:`gradwire.reencode.ReencodeFeedback`; the DCT codec's is
        :class:`gradwire.dct.CoefficientDomain`); ``None`` (the default) where the mean is taken in
        parameter space."""
        return None

    def own_records(self, entries, device=None) -> Any:
        """What this codec kept of those of ``entries`` it wrote itself (the very objects), in the form its
        readers take in place of parsing them again (the DCT codec's: a :class:`gradwire.dct.ParseCache`);
        ``None`` (the default) when it keeps nothing."""
        return None

    def record_template(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Any:
        """What this codec's record of a tensor ``name`` of ``shape`` and ``dtype`` will hold but its
        payloads, as a :class:`gradwire.frame.RecordTemplate`, for readers that know the tensor in advance
        (the sharded exchange's layout frames, docs/FORMAT.md section 12: a record that matches its template
        travels as its payloads' lengths, about 120 bytes less). ``None`` (the default): the records travel
        whole. A prediction only: a record that turns out otherwise (other params: the template's are
        ignored for it) still travels, in full or with its own params."""
        return None

    def encode(self, tensor: torch.Tensor, *, name: str = "", round: int = 0, sender: int = 0) -> bytes:
        """A tensor frame holding ``tensor`` compressed."""
        entry, _ = self.compress(tensor, name)
        return write_frame([entry], round=round, sender=sender)

    def encode_bundle(self, tensors: Mapping[str, torch.Tensor], *, round: int = 0, sender: int = 0) -> bytes:
        """A bundle frame holding every named tensor compressed (no error feedback)."""
        entries = [e for e, _ in self.compress_bundle(tensors).values()]
        return write_frame(entries, round=round, sender=sender, bundle=True)

    def decode(self, frame: bytes | Frame, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Decode a tensor frame (any codec's: the frame names its codec)."""
        return decode(frame, device=device)

    def decode_bundle(
        self, frame: bytes | Frame, *, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        return decode_bundle(frame, device=device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
