"""Sharded parameters (FSDP2 and HSDP ``DTensor`` s) in :class:`~gradwire.torch.DeMo` and
:class:`~gradwire.torch.SparseLoCo`: each rank works on the shard it holds.

With ``fully_shard`` a parameter is a ``DTensor``: every rank of the FSDP group holds one shard of it,
and its gradient after ``backward()`` is that shard of the group's mean gradient. The optimizers encode,
exchange and update the *local* tensors (:func:`local_tensor`, :func:`local_grad`): in-place updates of
a local tensor are updates of the parameter's shard, which FSDP all-gathers at the next forward. The
exchange then runs among the ranks given as ``process_group``, which must hold the same shard: the
replicas of that shard, one per FSDP group (HSDP: FSDP inside a group, gradwire across groups).

:class:`ShardLayout` checks that once, when the optimizer is built:

- without communication, that no rank of ``process_group`` (other than this one) is also in one of the
  parameter's own mesh dimensions: a rank of the shard dimension holds another shard, and a rank of a
  replicate dimension already gets FSDP's dense gradient all-reduce (native HSDP, ``fully_shard`` over a
  2-D mesh), which gradwire would only add to;
- with one small all-gather over ``process_group``, that every rank holds the same shards (the same
  global shapes, placements, mesh sizes and coordinates along the sharded mesh dimensions).

It also names the layout in the optimizers' checkpoints, so a rank's checkpoint is refused by a rank
that holds other shards.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .collectives import comm_device, gather_rows

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch 2.1 to 2.4
    try:
        from torch.distributed._tensor import DTensor, Replicate, Shard
    except ImportError:  # a torch build without distributed
        DTensor = Replicate = Shard = None

__all__ = ["LocalTensors", "ShardLayout", "is_dtensor", "like_parameter", "local_grad", "local_tensor"]

#: The fix for the usual mistakes, quoted by the errors below.
_HOW = (
    "FSDP inside a replica group, gradwire across them: build the mesh as "
    "init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard')), shard with "
    "fully_shard(module, mesh=mesh['shard']) and pass process_group=mesh.get_group('replicate')"
)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed`` ``DTensor`` (an FSDP2 parameter or gradient)."""
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``t``: its local shard for a ``DTensor``, ``t`` itself otherwise.

    The shard shares ``t``'s storage, so in-place operations on it update the parameter.
    """
    if not is_dtensor(t):
        return t
    with torch.no_grad():  # outside autograd to_local() hands back the local tensor itself, not a copy
        return t.to_local()


def like_parameter(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t``, this rank's state of parameter ``p`` (its local shape), as ``p`` is: a ``DTensor`` on ``p``'s
    mesh with ``p``'s placements if ``p`` is one (so ``torch.distributed.checkpoint`` saves each shard's
    state with its shard and reshards it as it reshards ``p``), else ``t`` itself."""
    if not is_dtensor(p):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class LocalTensors(MutableMapping):
    """``{name: parameter}`` read as ``{name: local_tensor(parameter)}``: the tensors a node side steps in
    place (a ``DTensor``'s local shard, looked up at each access, so that it is always the shard the
    parameter holds now)."""

    def __init__(self, params: Mapping[str, torch.Tensor]):
        self._params = dict(params)

    def __getitem__(self, name: str) -> torch.Tensor:
        return local_tensor(self._params[name])

    def __contains__(self, name: object) -> bool:
        return name in self._params

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._params[name] = value

    def __delitem__(self, name: str) -> None:
        del self._params[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient as :func:`local_tensor` sees ``p`` (zeros of the local shape where there is none)."""
    if p.grad is None:
        return torch.zeros_like(local_tensor(p))
    return local_tensor(p.grad)


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (the default group's for ``None``)."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _placement_kind(placement) -> str:
    if isinstance(placement, Shard):
        return "shard"
    if isinstance(placement, Replicate):
        return "replicate"
    return "other"


class ShardLayout:
    """The shards this rank holds of named parameters, checked against the exchange's group.

    ``named``: ``(name, parameter)`` pairs, in the optimizer's order; ``process_group``: the group the
    optimizer exchanges over. Raises ``ValueError`` when the group mixes ranks that hold other shards,
    or ranks FSDP already all-reduces with (see the module docstring).
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], process_group: dist.ProcessGroup | None):
        self.sharded = [(n, p) for n, p in named if is_dtensor(p)]
        self.description = [self._describe(n, p) for n, p in self.sharded]
        if not self.sharded:
            return
        group = set(_ranks(process_group))
        me = dist.get_rank()
        label = "process_group" if process_group is not None else "the default group (no process_group was given)"
        for n, p in self.sharded:
            self._check_mesh(n, p, group, me, label)
        self._check_replicas(process_group)

    @staticmethod
    def _describe(name: str, p) -> list:
        """What a replica of this shard has alike: the global shape, the placements, the mesh's sizes and
        this rank's coordinate along every sharded mesh dimension (replicated ones may differ)."""
        mesh = p.device_mesh
        coordinate = mesh.get_coordinate() or []
        at = [int(c) if isinstance(pl, Shard) else None for pl, c in zip(p.placements, coordinate)]
        return [name, list(p.shape), [str(pl) for pl in p.placements], list(mesh.mesh.shape), at]

    @staticmethod
    def _check_mesh(name: str, p, group: set[int], me: int, label: str) -> None:
        mesh = p.device_mesh
        for dim, placement in enumerate(p.placements):
            if mesh.size(dim) == 1:
                continue
            along = set(_ranks(mesh.get_group(dim))) & group - {me}
            if not along:
                continue
            kind = _placement_kind(placement)
            dim_name = (mesh.mesh_dim_names or [None] * mesh.ndim)[dim] or f"dimension {dim}"
            if kind == "replicate":
                raise ValueError(
                    f"parameter {name} is replicated by FSDP over mesh {dim_name!r} (native HSDP), so FSDP "
                    f"all-reduces its dense gradient with ranks {sorted(along)}, which are also in "
                    f"{label}: gradwire would only add to that traffic. {_HOW}"
                )
            raise ValueError(
                f"parameter {name} is {placement} over mesh {dim_name!r}, so ranks {sorted(along)} of "
                f"{label} hold other parts of it: the exchange's group must join only replicas of the "
                f"same shard. {_HOW}"
            )

    def _check_replicas(self, process_group: dist.ProcessGroup | None) -> None:
        if dist.get_world_size(process_group) == 1:
            return
        mine = torch.tensor(list(bytes.fromhex(self.digest())), dtype=torch.uint8, device=comm_device(process_group))
        rows = gather_rows(mine, process_group).cpu()
        differ = [r for r in range(rows.shape[0]) if not torch.equal(rows[r], rows[0])]
        if differ:
            raise ValueError(
                f"ranks {differ} of process_group hold other shards of the parameters than its rank 0 (other "
                f"global shapes, placements, mesh sizes or positions along a sharded mesh dimension): the "
                f"group must join the replicas of one shard. {_HOW}"
            )

    def digest(self) -> str:
        """The BLAKE2b-128 hex digest of :attr:`description` (the same on every replica of the shards)."""
        return hashlib.blake2b(json.dumps(self.description).encode(), digest_size=16).hexdigest()

    def state_dict(self) -> dict[str, list]:
        """What a checkpoint records of the shards: ``{"shards": description}``, or nothing without
        ``DTensor`` s (an unsharded optimizer's checkpoint is unchanged)."""
        return {"shards": self.description} if self.description else {}

    def check_state(self, saved: list | None) -> None:
        """``ValueError`` if a checkpoint recorded other shards than this rank holds (``None``: a checkpoint
        from before shards were recorded, taken as unsharded)."""
        saved = [list(d) for d in (saved or [])]
        if json.loads(json.dumps(saved)) == json.loads(json.dumps(self.description)):
            return
        if not saved:
            raise ValueError(
                "this checkpoint is of unsharded parameters; this optimizer's are FSDP shards "
                f"({len(self.description)} DTensors): resume it on parameters sharded alike"
            )
        if not self.description:
            raise ValueError(
                "this checkpoint is of FSDP-sharded parameters; this optimizer's are not sharded: "
                "resume it on parameters sharded alike"
            )
        ours = {d[0]: d for d in self.description}
        diff = next((d for d in saved if ours.get(d[0]) != d), saved[0])
        raise ValueError(
            f"this checkpoint holds the state of other shards than this rank holds (first: {diff[0]} saved as "
            f"shape {diff[1]}, placements {diff[2]}, mesh {diff[3]} at {diff[4]}; here "
            f"{ours[diff[0]][1:] if diff[0] in ours else 'no such sharded parameter'}): each rank resumes "
            "from the checkpoint of a rank at its mesh position"
        )
