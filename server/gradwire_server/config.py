"""``RunConfig``: everything a run fixes when it is created (docs/API.md).

The algorithms' sections are the library's config dataclasses (``gradwire.algorithms``), one field per
registered algorithm (its ``config_field``: ``optimizer`` for adamw, ``demo``, ``sparseloco``), added from
the registry: a new algorithm needs no change here.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

import gradwire
from gradwire.aggregation import DEFAULT_RULE, RULES, UNBOUNDED_RULES
from gradwire.algorithms import (
    DEFAULT_ALGORITHM,
    AdamWConfig,
    Algorithm,
    DeMoConfig,
    SparseLoCoConfig,
    algorithm_names,
    algorithms,
    get_algorithm,
)
from gradwire.assignment import DataAssignment
from gradwire.frame import MIN_FRAME_BYTES
from gradwire.rule import Rule
from gradwire.sender_history import HISTORY_BETA, TRUST_MULTIPLE

__all__ = [
    "ALGORITHMS",
    "AggregationConfig",
    "CodecConfig",
    "DataAssignmentConfig",
    "ValidationConfig",
    "DeMoConfig",
    "OptimizerConfig",
    "RunConfig",
    "SparseLoCoConfig",
]

#: How a run trains (docs/ALGORITHMS.md): every registered algorithm.
ALGORITHMS = algorithm_names()
#: AdamW's config, under the name the server used before the registry (also SparseLoCo's ``inner``).
OptimizerConfig = AdamWConfig


#: The parameters of a ``dct`` codec config that names none.
DEFAULT_DCT_PARAMS = {"chunk_shape": [64, 64], "topk": 32}


class CodecConfig(BaseModel):
    """A codec or policy by name (``gradwire.codec_names()``) and its keyword parameters."""

    model_config = ConfigDict(extra="forbid")

    codec: str = "dct"
    params: dict[str, Any] = Field(
        default_factory=lambda: dict(DEFAULT_DCT_PARAMS),
        description="The codec's keyword parameters. When absent: the default codec's (dct) "
        f"{DEFAULT_DCT_PARAMS}, any other codec's own defaults (no parameters).",
    )

    @model_validator(mode="before")
    @classmethod
    def _params_of_the_named_codec(cls, data: Any) -> Any:
        """The DCT defaults belong to ``dct``: ``{"codec": "onebit"}`` means OneBit's own defaults."""
        if isinstance(data, dict) and "params" not in data and data.get("codec", "dct") != "dct":
            return {**data, "params": {}}
        return data

    @model_validator(mode="after")
    def _buildable(self) -> CodecConfig:
        try:
            self.build()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"codec {self.codec!r} with params {self.params}: {exc}") from None
        return self

    def build(self) -> gradwire.Codec:
        params = dict(self.params)
        if "wire_dtype" in params and isinstance(params["wire_dtype"], str):
            import torch

            params["wire_dtype"] = getattr(torch, params["wire_dtype"])
        return gradwire.build_codec(self.codec, **params)


class AggregationConfig(BaseModel):
    """The rule that turns a round's updates into one gradient (docs/SERVER.md, "Rogue nodes")."""

    model_config = ConfigDict(extra="forbid")

    rule: Literal[RULES] = Field(  # type: ignore[valid-type]
        DEFAULT_RULE,
        description="bounded_mean (the default): each update clipped to clip_multiple × the round's lower median "
        "norm (0.75 × the round's size, between 1.5 and 6, without a data assignment; 1.5 with one), capped at "
        "cap_factor × the median clip level of the last cap_rounds rounds, then averaged; an update pointing "
        "against the rest of its round (an outlier cosine), at most a minority of the round, loses weight "
        "(opposed_ramp; all of it with a data assignment); where the honest nodes are IID (honest_iid), a "
        "node that deviates persistently loses weight. "
        "mean: no bound (the run's status says so). clipped_mean: clipped to the round's median norm. "
        "trimmed_mean, median: coordinate-wise.",
    )
    trim_fraction: float = Field(0.2, ge=0.0, lt=0.5)
    cap_factor: float = Field(
        3.0,
        ge=1.0,
        allow_inf_nan=False,
        description="bounded_mean: a round's clip level is at most this many times the "
        "median clip level of the last cap_rounds rounds.",
    )
    cap_rounds: int = Field(
        8, ge=1, le=1024, description="bounded_mean: how many recent rounds' clip levels the cap looks at."
    )

    history_beta: float = Field(
        HISTORY_BETA,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="bounded_mean runs whose honest nodes are IID (honest_iid), every mode: how much of each "
        "node's past deviations from its rounds the server remembers (h = beta·h + deviation); a node whose history "
        "grows past 1.5 × the round's lower median loses weight, and all of it at "
        "3 ×: colluders who stay inside the honest spread (ALIE, min-max) "
        "deviate the same way every round. 0 remembers only the round itself.",
    )
    trust_multiple: float = Field(
        TRUST_MULTIPLE,
        ge=1.0,
        allow_inf_nan=False,
        description="bounded_mean: the multiple of the round's lower median history up to "
        "which a node keeps its whole weight (none from twice it).",
    )

    clip_multiple: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="bounded_mean: each update is clipped to this multiple of the round's lower median norm "
        "(one node moves a round by at most this many median updates). None (the default): 0.75 × the round's "
        "size, between 1.5 and 6, without a data assignment (an honest node on data of its own sends larger "
        "updates), 1.5 with one (gradwire.rule).",
    )
    opposed_ramp: float | None = Field(
        None,
        ge=1.0,
        allow_inf_nan=False,
        description="bounded_mean: an update pointing against the rest of its round past the direction test's "
        "threshold keeps a share of its weight falling from 1 at the threshold to 0 at opposed_ramp times it "
        "(gradwire.aggregation.opposed_factors); 1 drops it. None (the default): 1.5 without a data assignment "
        "(an honest node on data of its own is a little past it in some rounds), 1 with one (gradwire.rule).",
    )
    honest_iid: bool | None = Field(
        None,
        description="bounded_mean: whether the run's honest nodes are IID by construction, so that a node whose "
        "deviation from its rounds persists loses weight (its sender history, in every mode). None (the "
        "default): true exactly where the run assigns its data (data_assignment). Without it the rule bounds "
        "each update and drops direction outliers, and down-weights nobody for deviating: an honest node on "
        "data of its own deviates persistently too (docs/SERVER.md, 'Robust aggregation').",
    )

    def rule_object(self, data_assigned: bool) -> Rule:
        """A fresh :class:`~gradwire.rule.Rule` for a run of these settings (``data_assigned``: whether the run
        declares a data assignment; ``honest_iid``, where set, decides instead)."""
        honest_iid = data_assigned if self.honest_iid is None else self.honest_iid
        return Rule(
            self.rule,
            trim_fraction=self.trim_fraction,
            cap_factor=self.cap_factor,
            cap_rounds=self.cap_rounds,
            clip_multiple=self.clip_multiple,
            opposed_ramp=self.opposed_ramp,
            history_beta=self.history_beta,
            trust_multiple=self.trust_multiple,
            honest_iid=honest_iid,
        )

    def warnings(self, quorum: int) -> list[str]:
        """What this rule leaves unbounded, for a run's status and the log at its creation."""
        if self.rule in UNBOUNDED_RULES:
            return [
                f"aggregation rule {self.rule!r} does not bound one node's influence: a single node can move "
                "the weights arbitrarily far in one round (use 'bounded_mean', the default; docs/SERVER.md)"
            ]
        # The fewest updates a round needs before the rule drops or clips a rogue one.
        if self.rule == "trimmed_mean":
            least = math.ceil(1 / self.trim_fraction - 1e-9) if self.trim_fraction > 0 else math.inf
            least = max(3, least)
        else:
            least = 3 if self.rule in ("clipped_mean", "median") else 1
        if quorum < least:
            return [
                f"aggregation rule {self.rule!r} bounds one node's influence only in rounds of {least} or more "
                f"updates, and quorum is {quorum}: smaller rounds are not bounded (use 'bounded_mean', the "
                "default; docs/SERVER.md)"
            ]
        return []


class DataAssignmentConfig(BaseModel):
    """How a run deals out its data (``gradwire.assignment``): nodes, validators and tests call
    ``assigned_pages(assignment, node_id, round)`` on it to know which pages a node reads."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(ge=0, description="The run's data seed (below 2**64).")
    pages: int = Field(ge=1, description="How many pages (or shards) the corpus is cut into.")
    pages_per_node: int = Field(ge=1, description="How many pages each node reads each round.")

    @model_validator(mode="after")
    def _fits(self) -> DataAssignmentConfig:
        self.build()  # AssignmentError (a ValueError) names the values
        return self

    def build(self) -> DataAssignment:
        """The library's assignment (``gradwire.assignment.DataAssignment``)."""
        return DataAssignment(seed=self.seed, pages=self.pages, pages_per_node=self.pages_per_node)


class ValidationConfig(BaseModel):
    """A run whose rounds wait for its validators' scores (docs/SERVER.md, "Validators")."""

    model_config = ConfigDict(extra="forbid")

    score_deadline_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a ready round waits for every validator's scores; a round with no score by then "
        "closes with the structural rule (a validator that is down delays a round by at most this).",
    )


class _RunConfigBase(BaseModel):
    """A run's configuration; every field has a default."""

    model_config = ConfigDict(extra="forbid")

    algorithm: Literal[ALGORITHMS] = Field(  # type: ignore[valid-type]
        DEFAULT_ALGORITHM,
        description="; ".join(f"{a.name}: {a.summary}" for a in algorithms()) + " (docs/ALGORITHMS.md).",
    )
    uplink: CodecConfig = Field(default_factory=CodecConfig)
    downlink: CodecConfig = Field(
        default_factory=CodecConfig,
        description="What the server's versions are compressed with: adamw's weight diff, or the re-encoded "
        "aggregate of publish='aggregate'. When absent, the algorithm's own default (demo, "
        "sparseloco: their nodes' top-k DCT codec), else a 64×64 DCT keeping 32 coefficients.",
    )
    publish: Literal["aggregate", "frames"] = Field(
        "aggregate",
        description="Algorithms whose versions publish a mean (demo, sparseloco). 'aggregate': the server "
        "computes the round's exact (robust) aggregate, re-encodes it with the downlink codec and its "
        "own error feedback, and publishes that one frame, so a node's downlink does not grow with "
        "the node count; 'frames': the round's node frames verbatim (n frames per version). adamw "
        "runs always publish their compressed weight diff.",
    )
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    quorum: int = Field(1, ge=1, description="Aggregate as soon as this many distinct nodes submitted.")
    min_updates: int = Field(1, ge=1, description="At the deadline, aggregate if at least this many updates.")
    round_deadline_s: float = Field(30.0, gt=0, description="Seconds from the moment a round opens.")
    max_frame_bytes: int = Field(64 << 20, ge=MIN_FRAME_BYTES)
    max_update_norm: float | None = Field(None, gt=0, description="Per-update L2 norm ceiling.")
    require_run_binding: bool = Field(
        False,
        description="Refuse update frames without a run-binding record (422 run_binding_missing). A frame "
        "that carries one is always checked: bound to another run or round, it is refused (422 "
        "run_binding_mismatch). gradwire's Node binds every frame (docs/FORMAT.md section 10).",
    )
    late_policy: Literal["reject", "staleness"] = "reject"
    validation: ValidationConfig | None = Field(
        None,
        description="Rounds wait for the run's validators' scores and weigh each update by them "
        '(docs/SERVER.md, "Validators"). None: rounds close with the structural rule alone.',
    )
    data_assignment: DataAssignmentConfig | None = Field(
        None,
        description='How the run deals out its data pages (gradwire.assignment, docs/SERVER.md "Validators"); '
        "returned to nodes in the run's status. None: each node reads data of its own.",
    )
    keep_versions: int = Field(1000, ge=1, description="Published diffs retained for catch-up.")
    model_record: bool = Field(
        False,
        description="Algorithms whose versions publish a mean (demo, sparseloco): nodes send the whole "
        "model as one record (its tensors as float32, flattened in sorted name order, named "
        "after the spec's hash: docs/FORMAT.md section 9), so a frame's headers do not grow "
        "with the tensor count. The server refuses frames of any other form (tensor_mismatch).",
    )

    @property
    def algorithm_spec(self) -> Algorithm:
        """The run's registered algorithm (``gradwire.algorithms.get_algorithm``)."""
        return get_algorithm(self.algorithm)

    def algorithm_config(self) -> Any:
        """The run's algorithm's config (its section of this config, a library dataclass)."""
        return getattr(self, self.algorithm_spec.config_field)

    @model_validator(mode="before")
    @classmethod
    def _algorithm_downlink(cls, data: Any) -> Any:
        """A config that names no downlink gets its algorithm's default, if the algorithm has one."""
        if not isinstance(data, dict) or "downlink" in data:
            return data
        try:
            algo = get_algorithm(data.get("algorithm", DEFAULT_ALGORITHM))
            default = algo.default_downlink(data.get(algo.config_field))
        except (TypeError, ValueError):
            return data  # the fields' own validation reports what is wrong
        if default is None:
            return data
        return {**data, "downlink": {"codec": default[0], "params": default[1]}}

    @property
    def replays_from_submissions(self) -> bool:
        """Whether replaying a version after a restart re-runs the server's own encoding (AdamW's diff, a
        re-encoded aggregate, each with the server's error feedback), so it needs the round's logged
        submissions, not only the published bytes."""
        return self.algorithm_spec.publication == "diff" or self.reencodes

    @property
    def reencodes(self) -> bool:
        """Whether the server re-encodes a ``"mean"`` version's aggregate (``publish='aggregate'``)."""
        return self.algorithm_spec.publication == "mean" and self.publish == "aggregate"

    def warnings(self) -> list[str]:
        """What this config leaves unsafe (an aggregation rule that does not bound one node's influence):
        shown in the run's status and logged when the run is created."""
        return self.aggregation.warnings(self.quorum)

    @model_validator(mode="after")
    def _check_model_record(self) -> _RunConfigBase:
        if self.model_record and not self.algorithm_spec.takes_model_record:
            takers = [a.name for a in algorithms() if a.takes_model_record]
            raise ValueError(
                f"model_record is for the {' and '.join(takers)} algorithms "
                f"({self.algorithm} runs send a record per tensor)"
            )
        return self


#: One section per registered algorithm, of the library's config type, defaults throughout.
RunConfig = create_model(
    "RunConfig",
    __base__=_RunConfigBase,
    __module__=__name__,
    **{
        a.config_field: (a.config_type, Field(default_factory=a.config_type, description=a.config_type.__doc__))
        for a in algorithms()
    },
)
RunConfig.__doc__ = _RunConfigBase.__doc__
