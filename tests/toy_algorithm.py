"""A training algorithm that exists only in the test suite, in one module: error-feedback SGD on the exact
mean (``"test_ef_sgd"``). Each node adds its gradient to a residual, sends the residual compressed and
keeps what was not sent; everyone applies ``w −= lr · mean``.

It is what adding an algorithm takes: this module and its registration (:func:`register_ef_sgd`, called by
tests/test_toy_algorithm.py), and it then runs on every transport — the torch one with the sharded exchange,
overlap with the backward pass and resume from a checkpoint, the server and the client's ``Node`` — with no
other file touched.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from gradwire.algorithms import Algorithm, NodeSide, RecordLayout, algorithm_names, get_algorithm, register
from gradwire.algorithms.base import check_number, frozen_config
from gradwire.frame import Entry

NAME = "test_ef_sgd"


@frozen_config
class EFSGDConfig:
    """Error-feedback SGD: nodes send their compressed residual; everyone applies ``-lr·mean``."""

    lr: float = 0.1
    """The step on the mean."""

    def __post_init__(self) -> None:
        check_number(self.lr, f"{NAME}.lr", low=0.0, low_open=True)


class EFSGDNode(NodeSide):
    """A node's residuals (keyed by its layout's record names) and the replica."""

    records_per_tensor = True  # a tensor's records are its own gradient's: the torch transport may overlap them

    def __init__(self, codec, params: MutableMapping[str, torch.Tensor], layout: RecordLayout | None = None):
        self.codec = codec
        self.params = params
        self.layout = layout if layout is not None else RecordLayout()
        self.residuals: dict[str, torch.Tensor] = {}
        self._due: list[str] = []

    def local_step(self, grads, groups=None) -> bool:
        if grads is None:
            raise ValueError(f"{NAME} sends its gradients every step: pass them")
        cut = self.layout.cut(grads)
        for n in sorted(cut):
            g = cut[n].detach().to(torch.float32)
            r = self.residuals.get(n)
            self.residuals[n] = g.clone() if r is None else torch.add(r, g)
        self._due += sorted(cut)
        return True

    def send(self) -> list[Entry]:
        due, self._due = self._due, []
        done = self.codec.compress_bundle({n: self.residuals[n] for n in due})
        for n in due:
            self.residuals[n] = torch.sub(self.residuals[n], done[n][1].to(self.residuals[n]))
        return [done[n][0] for n in due]

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        for n, t in sent.items():
            self.residuals[n] = torch.add(self.residuals[n], t.to(self.residuals[n]))

    def target(self) -> MutableMapping[str, torch.Tensor]:
        return self.params

    def buffers(self) -> dict[str, MutableMapping[str, torch.Tensor]]:
        return {"residual": self.residuals}

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {n: t.clone() for n, t in self.residuals.items()}, "codec": self.codec.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        self.residuals = {n: t.to(torch.float32).clone() for n, t in state["residuals"].items()}


class EFSGD(Algorithm):
    name = NAME
    config_field = NAME
    config_type = EFSGDConfig
    publication = "mean"
    group_fields = ("lr",)  # a torch param group may set its own lr, and schedulers change it
    summary = "nodes send their compressed gradient residual; everyone applies -lr·mean"

    def default_codec(self, config) -> tuple[str, dict[str, Any]]:
        return "dct", {"chunk_shape": [64], "topk": 16}

    def node(self, config, codec, params, module=None, model_spec=None, *, layout=None, inner=None) -> EFSGDNode:
        return EFSGDNode(codec, params, layout)

    def apply(self, config, weights, mean, state) -> dict[str, Any]:
        lr = float(self.config(config).lr)
        with torch.no_grad():
            for n in sorted(weights):
                weights[n].sub_(torch.mul(mean[n].to(weights[n]), lr))
        return {}


def register_ef_sgd() -> Algorithm:
    """Register the algorithm (once per process); returns it."""
    if NAME not in algorithm_names():
        register(EFSGD())
    return get_algorithm(NAME)
