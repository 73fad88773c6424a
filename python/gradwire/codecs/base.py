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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ..frame import Entry, Frame, decode, decode_bundle, write_frame

__all__ = ["Codec"]


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
