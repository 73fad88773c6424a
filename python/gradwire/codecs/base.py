"""The protocol every codec follows.

A codec turns a tensor into a frame record (:class:`~gradwire.frame.Entry`) and reports the dense
reconstruction a receiver will decode from it, so error feedback can carry the difference to the next
step without decoding twice. Decoding needs nothing but the bytes: each codec registers a decoder
under its id with :func:`gradwire.frame.register_decoder`.
"""

from __future__ import annotations

from typing import ClassVar, Mapping, Optional

import torch

from ..frame import Entry, Frame, decode, decode_bundle, write_frame

__all__ = ["Codec"]


class Codec:
    """Base class: subclasses set ``codec_id`` and ``name`` and implement :meth:`compress`."""

    codec_id: ClassVar[int]
    name: ClassVar[str]

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        """The record for ``tensor`` and the dense tensor a receiver decodes from it.

        The reconstruction has ``tensor``'s shape, lives on ``tensor``'s device and equals
        ``decode_entry(entry)`` on that device.
        """
        raise NotImplementedError

    def encode(self, tensor: torch.Tensor, *, name: str = "", round: int = 0, sender: int = 0) -> bytes:
        """A tensor frame holding ``tensor`` compressed."""
        entry, _ = self.compress(tensor, name)
        return write_frame([entry], round=round, sender=sender)

    def encode_bundle(
        self, tensors: Mapping[str, torch.Tensor], *, round: int = 0, sender: int = 0
    ) -> bytes:
        """A bundle frame holding every named tensor compressed (no error feedback)."""
        entries = [self.compress(t, n)[0] for n, t in tensors.items()]
        return write_frame(entries, round=round, sender=sender, bundle=True)

    def decode(self, frame: bytes | Frame, *, device: Optional[torch.device | str] = None) -> torch.Tensor:
        """Decode a tensor frame (any codec's: the frame names its codec)."""
        return decode(frame, device=device)

    def decode_bundle(
        self, frame: bytes | Frame, *, device: Optional[torch.device | str] = None
    ) -> dict[str, torch.Tensor]:
        return decode_bundle(frame, device=device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
