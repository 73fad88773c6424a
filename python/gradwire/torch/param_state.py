"""Parameters by position, and an optimizer's state by parameter: the names and forms the torch transport
(:class:`gradwire.torch.AlgorithmOptimizer`) and the resharding of its checkpoints share.

A parameter is named by its position in the param groups, ``"g<group>.p<index>"`` (``"g0.p3"``: the
fourth parameter of the first group), so frames and checkpoints are the same whatever the modules are
called. torch's ``state_dict()["state"]`` packs per-parameter state by index (parameters counted in
group order); these helpers turn one form into the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "INNER",
    "by_position",
    "counter_of",
    "from_saved_indices",
    "module_paths",
    "nonzero",
    "packed_index",
    "positions",
    "torch_form",
    "trainable",
]

#: Per-parameter state keys of an inner optimizer (SparseLoCo's) carry this prefix.
INNER = "inner."


def trainable(param_groups) -> list[tuple[str, torch.Tensor, dict]]:
    """``(name, parameter, group)`` for every parameter that requires a gradient, by position."""
    out = []
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            if p.requires_grad:
                out.append((f"g{gi}.p{pi}", p, group))
    return out


def positions(param_groups) -> dict[str, torch.Tensor]:
    """``{"g<group>.p<index>": parameter}`` for every parameter, trainable or frozen."""
    return {f"g{gi}.p{pi}": p for gi, group in enumerate(param_groups) for pi, p in enumerate(group["params"])}


def module_paths(*groups_lists: Iterable[Mapping[str, Any]]) -> dict[int, str]:
    """``{id(parameter): module path}`` from the ``param_names`` torch keeps in a group built from
    ``named_parameters()``."""
    out: dict[int, str] = {}
    for param_groups in groups_lists:
        for group in param_groups:
            for p, name in zip(group["params"], group.get("param_names", ())):
                out.setdefault(id(p), name)
    return out


def packed_index(param_groups) -> dict[str, int]:
    """Each position's index in torch's packed ``state_dict()["state"]``."""
    out, i = {}, 0
    for gi, group in enumerate(param_groups):
        for pi, _ in enumerate(group["params"]):
            out[f"g{gi}.p{pi}"] = i
            i += 1
    return out


def by_position(packed: Mapping, param_groups) -> dict[str, dict]:
    """torch's packed ``"state"`` (by index) as ``{position: state}``."""
    name_of = {i: n for n, i in packed_index(param_groups).items()}
    return {name_of[int(i)]: dict(fields) for i, fields in packed.items()}


def from_saved_indices(packed: Mapping, saved_groups) -> dict[str, dict]:
    """The ``"state"`` of a saved state dict by position, its parameter ids read from its own
    ``param_groups`` (as torch's ``load_state_dict`` maps them)."""
    name_of = {pid: f"g{gi}.p{pi}" for gi, g in enumerate(saved_groups) for pi, pid in enumerate(g["params"])}
    out = {}
    for pid, fields in packed.items():
        if pid not in name_of:
            raise ValueError(f"the checkpoint's state names parameter id {pid!r}, which none of its param groups holds")
        out[name_of[pid]] = dict(fields)
    return out


def nonzero(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint, or none if every one is all zeros: a state dict holds zeros where no
    buffer exists yet (``torch.distributed.checkpoint`` loads only the keys of the state dict it loads
    into), and a zero buffer and none step alike."""
    return dict(tensors) if any(bool(t.any()) for t in tensors.values()) else {}


def counter_of(per_param: Mapping[str, Mapping[str, Any]], key: str) -> int | None:
    """A counter kept per parameter (the same in each), ``None`` if none is kept."""
    values = {int(fields[key]) for fields in per_param.values() if key in fields}
    if len(values) > 1:
        raise ValueError(f"the checkpoint's parameters disagree on {key!r}: {sorted(values)[:4]}")
    return values.pop() if values else None


def torch_form(state: Mapping[str, Any]) -> bool:
    """Whether an optimizer's state dict is torch's own form (``"state"`` by packed index and
    ``"param_groups"``), which the transport spreads over its parameters; another form (``MuonAdamW``'s)
    is kept whole."""
    return set(state) == {"state", "param_groups"}
