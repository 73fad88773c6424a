"""Resuming a full optimizer state (``full_state_dict``) in a group of another size.

A share of the state is either **the same on every rank** (the step counters, SparseLoCo's anchor and
outer state: kept as rank 0 saved them) or **each rank's own**:

- the node's buffers (DeMo's momenta, SparseLoCo's error buffers) and SparseLoCo's inner optimizer state
  (AdamW's moments): what each rank has not sent yet, or its local statistics. The new group's ranks each
  take **their mean over the old ranks**: the exchange averages the ranks, so the mean of what is left
  to send is what the old group would still have delivered, and every new rank starts alike;
- the sharded exchange's owner error feedback: what the owners' re-encoded means left out, one piece per
  owner. Together the old owners hold **one residual of the whole model**; it is joined and cut again
  into the new group's pieces, each new owner taking its own, so nothing of it is lost or counted twice.

The byte counters start at 0. Refused with a ``ValueError`` naming the reason: FSDP-sharded parameters
(their shards follow the mesh), a codec that keeps state of its own (its state follows the tensors it
saw), a checkpoint of the other exchange, and pieces cut otherwise than this optimizer would cut them
for the old group (another ``piece_numel`` or codec).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from .sharded import Pieces

__all__ = ["reshard_share"]

# Keys of a share that hold each rank's own state; every other key is the same on every rank.
_NODE, _INNER, _OWNER = "node", "inner", "owner"


def reshard_share(parts: Sequence[Mapping[str, Any]], *, kind: str, world: int, rank: int,
                  old_pieces: Optional[Pieces], new_pieces: Optional[Pieces], owned: Sequence[str]) -> dict:
    """Rank ``rank``'s share in a group of ``world`` from the ``parts`` a group of ``len(parts)`` saved
    (see the module docstring). ``kind``: this optimizer's exchange; ``old_pieces`` / ``new_pieces``: the
    sharded exchange's pieces for the old and the new group (``None`` all-gathered); ``owned``: the
    names of the new pieces this rank owns."""
    saved_kind = parts[0].get("exchange", "all_gather")
    if saved_kind != kind:
        raise ValueError(f"this checkpoint was saved with exchange={saved_kind!r}; this optimizer uses "
                         f"exchange={kind!r} (build it with exchange={saved_kind!r} to resume it)")
    if any(p.get("shards") for p in parts):
        raise ValueError(f"this full checkpoint holds the state of {len(parts)} ranks of FSDP-sharded parameters, "
                         f"this group has {world}: sharded parameters resume in a group of the same size")
    if old_pieces is not None:
        names = [p.name for p in old_pieces.pieces]
        for r, part in enumerate(parts):
            if list(part.get("pieces", names)) != names:
                raise ValueError(f"rank {r}'s pieces in this checkpoint are cut otherwise than this optimizer cuts "
                                 f"them for {len(parts)} ranks: build it with the piece_numel and codec it was saved with")
    share = dict(parts[0])
    share[_NODE] = _mean_node([p[_NODE] for p in parts], old_pieces, new_pieces)
    if _INNER in share:
        share[_INNER] = _mean_inner([p[_INNER] for p in parts])
    share.update(world=world, rank=rank, bytes_sent=0, bytes_received=0)
    if new_pieces is not None:
        share["pieces"] = [p.name for p in new_pieces.pieces]
        share[_OWNER] = _owner_feedback([p[_OWNER] for p in parts], old_pieces, new_pieces, owned)
    return share


def _stateless(states: Sequence[Any], what: str) -> None:
    if any(states):
        raise ValueError(f"the {what} keeps state of its own, which follows the tensors it compressed: a "
                         "checkpoint of it resumes in a group of the same size only")


def _mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The float32 mean in rank order (one fixed sequence of operations: every new rank gets the same bits)."""
    acc = tensors[0].detach().to(torch.float32).clone()
    for t in tensors[1:]:
        acc.add_(t.detach().to(acc.device, torch.float32))
    return acc.div_(len(tensors))


def _per_tensor(buffers: Mapping[str, torch.Tensor], pieces: Optional[Pieces]) -> dict[str, torch.Tensor]:
    """One rank's buffers by tensor (its pieces joined)."""
    if pieces is None or not buffers:
        return dict(buffers)
    return pieces.join(buffers)


def _cut(tensors: Mapping[str, torch.Tensor], pieces: Optional[Pieces]) -> dict[str, torch.Tensor]:
    if pieces is None:
        return {n: t.contiguous() for n, t in tensors.items()}
    return {n: t.clone().contiguous() for n, t in pieces.cut(tensors).items()}


def _mean_node(nodes: Sequence[Mapping[str, Any]], old: Optional[Pieces], new: Optional[Pieces]) -> dict:
    out: dict[str, Any] = {}
    for key, value in nodes[0].items():
        if key == "codec":
            _stateless([n["codec"] for n in nodes], "uplink codec")
            out[key] = value
            continue
        joined = [_per_tensor(n[key], old) for n in nodes]
        names = list(joined[0])
        if any(list(j) != names for j in joined):
            raise ValueError(f"the ranks of this checkpoint hold {key} of different tensors: it cannot be averaged")
        out[key] = _cut({n: _mean([j[n] for j in joined]) for n in names}, new)
    return out


def _mean_inner(states: Sequence[Mapping[str, Any]]) -> dict:
    """SparseLoCo's inner optimizer: each parameter's floating-point state averaged, the rest (its step
    count, the param groups) rank 0's."""
    out = dict(states[0])
    per_param = {}
    for idx, fields in states[0]["state"].items():
        merged = dict(fields)
        for k, v in fields.items():
            if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                merged[k] = _mean([s["state"][idx][k] for s in states]).to(v.dtype)
        per_param[idx] = merged
    out["state"] = per_param
    return out


def _owner_feedback(owners: Sequence[Mapping[str, Any]], old: Pieces, new: Pieces, owned: Sequence[str]) -> dict:
    """The old owners' residuals joined into one per tensor (a piece nobody holds yet is zeros), cut into
    the new pieces, the ones this rank owns kept."""
    _stateless([o.get("codec") for o in owners], "downlink codec")
    residuals: dict[str, torch.Tensor] = {}
    for o in owners:
        residuals.update(o.get("residuals", {}))
    if not residuals:
        return {"residuals": {}, "codec": owners[0].get("codec", {})}
    device = next(iter(residuals.values())).device
    parts = {p.name: residuals.get(p.name, torch.zeros(p.shape, dtype=torch.float32, device=device))
             for p in old.pieces}
    whole = old.join({n: t.reshape(p.shape) for (n, t), p in zip(parts.items(), old.pieces)})
    cut = _cut(whole, new)
    return {"residuals": {n: cut[n] for n in owned}, "codec": owners[0].get("codec", {})}
