"""Moving variable-length frames between the ranks of a process group.

Collectives want tensors of one size on every rank (gloo refuses an uneven ``all_gather``), while frames
differ in length from rank to rank and step to step. :func:`all_gather_bytes` therefore first gathers
every rank's length, then pads each frame to the longest and gathers the padded ``uint8`` tensors;
:func:`exchange_bytes` does the same pairwise with point-to-point sends for a fixed set of peers.

Tensors travel on the device the backend needs: the GPU for NCCL, the host for gloo. Every announced
length is checked against :class:`gradwire.Limits` before the receive buffer is allocated, so a broken
or hostile peer cannot make a rank allocate more than a frame may hold.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..errors import FrameError
from ..frame import DEFAULT_LIMITS, Limits

__all__ = ["Exchanged", "all_gather_bytes", "comm_device", "exchange_bytes", "gather_rows"]

class Exchanged(list):
    """Frames received, one ``uint8`` numpy array per rank or peer, with what moving them cost.

    ``bytes_out`` counts the bytes this rank put into the collective (length words and padding
    included), the honest wire cost of the exchange; ``payload_bytes`` only its own frame.
    """

    bytes_out: int = 0
    payload_bytes: int = 0


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a group's collective tensors must live: the current CUDA device for NCCL, else the host."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_tensor(payload, device: torch.device) -> torch.Tensor:
    arr = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload.view(np.uint8)
    return torch.from_numpy(arr.reshape(-1).copy()).to(device)


def _check_length(n: int, who: str, limits: Limits) -> int:
    if n < 0 or n > limits.max_frame_bytes:
        raise FrameError(f"{who} announced a frame of {n} bytes, outside 0..{limits.max_frame_bytes} (limit)")
    return n


def all_gather_bytes(
    payload,
    group: Optional[dist.ProcessGroup] = None,
    *,
    device: Optional[torch.device] = None,
    limits: Optional[Limits] = None,
) -> Exchanged:
    """Every rank's ``payload`` (bytes of any length), in group-rank order, on every rank.

    Two collectives: an ``all_gather`` of the lengths (one int64 each), then one of the payloads
    padded with zeros to the longest. ``device`` defaults to :func:`comm_device`.
    """
    lim = limits or DEFAULT_LIMITS
    dev = device if device is not None else comm_device(group)
    world = dist.get_world_size(group)
    mine = _as_tensor(payload, dev)
    n = mine.numel()

    lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([n], dtype=torch.int64, device=dev), group=group)
    sizes = [_check_length(int(t.item()), f"rank {r}", lim) for r, t in enumerate(lengths)]
    longest = max(sizes)

    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[:n] = mine
    gathered = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)

    out = Exchanged(t[:size].cpu().numpy() for t, size in zip(gathered, sizes))
    out.bytes_out = 8 + longest
    out.payload_bytes = n
    return out


def exchange_bytes(
    payload,
    peers: Sequence[int],
    group: Optional[dist.ProcessGroup] = None,
    *,
    device: Optional[torch.device] = None,
    limits: Optional[Limits] = None,
) -> dict[int, np.ndarray]:
    """Send ``payload`` to every peer and receive one payload from each (group ranks).

    The peer relation must be symmetric (every peer of this rank lists this rank among its own),
    else the exchange waits forever. Lengths go first (one int64), then the frames, each phase as
    non-blocking sends and receives so no pair waits on the other's order.
    """
    lim = limits or DEFAULT_LIMITS
    dev = device if device is not None else comm_device(group)
    mine = _as_tensor(payload, dev)
    length = torch.tensor([mine.numel()], dtype=torch.int64, device=dev)

    incoming_len = {p: torch.zeros(1, dtype=torch.int64, device=dev) for p in peers}
    _wait_all(
        [dist.P2POp(dist.isend, length, group=group, group_peer=p) for p in peers]
        + [dist.P2POp(dist.irecv, incoming_len[p], group=group, group_peer=p) for p in peers]
    )
    incoming = {
        p: torch.empty(_check_length(int(t.item()), f"peer {p}", lim), dtype=torch.uint8, device=dev)
        for p, t in incoming_len.items()
    }
    _wait_all(
        [dist.P2POp(dist.isend, mine, group=group, group_peer=p) for p in peers]
        + [dist.P2POp(dist.irecv, incoming[p], group=group, group_peer=p) for p in peers]
    )
    return {p: t.cpu().numpy() for p, t in incoming.items()}


def _wait_all(ops: list) -> None:
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def gather_rows(row: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Stack one equal-shaped tensor from every rank into ``(world, *row.shape)`` (on ``row``'s device)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(parts, row, group=group)
    return torch.stack(parts)
