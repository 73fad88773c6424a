"""What the gradwire optimizers check when they are built, before a step can go wrong quietly.

:func:`checked_constructor` decorates an optimizer's ``__init__`` (one line in the class) and runs, in order:

1. **Reference names.** DeMo's reference optimizer (bloc97/DeMo, ``demo.py``) names its arguments
   ``compression_topk``, ``compression_chunk``, ``compression_decay``; torchft's DiLoCo ``inner_optimizer``;
   the DiLoCo papers ``H`` or ``inner_steps``. Given to gradwire's optimizers they would be a bare
   "unexpected keyword argument": here the ``TypeError`` names gradwire's equivalent
   (docs/howto-from-demo.md).
2. **A DCT codec's** ``topk`` **beyond a chunk.** A chunk keeps ``min(topk, its elements)`` coefficients, so
   a ``topk`` above the largest chunk the codec cuts keeps every coefficient (no top-k compression at all):
   a ``UserWarning`` naming both numbers.
3. **Parameter dtypes** (after the constructor, on the param groups it built). A parameter that is not
   floating point (``int64``, ``bool``, complex) is refused with a ``TypeError`` naming it: the frames, the
   momenta and the anchors are float32 and an integer tensor has no gradient. A ``float64`` parameter is
   accepted with a ``UserWarning``: what gradwire exchanges and keeps for it is float32, so it trains at
   float32 precision (SparseLoCo sets its weights from the float32 anchor at every sync).

The launcher is checked at the first step instead (:mod:`gradwire.torch.launcher_check`): an optimizer may be
built before the process group is.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "DEMO_REFERENCE_NAMES",
    "SPARSELOCO_REFERENCE_NAMES",
    "check_parameter_dtypes",
    "check_reference_names",
    "check_topk",
    "checked_constructor",
]

#: DeMo's reference (bloc97/DeMo demo.py) argument -> what gradwire.torch.DeMo takes instead.
DEMO_REFERENCE_NAMES: dict[str, str] = {
    "compression_topk": "codec=gradwire.DCTCodec(chunk_shape=(64, 64), mode='tiles', topk=32): "
    "topk is the coefficients kept per chunk",
    "compression_chunk": "the c of codec=gradwire.DCTCodec(chunk_shape=(c, c), mode='tiles', topk=...)",
    "compression_decay": "beta= (the momentum's decay, default 0.999)",
}

#: Names of the DiLoCo family (torchft's DiLoCo, the papers) -> what gradwire.torch.SparseLoCo takes instead.
SPARSELOCO_REFERENCE_NAMES: dict[str, str] = {
    "inner_optimizer": "inner= (the local optimizer, the second argument)",
    "H": "sync_every= (local steps per sync)",
    "inner_steps": "sync_every= (local steps per sync)",
    "compression_topk": "codec=gradwire.DCTCodec(chunk_shape=(64, 64), topk=...)",
    "compression_decay": "error_decay= (the error buffer's decay, default 0.95)",
}

#: A tile-mode DCT codec cuts a matrix into tiles of at most this many elements (gradwire.dct.chunks.MAX_TILE²).
_MAX_TILE_NUMEL = 64 * 64


def check_reference_names(who: str, given: Mapping[str, Any], names: Mapping[str, str], doc: str) -> None:
    """``TypeError`` for a keyword of another implementation, naming gradwire's equivalent of each one given
    and the page that maps them (``doc``)."""
    found = [k for k in given if k in names]
    if found:
        said = "; ".join(f"{k}= is {names[k]}" for k in found)
        raise TypeError(
            f"{who} got {', '.join(f'{k}=' for k in found)}, a reference implementation's name"
            f"{'s' if len(found) > 1 else ''}: in gradwire, {said} ({doc})"
        )


def check_topk(who: str, what: str, codec: Any) -> None:
    """A ``UserWarning`` when a DCT codec's ``topk`` is more than its largest chunk holds."""
    from ..dct import MODE_TILES, DCTCodec

    if not isinstance(codec, DCTCodec):
        return
    flat = math.prod(codec.chunk_shape)
    largest = max(flat, _MAX_TILE_NUMEL) if codec.mode == MODE_TILES else flat
    if codec.topk > largest:
        shape = "×".join(map(str, codec.chunk_shape))
        warnings.warn(
            f"{who}: {what}'s topk={codec.topk} is more than its largest chunk holds ({largest} elements; "
            f"chunk_shape {shape}{', tiles up to 64×64' if codec.mode == MODE_TILES else ''}): every chunk "
            f"keeps all its coefficients, so top-k compresses nothing; give a topk of at most {largest}",
            UserWarning,
            stacklevel=3,
        )


def check_parameter_dtypes(who: str, param_groups, describe: Callable[[str], str] = str) -> None:
    """``TypeError`` for a parameter that is not floating point; a ``UserWarning`` for a float64 one (see the
    module docstring). Parameters are named by position (``g0.p3``), ``describe`` adds the module path."""
    wide = []
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            name = f"g{gi}.p{pi}"
            if not p.is_floating_point():
                raise TypeError(
                    f"{who}: parameter {describe(name)} is {p.dtype}: gradwire's optimizers train floating-point "
                    "parameters (float32, bfloat16, float16); an integer or complex tensor has no gradient to "
                    "send: keep it out of the parameters given (register it as a buffer)"
                )
            if p.dtype == torch.float64 and p.requires_grad:
                wide.append(describe(name))
    if wide:
        warnings.warn(
            f"{who}: {', '.join(wide[:3])}{' …' if len(wide) > 3 else ''} {'is' if len(wide) == 1 else 'are'} "
            "float64; gradwire exchanges and keeps float32 values for them (frames, momenta, error buffers, "
            "SparseLoCo's anchor, from which the weights are set at every sync), so they train at float32 "
            "precision: cast the model to float32 (model.float()) to say so",
            UserWarning,
            stacklevel=3,
        )


#: Where each optimizer's names are mapped from another implementation's.
REFERENCE_DOCS = {
    id(DEMO_REFERENCE_NAMES): "docs/howto-from-demo.md",
    id(SPARSELOCO_REFERENCE_NAMES): "docs/ALGORITHMS.md",
}


def checked_constructor(reference_names: Mapping[str, str] = DEMO_REFERENCE_NAMES):
    """Decorate an optimizer's ``__init__`` with the checks of the module docstring (its signature, as
    ``inspect`` reads it, stays the constructor's own); ``reference_names`` maps another implementation's
    keywords to gradwire's."""
    doc = REFERENCE_DOCS.get(id(reference_names), "docs/ALGORITHMS.md")

    def decorate(init):
        @functools.wraps(init)
        def checked(self, *args, **kwargs):
            who = type(self).__name__
            check_reference_names(who, kwargs, reference_names, doc)
            for what in ("codec", "downlink_codec"):
                check_topk(who, what, kwargs.get(what))
            init(self, *args, **kwargs)
            check_parameter_dtypes(who, self.param_groups, getattr(self, "_describe", str))

        return checked

    return decorate
