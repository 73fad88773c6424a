"""SparseLoCo (sparse, quantized DiLoCo): the node side and the outer step.

Between syncs each node trains alone with its inner optimizer. At a sync it forms the pseudo-gradient
``anchor − current`` (the weights at the last sync minus now), adds it to a decaying error buffer
(``e = error_decay · e + pg``), sends the compressed buffer (top-k DCT, 2-bit values) and keeps the rest
(``e −= reconstruction``). Every node averages the senders' records
(:func:`gradwire.algorithms.exact_mean`) and applies :class:`OuterStep` to the anchor; the new anchor is
everyone's new weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from .. import _native
from ..codecs import DCTCodec
from ..codecs import statedict as sd
from ..codecs.base import Codec
from ..frame import Entry
from ._state import load_tensors, save_tensors, send_and_keep_rest, take_back, updates_in_place
from .adamw import AdamWConfig
from .base import (
    Algorithm,
    NodeSide,
    RecordLayout,
    check_number,
    frozen_config,
    record_layout,
    register,
    same_names,
)

__all__ = [
    "DEFAULT_SYNC_EVERY",
    "OuterStep",
    "SPARSELOCO",
    "SparseLoCoConfig",
    "SparseLoCoState",
    "default_sparseloco_codec",
    "default_sparseloco_downlink",
    "sparseloco_codec_params",
    "sparseloco_downlink_params",
]


#: The default local steps per round. On the stdlib byte LM at 300× per local step both ways (2,048 steps,
#: docs/results/convergence-nodes.md, docs/reencode-design.md) 8 steps with 487 of each 64×64 chunk's 4096
#: coefficients held dense AdamW's held-out loss within +1.4 % (4 nodes, every frame) and +2.5 %
#: (re-encoded); at 16 nodes re-encoded +5.9 % against +6.3 % with 4 steps (171 coefficients), and 1000×
#: (72 coefficients) cost +5.2 % where 300× cost +1.4 %.
DEFAULT_SYNC_EVERY = 8


@frozen_config
class SparseLoCoConfig:
    """SparseLoCo: nodes take ``sync_every`` local steps, then send their compressed pseudo-gradient."""

    sync_every: int = DEFAULT_SYNC_EVERY
    """Local (inner) steps per round (the benches' best measured setting: :data:`DEFAULT_SYNC_EVERY`)."""
    inner: AdamWConfig = dataclasses.field(default_factory=AdamWConfig)
    """Each node's local AdamW (its schedule fields are not used)."""
    error_decay: float = 0.95
    """Decay of each node's error buffer, in [0, 1]."""
    outer_lr: float = 1.0
    """The outer step's learning rate (> 0)."""
    outer_momentum: float = 0.0
    """DiLoCo's recipe: 0.9 with outer_lr 0.7."""
    nesterov: bool = False
    """Nesterov momentum for the outer step (needs outer_momentum > 0)."""

    def __post_init__(self) -> None:
        check_number(self.sync_every, "sparseloco.sync_every", low=1, integer=True)
        if not isinstance(self.inner, AdamWConfig):
            raise ValueError(f"sparseloco.inner must be an AdamWConfig, got {type(self.inner).__name__}")
        check_number(self.error_decay, "sparseloco.error_decay", low=0.0, high=1.0)
        check_number(self.outer_lr, "sparseloco.outer_lr", low=0.0, low_open=True)
        check_number(self.outer_momentum, "sparseloco.outer_momentum", low=0.0, high=1.0, high_open=True)
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"sparseloco.nesterov must be a boolean, got {self.nesterov!r}")

    def outer_step(self) -> OuterStep:
        """A fresh :class:`OuterStep` of this config."""
        return OuterStep(self.outer_lr, self.outer_momentum, self.nesterov)


#: The ratio the default codec aims for (fp32 bytes per local step over frame bytes per local step),
#: with a margin over the 300× it promises: the benches' best quality at ≥ 300× is there, with the
#: largest ``k`` those bytes allow (more coefficients per round rather than fewer bytes).
_TARGET_RATIO = 330.0
_TILE = 64 * 64


def _estimated_chunk_bytes(k: int, value_bits: int = 2) -> float:
    """Bytes one 64×64 chunk of ``k`` kept coefficients takes: Rice-coded positions (within 3 % of the
    ``log2(C choose k)`` floor), the packed values, a float32 scale and minimum."""
    floor_bits = (math.lgamma(_TILE + 1) - math.lgamma(k + 1) - math.lgamma(_TILE - k + 1)) / math.log(2)
    return 1.03 * floor_bits / 8 + k * value_bits / 8 + 8


def default_sparseloco_codec(sync_every: int = DEFAULT_SYNC_EVERY) -> Codec:
    """SparseLoCo's default codec for syncs every ``sync_every`` local steps: DCT on 64×64 tiles (flat
    64×64 chunks where tiles would be small), 2-bit values, positions Rice-coded (or packed, if smaller).

    The per-chunk budget ``k`` is the largest whose estimated bytes per sync, spread over ``sync_every``
    local steps, stay ≥ 330× below fp32 on 64×64 tiles, at most half the chunk: 472 of 4096 at the default
    8 steps, 31 at 1, 2,048 from 32 on (≈ 500× there); a smaller chunk keeps its share
    (``topk_scaling="proportional"``). Measured on a 1024×1024 weight in tests/test_algorithms.py. (Before
    the benches measured it, the budget was capped at SparseLoCo's own 64 per chunk, which sends ≈ 1,700×
    at 8 steps and ≈ 6,000× at 32 — a ratio whose quality no bench had measured, where 1000× already
    cost +5 % loss.)
    """
    return DCTCodec(**sparseloco_codec_params(sync_every))


def sparseloco_codec_params(sync_every: int = DEFAULT_SYNC_EVERY) -> dict[str, Any]:
    """The keyword parameters of :func:`default_sparseloco_codec` (as ``gradwire.build_codec("dct",
    **params)`` takes them; also the default downlink of a SparseLoCo run's re-encoded aggregate)."""
    sync_every = int(sync_every)
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    budget = 4 * _TILE * sync_every / _TARGET_RATIO
    # The estimate grows with k up to half the chunk (where the positions cost most): the largest k
    # within the budget, at least 1 and at most half the chunk.
    lo, hi = 1, _TILE // 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _estimated_chunk_bytes(mid) <= budget else (lo, mid - 1)
    k = lo
    return {
        "chunk_shape": [64, 64],
        "topk": k,
        "mode": "tiles",
        "index_coding": "auto",
        "value_bits": 2,
        "topk_scaling": "proportional",
    }


#: Value bits of the re-encoded aggregate: at 16 nodes on the stdlib byte LM (640 steps, the best lr, 2 seeds,
#: docs/reencode-design.md) 4-bit values at the same downlink bytes held 1.766 where the nodes' own 2-bit
#: codec held 1.802 (verbatim frames: 1.704); at 64 nodes (320 steps, one seed) 2.023 against 2.139.
DOWNLINK_VALUE_BITS = 4


def default_sparseloco_downlink(sync_every: int = DEFAULT_SYNC_EVERY) -> Codec:
    """The default codec that re-encodes a SparseLoCo round's mean (the server's, or a sharded owner's)."""
    return DCTCodec(**sparseloco_downlink_params(sync_every))


def sparseloco_downlink_params(sync_every: int = DEFAULT_SYNC_EVERY) -> dict[str, Any]:
    """The parameters of :func:`default_sparseloco_downlink`: the nodes' codec for ``sync_every``
    (:func:`sparseloco_codec_params`), its bytes spent on :data:`DOWNLINK_VALUE_BITS`-bit values — the
    largest ``k`` whose estimated chunk bytes stay within the nodes' — so a node receives about what it
    sends."""
    params = sparseloco_codec_params(sync_every)
    budget = _estimated_chunk_bytes(params["topk"], params["value_bits"])
    k = params["topk"]
    while k > 1 and _estimated_chunk_bytes(k, DOWNLINK_VALUE_BITS) > budget:
        k -= 1
    return {**params, "topk": k, "value_bits": DOWNLINK_VALUE_BITS}


class SparseLoCoState:
    """SparseLoCo's node side: one float32 error buffer per tensor name, the codec, ``error_decay``."""

    def __init__(self, codec: Codec | None = None, *, error_decay: float = 0.95):
        error_decay = float(error_decay)
        if not 0.0 <= error_decay <= 1.0:
            raise ValueError(f"error_decay must lie in [0, 1], got {error_decay}")
        self.codec = codec if codec is not None else default_sparseloco_codec()
        self.error_decay = error_decay
        self.errors: dict[str, torch.Tensor] = {}

    def compress(self, anchor: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> list[Entry]:
        """``pg = anchor − current``; ``e = error_decay·e + pg``; the codec compresses every buffer (one
        ``compress_bundle`` in sorted name order); ``e −= reconstruction``. Records in sorted name order."""
        names = sorted(anchor)
        if set(current) != set(anchor):
            raise ValueError("anchor and current must name the same tensors")
        in_place = updates_in_place(self.codec)
        pgs, decayed, fresh = [], [], []
        for n in names:
            a, c = anchor[n], current[n]
            if tuple(a.shape) != tuple(c.shape):
                raise ValueError(f"{n!r}: anchor has shape {tuple(a.shape)}, current {tuple(c.shape)}")
            e = self.errors.get(n)
            if e is not None and tuple(e.shape) != tuple(a.shape):
                raise ValueError(f"{n!r} has shape {tuple(a.shape)}, its error buffer {tuple(e.shape)}")
            pgs.append((a.detach().to(torch.float32), c.detach().to(device=a.device, dtype=torch.float32)))
        # pg = anchor − current and e = error_decay·e + pg: one _foreach_ op each over every tensor, the
        # buffers (this object's own) in place around a codec whose records never view them — the same
        # once-rounded operations as tensor by tensor, so the same bits.
        pg = torch._foreach_sub([a for a, _ in pgs], [c for _, c in pgs]) if pgs else []
        for n, d in zip(names, pg):
            e = self.errors.get(n)
            if e is None:
                self.errors[n] = d
                continue
            if e.device != d.device:
                e = e.to(d.device)
            elif not in_place:
                e = e.clone()  # a record made at the last sync may view it: step a copy
            decayed.append(e)
            fresh.append(d)
            self.errors[n] = e
        if decayed:
            torch._foreach_mul_(decayed, self.error_decay)
            torch._foreach_add_(decayed, fresh)
        return send_and_keep_rest(self.codec, self.errors, names, in_place=in_place)

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        """Add back what a frame made by :meth:`compress` carried (decoded), when it never counted."""
        take_back(self.errors, sent)

    def state_dict(self) -> dict[str, Any]:
        """``{"errors": {name: float32 tensor}, "codec": codec.state_dict()}`` (copies)."""
        return {"errors": save_tensors(self.errors), "codec": self.codec.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = sd.fields(state, "SparseLoCoState state", ("errors", "codec"))
        errors = load_tensors(state["errors"], "error buffer")
        self.codec.load_state_dict(state["codec"])
        self.errors = errors

    def __repr__(self) -> str:
        return f"SparseLoCoState({self.codec!r}, error_decay={self.error_decay}, errors={len(self.errors)})"


class OuterStep:
    """The outer optimizer, the same on every node and on the server: SGD on the anchor with the mean
    pseudo-gradient as its gradient.

    - plain (``momentum=0``): ``anchor −= outer_lr · delta``;
    - with ``momentum`` μ (torch's SGD, no dampening): ``b = μ·b + delta`` (``b = delta`` at the first
      step), then ``anchor −= outer_lr · b``, or with ``nesterov`` ``anchor −= outer_lr · (delta + μ·b)``.

    DiLoCo's recipe is Nesterov momentum 0.9 with outer learning rate 0.7
    (``OuterStep(outer_lr=0.7, momentum=0.9, nesterov=True)``). Every operation is one elementwise,
    once-rounded multiply or add, so the same deltas give the same anchors on every device.
    """

    def __init__(self, outer_lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False):
        outer_lr, momentum = float(outer_lr), float(momentum)
        if not outer_lr > 0.0 or not math.isfinite(outer_lr):
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
        if nesterov and momentum == 0.0:
            raise ValueError("nesterov needs a momentum > 0")
        self.outer_lr = outer_lr
        self.momentum = momentum
        self.nesterov = bool(nesterov)
        self.buffers: dict[str, torch.Tensor] = {}

    def apply(self, anchor: MutableMapping[str, torch.Tensor], mean_delta: Mapping[str, torch.Tensor]) -> None:
        """Step ``anchor`` (the last synced weights, updated in place) by ``mean_delta``, in sorted name order."""
        missing = sorted(set(anchor) - set(mean_delta))
        if missing:
            raise ValueError(f"no mean delta for {missing[:5]}")
        with torch.no_grad():
            rest: list[tuple[str, torch.Tensor, torch.Tensor]] = []
            for n in sorted(anchor):
                a = anchor[n]
                d = mean_delta[n]
                if tuple(d.shape) != tuple(a.shape):
                    raise ValueError(f"mean delta {n!r} has shape {tuple(d.shape)}, the anchor {tuple(a.shape)}")
                d = d.to(device=a.device, dtype=torch.float32)
                if self._stepped_natively(n, a, d):
                    continue
                rest.append((n, a, d))
            if rest:
                self._apply_foreach(rest)

    def _apply_foreach(self, rest: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """:meth:`apply` for tensors the native step does not take (a GPU's), every stage one ``_foreach_``
        op over all of them: the operations and their order unchanged (so the same rounding), in place
        where they can be — each is one rounded multiply or add, and ``x + y`` rounds as ``y + x``."""
        names = [n for n, _, _ in rest]
        anchors = [a for _, a, _ in rest]
        deltas = [d for _, _, d in rest]
        if self.momentum:
            held = [(i, self.buffers[n].to(anchors[i].device)) for i, n in enumerate(names) if n in self.buffers]
            if held:
                bs = [b for _, b in held]
                torch._foreach_mul_(bs, self.momentum)
                torch._foreach_add_(bs, [deltas[i] for i, _ in held])
            buffers = dict(held)
            for i, n in enumerate(names):
                b = buffers.get(i)
                if b is None:
                    b = deltas[i].clone()
                self.buffers[n] = b
                buffers[i] = b
            bufs = [buffers[i] for i in range(len(names))]
            owned = self.nesterov  # Nesterov's step is a new tensor; otherwise it is the buffer
            if self.nesterov:
                steps = torch._foreach_mul(bufs, self.momentum)
                torch._foreach_add_(steps, deltas)
            else:
                steps = bufs
        else:
            owned, steps = False, deltas
        # Multiplying by 1.0 is exact, so an outer lr of 1 subtracts the step itself; the step is scaled
        # in place only where it is this call's own tensor (not the buffer, not the delta).
        if self.outer_lr != 1.0:
            if owned:
                torch._foreach_mul_(steps, self.outer_lr)
            else:
                steps = torch._foreach_mul(steps, self.outer_lr)
        steps = [s if s.dtype == a.dtype else s.to(a.dtype) for s, a in zip(steps, anchors)]
        torch._foreach_sub_(anchors, steps)

    def _stepped_natively(self, name: str, a: torch.Tensor, d: torch.Tensor) -> bool:
        """The step of one float32 CPU tensor in one pass (``gradwire._native.outer_step``: the same
        operations in the same order as :meth:`apply`'s torch operations, so the same bits; a server's
        close at 10 M parameters spent six passes over memory here). ``False``, nothing done, for
        anything else."""
        if a.device.type != "cpu" or a.dtype != torch.float32 or not a.is_contiguous():
            return False
        b = self.buffers.get(name) if self.momentum else None
        fresh = self.momentum != 0.0 and b is None
        if b is not None and (
            b.device.type != "cpu" or b.dtype != torch.float32 or not b.is_contiguous() or b.shape != a.shape
        ):
            return False
        if fresh:
            b = torch.empty_like(a)  # the kernel writes the delta into it: b = d at the first step
        # detach(): the same memory, numpy-viewable even where a tensor requires grad
        _native.outer_step(
            a.detach().reshape(-1).numpy(),
            None if b is None else b.detach().reshape(-1).numpy(),
            d.detach().contiguous().reshape(-1).numpy(),
            self.momentum,
            self.nesterov,
            self.outer_lr,
            fresh,
            torch.get_num_threads(),
        )
        if b is not None:
            self.buffers[name] = b
        return True

    def state_dict(self) -> dict[str, Any]:
        """``{"buffers": {name: float32 momentum buffer}}`` (empty without momentum)."""
        return {"buffers": save_tensors(self.buffers)}

    def load_state_dict(self, state: Mapping[str, Any], *, copy: bool = True) -> None:
        """Take :meth:`state_dict`'s buffers (copies; with ``copy=False`` the float32 tensors themselves,
        which later steps then update in place)."""
        state = sd.fields(state, "OuterStep state", ("buffers",))
        self.buffers = load_tensors(state["buffers"], "outer momentum buffer", copy=copy)

    def __repr__(self) -> str:
        return f"OuterStep(outer_lr={self.outer_lr}, momentum={self.momentum}, nesterov={self.nesterov})"


class SparseLoCoNode(NodeSide):
    """A node of a SparseLoCo run: the inner optimizer (an AdamW over the module, or the one given), the
    error buffers (:class:`SparseLoCoState`, keyed by the layout's record names), and the anchor — the
    weights of the last synced version, which published versions step and which then become the replica."""

    needs_algorithm_state = True
    reads_module_grads = True
    checkpoint_counters = {"local_steps": "steps", "syncs": "rounds"}
    parameter_counters = {"step": "steps", "syncs": "rounds"}

    def __init__(
        self,
        config: SparseLoCoConfig,
        codec: Codec,
        params: MutableMapping[str, torch.Tensor],
        module: torch.nn.Module | None,
        layout: RecordLayout | None = None,
        inner: torch.optim.Optimizer | None = None,
    ):
        if inner is None:
            if module is None:
                raise ValueError("a SparseLoCo node takes local optimizer steps: give it the module, not tensors")
            inner = torch.optim.AdamW(module.parameters(), **config.inner.torch_kwargs())
        self.config = config
        self.state = SparseLoCoState(codec, error_decay=config.error_decay)
        self.inner = inner
        self.module = module
        self.params = params
        self.layout = layout if layout is not None else RecordLayout()
        self.anchor: dict[str, torch.Tensor] = {}
        self.local_steps = 0

    @property
    def error_decay(self) -> float:
        """The error buffer's decay (``opt.node.error_decay``, as on the node side before the one transport)."""
        return self.state.error_decay

    @property
    def codec(self) -> Codec:
        return self.state.codec

    @property
    def errors(self) -> dict[str, torch.Tensor]:
        """The error buffers by record name (a parameter's name, a piece's, or the model record's)."""
        return self.state.errors

    def local_step(self, grads, groups=None) -> bool:
        """One inner step (on ``grads`` if given, else the parameters' ``.grad``); whether it is a
        ``sync_every``-th one, which sends."""
        if grads is not None:
            params = dict(self.module.named_parameters())
            for name, g in grads.items():
                params[name].grad = g
        self.inner.step()
        self.local_steps += 1
        return self.local_steps % self.config.sync_every == 0

    def send(self) -> list[Entry]:
        """The records of the pseudo-gradient since the anchor, into the error buffers."""
        current = {n: self.params[n] for n in self.anchor}
        return self.state.compress(self.layout.cut(self.anchor), self.layout.cut(current))

    def joined(self, tensors: Mapping[str, torch.Tensor]) -> None:
        # Its weights now are its anchor: the inner optimizer has not stepped it since the last sync.
        for n, t in tensors.items():
            self.params[n] = t
            self.anchor[n] = t.detach().to(torch.float32).clone()

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        self.state.take_back(sent)

    def target(self) -> MutableMapping[str, torch.Tensor]:
        return self.anchor

    def loaded(self) -> None:
        with torch.no_grad():
            self.anchor = {n: t.detach().to(torch.float32).clone() for n, t in self.params.items()}

    def synced(self) -> None:
        # The local steps since the last sync are replaced by the synced weights: one _foreach_copy_ (exact
        # copies, the same bits as tensor by tensor).
        if self.anchor:
            with torch.no_grad():
                torch._foreach_copy_([self.params[n] for n in self.anchor], list(self.anchor.values()))

    def buffers(self) -> dict[str, MutableMapping[str, torch.Tensor]]:
        return {"error": self.state.errors}

    def tensors(self) -> dict[str, MutableMapping[str, torch.Tensor]]:
        return {"anchor": self.anchor}

    def load_torch_state(self, state: Mapping[str, Any], steps: int) -> None:
        super().load_torch_state(state, steps)
        self.local_steps = int(steps)

    def state_dict(self) -> dict[str, Any]:
        return {
            "node": self.state.state_dict(),
            "inner": self.inner.state_dict(),
            "anchor": save_tensors(self.anchor),
            "local_steps": self.local_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = sd.fields(state, "SparseLoCo node state", ("node", "inner", "anchor", "local_steps"))
        anchor = load_tensors(state["anchor"], "anchor")
        same_names(list(anchor), list(self.params), "the saved anchor's tensors")
        self.state.load_state_dict(state["node"])
        self.inner.load_state_dict(state["inner"])
        self.anchor = anchor
        self.local_steps = int(state["local_steps"])


class SparseLoCoAlgorithm(Algorithm):
    name = "sparseloco"
    config_field = "sparseloco"
    config_type = SparseLoCoConfig
    publication = "mean"
    takes_model_record = True
    summary = (
        "nodes take sync_every local AdamW steps, then send their compressed pseudo-gradient with "
        "error feedback; everyone applies the outer step to the last synced weights"
    )

    def default_codec(self, config) -> tuple[str, dict[str, Any]]:
        return "dct", sparseloco_codec_params(self.config(config).sync_every)

    def default_downlink(self, config) -> tuple[str, dict[str, Any]]:
        return "dct", sparseloco_downlink_params(self.config(config).sync_every)

    applies_as_gradient = True  # the outer step is SGD on the anchor with the mean pseudo-gradient as its gradient

    def node(self, config, codec, params, module=None, model_spec=None, *, layout=None, inner=None) -> SparseLoCoNode:
        layout = layout if layout is not None else record_layout(model_spec)
        return SparseLoCoNode(self.config(config), codec, params, module, layout, inner)

    def apply(self, config, weights, mean, state) -> dict[str, Any]:
        outer = self.config(config).outer_step()
        # The momentum steps in place, as the weights do: no copy of a model-sized buffer per version.
        outer.load_state_dict(state.get("outer", {"buffers": {}}), copy=False)
        outer.apply(weights, mean)
        return {"outer": {"buffers": {n: outer.buffers[n] for n in sorted(outer.buffers)}}}

    def public_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {"outer": state["outer"]} if "outer" in state else {}

    def parameter_state(self, config, state) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """The outer momentum per tensor (``"outer_momentum"``; none without momentum)."""
        buffers = dict(state.get("outer", {}).get("buffers", {}))
        rest = {k: v for k, v in state.items() if k != "outer"}
        return ({"outer_momentum": buffers} if self.config(config).outer_momentum else {}), rest

    def with_parameter_state(self, config, rest, tensors) -> dict[str, Any]:
        return {**rest, "outer": {"buffers": dict(tensors.get("outer_momentum", {}))}}


SPARSELOCO = register(SparseLoCoAlgorithm())
