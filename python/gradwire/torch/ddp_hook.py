"""A DistributedDataParallel communication hook that sends every bucket through a gradwire codec.

Per bucket and step, each rank compresses its flat gradient plus that bucket's error-feedback residual
into one frame, the ranks all-gather their frames (lengths first, then the frames padded to the
longest: see :mod:`gradwire.torch.collectives`), and every rank sums all frames *in rank order* and
divides by the world size. On the CPU the sum is :func:`gradwire.algorithms.exact_mean` with weight 1
per rank (each record decoded exactly, ``acc = d_0``, ``acc = acc + d_i``: for DCT records in one Rust
pass); on GPUs it is one accumulator — the codec's transform-domain one where it registered one, else
dense decoding. All ranks run the same ops on the same bytes in the same order, so they end each step
with bit-identical gradients and hence parameters. (A transform-domain sum such as the DCT's ends in one
float32 matrix product, whose rounding may follow how many threads the BLAS takes at that moment;
overlapped with backward, that can differ between ranks, so the CPU path does not use it.)

DDP rebuilds its buckets after the first iteration (and may regroup parameters then). Residuals are
therefore tracked by the parameters a bucket holds, not by its index alone: when a bucket arrives with
a layout other than the one its residual was cut for, the residuals holding any of its parameters
are split back into per-parameter pieces and the new buckets reassemble theirs from those pieces, so
nothing a codec dropped is lost in the rebuild. With ``per_parameter=True`` each parameter travels as its own record
(in its own shape, for codecs that work per tensor) and its residual is keyed by the parameter.

Overlap with the backward pass. DDP calls the hook for buckets 0, 1, … in order as their gradients
become ready, and waits for the futures the hook returned only at the end of backward. The hook
compresses its bucket and launches the length all-gather without waiting; the padded frames of bucket
``i`` are launched at the start of the hook for bucket ``i + 1`` (the last bucket's at once), by when
its lengths have long arrived, and the frames are decoded in a callback when they land, on the thread
that completed the collective, while backward goes on computing and compressing the next buckets. The
future returned for a bucket is completed by that callback. Every collective is launched from the
hook itself, never from a callback: gloo pairs collectives by the order each rank launches them, and
callbacks run on whichever worker thread finished a collective, so launching from them could
interleave differently on different ranks (what breaks torch's own PowerSGD hook on gloo with more
than one bucket).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against the real types.
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..aggregation import weighted_sum
from ..codecs import Codec
from ..errors import FrameError
from ..feedback import ErrorFeedback
from ..frame import DEFAULT_LIMITS, Limits, read_frame, write_frame
from ..registry import build_codec
from .collectives import BytesGather, comm_device

__all__ = ["GradwireHookState", "ddp_hook", "gradwire_hook"]

# One bucket's layout: (id(parameter), numel) for each parameter, in bucket order.
Layout = tuple[tuple[int, int], ...]


@dataclass(eq=False)
class GradwireHookState:
    """What :func:`gradwire_hook` keeps between calls, and its traffic statistics.

    ``bytes_sent`` counts this rank's own frames; ``bytes_exchanged`` what it put into the collectives
    (the length word and the padding to the longest frame included); ``dense_bytes`` what the same
    buckets weigh uncompressed (their dtype's size). ``steps`` counts finished iterations;
    ``residual_rebuilds`` how often residuals were re-cut for a new bucket layout. ``per_parameter``:
    one record per parameter instead of one per bucket (see :func:`ddp_hook`). ``overlap=False``
    exchanges and decodes each bucket before its hook returns (nothing overlaps backward: for
    comparisons and debugging).
    """

    codec: Codec
    process_group: dist.ProcessGroup | None = None
    limits: Limits = DEFAULT_LIMITS
    per_parameter: bool = False
    overlap: bool = True
    feedback: ErrorFeedback = field(init=False)
    steps: int = 0
    bytes_sent: int = 0
    bytes_exchanged: int = 0
    dense_bytes: int = 0
    residual_rebuilds: int = 0
    _layouts: dict[int, Layout] = field(default_factory=dict, repr=False)
    _loose: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _waiting: Optional["_BucketInFlight"] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.feedback = ErrorFeedback(self.codec)

    # -- statistics ------------------------------------------------------------------------------

    def frame_bytes_per_step(self) -> float:
        """Mean bytes of this rank's frames per finished step."""
        return self.bytes_sent / max(1, self.steps)

    def wire_bytes_per_step(self) -> float:
        """Mean bytes this rank put into the collectives per finished step (padding included)."""
        return self.bytes_exchanged / max(1, self.steps)

    def compression_ratio(self) -> float:
        """Uncompressed bucket bytes over frame bytes, so far."""
        return self.dense_bytes / max(1, self.bytes_sent)

    # -- residuals across bucket rebuilds --------------------------------------------------------

    def parameter_residual(self, param: torch.Tensor) -> torch.Tensor | None:
        """The error-feedback residual currently held for ``param`` (float32, its shape), or ``None``."""
        if self.per_parameter:
            r = self.feedback.residual(_parameter_key(param))
            return None if r is None else r.reshape(param.shape)
        key = id(param)
        if key in self._loose:
            return self._loose[key].reshape(param.shape)
        for index, layout in self._layouts.items():
            r = self.feedback.residual(_bucket_name(index))
            if r is None:
                continue
            offset = 0
            for pid, numel in layout:
                if pid == key:
                    return r[offset : offset + numel].reshape(param.shape)
                offset += numel
        return None

    def _adopt_layout(self, index: int, layout: Layout) -> None:
        """Make the residual of bucket ``index`` match ``layout``, carrying every parameter's piece over."""
        if self._layouts.get(index) == layout:
            return
        # Dissolve the residuals cut for an older layout of this bucket, or holding any of its
        # parameters, into per-parameter pieces; buckets untouched by the rebuild keep theirs.
        wanted = {pid for pid, _ in layout}
        stale = [
            other for other, old in self._layouts.items() if other == index or any(pid in wanted for pid, _ in old)
        ]
        for other in stale:
            old = self._layouts.pop(other)
            r = self.feedback.residual(_bucket_name(other))
            self.feedback.reset(_bucket_name(other))
            if r is None:
                continue
            self.residual_rebuilds += 1
            offset = 0
            for pid, numel in old:
                self._loose[pid] = r[offset : offset + numel]
                offset += numel
        self._layouts[index] = layout
        pieces = [self._loose.pop(pid, None) for pid, _ in layout]
        if all(p is None for p in pieces):
            return
        device = next(p for p in pieces if p is not None).device
        joined = torch.cat(
            [
                p if p is not None else torch.zeros(n, dtype=torch.float32, device=device)
                for p, (_, n) in zip(pieces, layout)
            ]
        )
        self.feedback.set_residual(_bucket_name(index), joined)


def _bucket_name(index: int) -> str:
    return f"bucket{index}"


def _parameter_key(param: torch.Tensor) -> str:
    return f"param{id(param)}"


def _layout(bucket: dist.GradBucket) -> Layout:
    return tuple((id(p), p.numel()) for p in bucket.parameters())


@dataclass(eq=False)
class _BucketInFlight:
    """A bucket whose frame went out: what its decode needs, and the future DDP waits on."""

    index: int
    round: int
    world: int
    per_parameter: bool
    limits: Limits
    buffer: torch.Tensor
    targets: list
    gather: BytesGather
    future: torch.futures.Future


def _launch_frames(state: GradwireHookState, bucket: _BucketInFlight) -> None:
    """Launch ``bucket``'s padded frame all-gather (from the hook's thread) and decode it when it lands."""
    try:
        landed = bucket.gather.launch()
    except Exception as e:
        # The lengths broke a limit (every rank sees the same lengths, so every rank refuses alike).
        bucket.future.set_exception(e)
        return
    state.bytes_exchanged += bucket.gather.bytes_out

    def decode(done: torch.futures.Future) -> None:
        try:
            done.wait()  # re-raises a failed collective
            _decode_into(bucket)
        except Exception as e:
            bucket.future.set_exception(e)
        else:
            bucket.future.set_result(bucket.buffer)

    landed.add_done_callback(decode)


def _decode_into(bucket: _BucketInFlight) -> None:
    """Average every rank's frame into the bucket's tensors, decoding in rank order."""
    index, targets = bucket.index, bucket.targets
    columns: list[list] = [[] for _ in targets]
    for r, data in enumerate(bucket.gather.received()):
        got = read_frame(data, limits=bucket.limits)
        if got.bundle != bucket.per_parameter or got.round != bucket.round or got.sender != r:
            raise FrameError(
                f"bucket {index}: rank {r} sent a {'bundle' if got.bundle else 'tensor'} frame for round"
                f" {got.round} from sender {got.sender}; expected a {'bundle' if bucket.per_parameter else 'tensor'}"
                f" frame for round {bucket.round} from {r}"
            )
        if len(got.entries) != len(targets):
            raise FrameError(f"bucket {index}: rank {r} sent {len(got.entries)} records, the bucket has {len(targets)}")
        for i, (e, target) in enumerate(zip(got.entries, targets)):
            if tuple(e.shape) != tuple(target.shape):
                raise FrameError(
                    f"bucket {index}: rank {r} sent shape {tuple(e.shape)} for tensor {i}, expected {tuple(target.shape)}"
                )
            columns[i].append(e)
    for column, target in zip(columns, targets):
        target.copy_(_rank_order_sum(column, bucket.buffer.device).div_(bucket.world))


def _rank_order_sum(column: list, device: torch.device) -> torch.Tensor:
    """Every rank's record of one tensor, summed in rank order: exactly on the CPU (bit-identical on any
    thread count), through the codec's accumulator on GPUs."""
    return weighted_sum(column, [1.0] * len(column), device, exact=device.type == "cpu")


def gradwire_hook(state: GradwireHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket across ranks through ``state.codec`` (see the module docstring).

    Returns a future that completes with the bucket's buffer, overwritten with the average, once every
    rank's frame has arrived and been decoded; with ``state.overlap`` it is not done on return for
    any bucket but the last.
    """
    group = state.process_group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    buf = bucket.buffer()
    index = bucket.index()

    # The previous bucket's lengths were launched by its own hook: launch its frames first, so they
    # travel and decode while this bucket compresses.
    if state._waiting is not None:
        waiting, state._waiting = state._waiting, None
        _launch_frames(state, waiting)

    if state.per_parameter:
        # One record per parameter, its gradient in its own shape; residuals keyed by the parameter
        # itself, which no bucket rebuild changes (a codec with a budget across tensors, such as global
        # top-k, spends it across the bucket). Record names are positions in the bucket.
        targets = list(bucket.gradients())
        named = {_parameter_key(p): g for p, g in zip(bucket.parameters(), targets)}
        entries = [dataclasses.replace(e, name=str(i)) for i, e in enumerate(state.feedback.compress_bundle(named))]
    else:
        state._adopt_layout(index, _layout(bucket))
        targets = [buf]
        entries = [state.feedback.compress(buf, _bucket_name(index))]
    frame = write_frame(entries, round=state.steps, sender=rank, bundle=state.per_parameter)
    in_flight = _BucketInFlight(
        index=index,
        round=state.steps,
        world=world,
        per_parameter=state.per_parameter,
        limits=state.limits,
        buffer=buf,
        targets=targets,
        gather=BytesGather(frame, group, device=comm_device(group), limits=state.limits),
        # A future on the bucket's device, so that with CUDA tensors DDP's wait also waits for the
        # streams the decode ran on.
        future=torch.futures.Future(devices=[buf.device] if buf.device.type == "cuda" else None),
    )
    state.bytes_sent += len(frame)
    state.dense_bytes += buf.numel() * buf.element_size()
    if bucket.is_last():
        state.steps += 1
    if bucket.is_last() or not state.overlap:
        _launch_frames(state, in_flight)
    else:
        state._waiting = in_flight
    if not state.overlap:
        in_flight.future.wait()
    # Chained so that a decode error reaches DDP as an error (a future completed by set_exception
    # holds the exception as its value as far as DDP's C++ side can see; a raising callback does not).
    return in_flight.future.then(_value)


def _value(done: torch.futures.Future) -> torch.Tensor:
    return done.wait()


def ddp_hook(
    codec: Codec | str,
    process_group: dist.ProcessGroup | None = None,
    *,
    per_parameter: bool = False,
    limits: Limits | None = None,
    overlap: bool = True,
    **codec_params,
) -> tuple[GradwireHookState, Callable[[GradwireHookState, dist.GradBucket], torch.futures.Future]]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``.

    ``codec`` is a codec instance or a registered name (``"dct"``; ``codec_params`` then go to
    :func:`gradwire.build_codec`: a wire codec or a policy such as Accordion). Error feedback is kept per bucket and survives DDP's bucket rebuild.

    ``per_parameter=True`` sends each parameter's gradient as its own record of a bundle frame, in its
    own shape, instead of the bucket as one flat vector: codecs that work per tensor (3LC's and
    signSGD's scales, PowerSGD's and DCT tiles' matrix view, per-layer top-k) then see layers, as in
    their papers, at the cost of a record header (a few dozen bytes) per parameter.

    ``overlap`` (default): the returned futures complete in the background, each bucket's frames
    travelling and decoding while backward computes the next buckets (see the module docstring);
    ``overlap=False`` finishes every bucket inside its hook.

    Example::

        state, hook = gradwire.torch.ddp_hook(gradwire.DCTCodec(topk=32))
        ddp_model.register_comm_hook(state, hook)
    """
    if isinstance(codec, str):
        codec = build_codec(codec, **codec_params)
    elif codec_params:
        raise TypeError("codec parameters are only accepted with a codec name")
    state = GradwireHookState(
        codec=codec,
        process_group=process_group,
        limits=limits or DEFAULT_LIMITS,
        per_parameter=per_parameter,
        overlap=overlap,
    )
    return state, gradwire_hook
