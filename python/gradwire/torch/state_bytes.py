"""An optimizer's state as bytes and back, without pickle: what the full state dict moves between ranks.

:meth:`gradwire.torch.DeMo.full_state_dict` (and SparseLoCo's) gathers every rank's share of the state onto
every rank. torch's ``all_gather_object`` would pickle it, and nothing gradwire receives is unpickled; so each
rank's share is written here as one safetensors file (safetensors' own format, its size checks) whose
``__metadata__`` holds the share's structure as JSON: dicts (with string or integer keys, as torch's
optimizer state dicts have), lists, tuples, strings, numbers, booleans and ``None``, each tensor a reference
into the file. Tensors come back on the CPU; ``load_state_dict`` moves them to their parameters' devices.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

__all__ = ["StateBytesError", "state_from_bytes", "state_to_bytes"]

_META = "gradwire_state"


class StateBytesError(ValueError):
    """Bytes that are no state written by :func:`state_to_bytes`, or a state it cannot write."""


def state_to_bytes(state: Any) -> bytes:
    """``state`` (nested dicts, lists, tuples, scalars, ``None`` and tensors) as one safetensors file."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = value.detach().cpu().contiguous().clone()  # own storage: safetensors refuses shared
            return {"tensor": key}
        if isinstance(value, dict):
            items = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise StateBytesError(f"state key {k!r} at {path or 'the top'} is neither a string nor an int")
                items.append([k, encode(v, f"{path}/{k}")])
            return {"dict": items}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        raise StateBytesError(f"state value of type {type(value).__name__} at {path or 'the top'} has no byte form")

    skeleton = encode(state, "")
    return save_tensors(tensors, metadata={_META: json.dumps(skeleton, allow_nan=True)})


def state_from_bytes(data: bytes) -> Any:
    """The state :func:`state_to_bytes` wrote; :class:`StateBytesError` for other bytes."""
    data = bytes(data)
    if len(data) < 8:
        raise StateBytesError(f"a state of {len(data)} bytes: too short for a safetensors header")
    try:
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len]) if header_len <= len(data) - 8 else None
        skeleton = json.loads(header["__metadata__"][_META])
        tensors = load_tensors(data)
    except Exception as exc:  # safetensors' and json's own errors, named as ours
        raise StateBytesError(f"not a gradwire optimizer state: {type(exc).__name__}: {exc}") from exc

    def decode(node: Any, path: str) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise StateBytesError(f"malformed state structure at {path or 'the top'}")
        ((kind, body),) = node.items()
        if kind == "tensor":
            if body not in tensors:
                raise StateBytesError(f"the state refers to tensor {body!r} at {path}, which the file lacks")
            return tensors[body]
        if kind == "dict":
            return {k: decode(v, f"{path}/{k}") for k, v in body}
        if kind == "list":
            return [decode(v, f"{path}/{i}") for i, v in enumerate(body)]
        if kind == "tuple":
            return tuple(decode(v, f"{path}/{i}") for i, v in enumerate(body))
        if kind == "value":
            return body
        raise StateBytesError(f"unknown state node {kind!r} at {path or 'the top'}")

    return decode(skeleton, "")
