"""Bagua's low-precision decentralized SGD: peers exchange quantized model differences, no all-reduce.

Worker ``i`` holds its model ``x_i`` and a replica ``x̂_j`` of each peer's. Each step, after the
gradient ``g`` is computed:

1. ``x_{t+½} = Σ_j W_ij x̂_j − γ g`` over ``j`` in ``{i} ∪ peers(i)``, with ``x̂_i = x_i``; the local
   step ``−γ g`` is whatever the optimizer does to the parameters (plain SGD: exactly ``−γ g``);
2. ``z = x_{t+½} − x_t``, all parameters as one flat vector, is compressed (MinMax uint8 by default,
   per chunk of 1024 elements) into one frame;
3. the worker moves by what that frame decodes to: ``x_{t+1} = x_t + Q(z)``;
4. it sends the frame to every peer and receives theirs, and moves each replica the same way:
   ``x̂_j += Q(z_j)``.

Since a worker's own model and its replica on every peer start equal (rank 0's parameters are
broadcast at construction, or each worker's are sent to its peers once at full precision) and
advance by the same decoded tensor with the same float operation, every replica equals its owner's
model bit for bit, whatever the codec.

Frames travel point to point (:func:`gradwire.torch.collectives.exchange_bytes`): a length word, then
the frame, to and from each peer. The peer graph is fixed for the run and must be symmetric; it is
checked once, at construction, by gathering every rank's adjacency row. Mixing weights are
Metropolis–Hastings: ``W_ij = 1 / (1 + max(deg_i, deg_j))`` for peers and the rest on ``W_ii``, which is
the uniform ``1 / (1 + deg)`` over self and peers on a ring or any graph where all degrees are equal,
and keeps ``W`` symmetric and doubly stochastic (the workers' mean is preserved) on any other.

Only parameters are exchanged; buffers (batch-norm statistics) stay local.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..codecs import Codec, IdentityCodec
from ..errors import FrameError
from ..frame import DEFAULT_LIMITS, Limits, decode_entry, read_frame, write_frame
from .collectives import comm_device, exchange_bytes, gather_rows
from .launcher_check import refuse_single_rank_launch

__all__ = ["LowPrecisionDecentralized", "ring_peers"]

PeerSpec = str | Sequence[int] | Mapping[int, Sequence[int]]
# The round number of the one-off frame that carries starting parameters (steps count from 0).
_INITIAL_ROUND = 2**64 - 1
# The record name of the flat parameter vector in every frame.
_NAME = "parameters"


def ring_peers(rank: int, world: int) -> tuple[int, ...]:
    """The left and right neighbours of ``rank`` on a ring of ``world`` workers (one when world is 2)."""
    return tuple(sorted({(rank - 1) % world, (rank + 1) % world} - {rank}))


def _resolve_peers(spec: PeerSpec, rank: int, world: int) -> tuple[int, ...]:
    if isinstance(spec, str):
        if spec == "ring":
            return ring_peers(rank, world)
        if spec in ("all", "complete"):
            return tuple(r for r in range(world) if r != rank)
        raise ValueError(f"peers must be 'ring', 'all', a list of ranks or a mapping, got {spec!r}")
    if isinstance(spec, Mapping):
        spec = spec.get(rank, ())
    peers = tuple(sorted({int(p) for p in spec}))
    for p in peers:
        if not 0 <= p < world or p == rank:
            raise ValueError(f"rank {rank}: peer {p} is not another rank of a group of {world}")
    return peers


class LowPrecisionDecentralized:
    """Low-precision decentralized SGD over ``model``'s parameters (see the module docstring).

    ``optimizer`` makes the local step from the gradients (``None``: plain SGD with step ``lr``).
    ``peers``: ``"ring"`` (default), ``"all"``, this rank's peers as a list of group ranks, or a
    mapping ``{rank: peers}`` for the whole graph; it must be symmetric. ``codec`` quantizes the model
    differences (default :class:`gradwire.MinMaxUInt8`). Construction is collective: every rank of
    ``process_group`` must build one. Rank 0's parameters are broadcast so all workers start equal;
    with ``broadcast_parameters=False`` each keeps its own and peers exchange them once, at full
    precision, to seed the replicas.

    ``steps``, ``bytes_sent`` (frames and length words to all peers), ``frame_bytes`` (this rank's
    frames) and ``last_frame`` (the bytes sent at the last step) describe the traffic; the frame holds
    one record, ``"parameters"``, the flat vector of every trainable parameter in model order.

    Use::

        algo = LowPrecisionDecentralized(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loss.backward(); algo.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        peers: PeerSpec = "ring",
        codec: Codec | None = None,
        process_group: dist.ProcessGroup | None = None,
        lr: float | None = None,
        *,
        broadcast_parameters: bool = True,
        limits: Limits | None = None,
    ):
        refuse_single_rank_launch(type(self).__name__, process_group, "building LowPrecisionDecentralized")
        if optimizer is None and lr is None:
            raise ValueError("give an optimizer, or lr for plain SGD")
        if optimizer is not None and lr is not None:
            raise ValueError("lr is the step of plain SGD when no optimizer is given; set it on the optimizer")
        if codec is None:
            from ..codecs.minmax import MinMaxUInt8

            codec = MinMaxUInt8()
        self.model = model
        self.optimizer = optimizer
        self.lr = lr
        self.codec = codec
        self.process_group = process_group
        self.limits = limits or DEFAULT_LIMITS
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.peers = _resolve_peers(peers, self.rank, self.world_size)
        self.weights = self._mixing_weights()
        self.named_parameters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.named_parameters:
            raise ValueError("the model has no trainable parameters")
        first = self.named_parameters[0][1]
        if any(p.dtype != first.dtype or p.device != first.device for _, p in self.named_parameters):
            raise ValueError("all trainable parameters must share one dtype and device")
        self.device, self.dtype = first.device, first.dtype
        self.numel = sum(p.numel() for _, p in self.named_parameters)
        self.steps = 0
        self.bytes_sent = 0
        self.frame_bytes = 0
        self.last_frame: bytes | None = None
        if broadcast_parameters:
            self._broadcast_from_rank0()
            self._replicas = {peer: self._flat() for peer in self.peers}
        else:
            self._replicas = self._receive_initial_replicas()

    # -- set-up ----------------------------------------------------------------------------------

    def _mixing_weights(self) -> dict[int, float]:
        """``{j: W_ij}`` for this rank over itself and its peers, after checking the graph is symmetric."""
        dev = comm_device(self.process_group)
        row = torch.zeros(self.world_size, dtype=torch.int32, device=dev)
        if self.peers:
            row[list(self.peers)] = 1
        adjacency = gather_rows(row, self.process_group).cpu()
        if not torch.equal(adjacency, adjacency.t()):
            bad = [(i, j) for i, j in (adjacency != adjacency.t()).nonzero().tolist() if adjacency[i, j]]
            raise ValueError(
                "the peer graph must be symmetric (fixed pairs that both send and receive); "
                f"these (rank, peer) links have no way back: {bad}"
            )
        degree = adjacency.sum(dim=1).tolist()
        mine = degree[self.rank]
        weights = {j: 1.0 / (1 + max(mine, degree[j])) for j in self.peers}
        weights[self.rank] = 1.0 - sum(weights.values())
        return weights

    def _broadcast_from_rank0(self) -> None:
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        dev = comm_device(self.process_group)
        with torch.no_grad():
            for _, p in self.named_parameters:
                t = p.detach().to(dev).contiguous()
                dist.broadcast(t, src=src, group=self.process_group)
                p.copy_(t.to(p.device))

    def _receive_initial_replicas(self) -> dict[int, torch.Tensor]:
        """Each peer's starting parameters, exchanged once at full precision (an identity frame)."""
        entry, _ = IdentityCodec().compress(self._flat(), _NAME)
        frame = write_frame([entry], round=_INITIAL_ROUND, sender=self.rank)
        received = exchange_bytes(frame, self.peers, self.process_group, limits=self.limits)
        return {peer: self._decode(received[peer], peer, _INITIAL_ROUND) for peer in self.peers}

    def _flat(self) -> torch.Tensor:
        """This rank's parameters as one new flat vector (model order)."""
        return torch.cat([p.detach().reshape(-1) for _, p in self.named_parameters])

    # -- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """One step: local optimizer step, mix with the replicas, send and apply ``Q(z)``; see above."""
        params = [p for _, p in self.named_parameters]
        before = self._flat()
        if self.optimizer is not None:
            self.optimizer.step()
        else:
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)

        # z = Σ_j W_ij x̂_j + (local step) − x_t = (local step) + Σ_peers W_ij (x̂_j − x_t): the second
        # form (the weights sum to one) adds small differences, not large parameters. The whole model
        # goes as one flat vector, as Bagua quantizes flattened buckets: one record, chunked by the codec.
        z = self._flat().sub_(before)
        for peer in self.peers:
            z.add_(self._replicas[peer] - before, alpha=self.weights[peer])
        entry, decoded = self.codec.compress(z, _NAME)
        frame = write_frame([entry], round=self.steps, sender=self.rank)

        # The codec's reconstruction is, by its contract, exactly what peers decode from the frame.
        after = before + decoded.to(before.dtype)
        offset = 0
        for p in params:
            p.copy_(after[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

        received = exchange_bytes(frame, self.peers, self.process_group, limits=self.limits)
        for peer in self.peers:
            self._replicas[peer].add_(self._decode(received[peer], peer))

        self.steps += 1
        self.last_frame = frame
        self.frame_bytes += len(frame)
        self.bytes_sent += (8 + len(frame)) * len(self.peers)

    def _decode(self, data, sender: int, round: int | None = None) -> torch.Tensor:
        """The flat vector a peer's frame carries, checked against this model."""
        expected_round = self.steps if round is None else round
        frame = read_frame(data, limits=self.limits)
        if frame.bundle or frame.round != expected_round or frame.sender != sender:
            raise FrameError(
                f"peer {sender} sent a {'bundle' if frame.bundle else 'tensor'} frame for round {frame.round}"
                f" from sender {frame.sender}; expected a tensor frame for round {expected_round} from {sender}"
            )
        entry = frame.entry()
        if tuple(entry.shape) != (self.numel,):
            raise FrameError(
                f"peer {sender} sent a tensor of shape {tuple(entry.shape)}; the model has {self.numel} parameters"
            )
        return decode_entry(entry, self.device).to(self.dtype)

    # -- inspection ------------------------------------------------------------------------------

    def replica(self, peer: int) -> dict[str, torch.Tensor]:
        """This rank's replica ``x̂_peer`` of a peer's parameters, by name (views; do not modify)."""
        try:
            flat = self._replicas[peer]
        except KeyError:
            raise KeyError(f"rank {peer} is not a peer of rank {self.rank} (peers: {self.peers})") from None
        out, offset = {}, 0
        for name, p in self.named_parameters:
            out[name] = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return out

    def frame_bytes_per_step(self) -> float:
        """Mean bytes of this rank's frame per step: the message each of its peers receives."""
        return self.frame_bytes / max(1, self.steps)

    def sent_bytes_per_step(self) -> float:
        """Mean bytes this rank sent per step: its frame and a length word, to every peer."""
        return self.bytes_sent / max(1, self.steps)

    def __repr__(self) -> str:
        return (
            f"LowPrecisionDecentralized(rank={self.rank}, peers={self.peers}, codec={self.codec!r}, steps={self.steps})"
        )
