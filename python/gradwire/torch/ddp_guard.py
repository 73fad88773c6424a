"""Refusing to run DeMo or SparseLoCo under a DistributedDataParallel that still all-reduces gradients.

:class:`~gradwire.torch.DeMo` and :class:`~gradwire.torch.SparseLoCo` exchange compressed frames
themselves, from each rank's *own* gradients. A model wrapped in ``DistributedDataParallel`` (which the
HF Trainer, Accelerate and Lightning do under torchrun) all-reduces every gradient densely during
``backward()``, beside the optimizer's frames: the run still trains, but every byte gradwire saves is
spent again by DDP, silently. DDP keeps working — it broadcasts the weights at the start and the buffers
at each forward — once its comm hook is :func:`local_gradients_hook`, which leaves each rank's gradient
as it is and sends nothing.

:func:`check_not_all_reduced` finds the DDP modules holding the optimizer's parameters (one pass over
the garbage collector's objects, done once, at the optimizer's first distributed step) and raises
:class:`DenseAllReduceError` for one whose hook communicates.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
import gc
import warnings
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["DenseAllReduceError", "check_not_all_reduced", "local_gradients_hook", "skip_ddp_all_reduce"]


class DenseAllReduceError(RuntimeError):
    """A ``DistributedDataParallel`` module all-reduces the gradients of a gradwire optimizer's parameters."""


def local_gradients_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that sends nothing: each rank keeps its own gradient (what DeMo and SparseLoCo
    compress and exchange themselves). ``ddp_model.register_comm_hook(None, local_gradients_hook)``."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def skip_ddp_all_reduce(ddp_model: DistributedDataParallel) -> DistributedDataParallel:
    """Register :func:`local_gradients_hook` on ``ddp_model`` (once; DDP accepts one hook) and return it."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"expected a DistributedDataParallel module, got {type(ddp_model).__name__}")
    if not any(hook is local_gradients_hook for hook, _ in _python_hooks(ddp_model)):
        ddp_model.register_comm_hook(None, local_gradients_hook)
    return ddp_model


def _python_hooks(ddp: DistributedDataParallel) -> list[tuple[Callable, object]]:
    return list(getattr(ddp, "_comm_hooks", ()))


def _sends_nothing(hook: Callable) -> bool:
    if hook is local_gradients_hook:
        return True
    # torch's own no-communication hook (debugging_hooks.noop_hook) is the same thing.
    return getattr(hook, "__name__", "") == "noop_hook" and "debugging_hooks" in getattr(hook, "__module__", "")


#: Hooks known to communicate: torch's defaults (dense all-reduce, fp16/bf16 casts, PowerSGD) and gradwire's
#: own DDP hook (a second compressed exchange of the same gradients).
_COMMUNICATING = {
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "powerSGD_hook",
    "batched_powerSGD_hook",
    "gradwire_hook",
    "decompress",
    "fp16_compress_wrapper_hook",
    "bf16_compress_wrapper_hook",
    "hook_with_zero_step",
    "post_localSGD_hook",
}


def check_not_all_reduced(params: Iterable[torch.Tensor], labels: Mapping[int, str], optimizer: str) -> None:
    """Raise :class:`DenseAllReduceError` if a ``DistributedDataParallel`` module holding any of ``params``
    all-reduces their gradients (no comm hook, a builtin one, or a hook known to communicate); warn for a
    hook of unknown kind. ``labels`` maps ``id(parameter)`` to how errors name it."""
    mine = {id(p) for p in params}
    if not mine:
        return
    for obj in gc.get_objects():
        # type(), not isinstance: a proxy object's __class__ property may raise, type() never does
        if not issubclass(type(obj), DistributedDataParallel):
            continue
        held = [pid for pid in (id(p) for p in obj.module.parameters()) if pid in mine]
        if not held:
            continue
        hooks = _python_hooks(obj)
        if hooks and all(_sends_nothing(h) for h, _ in hooks):
            continue
        names = ", ".join(labels.get(pid, "?") for pid in held[:3]) + (", …" if len(held) > 3 else "")
        fix = (
            "register gradwire.torch.local_gradients_hook on it (gradwire.torch.skip_ddp_all_reduce(ddp_model), "
            "or ddp_model.register_comm_hook(None, local_gradients_hook)) so each rank keeps its own gradient, "
            "or do not wrap the model in DDP (docs/RECIPES.md)"
        )
        unknown = [
            getattr(h, "__qualname__", repr(h))
            for h, _ in hooks
            if not _sends_nothing(h) and getattr(h, "__name__", "") not in _COMMUNICATING
        ]
        if hooks and unknown and len(unknown) == len(hooks):
            warnings.warn(
                f"{optimizer}: the DistributedDataParallel module holding {names} has comm hook {unknown[0]}; if it "
                f"communicates, it spends the bytes {optimizer} saves: {fix}",
                stacklevel=3,
            )
            continue
        what = f"its comm hook {getattr(hooks[-1][0], '__qualname__', '?')}" if hooks else "its default all-reduce"
        raise DenseAllReduceError(
            f"{optimizer}: the model is wrapped in DistributedDataParallel, which exchanges the gradients of {names} "
            f"({len(held)} of this optimizer's parameters) with {what} beside {optimizer}'s own compressed frames, "
            f"so nothing is saved: {fix}"
        )
