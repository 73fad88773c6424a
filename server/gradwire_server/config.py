"""``RunConfig``: everything a run fixes when it is created (docs/API.md)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

import gradwire
from gradwire.frame import MIN_FRAME_BYTES

__all__ = ["ALGORITHMS", "AggregationConfig", "CodecConfig", "DeMoConfig", "OptimizerConfig", "RunConfig",
           "SparseLoCoConfig"]

#: How a run trains (docs/ALGORITHMS.md).
ALGORITHMS = ("adamw", "demo", "sparseloco")


class CodecConfig(BaseModel):
    """A codec or policy by name (``gradwire.codec_names()``) and its keyword parameters."""

    model_config = ConfigDict(extra="forbid")

    codec: str = "dct"
    params: dict[str, Any] = Field(default_factory=lambda: {"chunk_shape": [64, 64], "topk": 32})

    @model_validator(mode="after")
    def _buildable(self) -> "CodecConfig":
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


class OptimizerConfig(BaseModel):
    """AdamW on the fp32 master weights, with linear warm-up then a constant or cosine schedule."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_rounds: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    total_rounds: Optional[int] = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "OptimizerConfig":
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        if self.schedule == "cosine" and self.total_rounds is None:
            raise ValueError("schedule 'cosine' needs total_rounds")
        return self


class AggregationConfig(BaseModel):
    """The rule that turns a round's updates into one gradient."""

    model_config = ConfigDict(extra="forbid")

    rule: Literal["mean", "clipped_mean", "trimmed_mean", "median"] = "mean"
    trim_fraction: float = Field(0.2, ge=0.0, lt=0.5)


class DeMoConfig(BaseModel):
    """DeMo: nodes send the top-k DCT of their decoupled momentum; everyone applies ``-lr·sign(mean)``."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-3, gt=0, description="The sign step (also scales the momentum's input, lr·grad).")
    beta: float = Field(0.999, ge=0.0, lt=1.0, description="Momentum decay.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled: p ← p·(1 − lr·weight_decay).")


class SparseLoCoConfig(BaseModel):
    """SparseLoCo: nodes take ``sync_every`` local steps, then send their compressed pseudo-gradient."""

    model_config = ConfigDict(extra="forbid")

    sync_every: int = Field(32, ge=1, description="Local (inner) steps per round.")
    inner: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Each node's local AdamW.")
    error_decay: float = Field(0.95, ge=0.0, le=1.0, description="Decay of each node's error buffer.")
    outer_lr: float = Field(1.0, gt=0)
    outer_momentum: float = Field(0.0, ge=0.0, lt=1.0, description="DiLoCo's recipe: 0.9 with outer_lr 0.7.")
    nesterov: bool = False


class RunConfig(BaseModel):
    """A run's configuration; every field has a default."""

    model_config = ConfigDict(extra="forbid")

    algorithm: Literal["adamw", "demo", "sparseloco"] = Field(
        "adamw", description="adamw: the server steps AdamW on the mean gradient and sends the compressed weight "
                             "diff; demo / sparseloco: the server averages the nodes' frames and publishes them "
                             "(docs/ALGORITHMS.md).")
    demo: DeMoConfig = Field(default_factory=DeMoConfig)
    sparseloco: SparseLoCoConfig = Field(default_factory=SparseLoCoConfig)
    uplink: CodecConfig = Field(default_factory=CodecConfig)
    downlink: CodecConfig = Field(default_factory=CodecConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    quorum: int = Field(1, ge=1, description="Aggregate as soon as this many distinct nodes submitted.")
    min_updates: int = Field(1, ge=1, description="At the deadline, aggregate if at least this many updates.")
    round_deadline_s: float = Field(30.0, gt=0, description="Seconds from the moment a round opens.")
    max_frame_bytes: int = Field(64 << 20, ge=MIN_FRAME_BYTES)
    max_update_norm: Optional[float] = Field(None, gt=0, description="Per-update L2 norm ceiling.")
    late_policy: Literal["reject", "staleness"] = "reject"
    keep_versions: int = Field(1000, ge=1, description="Published diffs retained for catch-up.")
    model_record: bool = Field(
        False, description="demo / sparseloco: nodes send the whole model as one record (its tensors as float32, "
                           "flattened in sorted name order, named after the spec's hash: docs/FORMAT.md section 9), "
                           "so a frame's headers do not grow with the tensor count. The server refuses frames of "
                           "any other form (tensor_mismatch).")

    @model_validator(mode="after")
    def _check_model_record(self) -> "RunConfig":
        if self.model_record and self.algorithm == "adamw":
            raise ValueError("model_record is for the demo and sparseloco algorithms (adamw runs send a record per tensor)")
        return self
