"""DeMo (Decoupled Momentum Optimization, Peng et al. 2024): the node side and the update.

Each node keeps a float32 momentum per parameter. A step adds ``lr · grad`` to the decayed momentum,
sends the DCT top-k of the momentum (the fast-moving components), and subtracts from the momentum
exactly what receivers will decode, so the rest keeps accumulating locally. Every node averages the
senders' records (:func:`gradwire.algorithms.exact_mean`) and applies ``−lr · sign(mean)`` plus decoupled
weight decay (:func:`demo_update`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from ..codecs import DCTCodec
from ..codecs import statedict as sd
from ..codecs.base import Codec
from ..frame import Entry
from ._state import load_tensors, save_tensors, send_and_keep_rest, take_back, updates_in_place
from .base import (
    Algorithm,
    NodeSide,
    RecordLayout,
    check_number,
    frozen_config,
    ordered,
    record_layout,
    register,
    same_names,
)

__all__ = ["DEMO", "DeMoConfig", "DeMoState", "default_demo_codec", "demo_codec_params", "demo_update"]


@frozen_config
class DeMoConfig:
    """DeMo: nodes send the top-k DCT of their decoupled momentum; everyone applies ``-lr·sign(mean)``."""

    lr: float = 1e-3
    """The sign step (also scales the momentum's input, lr·grad)."""
    beta: float = 0.999
    """Momentum decay, in [0, 1)."""
    weight_decay: float = 0.0
    """Decoupled: p ← p·(1 − lr·weight_decay)."""

    def __post_init__(self) -> None:
        check_number(self.lr, "demo.lr", low=0.0, low_open=True)
        check_number(self.beta, "demo.beta", low=0.0, high=1.0, high_open=True)
        check_number(self.weight_decay, "demo.weight_decay", low=0.0)


def default_demo_codec() -> Codec:
    """DeMo's default codec: DCT on 64×64 tiles (flat 64×64 chunks where tiles would be small), the 22
    largest coefficients of a full tile and a smaller chunk's share of 22 (``topk_scaling="proportional"``),
    1-bit values, positions Rice-coded (or packed, if smaller).

    A 1024×1024 float32 weight's record takes about 9.2 KB (456×); an embedding-and-linears model of
    240 k parameters whose dimensions are not multiples of 64 sends and receives ≥ 300× fewer bytes
    than fp32 (tests/test_torch_optimizers.py; docs/ALGORITHMS.md has the numbers and why 22).
    """
    return DCTCodec(**demo_codec_params())


def demo_codec_params() -> dict[str, Any]:
    """The keyword parameters of :func:`default_demo_codec` (as ``gradwire.build_codec("dct", **params)``
    takes them; also the default downlink of a DeMo run's re-encoded aggregate)."""
    return {
        "chunk_shape": [64, 64],
        "topk": 22,
        "mode": "tiles",
        "index_coding": "auto",
        "value_bits": 1,
        "topk_scaling": "proportional",
    }


class DeMoState:
    """DeMo's node side: one float32 momentum per tensor name, the codec, ``beta``.

    ``momenta`` live on their tensors' devices; the first :meth:`compress` of a name starts it at zero.
    """

    def __init__(self, codec: Codec | None = None, *, beta: float = 0.999):
        beta = float(beta)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must lie in [0, 1], got {beta}")
        self.codec = codec if codec is not None else default_demo_codec()
        self.beta = beta
        self.momenta: dict[str, torch.Tensor] = {}

    def compress(self, grads: Mapping[str, torch.Tensor], lr: float) -> list[Entry]:
        """``m = beta·m + lr·grad``; the codec compresses every momentum (one ``compress_bundle`` in
        sorted name order); ``m -= reconstruction``. Returns the records in sorted name order."""
        self.accumulate(grads, lr)
        return self.send(sorted(grads))

    def accumulate(self, grads: Mapping[str, torch.Tensor], lr: float) -> None:
        """``m = beta·m + lr·grad`` for every name of ``grads`` (a first one starts at zero)."""
        names = sorted(grads)
        lr = float(lr)
        gs = []
        for n in names:
            g = grads[n]
            if not isinstance(g, torch.Tensor) or not g.is_floating_point():
                raise ValueError(f"gradient {n!r} must be a floating-point tensor")
            g = g.detach().to(torch.float32)
            m = self.momenta.get(n)
            if m is not None and tuple(m.shape) != tuple(g.shape):
                raise ValueError(f"gradient {n!r} has shape {tuple(g.shape)}, its momentum {tuple(m.shape)}")
            gs.append(g)
        in_place = updates_in_place(self.codec)
        # Separate multiply and add (no fused alpha): each op rounds once, on every device. The momenta
        # are this object's own tensors, so (around a codec whose records never view them) they step in
        # place, every tensor in one _foreach_ op each: the same operations, the same bits.
        ms = []
        for n, g in zip(names, gs):
            m = self.momenta.get(n)
            if m is None:
                m = torch.zeros_like(g)
            elif m.device != g.device:
                m = m.to(g.device)
            elif not in_place:
                m = m.clone()  # a record made last step may view it: step a copy
            ms.append(m)
        if ms:
            torch._foreach_mul_(ms, self.beta)
            torch._foreach_add_(ms, torch._foreach_mul(gs, lr))
        for n, m in zip(names, ms):
            self.momenta[n] = m

    def send(self, names: Sequence[str]) -> list[Entry]:
        """The codec compresses the momenta of ``names`` (one ``compress_bundle``, in that order); each
        keeps what was not sent (``m -= reconstruction``). Returns the records in that order."""
        return send_and_keep_rest(self.codec, self.momenta, list(names), in_place=updates_in_place(self.codec))

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        """Add back what a frame made by :meth:`compress` carried (decoded), when it never counted."""
        take_back(self.momenta, sent)

    def state_dict(self) -> dict[str, Any]:
        """``{"momenta": {name: float32 tensor}, "codec": codec.state_dict()}`` (copies)."""
        return {"momenta": save_tensors(self.momenta), "codec": self.codec.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from what :meth:`state_dict` returned; ``ValueError`` on a bad state."""
        state = sd.fields(state, "DeMoState state", ("momenta", "codec"))
        momenta = load_tensors(state["momenta"], "momentum")
        self.codec.load_state_dict(state["codec"])
        self.momenta = momenta

    def __repr__(self) -> str:
        return f"DeMoState({self.codec!r}, beta={self.beta}, momenta={len(self.momenta)})"


def demo_update(
    params: Mapping[str, torch.Tensor], mean: Mapping[str, torch.Tensor], lr: float, weight_decay: float = 0.0
) -> None:
    """DeMo's update, in place, in sorted name order: ``p *= 1 − lr·weight_decay`` (if any), then
    ``p −= lr · sign(mean[name])``.

    Every operation is elementwise and rounds once (the sign step's product ``lr · ±1`` is exact), so the
    same ``mean`` gives the same bits on every device.
    """
    lr = float(lr)
    weight_decay = float(weight_decay)
    missing = sorted(set(params) - set(mean))
    if missing:
        raise ValueError(f"no aggregate for {missing[:5]}")
    names = sorted(params)
    for n in names:
        if tuple(mean[n].shape) != tuple(params[n].shape):
            raise ValueError(
                f"aggregate {n!r} has shape {tuple(mean[n].shape)}, the parameter {tuple(params[n].shape)}"
            )
    if not names:
        return
    with torch.no_grad():
        # One _foreach_ op per stage over every tensor (as torch.optim's foreach paths): each is the same
        # elementwise operation as tensor by tensor, so the same bits.
        ps = [params[n] for n in names]
        signs = torch._foreach_sign([mean[n].to(params[n].device) for n in names])
        signs = [s if s.dtype == p.dtype else s.to(p.dtype) for s, p in zip(signs, ps)]
        if weight_decay:
            torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
        torch._foreach_add_(ps, signs, alpha=-lr)


class DeMoNode(NodeSide):
    """A node of a DeMo run: its momenta (:class:`DeMoState`, keyed by the layout's record names), each
    step's records, the replica."""

    records_per_tensor = True
    checkpoint_counters = {"steps": "steps"}  # a DeMo round is a step

    def __init__(
        self,
        config: DeMoConfig,
        codec: Codec,
        params: MutableMapping[str, torch.Tensor],
        layout: RecordLayout | None = None,
    ):
        self.config = config
        self.state = DeMoState(codec, beta=config.beta)
        self.params = params
        self.layout = layout if layout is not None else RecordLayout()
        self._due: list[list[str]] = []  # the record names stepped since the last send, by group

    @property
    def codec(self) -> Codec:
        return self.state.codec

    @property
    def momenta(self) -> dict[str, torch.Tensor]:
        """The momenta by record name (a parameter's name, a piece's, or the model record's)."""
        return self.state.momenta

    def records(self, grads: Mapping[str, torch.Tensor] | None) -> list[Entry]:
        if grads is None:
            raise ValueError("a DeMo node sends its momentum every step: pass the gradients")
        same_names(list(grads), list(self.params), "gradients")
        self.local_step(ordered(grads))
        return self.send()

    def local_step(self, grads, groups=None) -> bool:
        """Each group's ``m = beta·m + lr·grad`` (the group's lr), in the layout's records. Where the layout
        joins the tensors into one record, each group's ``lr·grad`` is taken first and the record steps
        at lr 1 (``x·1`` is exact: the same bits as each group at its own lr)."""
        if grads is None:
            raise ValueError("a DeMo node steps its momentum every step: pass the gradients")
        unknown = sorted(set(grads) - set(self.params))
        if unknown:
            raise ValueError(f"gradients of {unknown[:5]}, which are not this node's tensors")
        if groups is None:
            groups = [(self.config, sorted(grads))]
        if self.layout.joins_tensors:
            scaled = {}
            for config, names in groups:
                scaled.update({n: torch.mul(grads[n].detach().to(torch.float32), config.lr) for n in names})
            cut = self.layout.cut(scaled)
            self.state.accumulate(cut, 1.0)
            self._due.append(sorted(cut))
            return True
        for config, names in groups:
            cut = self.layout.cut({n: grads[n] for n in names})
            self.state.accumulate(cut, config.lr)
            self._due.append(sorted(cut))
        return True

    def send(self) -> list[Entry]:
        """The stepped momenta's records, group by group (one ``compress_bundle`` each), the rest kept."""
        due, self._due = self._due, []
        out: list[Entry] = []
        for names in due:
            out += self.state.send(names)
        return out

    def joined(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.params.update(tensors)  # its momentum starts at zero at its first step

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        self.state.take_back(sent)

    def target(self) -> MutableMapping[str, torch.Tensor]:
        return self.params

    def buffers(self) -> dict[str, MutableMapping[str, torch.Tensor]]:
        return {"momentum": self.state.momenta}

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state.load_state_dict(state)


class DeMoAlgorithm(Algorithm):
    name = "demo"
    config_field = "demo"
    config_type = DeMoConfig
    publication = "mean"
    takes_model_record = True
    summary = "nodes send the top-k DCT of their decoupled momentum; everyone applies -lr·sign(mean)"

    def default_codec(self, config) -> tuple[str, dict[str, Any]]:
        return "dct", demo_codec_params()

    def default_downlink(self, config) -> tuple[str, dict[str, Any]]:
        return "dct", demo_codec_params()

    group_fields = ("lr", "weight_decay")

    def node(self, config, codec, params, module=None, model_spec=None, *, layout=None, inner=None) -> DeMoNode:
        if inner is not None:
            raise ValueError("DeMo steps no inner optimizer: its step is the momentum's and the sign step")
        return DeMoNode(self.config(config), codec, params, layout if layout is not None else record_layout(model_spec))

    def apply(self, config, weights, mean, state) -> dict[str, Any]:
        config = self.config(config)
        demo_update(weights, mean, config.lr, config.weight_decay)
        return {}


DEMO = register(DeMoAlgorithm())
