"""Every codec a configuration can name: the wire codecs and the policies built on them.

A *wire codec* (:data:`gradwire.codecs.CODECS`) has a codec id, a byte layout and a decoder. A *policy*
(:data:`POLICIES`) has none of those: it picks a wire codec per tensor (Accordion switches each layer
between a gentle and an aggressive setting), and its records carry the picked codec's id. A run config
(``{"codec": "accordion", "params": {...}}``), a DDP hook name or a command line names either kind;
:func:`build_codec` builds it.
"""

from __future__ import annotations

from collections.abc import Callable

from .accordion import Accordion
from .codecs import CODECS, Codec, make_codec

__all__ = ["POLICIES", "build_codec", "codec_names"]

#: Codec policies by name: codecs that choose among wire codecs and have no wire format of their own.
POLICIES: dict[str, Callable[..., Codec]] = {"accordion": Accordion}


def codec_names() -> tuple[str, ...]:
    """Every name :func:`build_codec` accepts: the wire codecs, then the policies."""
    return (*CODECS, *POLICIES)


def build_codec(name: str, **params) -> Codec:
    """The wire codec or policy called ``name``, built with its keyword parameters."""
    if name in POLICIES:
        return POLICIES[name](**params)
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(codec_names()))}")
    return make_codec(name, **params)
