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

import copy
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
    "Group",
    "NodeSide",
    "PUBLICATIONS",
    "RecordLayout",
    "WholeModelLayout",
    "algorithm_names",
    "algorithms",
    "config_from_json",
    "get_algorithm",
    "record_layout",
    "register",
]

#: The algorithm of a run whose config names none.
DEFAULT_ALGORITHM = "adamw"
#: How a version of a run is made and applied (see the module docstring).
PUBLICATIONS = ("diff", "mean")

#: What the config dataclasses tell pydantic (the server validates them): no unknown keys, and each
#: field's docstring as its description in the OpenAPI schema.
PYDANTIC_CONFIG: dict[str, Any] = {"extra": "forbid", "use_attribute_docstrings": True}


class RecordLayout:
    """How a node side's tensors, by name, become what its records carry: here, each tensor as it is, under
    its own name. A transport may give a node side another layout (:meth:`Algorithm.node`'s ``layout``):
    the whole model as one record (:func:`record_layout`), or the pieces of a sharded exchange
    (``gradwire.torch``). A node side keeps its buffers (momenta, error buffers) keyed by the names
    :meth:`cut` gives, and compresses them under those names."""

    #: Whether :meth:`cut` joins tensors into one record (a whole-model record): the tensors are then
    #: cut all at once, never a group or a bucket of them on its own.
    joins_tensors: ClassVar[bool] = False

    def cut(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` as the records carry them: ``{record name: tensor}``."""
        return dict(tensors)


class WholeModelLayout(RecordLayout):
    """Every tensor flattened, in ``spec``'s order, into the one record named after ``spec``'s hash
    (docs/FORMAT.md section 9; ``spec`` is a :class:`gradwire.ModelSpec`)."""

    joins_tensors = True

    def __init__(self, spec: Any):
        self.spec = spec

    def cut(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.spec.record_name: self.spec.flatten(tensors)}


def record_layout(model_spec: Any = None) -> RecordLayout:
    """The layout of a node side given only a run's ``model_spec``: one record per tensor, or the whole model."""
    return RecordLayout() if model_spec is None else WholeModelLayout(model_spec)


#: One param group of a torch transport's step: its config (the algorithm's, with the hyperparameters the
#: group holds now: :meth:`Algorithm.group_config`) and the names of its tensors in this step.
Group = tuple[Any, Sequence[str]]


class NodeSide:
    """An algorithm's state on one training node, for any transport.

    A step is :meth:`local_step` (this step's local work: a momentum step, an inner optimizer's step)
    and, on a step that sends, :meth:`send` (the records of what the node holds now); :meth:`records`
    is both at once (``None`` on a step that sends nothing, such as SparseLoCo's local steps), what the
    client's ``Node`` calls. A node side written with :meth:`records` alone works on every transport
    that needs nothing more (the all-gather exchange); one written with :meth:`local_step` and
    :meth:`send` also lets the torch transport send a round outside a step (``sync()``) and, with
    :attr:`records_per_tensor`, form its records bucket by bucket during the backward pass.

    :meth:`take_back` puts back what a frame carried when it never counted; :meth:`target` names the
    tensors a published version is applied to; :meth:`loaded` runs after a full-state load and
    :meth:`synced` once the published versions up to a round are applied.

    **Live state.** :meth:`buffers` and :meth:`tensors` hand the torch transport the node's own dicts,
    which it presents per parameter (``opt.state[p]["momentum"]``, ``state_dict()["state"]``) and fills
    on a checkpoint's load: keep the values there (a transport may put views of its own float32 storage
    in place of a buffer between steps, with the same values) and the live state is what the step
    updates.
    """

    #: Whether :meth:`synced` needs the run's algorithm state (e.g. an outer momentum) at the same
    #: version as the weights after a full-state load.
    needs_algorithm_state: ClassVar[bool] = False
    #: Whether :meth:`local_step` reads the module's ``.grad`` itself (an inner optimizer over the
    #: module, or :attr:`inner`) when given no gradients; otherwise the transport passes the gradients
    #: every step, and the node sends records of the tensors it is given.
    reads_module_grads: ClassVar[bool] = False
    #: Whether every step sends and each tensor's records depend on that tensor's gradient alone: a
    #: transport may then take :meth:`local_step` and :meth:`send` one bucket of tensors at a time, while
    #: the backward pass still runs (``overlap=True``).
    records_per_tensor: ClassVar[bool] = False
    #: The torch optimizer the node side steps locally (SparseLoCo's inner optimizer), or ``None``: a torch
    #: transport's param groups are its groups, and a torch checkpoint spreads its state over the parameters.
    inner: Any = None
    #: The names a torch checkpoint gives the transport's counters in its ``"gradwire"`` section,
    #: ``{key: "steps" | "rounds"}`` (steps: every ``step()``; rounds: every exchange). A counter left out is
    #: restored as the other (DeMo sends every step: its rounds are its steps).
    checkpoint_counters: ClassVar[Mapping[str, str]] = {"steps": "steps", "rounds": "rounds"}
    #: The same, per parameter (torch's optimizers keep a ``"step"`` there).
    parameter_counters: ClassVar[Mapping[str, str]] = {"step": "steps"}

    def local_step(self, grads: Mapping[str, torch.Tensor] | None, groups: Sequence[Group] | None = None) -> bool:
        """This step's local work on ``grads`` (``None`` for a node that :attr:`reads_module_grads`);
        whether the step sends. ``groups``: the tensors' param groups, each with its config (a torch
        transport's, whose param groups may set hyperparameters per group), ``None`` for one group of
        every tensor under the node's own config. A node side written with :meth:`records` alone runs it
        here, and :meth:`send` hands its records over."""
        if type(self).records is NodeSide.records:
            raise NotImplementedError(f"{type(self).__name__} implements neither records nor local_step and send")
        self._formed = self.records(grads)
        return self._formed is not None

    def send(self) -> list[Entry]:
        """The records of this round, from what the node holds now (the steps since the last send)."""
        formed = self.__dict__.pop("_formed", None)
        if formed is None:
            raise RuntimeError(
                f"{type(self).__name__} forms its records in records() at a step that sends; it has none to send now"
            )
        return formed

    def records(self, grads: Mapping[str, torch.Tensor] | None) -> list[Entry] | None:
        """One step: :meth:`local_step`, then :meth:`send` on a step that sends (else ``None``)."""
        return self.send() if self.local_step(grads) else None

    def joined(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """``tensors`` join the exchange: parameters that began to require a gradient since the node side
        was built (a torch transport whose exchanged tensors may change: all-gathered, per-tensor records)."""
        raise ValueError(
            f"{type(self).__name__} exchanges the tensors it was built over: {sorted(tensors)[:3]} cannot join"
        )

    def take_back(self, sent: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def target(self) -> MutableMapping[str, torch.Tensor]:
        raise NotImplementedError

    def loaded(self) -> None:
        """The replica was just loaded from the run's full state (a join, or a catch-up from too far)."""

    def synced(self) -> None:
        """The published versions up to now are applied to :meth:`target`."""

    def buffers(self) -> dict[str, MutableMapping[str, torch.Tensor]]:
        """The node's float32 buffers by kind (``{"momentum": momenta}``), each keyed by the names of the
        records it sends (its layout's): each rank's own state, which a torch transport presents per
        parameter and averages over the ranks when a group of another size resumes."""
        return {}

    def tensors(self) -> dict[str, MutableMapping[str, torch.Tensor]]:
        """Per-tensor state by kind (``{"anchor": anchor}``), keyed by tensor name: the same on every rank."""
        return {}

    def torch_state(self) -> dict[str, Any]:
        """What a torch checkpoint keeps of the node beside its :meth:`buffers`, :meth:`tensors`,
        :attr:`inner` and the transport's counters: by default its codec's state."""
        return {"codec": self.codec.state_dict()} if getattr(self, "codec", None) is not None else {}

    def load_torch_state(self, state: Mapping[str, Any], steps: int) -> None:
        """Continue from :meth:`torch_state` (the buffers and tensors are loaded already); ``steps``: the
        transport's step counter, restored."""
        if "codec" in state:
            self.codec.load_state_dict(state["codec"])

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
    #: The config fields a torch param group carries (``lr``, …): set per group, changed by lr schedulers,
    #: read at every step (:meth:`group_config`).
    group_fields: ClassVar[tuple[str, ...]] = ()
    #: Whether :meth:`apply` is an optimizer step of the target with the mean as its gradient (SparseLoCo's
    #: outer SGD): a torch transport may then step any torch optimizer there instead (``outer_optimizer``).
    applies_as_gradient: ClassVar[bool] = False

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
        *,
        layout: RecordLayout | None = None,
        inner: Any = None,
    ) -> NodeSide:
        """A node's side of a run: ``params`` is the replica (updated in place), ``module`` the model when
        the algorithm needs one (local optimizer steps), ``model_spec`` the run's
        :class:`~gradwire.ModelSpec` when it takes whole-model records (the codec is then already the
        model-record codec). ``layout``: how the tensors become records (default
        ``record_layout(model_spec)``); ``inner``: a torch optimizer over ``module``'s parameters that the
        node side steps locally in place of its own (a transport passes these two only where it has
        them, so a node side of an algorithm that uses neither need not take them)."""
        raise NotImplementedError

    def group_defaults(self, config: Any) -> dict[str, Any]:
        """The param-group defaults of a torch transport: ``config``'s :attr:`group_fields`."""
        return {f: getattr(config, f) for f in self.group_fields}

    def group_config(self, config: Any, group: Mapping[str, Any]) -> Any:
        """``config`` with a torch param group's :attr:`group_fields`, as the group holds them now (not
        checked again: a scheduler may set an lr of 0, as ``torch.distributed.checkpoint`` does)."""
        if not self.group_fields:
            return config
        out = copy.copy(config)
        for f in self.group_fields:
            object.__setattr__(out, f, group[f])
        return out

    def parameter_state(self, config: Any, state: Mapping[str, Any]) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """The algorithm state (:meth:`apply`'s) as per-tensor tensors by kind (``{"outer_momentum":
        {name: tensor}}``: what a torch transport presents per parameter, zeros where none exists yet) and
        the rest. Nothing is per tensor by default."""
        return {}, dict(state)

    def with_parameter_state(
        self, config: Any, rest: Mapping[str, Any], tensors: Mapping[str, Mapping[str, torch.Tensor]]
    ) -> dict[str, Any]:
        """:meth:`parameter_state` undone: the algorithm state from the rest and the per-tensor tensors
        (a kind none of whose tensors exists yet is absent)."""
        return dict(rest)

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
