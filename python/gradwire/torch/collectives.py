"""Moving variable-length frames between the ranks of a process group.

Collectives want tensors of one size on every rank (gloo refuses an uneven ``all_gather``), while frames
differ in length from rank to rank and step to step. :func:`all_gather_bytes` therefore first gathers
every rank's length, then pads each frame to the longest and gathers the padded ``uint8`` tensors;
:func:`exchange_bytes` does the same pairwise with point-to-point sends for a fixed set of peers.
:func:`all_to_all_bytes` sends each rank its own payload (a different one per destination): every
rank's row of lengths is all-gathered, then the payloads travel unpadded in one ``all_to_all_single``
(or, on a backend without it, as batched point-to-point sends).

:class:`BytesGather` is the same all-gather in two halves, for callers that overlap it with other work
(the DDP hook): constructing it launches the length all-gather without waiting; :meth:`BytesGather.launch`
waits for the lengths and launches the padded all-gather, returning its future; once that future is
done, :meth:`BytesGather.received` slices the frames out. Both collectives are launched from the
caller's thread, never from a future's callback: gloo pairs collectives across ranks by the order in
which each rank launches them, and a callback runs on whichever gloo worker thread completed the
future, so collectives launched from callbacks can interleave differently on different ranks.

Tensors travel on the device the backend needs: the GPU for NCCL, the host for gloo. Every announced
length is checked against :class:`gradwire.Limits` before the receive buffer is allocated, so a broken
or hostile peer cannot make a rank allocate more than a frame may hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..errors import FrameError
from ..frame import DEFAULT_LIMITS, Limits

__all__ = [
    "BytesGather",
    "Exchanged",
    "GroupMember",
    "all_gather_bytes",
    "all_to_all_bytes",
    "comm_device",
    "exchange_bytes",
    "gather_rows",
]


class Exchanged(list):
    """Frames received, one ``uint8`` numpy array per rank or peer, with what moving them cost.

    ``bytes_out`` counts the bytes this rank put into the collective (length words and padding
    included), the honest wire cost of the exchange; ``payload_bytes`` only its own frame.
    """

    bytes_out: int = 0
    payload_bytes: int = 0


class GroupMember:
    """What an exchange knows of its process group: this rank and the world size, and a group of one
    when torch.distributed is not initialized and no group was given (single-process code runs as rank 0
    of one)."""

    process_group: dist.ProcessGroup | None

    def _distributed(self) -> bool:
        return self.process_group is not None or (dist.is_available() and dist.is_initialized())

    def rank(self) -> int:
        return dist.get_rank(self.process_group) if self._distributed() else 0

    def world(self) -> int:
        return group_world_size(self.process_group)


def group_world_size(process_group: dist.ProcessGroup | None) -> int:
    """The size of ``process_group`` (the default group when ``None``), or 1 without torch.distributed."""
    distributed = process_group is not None or (dist.is_available() and dist.is_initialized())
    return dist.get_world_size(process_group) if distributed else 1


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
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


class BytesGather:
    """One :func:`all_gather_bytes` in flight: the lengths launched at construction, the frames by :meth:`launch`.

    Call :meth:`launch` exactly once, from the thread that constructed it (see the module docstring),
    then :meth:`received` once the returned future is done.
    """

    def __init__(
        self,
        payload,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | None = None,
        limits: Limits | None = None,
    ):
        self.group = group
        self.limits = limits or DEFAULT_LIMITS
        self.device = device if device is not None else comm_device(group)
        world = dist.get_world_size(group)
        self._mine = _as_tensor(payload, self.device)
        self._lengths = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(world)]
        self._lengths_work = dist.all_gather(
            self._lengths,
            torch.tensor([self._mine.numel()], dtype=torch.int64, device=self.device),
            group=group,
            async_op=True,
        )
        self._gathered: list[torch.Tensor] | None = None
        self.sizes: list[int] = []

    @property
    def payload_bytes(self) -> int:
        """This rank's payload length."""
        return self._mine.numel()

    @property
    def bytes_out(self) -> int:
        """What this rank puts into the two collectives: its length word and its padded frame (after :meth:`launch`)."""
        return 8 + (max(self.sizes) if self.sizes else 0)

    def launch(self) -> torch.futures.Future:
        """Wait for the lengths, check them against the limits, launch the padded all-gather; its future.

        Raises :class:`~gradwire.FrameError` (on every rank alike: all see the same lengths) when a
        rank announced more than ``limits.max_frame_bytes``.
        """
        if self._gathered is not None:
            raise RuntimeError("BytesGather.launch called twice")
        self._lengths_work.wait()
        self.sizes = [_check_length(int(t.item()), f"rank {r}", self.limits) for r, t in enumerate(self._lengths)]
        longest = max(self.sizes)
        n = self._mine.numel()
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:n] = self._mine
        self._gathered = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in self.sizes]
        work = dist.all_gather(self._gathered, padded, group=self.group, async_op=True)
        return work.get_future()

    def received(self) -> Exchanged:
        """Every rank's payload in group-rank order, once :meth:`launch`'s future is done."""
        if self._gathered is None:
            raise RuntimeError("BytesGather.received called before launch")
        out = Exchanged(t[:size].cpu().numpy() for t, size in zip(self._gathered, self.sizes))
        out.bytes_out = self.bytes_out
        out.payload_bytes = self.payload_bytes
        return out


def all_gather_bytes(
    payload,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
    limits: Limits | None = None,
) -> Exchanged:
    """Every rank's ``payload`` (bytes of any length), in group-rank order, on every rank.

    Two collectives: an ``all_gather`` of the lengths (one int64 each), then one of the payloads
    padded with zeros to the longest. ``device`` defaults to :func:`comm_device`. Blocks until both
    are done; :class:`BytesGather` is the non-blocking form.
    """
    gather = BytesGather(payload, group, device=device, limits=limits)
    gather.launch().wait()
    return gather.received()


#: Backends whose ``all_to_all_single`` takes uneven split sizes (gloo does since torch 1.x; checked
#: on 2.15 with uint8 tensors). Any other backend goes through batched point-to-point sends.
_ALL_TO_ALL_BACKENDS = ("gloo", "nccl", "mpi")


def all_to_all_bytes(
    payloads: Sequence,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
    limits: Limits | None = None,
    method: str = "auto",
) -> Exchanged:
    """``payloads[r]`` (bytes of any length, possibly empty) to group rank ``r``; returns the payload each
    rank sent this one, in group-rank order (this rank's own ``payloads[rank]`` is handed back, not sent).

    Two collectives: an ``all_gather`` of every rank's row of lengths (``world`` int64 each), so that
    every rank checks every announced length against ``limits`` and a length over them raises
    :class:`~gradwire.FrameError` on every rank alike before anything is allocated; then the payloads,
    unpadded, in one ``all_to_all_single`` of ``uint8`` with uneven split sizes (skipped when nothing
    moves). ``method="pairwise"`` (the fallback where the backend has no all-to-all, chosen by
    ``"auto"``) sends them as one batch of ``isend``/``irecv`` pairs instead.

    ``bytes_out`` of the result counts this rank's length row and the payloads it sent,
    ``payload_bytes`` the payloads only.
    """
    if method not in ("auto", "all_to_all", "pairwise"):
        raise ValueError(f"method must be 'auto', 'all_to_all' or 'pairwise', got {method!r}")
    lim = limits or DEFAULT_LIMITS
    dev = device if device is not None else comm_device(group)
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    if len(payloads) != world:
        raise ValueError(f"all_to_all_bytes takes one payload per rank ({world}), got {len(payloads)}")
    arrays = [
        (np.frombuffer(p, dtype=np.uint8) if not isinstance(p, np.ndarray) else p.view(np.uint8)).reshape(-1)
        for p in payloads
    ]
    sizes = [0 if r == me else int(a.size) for r, a in enumerate(arrays)]
    matrix = gather_rows(torch.tensor(sizes, dtype=torch.int64, device=dev), group).cpu().tolist()
    for s, row in enumerate(matrix):
        for r, n in enumerate(row):
            _check_length(int(n), f"rank {s} (to rank {r})", lim)
    incoming = [int(matrix[s][me]) for s in range(world)]
    out = Exchanged(np.empty(0, dtype=np.uint8) for _ in range(world))
    if any(any(row) for row in matrix):
        if method == "auto":
            method = "all_to_all" if str(dist.get_backend(group)) in _ALL_TO_ALL_BACKENDS else "pairwise"
        if method == "all_to_all":
            outgoing = np.concatenate([np.empty(0, np.uint8)] + [a for r, a in enumerate(arrays) if r != me])
            send = torch.from_numpy(outgoing).to(dev)
            recv = torch.empty(sum(incoming), dtype=torch.uint8, device=dev)
            dist.all_to_all_single(recv, send, output_split_sizes=incoming, input_split_sizes=sizes, group=group)
            host = recv.cpu().numpy()
            at = 0
            for s, n in enumerate(incoming):
                out[s] = host[at : at + n]
                at += n
        else:
            ops, bufs = [], {}
            for r, a in enumerate(arrays):
                if sizes[r]:
                    ops.append(dist.P2POp(dist.isend, _as_tensor(a, dev), group=group, group_peer=r))
            for s, n in enumerate(incoming):
                if n:
                    bufs[s] = torch.empty(n, dtype=torch.uint8, device=dev)
                    ops.append(dist.P2POp(dist.irecv, bufs[s], group=group, group_peer=s))
            _wait_all(ops)
            for s, t in bufs.items():
                out[s] = t.cpu().numpy()
    out[me] = arrays[me].copy()
    out.payload_bytes = sum(sizes)
    out.bytes_out = 8 * world + out.payload_bytes
    return out


def exchange_bytes(
    payload,
    peers: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
    limits: Limits | None = None,
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


def gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Stack one equal-shaped tensor from every rank into ``(world, *row.shape)`` (on ``row``'s device)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(parts, row, group=group)
    return torch.stack(parts)
