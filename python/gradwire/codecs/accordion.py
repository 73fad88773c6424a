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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import torch

from ..frame import ELEM_BF16, Entry
from . import record as rec
from .base import Codec

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
    total: Optional[torch.Tensor] = None
    old_norm: Optional[float] = None
    setting: str = LOW


CodecSpec = Union[Codec, Mapping[str, Any]]


def _build(spec: CodecSpec, which: str) -> Codec:
    if isinstance(spec, Mapping):
        from . import make_codec  # the registry imports this module

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

    codec_id = None  # not a wire format: records carry the wrapped codec's id
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

        x = tensor.detach().to(torch.float32)
        layer.total = x.clone() if layer.total is None else layer.total + x
        layer.calls += 1
        if layer.calls % self.interval == 0:
            self._decide(name, layer)
        return entry, recon

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

    def regime_of(self, entry: Entry) -> Optional[str]:
        """``"low"`` or ``"high"``: which setting made ``entry`` (by its codec id and parameters), or
        ``None`` if this Accordion never made such a record, or both settings did (identical records)."""
        made = self._made_by.get((entry.name, _key(setting_of(entry))), set())
        return next(iter(made)) if len(made) == 1 else None

    def reset(self) -> None:
        """Forget every layer's sums, norms and settings (the log is kept)."""
        self._layers.clear()

    def __repr__(self) -> str:
        return f"Accordion(low={self.low!r}, high={self.high!r}, threshold={self.threshold}, interval={self.interval})"


def _key(setting: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in setting.items()))


# ---------------------------------------------------------------------------------------------
# Reading the setting in force from a record


SettingReader = Callable[[Entry], dict]
_READERS: dict[int, SettingReader] = {}


def register_setting_reader(codec_id: int) -> Callable[[SettingReader], SettingReader]:
    """Register how :func:`setting_of` describes records of ``codec_id`` (from their params)."""

    def deco(fn: SettingReader) -> SettingReader:
        _READERS[codec_id] = fn
        return fn

    return deco


def setting_of(entry: Entry) -> dict:
    """The codec setting a record was made with, read from its codec id and params alone.

    ``{"codec": name, ...parameters}``, e.g. ``{"codec": "powersgd", "rank": 2}`` or
    ``{"codec": "topk", "k": 410, "density": 0.1}``. Records of codecs without a registered reader
    give ``{"codec_id": id, "params": hex}``.
    """
    reader = _READERS.get(entry.codec)
    if reader is None:
        return {"codec_id": entry.codec, "params": entry.params.hex()}
    try:
        return reader(entry)
    except Exception as e:  # a record too short for its layout
        raise rec.bad(entry, "setting_of", f"params do not fit the codec's layout ({e})") from None


def _register_builtin_readers() -> None:
    from . import dct, minmax, powersgd, sign, sparse, threelc

    @register_setting_reader(0)
    def _identity(entry: Entry) -> dict:
        data = entry.sections.get("data")
        if entry.section_elems.get("data") == ELEM_BF16:
            return {"codec": "identity", "wire_dtype": "bfloat16"}
        return {"codec": "identity", "wire_dtype": str(data.dtype) if data is not None else None}

    @register_setting_reader(1)
    def _dct(entry: Entry) -> dict:
        p = dct.unpack_params(entry.params)
        mode = {0: "flat", 1: "tiles"}.get(p["mode"], p["mode"])
        return {"codec": "dct", "mode": mode, "chunk_shape": p["chunk_shape"], "topk": p["k"]}

    @register_setting_reader(2)
    def _threelc(entry: Entry) -> dict:
        return {"codec": "3lc", "sparsity": round(threelc.unpack_params(entry.params)["sparsity"], 6)}

    @register_setting_reader(5)
    def _onebit(entry: Entry) -> dict:
        return {"codec": "onebit"}

    @register_setting_reader(6)
    def _signsgd(entry: Entry) -> dict:
        return {"codec": "signsgd", **sign.unpack_params(entry.params)}

    @register_setting_reader(7)
    def _topk(entry: Entry) -> dict:
        k = sparse.unpack_topk_params(entry.params)["k"]
        return {"codec": "topk", "k": k, "density": k / entry.numel if entry.numel else 0.0}

    @register_setting_reader(8)
    def _randomk(entry: Entry) -> dict:
        p = sparse.unpack_randomk_params(entry.params)
        k = p["k"]
        return {"codec": "randomk", "k": k, "density": k / entry.numel if entry.numel else 0.0,
                "unbiased": bool(p["scaled"])}

    @register_setting_reader(9)
    def _powersgd(entry: Entry) -> dict:
        p = powersgd.unpack_params(entry.params)
        return {"codec": "powersgd", "rank": p["rank"], "dense": p["mode"] == powersgd.MODE_DENSE}

    @register_setting_reader(10)
    def _minmax(entry: Entry) -> dict:
        return {"codec": "minmax", **minmax.unpack_params(entry.params)}


_register_builtin_readers()
