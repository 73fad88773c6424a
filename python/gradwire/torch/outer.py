"""Any torch optimizer as SparseLoCo's outer step, as torchft's DiLoCo takes any ``outer_optimizer``.

The default outer step is :class:`gradwire.algorithms.OuterStep` (SGD, with momentum and Nesterov if asked:
DiLoCo's recipe), which the server applies too. :class:`TorchOuterStep` runs a torch optimizer instead —
``torch.optim.SGD``, ``Adam``, anything that steps parameters from their ``.grad`` — over SparseLoCo's
anchor (the float32 weights of the last sync), with every sync's exact mean pseudo-gradient as the
gradient. Every rank holds the same anchor and receives the same mean, so an optimizer whose step is the
same sequence of elementwise operations on every rank (torch's are, on one kind of device) keeps every
replica bit-identical; tests/test_torch_outer_optimizer.py checks it on gloo ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["OuterOptimizerFactory", "TorchOuterStep"]

#: What ``SparseLoCo(outer_optimizer=...)`` takes: the anchor tensors (sorted by parameter position) to a
#: torch optimizer over exactly them, e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)``.
OuterOptimizerFactory = Callable[[list], torch.optim.Optimizer]


class TorchOuterStep:
    """A torch optimizer built by ``factory`` over ``anchor``'s tensors, with :class:`~gradwire.algorithms.OuterStep`'s
    ``apply`` / ``state_dict`` / ``load_state_dict``."""

    def __init__(self, factory: OuterOptimizerFactory, anchor: Mapping[str, torch.Tensor]):
        self.factory = factory
        self.names = sorted(anchor)
        tensors = [anchor[n] for n in self.names]
        optimizer = factory(tensors)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
        given = sorted(id(p) for g in optimizer.param_groups for p in g["params"])
        if given != sorted(id(t) for t in tensors):
            raise ValueError(
                "outer_optimizer must build its optimizer over exactly the tensors it is given "
                "(SparseLoCo's anchor), not over the model's parameters"
            )
        self.optimizer = optimizer
        self.anchor = dict(anchor)

    def apply(self, anchor: MutableMapping[str, torch.Tensor], mean_delta: Mapping[str, torch.Tensor]) -> None:
        """Step ``anchor`` with ``mean_delta`` as its gradient (one ``optimizer.step()``)."""
        missing = sorted(set(anchor) - set(mean_delta))
        if missing:
            raise ValueError(f"no mean delta for {missing[:5]}")
        if sorted(anchor) != self.names:
            joined = sorted(set(anchor) - set(self.names))[:5]
            raise ValueError(
                f"parameters {joined} joined the exchange after the outer optimizer was built over the "
                "others: with outer_optimizer the trainable set is fixed (unfreeze before building "
                "SparseLoCo)"
            )
        for n in self.names:
            a = anchor[n]
            if a is not self.anchor[n]:
                raise RuntimeError(f"the anchor of {n!r} is no longer the tensor the outer optimizer steps")
            d = mean_delta[n]
            if tuple(d.shape) != tuple(a.shape):
                raise ValueError(f"mean delta {n!r} has shape {tuple(d.shape)}, the anchor {tuple(a.shape)}")
            a.grad = d.to(device=a.device, dtype=a.dtype)
        with torch.no_grad():
            self.optimizer.step()
        for n in self.names:
            anchor[n].grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"torch_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "torch_optimizer" not in state:
            raise ValueError(
                "this checkpoint's outer step is gradwire's own OuterStep, not a torch optimizer: "
                "build SparseLoCo without outer_optimizer (or with the same one) to resume it"
            )
        self.optimizer.load_state_dict(state["torch_optimizer"])

    def __repr__(self) -> str:
        return f"TorchOuterStep({type(self.optimizer).__name__}, {len(self.names)} tensors)"
