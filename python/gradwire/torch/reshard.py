"""Resuming a full optimizer state (``full_state_dict``) in a group of another size.

A share of the state is either **the same on every rank** (the step counters, SparseLoCo's anchor and
outer state: kept as rank 0 saved them) or **each rank's own**:

- the per-parameter buffers (the node side's: DeMo's momenta, SparseLoCo's error buffers) and an inner
  optimizer's state (AdamW's moments): what each rank has not sent yet, or its local statistics. The new
  group's ranks each take **their mean over the old ranks**: the exchange averages the ranks, so the mean
  of what is left to send is what the old group would still have delivered, and every new rank starts
  alike;
- the sharded exchange's owner error feedback: what the owners' re-encoded means left out, one piece per
  owner. Together the old owners hold **one residual of the whole model**; it is joined and cut again
  into the new group's pieces, each new owner taking its own, so nothing of it is lost or counted twice.

The byte counters start at 0. Refused with a ``ValueError`` naming the reason: FSDP-sharded parameters
(their shards follow the mesh), a codec that keeps state of its own (its state follows the tensors it
saw), a checkpoint of the other exchange, and pieces cut otherwise than this optimizer would cut them
for the old group (another ``piece_numel`` or codec).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import dct as _dct
from .sharded import Pieces

__all__ = ["reshard_share"]


def reshard_share(
    parts: Sequence[Mapping[str, Any]],
    *,
    kind: str,
    world: int,
    rank: int,
    old_pieces: Pieces | None,
    new_pieces: Pieces | None,
    owned: Sequence[str],
    downlink=None,
    own: Callable[[str, Any], bool],
) -> dict:
    """Rank ``rank``'s share in a group of ``world`` from the ``parts`` a group of ``len(parts)`` saved
    (see the module docstring). ``kind``: this optimizer's exchange; ``old_pieces`` / ``new_pieces``: the
    sharded exchange's pieces for the old and the new group (``None`` all-gathered); ``owned``: the
    names of the new pieces this rank owns; ``downlink``: the owners' codec (sharded); ``own(key,
    value)``: whether a per-parameter entry is each rank's own (the optimizer's layout says: its node
    side's buffers, its inner optimizer's floating-point state), which is averaged."""
    saved_kind = parts[0].get("exchange", "all_gather")
    if saved_kind != kind:
        raise ValueError(
            f"this checkpoint was saved with exchange={saved_kind!r}; this optimizer uses "
            f"exchange={kind!r} (build it with exchange={saved_kind!r} to resume it)"
        )
    if any(p.get("shards") for p in parts):
        raise ValueError(
            f"this full checkpoint holds the state of {len(parts)} ranks of FSDP-sharded parameters, "
            f"this group has {world}: sharded parameters resume in a group of the same size"
        )
    if any("params" not in p for p in parts):
        raise ValueError(
            f"this full checkpoint holds the state of {len(parts)} ranks, this group has {world}, and "
            "it predates per-parameter state: resume it in a group of the same size, then save it again"
        )
    if old_pieces is not None:
        names = [p.name for p in old_pieces.pieces]
        for r, part in enumerate(parts):
            if list(part.get("pieces", names)) != names:
                raise ValueError(
                    f"rank {r}'s pieces in this checkpoint are cut otherwise than this optimizer cuts "
                    f"them for {len(parts)} ranks: build it with the piece_numel and codec it was saved with"
                )
    _stateless([p["node"].get("codec") for p in parts], "uplink codec")
    share = dict(parts[0])
    share["params"] = _mean_params([p["params"] for p in parts], own)
    share.update(world=world, rank=rank, bytes_sent=0, bytes_received=0)
    if new_pieces is not None:
        share["pieces"] = [p.name for p in new_pieces.pieces]
        share["owner"] = _owner_feedback([p["owner"] for p in parts], old_pieces, new_pieces, owned, downlink)
    return share


def _stateless(states: Sequence[Any], what: str) -> None:
    if any(states):
        raise ValueError(
            f"the {what} keeps state of its own, which follows the tensors it compressed: a "
            "checkpoint of it resumes in a group of the same size only"
        )


def _mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The float32 mean in rank order (one fixed sequence of operations: every new rank gets the same bits)."""
    acc = tensors[0].detach().to(torch.float32).clone()
    for t in tensors[1:]:
        acc.add_(t.detach().to(acc.device, torch.float32))
    return acc.div_(len(tensors))


def _mean_params(ranks: Sequence[Mapping[str, Mapping[str, Any]]], own: Callable[[str, Any], bool]) -> dict:
    """Each parameter's state: each rank's own averaged over the ranks that hold it, the rest rank 0's."""
    out: dict[str, dict] = {}
    for n in ranks[0]:
        fields = dict(ranks[0][n])
        for k, v in ranks[0][n].items():
            if own(k, v):
                held = [r[n][k] for r in ranks if n in r and k in r[n]]
                fields[k] = _mean(held).to(v.dtype)
        out[n] = fields
    return out


def _cut(tensors: Mapping[str, torch.Tensor], pieces: Pieces) -> dict[str, torch.Tensor]:
    return {n: t.clone().contiguous() for n, t in pieces.cut(tensors).items()}


def _owner_feedback(
    owners: Sequence[Mapping[str, Any]], old: Pieces, new: Pieces, owned: Sequence[str], downlink
) -> dict:
    """The old owners' residuals joined into one per tensor (a piece nobody holds yet is zeros; one held in
    the DCT coefficient domain is taken back to parameter space by its inverse transform), cut into the new
    pieces, the ones this rank owns kept: an ``ErrorFeedback`` state, parameter-domain."""
    _stateless([o.get("codec") for o in owners], "downlink codec")
    residuals: dict[str, torch.Tensor] = {}
    for o in owners:
        residuals.update(o.get("residuals", {}))
        for name, held in o.get("coefficients", {}).items():
            plan = downlink.plan(tuple(int(d) for d in held["shape"]))
            chunks = held["chunks"].to(torch.float32).reshape(plan.num_chunks, *plan.chunk_shape)
            residuals[name] = _dct.from_chunks(_dct.idct_chunks(chunks), plan)
    if not residuals:
        return {"residuals": {}, "codec": owners[0].get("codec", {})}
    device = next(iter(residuals.values())).device
    parts = {
        p.name: residuals.get(p.name, torch.zeros(p.shape, dtype=torch.float32, device=device)) for p in old.pieces
    }
    whole = old.join({n: t.reshape(p.shape) for (n, t), p in zip(parts.items(), old.pieces)})
    cut = _cut(whole, new)
    return {"residuals": {n: cut[n] for n in owned}, "codec": owners[0].get("codec", {})}
