"""Model state on the wire and at rest: safetensors bytes, applying published updates, and the weights hash.

Nodes and the server must hold bit-identical weights. They get there by starting from the same state
and applying the same decoded updates with the same operation (:func:`apply_update`, an in-place fp32
add in name order); :func:`state_hash` lets a node check that it is in sync with the server.

:func:`pack_state_dict` / :func:`unpack_state_dict` keep the ``state_dict()`` of codecs, error feedback
and optimizers at rest: nested dicts of tensors and plain values, as safetensors (the tensors) plus
JSON (the structure and the plain values) in its metadata — never pickle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

import blake3
import torch
from safetensors.torch import load as _st_load
from safetensors.torch import load_file as _st_load_file
from safetensors.torch import save as _st_save

__all__ = [
    "apply_update",
    "pack_state_dict",
    "state_from_bytes",
    "state_from_file",
    "state_hash",
    "state_to_bytes",
    "unpack_state_dict",
]


#: The process whose BLAKE3 thread pool (rayon's, started at its first threaded hash) :func:`state_hash`
#: uses. A child forked after that inherits the pool's state but not its threads, and a threaded hash
#: there would wait forever (torch.multiprocessing and DDP launchers fork), so a child hashes on its
#: calling thread. A process that never hashed with threads before forking leaves its children free to.
_threads_pid: int | None = None


def _hasher() -> blake3.blake3:
    global _threads_pid
    pid = os.getpid()
    if _threads_pid is None:
        _threads_pid = pid
    if _threads_pid != pid:
        return blake3.blake3()
    # Tree hashing gives the same digest on any number of threads.
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """The weights hash: BLAKE3 with a 16-byte output over each tensor's header and raw bytes, in name order.

    For each name in sorted order the hashed stream holds ``name`` (UTF-8), a zero byte, ``str(dtype)``,
    ``repr(tuple(shape))``, a zero byte, then the tensor's bytes (row-major, native little-endian). Equal
    hashes mean bit-identical tensors (same names, dtypes, shapes and bytes), whatever device they live on.
    BLAKE3 rather than hashlib's BLAKE2b: the server hashes every published version, and BLAKE3 runs about
    4x faster per core and on every core (bench/close_vs_adamw.py's hash column).
    """
    h = _hasher()
    for name in sorted(state):
        t = state[name].detach()
        header = name.encode("utf-8") + b"\0" + str(t.dtype).encode() + repr(tuple(t.shape)).encode() + b"\0"
        # The tensor's own bytes through the buffer protocol: no copy on the CPU.
        data = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        h.update(header)
        h.update(data)
    return h.hexdigest(16)


def apply_update(state: MutableMapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]) -> None:
    """``state[name] += update[name]`` in place, in name order; names and shapes must match exactly."""
    missing = set(update) - set(state)
    if missing:
        raise KeyError(f"update names tensors the state does not have: {sorted(missing)[:5]}")
    for name in sorted(update):
        dst, src = state[name], update[name]
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"update for {name!r} has shape {tuple(src.shape)}, the state has {tuple(dst.shape)}")
        dst.add_(src.to(device=dst.device, dtype=dst.dtype))


def state_to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """Named tensors as safetensors bytes (contiguous CPU copies)."""
    return _st_save({n: t.detach().contiguous().cpu() for n, t in state.items()})


def state_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """Named tensors from safetensors bytes; never unpickles anything."""
    try:
        return dict(_st_load(bytes(data)))
    except Exception as exc:  # safetensors raises its own SafetensorError for malformed headers
        raise ValueError(f"not a valid safetensors state: {exc}") from exc


def state_from_file(path: os.PathLike | str) -> dict[str, torch.Tensor]:
    """Named tensors from a safetensors file (read without holding the file's bytes twice); never unpickles."""
    try:
        return dict(_st_load_file(os.fspath(path)))
    except Exception as exc:  # SafetensorError for malformed headers, OSError for an unreadable file
        raise ValueError(f"not a valid safetensors state: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Nested state dicts at rest

_STRUCTURE_KEY = "gradwire.state_dict"
_TENSOR_MARK = "__tensor__"


def pack_state_dict(state: Mapping[str, Any]) -> bytes:
    """A nested state dict as safetensors bytes.

    Keys are strings; leaves are tensors or JSON values (None, bool, int, float, str, lists and tuples of
    these — tuples come back as lists). Tensors are stored as contiguous CPU copies under ``t0, t1, …``
    and the structure as JSON in the metadata, each tensor leaf replaced by ``{"__tensor__": "tK"}``.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = node.detach().cpu().contiguous().clone()
            return {_TENSOR_MARK: key}
        if isinstance(node, Mapping):
            out = {}
            for k, v in node.items():
                if not isinstance(k, str):
                    raise ValueError(f"state dict keys must be strings, got {k!r} at {path or 'the top'}")
                if k == _TENSOR_MARK:
                    raise ValueError(f"the key {_TENSOR_MARK!r} is reserved (at {path or 'the top'})")
                out[k] = walk(v, f"{path}.{k}" if path else k)
            return out
        if isinstance(node, (list, tuple)):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise ValueError(
            f"state dict value at {path or 'the top'} is a {type(node).__name__}; "
            "only tensors, dicts, lists and JSON scalars are kept"
        )

    structure = walk(state, "")
    return _st_save(tensors, {_STRUCTURE_KEY: json.dumps(structure, allow_nan=True)})


def unpack_state_dict(data: bytes) -> dict[str, Any]:
    """The nested state dict :func:`pack_state_dict` wrote; ``ValueError`` for anything else."""
    data = bytes(data)
    try:
        tensors = dict(_st_load(data))  # validates the header and every tensor's extent
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise ValueError(f"not a packed state dict: {exc}") from exc
    # The metadata sits in the (already validated) JSON header: u64 length, then the header itself.
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    raw = (header.get("__metadata__") or {}).get(_STRUCTURE_KEY)
    if raw is None:
        raise ValueError(f"not a packed state dict: its metadata has no {_STRUCTURE_KEY!r}")
    try:
        structure = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not a packed state dict: bad structure JSON ({exc})") from None

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {_TENSOR_MARK}:
                key = node[_TENSOR_MARK]
                if key not in tensors:
                    raise ValueError(f"not a packed state dict: tensor {key!r} is missing")
                return tensors[key]
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out = walk(structure)
    if not isinstance(out, dict):
        raise ValueError("not a packed state dict: the top level is not a dict")
    return out
