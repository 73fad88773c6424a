"""Whole-model records: one step's update of a whole model as one record (docs/FORMAT.md section 9).

Every record of a bundle pays for its name, its codec header, its u64 shape and its section headers
(about 137 bytes with the DCT codec), and a chunked codec pays one more partial chunk per tensor; at
a few hundred times compression that overhead, not the payload, bounds the frame. A *model record*
sends the model's tensors flattened in one fixed order as one 1-D float32 tensor of ``N`` elements (the
total), as Panthalia's worker does, so the overhead of a step no longer grows with the number of tensors.

The record's name says which model it belongs to: ``"@model:"`` and the 32 lowercase hex digits of the
BLAKE2b-128 hash of the model's :class:`ModelSpec` (its tensors' names, dtypes and shapes, in order).
A receiver decodes it against its own spec with :func:`decode_model`, which rejects a frame made for
any other spec (``FrameError`` of kind ``"model_spec_mismatch"``) or breaking the rules of model
records (kind ``"invalid_model_record"``), and hands back every tensor as a view of the decoded vector:
exactly what :func:`gradwire.decode_entry` gives for the record, sliced, with no arithmetic.

The record is an ordinary record of any codec: the frame format, its reader and writer do not change.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Mapping

import torch

from .codecs.base import Codec
from .errors import WireError, error
from .feedback import ErrorFeedback
from .frame import (
    ELEM_BF16,
    ELEM_F16,
    ELEM_F32,
    ELEM_F64,
    MAX_NAME_BYTES,
    Entry,
    Frame,
    Limits,
    decode_entry,
    dtype_code,
    read_frame,
    write_frame,
)
from .wire import BytesLike

__all__ = [
    "MODEL_RECORD_PREFIX",
    "ModelSpec",
    "check_model_entries",
    "check_model_frame",
    "expand_model_mean",
    "model_record_codec",
    "run_spec",
    "decode_model",
    "encode_model",
    "is_model_record",
]

#: The reserved prefix of a model record's name; no other record may have a name that starts with it.
MODEL_RECORD_PREFIX = "@model:"
#: The hash of a spec: BLAKE2b with a 16-byte digest (BLAKE2b-128), no key, salt or personalization.
HASH_BYTES = 16
#: The most tensors a spec may list, and the most dimensions of one (as a record's ``ndim``).
MAX_SPEC_TENSORS = 2**20
MAX_NDIM = 8

_NAME_RE = re.compile(re.escape(MODEL_RECORD_PREFIX) + f"[0-9a-f]{{{2 * HASH_BYTES}}}")
_TORCH_BY_CODE = {ELEM_F16: torch.float16, ELEM_BF16: torch.bfloat16, ELEM_F32: torch.float32, ELEM_F64: torch.float64}
_COUNT = struct.Struct("<I")
_HEAD = struct.Struct("<H")
_TYPE = struct.Struct("<BB")

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


class ModelSpec:
    """The ordered list of a model's tensors, ``(name, dtype, shape)`` each: what a model record carries.

    The order is the spec's and is part of its hash: :meth:`flatten` lays the tensors out in it,
    whatever order the mapping it is given has. Build the spec the same way on both sides —
    :meth:`from_module` (the order of ``module.named_parameters()``) or :meth:`from_tensors` (the
    mapping's order) — or send its :meth:`encode` bytes and rebuild it with :meth:`from_bytes`.
    """

    __slots__ = ("_tensors", "_offsets", "_encoded", "_hash")

    def __init__(self, tensors: Iterable[tuple[str, torch.dtype, Iterable[int]]]):
        items: list[TensorSpec] = []
        seen: set[str] = set()
        for name, dtype, shape in tensors:
            if not isinstance(name, str) or not name:
                raise ValueError(f"a model spec's tensor names are non-empty strings, got {name!r}")
            if name in seen:
                raise ValueError(f"tensor name {name!r} is listed twice in the model spec")
            if name.startswith(MODEL_RECORD_PREFIX):
                raise ValueError(f"tensor name {name!r} starts with the reserved prefix {MODEL_RECORD_PREFIX!r}")
            if len(name.encode("utf-8")) > MAX_NAME_BYTES:
                raise ValueError(f"tensor name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes of UTF-8")
            dtype_code(dtype)  # floating point only (ValueError otherwise)
            shape = tuple(int(d) for d in shape)
            if len(shape) > MAX_NDIM or any(d < 0 or d >= 2**64 for d in shape):
                raise ValueError(f"tensor {name!r}: shape {shape} must have at most {MAX_NDIM} dims in [0, 2^64)")
            seen.add(name)
            items.append((name, dtype, shape))
        if not items:
            raise ValueError("a model spec lists at least one tensor")
        if len(items) > MAX_SPEC_TENSORS:
            raise ValueError(f"a model spec lists at most {MAX_SPEC_TENSORS} tensors, got {len(items)}")
        self._tensors = tuple(items)
        offsets = [0]
        for _, _, shape in items:
            offsets.append(offsets[-1] + _numel(shape))
        self._offsets = tuple(offsets)
        self._encoded = _encode(items)
        self._hash = hashlib.blake2b(self._encoded, digest_size=HASH_BYTES).hexdigest()

    # -- building ----------------------------------------------------------------------------------

    @classmethod
    def from_tensors(cls, named: Mapping[str, torch.Tensor]) -> ModelSpec:
        """The spec of named tensors (parameters, gradients, a state dict), in the mapping's order."""
        return cls((n, t.dtype, tuple(t.shape)) for n, t in named.items())

    @classmethod
    def from_module(cls, module: torch.nn.Module, *, trainable_only: bool = False) -> ModelSpec:
        """The spec of ``module``'s parameters in the order of ``module.named_parameters()``; with
        ``trainable_only``, only those that require a gradient."""
        return cls(
            (n, p.dtype, tuple(p.shape)) for n, p in module.named_parameters() if p.requires_grad or not trainable_only
        )

    @classmethod
    def from_bytes(cls, data: BytesLike) -> ModelSpec:
        """The spec whose canonical bytes (:meth:`encode`) are ``data``; ``WireError`` (a ``ValueError``) if
        they are not: these bytes come from the network (a run's spec), so any bytes give that one error."""
        buf = bytes(data)
        pos = 0

        def take(n: int) -> bytes:
            nonlocal pos
            if pos + n > len(buf):
                raise WireError("model spec bytes end inside a field")
            out = buf[pos : pos + n]
            pos += n
            return out

        (count,) = _COUNT.unpack(take(4))
        if not 1 <= count <= MAX_SPEC_TENSORS:
            raise WireError(f"a model spec lists 1 to {MAX_SPEC_TENSORS} tensors, the bytes say {count}")
        items = []
        for _ in range(count):
            (name_len,) = _HEAD.unpack(take(2))
            try:
                name = take(name_len).decode("utf-8")
            except UnicodeDecodeError:
                raise WireError("a model spec's tensor name is not UTF-8") from None
            code, ndim = _TYPE.unpack(take(2))
            if code not in _TORCH_BY_CODE:
                raise WireError(f"tensor {name!r}: dtype code {code} is not a floating-point code (8 to 11)")
            if ndim > MAX_NDIM:
                raise WireError(f"tensor {name!r}: ndim {ndim} above {MAX_NDIM}")
            shape = struct.unpack(f"<{ndim}Q", take(8 * ndim))
            items.append((name, _TORCH_BY_CODE[code], shape))
        if pos != len(buf):
            raise WireError(f"{len(buf) - pos} bytes after the last tensor of the model spec")
        try:
            spec = cls(items)
        except ValueError as exc:  # a name twice, a reserved or empty name: the constructor's checks
            raise WireError(f"not a model spec: {exc}") from None
        if spec.encode() != buf:
            raise WireError("model spec bytes are not in the canonical form")
        return spec

    # -- what it says ------------------------------------------------------------------------------

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """``((name, dtype, shape), ...)`` in the spec's order."""
        return self._tensors

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self._tensors]

    @property
    def dtypes(self) -> list[torch.dtype]:
        return [d for _, d, _ in self._tensors]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [s for _, _, s in self._tensors]

    @property
    def numel(self) -> int:
        """``N``: the elements of all the tensors, the length of the flat vector."""
        return self._offsets[-1]

    def offsets(self) -> dict[str, tuple[int, int]]:
        """``{name: (start, end)}``: where each tensor lies in the flat vector."""
        return {n: (self._offsets[i], self._offsets[i + 1]) for i, n in enumerate(self.names)}

    def encode(self) -> bytes:
        """The canonical bytes of the spec (FORMAT.md section 9.1), which its hash is taken of."""
        return self._encoded

    @property
    def hash(self) -> str:
        """BLAKE2b-128 of :meth:`encode`, 32 lowercase hex digits."""
        return self._hash

    @property
    def record_name(self) -> str:
        """The name of this spec's model record: ``"@model:" + hash``."""
        return MODEL_RECORD_PREFIX + self._hash

    # -- flat vector -------------------------------------------------------------------------------

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The tensors, each flattened in row-major order, one after the other in the spec's order,
        as one 1-D float32 tensor of :attr:`numel` elements (on the tensors' device).

        ``tensors`` must name exactly the spec's tensors, each with the spec's dtype and shape
        (``ValueError`` otherwise); the mapping's own order does not matter.
        """
        if set(tensors) != set(self.names) or len(tensors) != len(self._tensors):
            missing = [n for n in self.names if n not in tensors]
            extra = [n for n in tensors if n not in set(self.names)]
            raise ValueError(f"tensors do not match the model spec: missing {missing[:5]}, not in the spec {extra[:5]}")
        parts = []
        for name, dtype, shape in self._tensors:
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name!r}: expected a tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name!r} is {t.dtype} {tuple(t.shape)}, the model spec says {dtype} {shape}")
            parts.append(t.detach().reshape(-1).to(torch.float32))
        return torch.cat(parts)

    def unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` in the spec's order: views of ``vec`` (1-D, :attr:`numel` elements) in
        the tensors' shapes, sharing its memory and keeping its dtype (no conversion, no copy)."""
        if vec.dim() != 1 or vec.numel() != self.numel:
            raise ValueError(f"expected a 1-D tensor of {self.numel} elements, got shape {tuple(vec.shape)}")
        o = self._offsets
        return {name: vec[o[i] : o[i + 1]].view(shape) for i, (name, _, shape) in enumerate(self._tensors)}

    # -- the rest --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._tensors)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelSpec) and self._encoded == other._encoded

    def __hash__(self) -> int:
        return hash(self._encoded)

    def __repr__(self) -> str:
        return f"ModelSpec({len(self._tensors)} tensors, numel={self.numel}, hash={self._hash})"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _encode(items: list[TensorSpec]) -> bytes:
    out = [_COUNT.pack(len(items))]
    for name, dtype, shape in items:
        raw = name.encode("utf-8")
        out.append(_HEAD.pack(len(raw)) + raw + _TYPE.pack(dtype_code(dtype), len(shape)))
        out.append(struct.pack(f"<{len(shape)}Q", *shape))
    return b"".join(out)


def is_model_record(entry: Entry) -> bool:
    """Whether ``entry``'s name is a model record's: ``"@model:"`` and 32 lowercase hex digits."""
    return _NAME_RE.fullmatch(entry.name) is not None


def encode_model(
    coder: Codec | ErrorFeedback,
    tensors: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    *,
    round: int = 0,
    sender: int = 0,
) -> bytes:
    """A bundle frame whose one record is ``spec``'s model record: ``tensors`` flattened
    (:meth:`ModelSpec.flatten`) and compressed by ``coder``.

    ``coder`` is a codec or an :class:`~gradwire.ErrorFeedback`; error feedback then keeps one residual,
    under :attr:`ModelSpec.record_name`, for the whole flat vector.
    """
    flat = spec.flatten(tensors)
    name = spec.record_name
    if isinstance(coder, ErrorFeedback):
        entry = coder.compress(flat, name)
    else:
        entry, _ = coder.compress(flat, name)
    return write_frame([entry], round=round, sender=sender, bundle=True)


def decode_model(
    frame: BytesLike | Frame,
    spec: ModelSpec,
    *,
    device: torch.device | str | None = None,
    limits: Limits | None = None,
) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` in ``spec``'s order from a frame made by :func:`encode_model`.

    The tensors are views (in their shapes) of the record decoded by :func:`gradwire.decode_entry`:
    exactly its values, in the record's dtype (float32). Raises ``FrameError`` of kind
    ``"model_spec_mismatch"`` for a model record of another spec, and of kind ``"invalid_model_record"``
    for a frame that is not a bundle of exactly one model record, 1-D, float32 and ``spec.numel`` long.
    """
    f = frame if isinstance(frame, Frame) else read_frame(frame, limits=limits)
    entry = check_model_frame(f, spec)
    vec = decode_entry(entry, None if device is None else torch.device(device))
    return spec.unflatten(vec)


def check_model_frame(frame: Frame, spec: ModelSpec) -> Entry:
    """The model record of ``frame`` after the checks of FORMAT.md section 9.3 (``FrameError``)."""
    if not frame.bundle:
        raise error(
            "invalid_model_record",
            f"a model frame is a bundle frame of exactly one record, got a tensor frame of {len(frame.entries)}",
        )
    return check_model_entries(frame.entries, spec)


def check_model_entries(entries, spec: ModelSpec) -> Entry:
    """The one model record of a bundle's ``entries`` after the checks of FORMAT.md section 9.3
    (``FrameError``): exactly one record, ``spec``'s, 1-D float32 of ``spec.numel`` elements."""
    if len(entries) != 1:
        raise error(
            "invalid_model_record",
            f"a model frame is a bundle frame of exactly one record, got a bundle frame of {len(entries)}",
        )
    entry = entries[0]
    if not is_model_record(entry):
        raise error(
            "invalid_model_record",
            f"record {entry.name[:80]!r} is not a model record ({MODEL_RECORD_PREFIX!r} and 32 lowercase hex digits)",
        )
    if entry.name != spec.record_name:
        raise error(
            "model_spec_mismatch",
            f"the frame's model record is for the model spec {entry.name[len(MODEL_RECORD_PREFIX) :]}, "
            f"this receiver's spec is {spec.hash} ({len(spec)} tensors, {spec.numel} elements): "
            "the two sides list different tensor names, dtypes, shapes or order",
        )
    if entry.dtype != torch.float32 or tuple(entry.shape) != (spec.numel,):
        raise error(
            "invalid_model_record",
            f"record {entry.name!r} is {entry.dtype} {tuple(entry.shape)}; its model spec makes it "
            f"torch.float32 ({spec.numel},)",
        )
    return entry


def run_spec(weights: Mapping[str, torch.Tensor]) -> ModelSpec:
    """The model spec of a server run's weights: every tensor as float32 (the master weights' dtype), in
    sorted name order. The server and every node of a run build it from the same names and shapes, so
    they agree on the record's name and on where each tensor lies in the flat vector."""
    return ModelSpec([(n, torch.float32, tuple(weights[n].shape)) for n in sorted(weights)])


def expand_model_mean(mean: Mapping[str, torch.Tensor], spec: ModelSpec) -> Mapping[str, torch.Tensor]:
    """``mean`` per tensor: a mean keyed by ``spec``'s model record becomes views of that flat vector per
    tensor name (:meth:`ModelSpec.unflatten`); a mean keyed by tensor names is returned as it is.
    ``ValueError`` for a model record of another spec."""
    names = list(mean)
    if len(names) == 1 and _NAME_RE.fullmatch(names[0]) is not None:
        if names[0] != spec.record_name:
            raise ValueError(f"the mean is of model record {names[0]!r}; these weights' spec is {spec.record_name!r}")
        return spec.unflatten(mean[names[0]])
    return mean


def model_record_codec(codec: Codec) -> Codec:
    """The codec for a model record's flat vector: :meth:`codec.flat_vector_codec()
    <gradwire.codecs.base.Codec.flat_vector_codec>` (a tile-mode DCT codec becomes its flat-mode twin,
    chunks of its ``chunk_shape``, since tiles of a vector would be 64 elements long; any other codec is
    used as it is)."""
    return codec.flat_vector_codec()
