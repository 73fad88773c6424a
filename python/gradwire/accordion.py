"""Accordion (Agarwal et al. 2021): switch each layer between a gentle and an aggressive codec setting
by detecting critical regimes of training.

Per tensor name, Accordion sums the tensors it is given over each interval of ``interval`` calls and
compares the norm of that sum with the previous interval's:

    ratio = |‖Δold‖ − ‖Δcurr‖| / ‖Δold‖;   critical  ⇔  ratio ≥ threshold (η)

A critical layer uses ``low`` (the gentle setting: low compression) for the next interval, any other
``high`` (the aggressive one). The first interval of every layer is critical — training starts in a
critical regime — so it runs on ``low``; so does the end of an interval with no previous norm to
compare (``ratio`` is then ``inf``; it is ``0`` when both norms are 0).

Accordion is not a wire format and has no codec id: each record is made by ``low`` or ``high`` and
carries that codec's id and parameters, so the setting in force is visible in every frame
(:func:`setting_of` reads it from a record; :meth:`Accordion.regime_of` says which of the two made it),
and frames decode with the wrapped codec's decoder. Every decision is kept in :attr:`Accordion.log`.

With error feedback (``ErrorFeedback(Accordion(...))``) the tensors Accordion sees include the carried
residual; the norms it compares are of those sums.

Accordion is a policy above the codecs, not one of them: it lives outside :mod:`gradwire.codecs` and
outside the wire codecs' registry ``gradwire.CODECS``; ``gradwire.make_codec("accordion", low=…, high=…)``
builds it through :mod:`gradwire.registry`, as every name of ``gradwire.codec_names()``. It follows the
:class:`~gradwire.codecs.base.Codec` protocol, so it
goes wherever a codec goes (``ErrorFeedback``, ``gradwire.torch.ddp_hook``), and builds the codecs it is
given as mappings (``{"codec": "powersgd", "rank": 2}``) with the registry's :func:`make_codec`. This
module imports :mod:`gradwire.codecs`, never the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from .capabilities import capabilities_of, provide
from .codecs import make_codec
from .codecs import record as rec
from .codecs import statedict as sd
from .codecs.base import Codec
from .frame import Entry

__all__ = ["Accordion", "AccordionDecision", "register_setting_reader", "setting_of"]

LOW = "low"
HIGH = "high"


class AccordionDecision(NamedTuple):
    """One interval's decision for one layer: a tuple ``(step, name, norm, ratio, critical, setting)``."""

    step: int  #: how many tensors of this name Accordion had compressed when it decided
    name: str
    norm: float  #: ‖Δcurr‖, the norm of the sum over the interval just ended
    ratio: float  #: |‖Δold‖ − ‖Δcurr‖| / ‖Δold‖ (inf without a previous norm)
    critical: bool
    setting: str  #: "low" or "high": the setting of the next interval


@dataclass
class _Layer:
    calls: int = 0
    total: torch.Tensor | None = None
    old_norm: float | None = None
    setting: str = LOW


CodecSpec = Codec | Mapping[str, Any]


def _build(spec: CodecSpec, which: str) -> Codec:
    if isinstance(spec, Mapping):
        params = dict(spec)
        try:
            name = params.pop("codec")
        except KeyError:
            raise ValueError(f"{which}: a codec given as a mapping needs a 'codec' key (its name)") from None
        return make_codec(name, **params)
    if not callable(getattr(spec, "compress", None)):
        raise ValueError(f"{which} must be a codec (or a mapping with a 'codec' name), got {spec!r}")
    return spec


class Accordion(Codec):
    """Per-layer switching between ``low`` (gentle, used in critical regimes) and ``high`` (aggressive).

    ``low`` and ``high`` are codecs — e.g. ``PowerSGD(rank=2)`` and ``PowerSGD(rank=1)``,
    ``TopK(density=0.99)`` and ``TopK(density=0.1)``, ``DCTCodec(topk=64)`` and ``DCTCodec(topk=8)`` — or
    mappings such as ``{"codec": "powersgd", "rank": 2}``.
    """

    codec_id: ClassVar[None] = None  # type: ignore[assignment]  # not a wire format: records carry low's or high's id
    name = "accordion"

    def __init__(self, low: CodecSpec, high: CodecSpec, threshold: float = 0.5, interval: int = 10):
        self.low = _build(low, "low")
        self.high = _build(high, "high")
        threshold = float(threshold)
        if not (threshold > 0 and math.isfinite(threshold)):
            raise ValueError(f"threshold must be a finite number > 0, got {threshold}")
        interval = int(interval)
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.threshold = threshold
        self.interval = interval
        #: Every decision, in order: ``AccordionDecision(step, name, norm, ratio, critical, setting)``.
        self.log: list[AccordionDecision] = []
        self._layers: dict[str, _Layer] = {}
        self._made_by: dict[tuple[str, tuple], set[str]] = {}

    def setting(self, name: str = "") -> str:
        """The setting in force for ``name``'s next tensor: ``"low"`` or ``"high"``."""
        layer = self._layers.get(name)
        return layer.setting if layer is not None else LOW

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        layer = self._layers.setdefault(name, _Layer())
        codec = self.low if layer.setting == LOW else self.high
        entry, recon = codec.compress(tensor, name)
        self._made_by.setdefault((name, _key(setting_of(entry))), set()).add(layer.setting)

        self._account(name, layer, tensor)
        return entry, recon

    @property
    def bundle_budget(self) -> bool:
        """Whether ``low`` or ``high`` spends a budget over a bundle (then so does Accordion, per setting)."""
        return bool(self.low.bundle_budget or self.high.bundle_budget)

    def compress_bundle(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[Entry, torch.Tensor]]:
        """``{name: (record, reconstruction)}``. With a bundle-wide budget in ``low`` or ``high``, the tensors
        of each setting go to their codec's :meth:`~Codec.compress_bundle` together; else one by one."""
        if not self.bundle_budget:
            return super().compress_bundle(tensors)
        layers = {n: self._layers.setdefault(n, _Layer()) for n in tensors}
        done: dict[str, tuple[Entry, torch.Tensor]] = {}
        for setting, codec in ((LOW, self.low), (HIGH, self.high)):
            group = {n: t for n, t in tensors.items() if layers[n].setting == setting}
            if group:
                done.update(codec.compress_bundle(group))
        for n, t in tensors.items():
            layer = layers[n]
            self._made_by.setdefault((n, _key(setting_of(done[n][0]))), set()).add(layer.setting)
            self._account(n, layer, t)
        return {n: done[n] for n in tensors}

    def _account(self, name: str, layer: _Layer, tensor: torch.Tensor) -> None:
        x = tensor.detach().to(torch.float32)
        layer.total = x.clone() if layer.total is None else layer.total.to(x.device) + x
        layer.calls += 1
        if layer.calls % self.interval == 0:
            self._decide(name, layer)

    def _decide(self, name: str, layer: _Layer) -> None:
        norm = float(layer.total.norm())
        old = layer.old_norm
        if old is None or (old == 0 and norm != 0):
            ratio = math.inf
        elif old == 0:
            ratio = 0.0
        else:
            ratio = abs(old - norm) / old
        critical = ratio >= self.threshold
        layer.setting = LOW if critical else HIGH
        layer.old_norm = norm
        layer.total = None
        self.log.append(AccordionDecision(layer.calls, name, norm, ratio, critical, layer.setting))

    def regime_of(self, entry: Entry) -> str | None:
        """``"low"`` or ``"high"``: which setting made ``entry`` (by its codec id and parameters), or
        ``None`` if this Accordion never made such a record, or both settings did (identical records)."""
        made = self._made_by.get((entry.name, _key(setting_of(entry))), set())
        return next(iter(made)) if len(made) == 1 else None

    def reset(self) -> None:
        """Forget every layer's sums, norms and settings (the log is kept)."""
        self._layers.clear()

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every layer's interval (``calls``, the running ``total`` or None, ``old_norm``, ``setting``), the
        decision ``log`` (lists ``[step, name, norm, ratio, critical, setting]``), which setting made
        which record setting (``made_by``, for :meth:`regime_of`) and ``low``'s and ``high``'s own state.
        Non-finite floats are written ``"inf"``, ``"-inf"``, ``"nan"``."""
        layers = {
            n: {
                "calls": layer.calls,
                "total": None if layer.total is None else layer.total.detach().clone().contiguous(),
                "old_norm": None if layer.old_norm is None else sd.to_float(layer.old_norm),
                "setting": layer.setting,
            }
            for n, layer in self._layers.items()
        }
        log = [[d.step, d.name, sd.to_float(d.norm), sd.to_float(d.ratio), d.critical, d.setting] for d in self.log]
        made_by = [
            [name, [list(kv) for kv in key], sorted(settings)] for (name, key), settings in self._made_by.items()
        ]
        return {
            "layers": layers,
            "log": log,
            "made_by": made_by,
            "low": self.low.state_dict(),
            "high": self.high.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        s = sd.fields(state, "Accordion state", ("layers", "log", "made_by", "low", "high"))
        layers: dict[str, _Layer] = {}
        for n, v in sd.mapping(s["layers"], "Accordion state 'layers'").items():
            what = f"Accordion layer {n!r}"
            f = sd.fields(v, what, ("calls", "total", "old_norm", "setting"))
            total = None
            if f["total"] is not None:
                total = sd.tensor(f["total"], f"{what} 'total'", floating=True).detach().to(torch.float32).clone()
            old = None if f["old_norm"] is None else sd.from_float(f["old_norm"], f"{what} 'old_norm'")
            layers[n] = _Layer(sd.integer(f["calls"], f"{what} 'calls'"), total, old, _setting(f["setting"], what))
        log = []
        for i, d in enumerate(sd.sequence(s["log"], "Accordion state 'log'")):
            what = f"Accordion log entry {i}"
            step, name, norm, ratio, critical, setting = sd.sequence(d, what, 6)
            if not isinstance(name, str) or not isinstance(critical, bool):
                raise ValueError(f"{what}: name must be a str and critical a bool, got {name!r}, {critical!r}")
            log.append(
                AccordionDecision(
                    sd.integer(step, f"{what} step"),
                    name,
                    sd.from_float(norm, f"{what} norm"),
                    sd.from_float(ratio, f"{what} ratio"),
                    critical,
                    _setting(setting, what),
                )
            )
        made_by: dict[tuple[str, tuple], set[str]] = {}
        for i, m in enumerate(sd.sequence(s["made_by"], "Accordion state 'made_by'")):
            what = f"Accordion made_by entry {i}"
            name, key, settings = sd.sequence(m, what, 3)
            pairs = [sd.sequence(kv, what, 2) for kv in sd.sequence(key, what)]
            if not isinstance(name, str) or not all(isinstance(a, str) and isinstance(b, str) for a, b in pairs):
                raise ValueError(f"{what} must hold a name and [str, str] pairs")
            made_by[(name, tuple((a, b) for a, b in pairs))] = {_setting(x, what) for x in sd.sequence(settings, what)}
        self.low.load_state_dict(s["low"])
        self.high.load_state_dict(s["high"])
        self._layers, self.log, self._made_by = layers, log, made_by

    def __repr__(self) -> str:
        return f"Accordion(low={self.low!r}, high={self.high!r}, threshold={self.threshold}, interval={self.interval})"


def _setting(value: Any, what: str) -> str:
    if value not in (LOW, HIGH):
        raise ValueError(f"{what}: setting must be 'low' or 'high', got {value!r}")
    return value


def _key(setting: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in setting.items()))


# ---------------------------------------------------------------------------------------------
# Reading the setting in force from a record


SettingReader = Callable[[Entry], dict]


def register_setting_reader(codec_id: int) -> Callable[[SettingReader], SettingReader]:
    """Register how :func:`setting_of` describes records of ``codec_id`` (from their params): the
    codec's ``setting`` capability (:mod:`gradwire.capabilities`)."""
    return lambda fn: provide(codec_id, "setting", fn)


def setting_of(entry: Entry) -> dict:
    """The codec setting a record was made with, read from its codec id and params alone.

    ``{"codec": name, ...parameters}``, e.g. ``{"codec": "powersgd", "rank": 2}`` or
    ``{"codec": "topk", "k": 410, "density": 0.1}``. Records of codecs that declare no ``setting``
    capability give ``{"codec_id": id, "params": hex}``.
    """
    reader = capabilities_of(entry.codec).setting
    if reader is None:
        return {"codec_id": entry.codec, "params": entry.params.hex()}
    try:
        return reader(entry)
    except Exception as e:  # a record too short for its layout
        raise rec.bad(entry, "setting_of", f"params do not fit the codec's layout ({e})") from None
