"""Encoding and exchanging gradients while the backward pass still runs: buckets of parameters, each
encoded as soon as all its gradients are ready and exchanged right after, as DDP's communication hooks
start a bucket's all-reduce.

:class:`GradientBuckets` cuts an optimizer's parameters into buckets of about ``bucket_numel`` elements
in reverse order (the order the backward pass produces their gradients), registers a post-accumulate-grad
hook on each parameter and, once every gradient of a bucket has arrived, hands the bucket to one worker
thread that encodes it (``encode(bucket)``: the optimizer's momentum step and compression of those
parameters). On a GPU the worker runs on a side stream that first waits for the gradients' stream, so
its kernels interleave with the rest of the backward pass; on the CPU it runs beside autograd's threads.
:meth:`GradientBuckets.collect` (the optimizer's step) waits for the worker, encodes the buckets whose
hooks did not fire (parameters that got no gradient), and returns every bucket's records.

With ``exchange`` given, a second worker thread exchanges each encoded bucket (``exchange(bucket,
records)``: the collectives and the owners' work of that bucket's tensors) in bucket order, on every rank
the same order whatever order the buckets became ready in (as DDP launches its buckets' all-reduces in
bucket order), while the backward pass goes on; :meth:`~GradientBuckets.collect` then returns every
bucket's exchanged result and the step has only the update left to apply. A bucket whose exchange fails
stops the later buckets' exchanges before their collectives, so a rank never pairs one bucket's
collective with another's.

Each bucket is encoded once per step, from the gradients as the backward pass left them. So:

- gradient accumulation over several backward passes runs the earlier passes inside :meth:`no_sync`
  (as with DDP); a gradient accumulated again after its bucket was encoded is refused at the step, with
  a ``RuntimeError`` saying so, rather than silently sending the first pass alone;
- whatever changes the gradients between ``backward()`` and ``step()`` (clipping, unscaling) does not
  reach what was encoded: clip inside the loss, or build the optimizer with ``overlap=False``.

The records are those the optimizer's step makes without overlap (the codec compresses each tensor on
its own: the same records, byte for byte on the CPU; on a GPU the forward transform's last bits follow
the batch's size, so a coefficient at a tie may be kept in place of another), and every rank applies the
same exact mean: the replicas stay bit-identical either way.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["DEFAULT_BUCKET_NUMEL", "GradientBuckets", "cut_buckets"]

#: Elements per bucket: 2^22 (16 MiB of float32 gradients), about DDP's 25 MB default.
DEFAULT_BUCKET_NUMEL = 1 << 22


def cut_buckets(params: Sequence[tuple[str, torch.Tensor, Any]], bucket_numel: int) -> list[list[int]]:
    """Indices into ``params`` (``(name, parameter, key)``), cut into buckets in reverse order: a bucket
    closes once it holds ``bucket_numel`` elements or the next parameter has another ``key`` (its param
    group: one bucket, one learning rate)."""
    if int(bucket_numel) < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    buckets: list[list[int]] = []
    size = 0
    key = object()
    for i in reversed(range(len(params))):
        _, p, k = params[i]
        if not buckets or size >= bucket_numel or k is not key:
            buckets.append([])
            size = 0
            key = k
        buckets[-1].append(i)
        size += p.numel()
    return buckets


class GradientBuckets:
    """Post-accumulate-grad hooks that encode each bucket of ``params`` once its gradients are ready
    (see the module docstring). ``encode(indices)`` encodes the parameters ``params[i]`` for ``i`` in
    ``indices`` and returns their records; it runs on one worker thread, one bucket at a time, in the
    order the buckets became ready."""

    def __init__(
        self,
        params: Sequence[tuple[str, torch.Tensor, Any]],
        encode: Callable[[list[int]], list],
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        exchange: Callable[[list[int], list], Any] | None = None,
    ):
        self.params = list(params)
        self.buckets = cut_buckets(self.params, bucket_numel)
        self._encode = encode
        self._exchange = exchange
        self._exchange_executor: ThreadPoolExecutor | None = None
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._syncing = True
        # The workers run the ops with this thread's count: a new thread's first BLAS call would otherwise
        # take OpenMP's default (every core), and a float32 transform rounds by its thread count (a flat
        # 64-element DCT chunk's coefficients differed from the step's own on 1-thread gloo ranks).
        self._threads = torch.get_num_threads()
        self._reset()
        devices = {p.device for _, p, _ in self.params}
        self._cuda = next((d for d in devices if d.type == "cuda"), None)
        self._side = torch.cuda.Stream(self._cuda) if self._cuda is not None else None
        # The hooks hold this object weakly: an optimizer dropped by its user stops encoding.
        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(_hook(ref, i)) for i, (_, p, _) in enumerate(self.params)]

    def _reset(self) -> None:
        self._ready = [set() for _ in self.buckets]
        self._started: dict[int, Future] = {}
        self._exchanges: dict[int, Future] = {}  # by bucket, launched in bucket order
        # This step's: a bucket's exchange failed, the later ones must not start their collectives. A new
        # object per step, so that a step that failed leaves the next one's exchanges alone.
        self._failure = {"failed": False}
        self._again: list[int] = []  # parameters whose gradient grew after their bucket was encoded

    # -- the hooks ---------------------------------------------------------------------------------

    def _grad_ready(self, i: int) -> None:
        if not self._syncing:
            return
        b = self._bucket_of[i]
        with self._lock:
            if b in self._started:
                self._again.append(i)
                return
            self._ready[b].add(i)
            if len(self._ready[b]) < len(self.buckets[b]):
                return
            self._started[b] = self._submit(b)
            self._launch_exchanges()

    def _launch_exchanges(self) -> None:
        """(Under the lock.) Hand the exchange worker every bucket, in bucket order, whose encode has started."""
        if self._exchange is None:
            return
        b = len(self._exchanges)
        while b in self._started:
            if self._exchange_executor is None:
                self._exchange_executor = self._worker("gradwire-exchange")
            self._exchanges[b] = self._exchange_executor.submit(self._run_exchange, b, self._started[b], self._failure)
            b += 1

    def _run_exchange(self, b: int, encoded: Future, failure: dict) -> Any:
        if failure["failed"]:
            raise RuntimeError(f"bucket {b} was not exchanged: an earlier bucket's exchange failed")
        try:
            records = encoded.result()
            if self._side is None:
                with torch.no_grad():
                    return self._exchange(self.buckets[b], records)
            # The encode's kernels were queued on the side stream: the exchange's follow them there.
            with torch.cuda.device(self._cuda), torch.cuda.stream(self._side), torch.no_grad():
                return self._exchange(self.buckets[b], records)
        except BaseException:
            failure["failed"] = True
            raise

    def _submit(self, b: int) -> Future:
        if self._executor is None:
            self._executor = self._worker("gradwire-encode")
        event = None
        if self._side is not None:
            # The gradients were written on the backward pass's stream: the side stream waits for them.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._cuda))
        return self._executor.submit(self._run, b, event)

    def _worker(self, name: str) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=torch.set_num_threads, initargs=(self._threads,)
        )

    def _run(self, b: int, event) -> list:
        if self._side is None:
            with torch.no_grad():
                return self._encode(self.buckets[b])
        with torch.cuda.device(self._cuda), torch.cuda.stream(self._side), torch.no_grad():
            self._side.wait_event(event)
            return self._encode(self.buckets[b])

    # -- the step ----------------------------------------------------------------------------------

    def collect(self) -> list:
        """Every bucket's records (in bucket order), after the worker is done: those encoded during the
        backward pass and, now, those whose gradients never all arrived; with ``exchange``, every bucket's
        exchanged result instead. Resets for the next step. ``RuntimeError`` if a gradient grew after its
        bucket was encoded (a second backward pass outside :meth:`no_sync`)."""
        with self._lock:
            again = list(self._again)
            for b in range(len(self.buckets)):
                if b not in self._started:
                    self._started[b] = self._submit(b)
            self._launch_exchanges()
            futures = dict(self._exchanges) if self._exchange is not None else dict(self._started)
            self._reset()
        try:
            out = [futures[b].result() for b in range(len(self.buckets))]
        finally:
            if self._side is not None:
                torch.cuda.current_stream(self._cuda).wait_stream(self._side)
        if again:
            names = ", ".join(self.params[i][0] for i in again[:3])
            raise RuntimeError(
                f"the gradient of {names} was accumulated again after its bucket had been encoded: with "
                "overlap=True each step encodes the gradients of one backward pass; run the earlier passes "
                "of gradient accumulation inside `with optimizer.no_sync():`, or build the optimizer with "
                "overlap=False (this step's update used the first pass only)"
            )
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block only accumulate gradients (no bucket is encoded): the earlier
        micro-batches of gradient accumulation, as with DDP's ``no_sync``."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def close(self) -> None:
        """Remove the hooks and stop the worker."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for executor in (self._executor, self._exchange_executor):
            if executor is not None:
                executor.shutdown(wait=True)
        self._executor = self._exchange_executor = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _hook(ref: weakref.ref[GradientBuckets], i: int) -> Callable[[torch.Tensor], None]:
    def hook(_param: torch.Tensor) -> None:
        buckets = ref()
        if buckets is not None:
            buckets._grad_ready(i)

    return hook
