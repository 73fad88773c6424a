"""What the node sides share: sending buffers with the rest kept, taking back what never counted, and
their ``state_dict`` / ``load_state_dict`` helpers."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from ..codecs import statedict as sd
from ..codecs.base import Codec
from ..frame import Entry


def save_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies, in sorted name order."""
    return {n: tensors[n].detach().clone().contiguous() for n in sorted(tensors)}


def load_tensors(value: Any, what: str, copy: bool = True) -> dict[str, torch.Tensor]:
    """Float32 copies of ``{name: tensor}`` (devices kept as given); ``ValueError`` on a bad state. With
    ``copy=False`` a float32 tensor is taken as it is (the caller hands it over)."""
    value = sd.mapping(value, what)
    out = {}
    for n, t in value.items():
        t = sd.tensor(t, f"{what} {n!r}", floating=True)
        if copy or t.dtype != torch.float32:
            out[n] = t.detach().to(torch.float32).clone()
        else:  # the tensor itself (not a detached alias), so that a caller holding it holds the live state
            out[n] = t.detach() if t.requires_grad else t
    return out


def updates_in_place(codec: Codec) -> bool:
    """Whether a node side may update its buffers in place around ``codec``: its records and
    reconstructions never view the buffers' memory. The DCT codec's records are built from new host
    arrays and its reconstructions are new tensors; another codec's record may view its input (a raw
    float32 section), and writing the buffer would then change the record's bytes."""
    says = getattr(codec, "records_copy_input", None)
    return bool(says()) if callable(says) else False


def send_and_keep_rest(
    codec: Codec, buffers: MutableMapping[str, torch.Tensor], names: Sequence[str], in_place: bool = False
) -> list[Entry]:
    """The codec compresses ``buffers[name]`` for every name (one ``compress_bundle``, in the order given);
    each buffer keeps what was not sent (``b − reconstruction``). Returns the records in that order.

    ``in_place`` (the buffers are the caller's own and :func:`updates_in_place` holds for ``codec``):
    the codec's :meth:`~gradwire.codecs.base.Codec.compress_bundle_keep_rest` leaves the rest in the
    buffers themselves: the same bits as ``b − reconstruction``, with no new model-sized tensors (the DCT
    codec decodes straight into the buffers)."""
    if in_place and names and all(buffers[n].dtype == torch.float32 for n in names):
        kept = codec.compress_bundle_keep_rest({n: buffers[n] for n in names})
        return [kept[n] for n in names]
    done = codec.compress_bundle({n: buffers[n] for n in names})
    out = [done[n][0] for n in names]
    for n in names:
        recon = done[n][1]
        buffers[n] = torch.sub(buffers[n], recon.to(device=buffers[n].device, dtype=torch.float32))
    return out


def take_back(buffers: MutableMapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]) -> None:
    """Add back what a frame carried when it never counted: each buffer is as if nothing had been sent."""
    missing = sorted(set(sent) - set(buffers))
    if missing:
        raise KeyError(f"no buffer to take back into for {missing[:5]}: those tensors were never sent")
    for n, t in sent.items():
        buffers[n] = torch.add(buffers[n], t.to(device=buffers[n].device, dtype=torch.float32))
