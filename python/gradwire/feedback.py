"""Error feedback: carry what a codec dropped into the next step.

:class:`ErrorFeedback` wraps any codec. For each named tensor it adds the stored residual to the input,
compresses the sum, and keeps ``input + residual - reconstruction`` — the reconstruction being exactly
what receivers decode — as the next residual. Over ``T`` steps the decoded updates therefore sum to the
inputs' sum minus the final residual: nothing is lost, only delayed.

Error feedback is the sender's business and never lives inside a codec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from .codecs import statedict as sd
from .codecs.base import Codec
from .frame import Entry, write_frame

__all__ = ["ErrorFeedback"]


def _owned(x: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``x`` (the input plus its residual) is a tensor of its own, not ``tensor``'s memory."""
    return x.numel() > 0 and x.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()


class ErrorFeedback:
    """Per-tensor residuals around ``codec``.

    Residuals are float32 and live on the device of the tensor they belong to. Records keep the
    tensor's own dtype: the codec works on the float32 sum and the record is tagged with the original
    dtype, so receivers decode to that dtype and the residual accounts for that rounding too.
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self._residuals: dict[str, torch.Tensor] = {}

    # -- compression -----------------------------------------------------------------------------

    def compress(self, tensor: torch.Tensor, name: str = "") -> Entry:
        """The record for ``tensor`` plus its stored residual; stores the new residual."""
        x = self._with_residual(tensor, name)
        entry, recon = self.codec.compress(x, name)
        return self._settle(tensor, name, x, entry, recon)[0]

    def compress_bundle(self, tensors: Mapping[str, torch.Tensor]) -> list[Entry]:
        """Records for every named tensor plus its residual; stores the new residuals.

        The codec gets all the corrected tensors at once (:meth:`Codec.compress_bundle`), so one whose
        budget spans the bundle (global top-k) spends it across them.
        """
        return [entry for entry, _ in self.compress_bundle_reconstructed(tensors).values()]

    def compress_bundle_reconstructed(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[Entry, torch.Tensor]]:
        """:meth:`compress_bundle`, also giving each record's reconstruction: ``{name: (record, what
        receivers decode from it)}`` in the mapping's order.

        The reconstruction is the codec's (``decode_entry(record)`` by :meth:`Codec.compress`'s contract),
        in the tensor's dtype, so a sender that applies its own update (the server's downlink) need not
        decode the frame it just wrote.
        """
        xs = self._with_residuals(tensors)
        done = self.codec.compress_bundle(xs)
        owned = [n for n in tensors if tensors[n].dtype == torch.float32 and _owned(xs[n], tensors[n])]
        if owned and self._records_copy():
            # x + residual is a new tensor no record views: every new residual x − recon in place, one
            # _foreach_sub_ (the same once-rounded subtractions, the same bits, no new tensors).
            recons = [done[n][1] for n in owned]
            if all(r.dtype == torch.float32 and r.device == xs[n].device for n, r in zip(owned, recons)):
                torch._foreach_sub_([xs[n] for n in owned], recons)
                for n in owned:
                    self._residuals[n] = xs[n]
                settled = set(owned)
                return {n: done[n] if n in settled else self._settle(tensors[n], n, xs[n], *done[n]) for n in tensors}
        return {n: self._settle(tensors[n], n, xs[n], *done[n]) for n in tensors}

    def _records_copy(self) -> bool:
        """Whether the codec's records and reconstructions never view its input (it says so: the DCT
        codec's are new host arrays and new tensors), so the input may become the residual in place."""
        says = getattr(self.codec, "records_copy_input", None)
        return bool(says()) if callable(says) else False

    def _with_residuals(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every ``tensor + residual`` (:meth:`_with_residual`), the sums as one ``_foreach_add`` (the same
        once-rounded additions, one dispatched operation however many tensors)."""
        xs = {n: self._with_residual(t, n, add=False) for n, t in tensors.items()}
        pairs = [
            (n, self._residuals[n].to(device=xs[n].device, dtype=torch.float32)) for n in xs if n in self._residuals
        ]
        if pairs:
            sums = torch._foreach_add([xs[n] for n, _ in pairs], [r for _, r in pairs])
            for (n, _), x in zip(pairs, sums):
                xs[n] = x
        return xs

    def _with_residual(self, tensor: torch.Tensor, name: str, add: bool = True) -> torch.Tensor:
        if not tensor.is_floating_point():
            raise ValueError(f"expected a floating-point tensor, got {tensor.dtype}")
        x = tensor.detach().to(torch.float32)
        r = self._residuals.get(name)
        if r is not None:
            if tuple(r.shape) != tuple(x.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(x.shape)} but its residual has {tuple(r.shape)};"
                    " call reset(name) if the tensor changed"
                )
            if add:
                x = x + r.to(device=x.device, dtype=torch.float32)
        return x

    def _settle(
        self, tensor: torch.Tensor, name: str, x: torch.Tensor, entry: Entry, recon: torch.Tensor
    ) -> tuple[Entry, torch.Tensor]:
        if tensor.dtype != torch.float32:
            # Receivers decode to the record's dtype: tag it with the original one and account for the
            # final rounding here (decoders compute in their own precision and cast at the end).
            entry = dataclasses.replace(entry, dtype=tensor.dtype)
            recon = recon.to(tensor.dtype)
        self._residuals[name] = x - recon.to(device=x.device, dtype=torch.float32)
        return entry, recon

    def encode(self, tensor: torch.Tensor, name: str = "", *, round: int = 0, sender: int = 0) -> bytes:
        """A tensor frame holding ``tensor`` (with its residual) compressed."""
        return write_frame([self.compress(tensor, name)], round=round, sender=sender)

    def encode_bundle(self, tensors: Mapping[str, torch.Tensor], *, round: int = 0, sender: int = 0) -> bytes:
        """One bundle frame holding every named tensor (with its residual) compressed."""
        return write_frame(self.compress_bundle(tensors), round=round, sender=sender, bundle=True)

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        """Add back what a frame carried when it never counted (refused, or its round closed without it).

        ``sent`` is that frame decoded (``{name: tensor}``); each residual grows by it, so the whole
        input of that step waits for the next one, as if nothing had been sent.
        """
        missing = sorted(set(sent) - set(self._residuals))
        if missing:
            raise KeyError(f"no residual to take back into for {missing[:5]}: those tensors were never compressed")
        for name, value in sent.items():
            r = self._residuals[name]
            self._residuals[name] = r + value.to(device=r.device, dtype=torch.float32)

    # -- state -----------------------------------------------------------------------------------

    def residual(self, name: str = "") -> torch.Tensor | None:
        """The residual stored for ``name`` (float32), or ``None`` before its first compression."""
        return self._residuals.get(name)

    def set_residual(self, name: str, residual: torch.Tensor) -> None:
        """Replace ``name``'s residual (kept as float32 on ``residual``'s device), e.g. after re-cutting tensors."""
        if not isinstance(residual, torch.Tensor) or not residual.is_floating_point():
            raise ValueError(f"residual {name!r} must be a floating-point tensor")
        self._residuals[name] = residual.detach().to(torch.float32).clone()

    def names(self) -> list[str]:
        """Names with a stored residual."""
        return list(self._residuals)

    def reset(self, name: str | None = None) -> None:
        """Forget every residual, or only ``name``'s."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        """``{"residuals": {name: residual}, "codec": codec.state_dict()}``: float32 residuals (copies) and
        the wrapped codec's own state. A fresh ``ErrorFeedback`` around a codec built with the same
        arguments, given this state, continues exactly as this one would."""
        return {
            "residuals": {n: r.detach().clone().contiguous() for n, r in self._residuals.items()},
            "codec": self.codec.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: what :meth:`state_dict` returned, or (the older format) a flat
        ``{name: residual}`` dict, which replaces the residuals and leaves the codec's state alone.
        Residuals are converted to float32, their devices kept as given. ``ValueError`` on a bad state."""
        state = sd.mapping(state, "ErrorFeedback state")
        nested = isinstance(state.get("residuals"), Mapping)
        if nested:
            state = sd.fields(state, "ErrorFeedback state", ("residuals", "codec"))
        residuals = sd.mapping(state["residuals"], "ErrorFeedback state 'residuals'") if nested else state
        new = {}
        for n, r in residuals.items():
            r = sd.tensor(r, f"residual {n!r}", floating=True)
            new[n] = r.detach().to(torch.float32).clone()
        if nested:
            self.codec.load_state_dict(state["codec"])
        self._residuals = new

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r}, residuals={len(self._residuals)})"
