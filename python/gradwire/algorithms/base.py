"""The one ``Algorithm`` concept and its registry.

A codec says how a tensor becomes bytes; an algorithm says *what* a node sends and how what comes back
is applied. Each algorithm is one object, registered under its name, that owns:

- its **config type** (:attr:`Algorithm.config_type`, a frozen dataclass checked in ``__post_init__``),
  which the server's ``RunConfig`` reuses as the section named :attr:`Algorithm.config_field`;
- its **node side** (:meth:`Algorithm.node`): the state a training node keeps (momenta, error buffers,
  an inner optimizer) and the records it sends each step, with ``state_dict()``;
- **what a version publishes** (:attr:`Algorithm.publication`): ``"diff"`` — the server steps its own
  optimizer on the aggregate and publishes the compressed weight diff, which nodes add — or ``"mean"``
  — a version carries node records whose exact aggregate every node (and the server) applies;
- **how a version is applied** (:meth:`Algorithm.apply`, for ``"mean"`` publications), the one function
  the server and every node run, so they hold the same bits.

Transports — the client's ``Node``, ``gradwire.published``, the server's round engine — look an
algorithm up here (:func:`get_algorithm`) and call it; none tests an algorithm's name. Adding an
algorithm is its own module (an :class:`Algorithm` subclass, registered with :func:`register`), its tests
and its docs.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, ClassVar

import torch

from ..codecs.base import Codec
from ..frame import Entry

__all__ = [
    "DEFAULT_ALGORITHM",
    "Algorithm",
    "NodeSide",
    "PUBLICATIONS",
    "algorithm_names",
    "algorithms",
    "config_from_json",
    "get_algorithm",
    "register",
]

#: The algorithm of a run whose config names none.
DEFAULT_ALGORITHM = "adamw"
#: How a version of a run is made and applied (see the module docstring).
PUBLICATIONS = ("diff", "mean")

#: What the config dataclasses tell pydantic (the server validates them): no unknown keys, and each
#: field's docstring as its description in the OpenAPI schema.
PYDANTIC_CONFIG: dict[str, Any] = {"extra": "forbid", "use_attribute_docstrings": True}


class NodeSide:
    """An algorithm's state on one training node, for any transport.

    :meth:`records` forms what this step sends (``None`` on a step that sends nothing, such as
    SparseLoCo's local steps); :meth:`take_back` puts back what a frame carried when it never counted;
    :meth:`target` names the tensors a published version is applied to; :meth:`loaded` runs after a
    full-state load and :meth:`synced` once the published versions up to a round are applied.
    """

    #: Whether :meth:`synced` needs the run's algorithm state (e.g. an outer momentum) at the same
    #: version as the weights after a full-state load.
    needs_algorithm_state: ClassVar[bool] = False
    #: Whether :meth:`records` reads the module's ``.grad`` itself when given no gradients (an inner
    #: optimizer over the module); otherwise the transport passes the gradients every step.
    reads_module_grads: ClassVar[bool] = False

    def records(self, grads: Mapping[str, torch.Tensor] | None) -> list[Entry] | None:
        raise NotImplementedError

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def target(self) -> MutableMapping[str, torch.Tensor]:
        raise NotImplementedError

    def loaded(self) -> None:
        """The replica was just loaded from the run's full state (a join, or a catch-up from too far)."""

    def synced(self) -> None:
        """The published versions up to now are applied to :meth:`target`."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError


class Algorithm:
    """One training algorithm: subclass, set the class attributes, implement :meth:`node` (and
    :meth:`apply` for ``"mean"`` publications), and :func:`register` an instance."""

    #: The name a run's config uses (``RunConfig.algorithm``).
    name: ClassVar[str]
    #: The ``RunConfig`` section holding this algorithm's config.
    config_field: ClassVar[str]
    #: The config dataclass (every field has a default).
    config_type: ClassVar[type]
    #: ``"diff"`` or ``"mean"``: :data:`PUBLICATIONS`.
    publication: ClassVar[str]
    #: Whether nodes may send the whole model as one record (docs/FORMAT.md section 9).
    takes_model_record: ClassVar[bool] = False
    #: A line for the docs and the OpenAPI description.
    summary: ClassVar[str] = ""

    def config(self, value: Any = None) -> Any:
        """This algorithm's config from a dataclass instance, a JSON mapping, or ``None`` (the defaults)."""
        if value is None:
            return self.config_type()
        if isinstance(value, self.config_type):
            return value
        return config_from_json(self.config_type, value)

    def run_config(self, run: Mapping[str, Any]) -> Any:
        """This algorithm's config from a whole run config as JSON (its :attr:`config_field` section)."""
        return self.config(run.get(self.config_field))

    def node(
        self,
        config: Any,
        codec: Codec,
        params: MutableMapping[str, torch.Tensor],
        module: torch.nn.Module | None = None,
        model_spec: Any = None,
    ) -> NodeSide:
        """A node's side of a run: ``params`` is the replica (updated in place), ``module`` the model when
        the algorithm needs one (local optimizer steps), ``model_spec`` the run's
        :class:`~gradwire.ModelSpec` when it takes whole-model records (the codec is then already the
        model-record codec)."""
        raise NotImplementedError

    def apply(
        self,
        config: Any,
        weights: MutableMapping[str, torch.Tensor],
        mean: Mapping[str, torch.Tensor],
        state: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Apply one ``"mean"`` version's aggregate to ``weights`` in place; ``state`` is the algorithm's
        state before it (e.g. an outer momentum), the return value the state after it (which may hold
        ``state``'s own tensors, updated in place)."""
        raise ValueError(
            f"algorithm {self.name!r} publishes {self.publication!r} versions, which are not applied from a mean"
        )

    def default_codec(self, config: Any) -> tuple[str, dict[str, Any]] | None:
        """The codec (a ``gradwire.build_codec`` name and its parameters) a node sends with when it is
        given none (``gradwire.torch.AlgorithmOptimizer``); ``None``: the transport's own default."""
        return None

    def default_downlink(self, config: Any) -> tuple[str, dict[str, Any]] | None:
        """The codec (a ``gradwire.build_codec`` name and its parameters) that re-encodes a ``"mean"``
        version's aggregate when the run names none; ``None``: the server's general default."""
        return None

    def public_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """What a node needs of the run's algorithm state beside the weights to apply the next versions
        as the server does (nothing by default)."""
        return {}

    def __repr__(self) -> str:
        return f"<algorithm {self.name!r}: {self.publication} publication, config {self.config_type.__name__}>"


_REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to the registry (its name must be new); returns it."""
    if algorithm.publication not in PUBLICATIONS:
        raise ValueError(
            f"algorithm {algorithm.name!r}: publication must be one of {PUBLICATIONS}, got {algorithm.publication!r}"
        )
    if not dataclasses.is_dataclass(algorithm.config_type):
        raise TypeError(f"algorithm {algorithm.name!r}: config_type must be a dataclass")
    if algorithm.name in _REGISTRY:
        raise ValueError(f"an algorithm named {algorithm.name!r} is already registered")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(algorithm_names())}") from None


def algorithm_names() -> tuple[str, ...]:
    """Every registered algorithm's name, in registration order."""
    return tuple(_REGISTRY)


def algorithms() -> tuple[Algorithm, ...]:
    """Every registered algorithm, in registration order."""
    return tuple(_REGISTRY.values())


# ---------------------------------------------------------------------------------------------
# Config dataclasses from JSON, and the checks their __post_init__ share


def config_from_json(cls: type, value: Any) -> Any:
    """A ``cls`` (a config dataclass) from its JSON form: unknown keys refused, nested dataclasses and
    tuples rebuilt, each ``__post_init__`` run. The server parses with pydantic (which also coerces
    types); this is the library's own reader of the same JSON, for the nodes."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{cls.__name__} must be a mapping, got {type(value).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, raw in value.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = config_from_json(hint, raw)
        elif typing.get_origin(hint) is tuple and isinstance(raw, (list, tuple)):
            kwargs[name] = tuple(raw)
        else:
            kwargs[name] = raw
    return cls(**kwargs)


def check_number(
    value: Any,
    what: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
) -> None:
    """``ValueError`` unless ``value`` is a finite number (a whole one with ``integer``) within the bounds
    (open at an end with ``low_open`` / ``high_open``)."""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise ValueError(f"{what} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{what} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{what} must be {'<' if high_open else '<='} {high}, got {value!r}")


def frozen_config(cls: type) -> type:
    """Make ``cls`` a frozen config dataclass that pydantic validates strictly (:data:`PYDANTIC_CONFIG`)."""
    cls.__pydantic_config__ = dict(PYDANTIC_CONFIG)  # type: ignore[attr-defined]
    return dataclasses.dataclass(frozen=True)(cls)


def ordered(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` in sorted name order (the order every record list and update runs in)."""
    return {name: tensors[name] for name in sorted(tensors)}


def same_names(got: Sequence[str], want: Sequence[str], what: str) -> None:
    """``ValueError`` naming the differences unless ``got`` and ``want`` hold the same names."""
    diff = sorted(set(got) ^ set(want))
    if diff:
        raise ValueError(f"{what} name {diff[:5]} differently from the replica")
