"""What the node sides share: sending buffers with the rest kept, taking back what never counted, and
their ``state_dict`` / ``load_state_dict`` helpers."""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Sequence

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
        t = sd.tensor(t, f"{what} {n!r}", floating=True).detach()
        out[n] = t.to(torch.float32).clone() if copy or t.dtype != torch.float32 else t
    return out


def send_and_keep_rest(codec: Codec, buffers: MutableMapping[str, torch.Tensor], names: Sequence[str]) -> list[Entry]:
    """The codec compresses ``buffers[name]`` for every name (one ``compress_bundle``, in the order given);
    each buffer keeps what was not sent (``b − reconstruction``). Returns the records in that order."""
    done = codec.compress_bundle({n: buffers[n] for n in names})
    out = []
    for n in names:
        entry, recon = done[n]
        buffers[n] = torch.sub(buffers[n], recon.to(device=buffers[n].device, dtype=torch.float32))
        out.append(entry)
    return out


def take_back(buffers: MutableMapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]) -> None:
    """Add back what a frame carried when it never counted: each buffer is as if nothing had been sent."""
    missing = sorted(set(sent) - set(buffers))
    if missing:
        raise KeyError(f"no buffer to take back into for {missing[:5]}: those tensors were never sent")
    for n, t in sent.items():
        buffers[n] = torch.add(buffers[n], t.to(device=buffers[n].device, dtype=torch.float32))
