"""Server settings: environment variables (prefix ``GRADWIRE_``) and command-line flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gradwire.frame import MIN_FRAME_BYTES

__all__ = ["ServerSettings"]


class ServerSettings(BaseSettings):
    """Everything the server process needs; each field is ``GRADWIRE_<NAME>`` or ``--<name>``."""

    # An empty variable is unset (GRADWIRE_ADMIN_TOKEN= beside --admin-token-file, say).
    model_config = SettingsConfigDict(
        env_prefix="GRADWIRE_", cli_kebab_case=True, cli_prog_name="gradwire-server", env_ignore_empty=True
    )

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8470, ge=0, le=65535, description="TCP port (0: any free port).")
    data_dir: Path = Field(Path("gradwire-data"), description="SQLite database and safetensors/frame files.")
    admin_token: SecretStr | None = Field(
        None,
        description="Admin bearer token. Prefer the environment (GRADWIRE_ADMIN_TOKEN) or admin_token_file: "
        "a --admin-token flag shows in `ps`. If none is set one is generated into "
        "<data_dir>/admin_token (mode 0600).",
    )
    admin_token_file: Path | None = Field(
        None, description="A file holding the admin bearer token (its first line), e.g. a mounted secret."
    )
    metrics_run_ids: bool = Field(
        False,
        description="Label per-run metrics (gradwire_version) with run ids; /metrics needs no token, so off "
        "by default.",
    )
    max_runs: int = Field(1000, ge=1, description="Cap on the runs the server holds (409 limit_reached beyond).")
    max_nodes_per_run: int = Field(
        4096, ge=1, description="Cap on the registered nodes of one run (409 limit_reached beyond)."
    )
    max_stored_bytes: int | None = Field(
        None,
        ge=1,
        description="Cap on the bytes of the runs' files and the database (409 limit_reached for a "
        "write that would pass it); unset: none.",
    )
    close_retry_initial_s: float = Field(
        1.0,
        gt=0,
        le=3600,
        description="A failed round close is retried after this long, then twice as long each "
        "time, up to close_retry_max_s.",
    )
    close_retry_max_s: float = Field(60.0, gt=0, le=3600, description="The longest wait between round close retries.")
    close_failures_before_failed: int = Field(
        5,
        ge=0,
        description="A run whose round close fails this many times in a row the same way (not for want "
        "of storage) is marked failed until the admin resumes it; 0: never.",
    )
    max_frame_bytes: int = Field(
        64 << 20, ge=MIN_FRAME_BYTES, description="Default per-run ceiling on a submitted frame."
    )
    max_state_bytes: int = Field(4 << 30, ge=1, description="Ceiling on an initial-state upload (PUT state).")
    live_window_rounds: int = Field(5, ge=1, description="A node is live if it submitted in this many last rounds.")
    log_json: bool = Field(False, description="Structured JSON log lines instead of plain text.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info")
    checkpoint_every: int = Field(
        50,
        ge=1,
        description="Write a run's full state (weights, moments, server state) every this many versions; "
        "a restart replays the versions since from their logged frames.",
    )
    checkpoint_every_version_below_bytes: int = Field(
        4 << 20,
        ge=0,
        description="Write the full state with every version (in the round close) when it is at most "
        "this many bytes: writing it then costs about what the frame does. 0: never.",
    )
    validate_threads: int = Field(
        0, ge=0, description="Worker threads that hash, validate and write submitted updates (0: one per CPU core)."
    )
    # Bounded connections (docs/SERVER.md, "Connections and deadlines"; gradwire_server.connections).
    max_connections: int = Field(
        512,
        ge=1,
        description="Open connections at most; beyond, the oldest one still waiting for its request "
        "headers, else the one stalled longest in a request body, is closed to make room "
        "(or the new one, when none is).",
    )
    max_connections_per_address: int = Field(
        128,
        ge=0,
        description="Open connections from one client address at most (0: no per-address cap); beyond, "
        "that address's oldest connection waiting for headers or stalled in a body is "
        "closed to make room (or the new one). Behind a reverse proxy every client shares "
        "the proxy's address: raise it to max_connections or set 0 there.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="A request's line and headers must arrive within this many seconds of the connection "
        "opening or the previous response ending; else the connection is closed.",
    )
    body_timeout_s: float = Field(
        20.0,
        gt=0,
        allow_inf_nan=False,
        description="Grace, in seconds, before a request body must keep up with min_body_rate; also how long a "
        "client may read nothing of a response before it is closed.",
    )
    min_body_rate: int = Field(
        16 << 10,
        ge=1,
        description="Bytes per second a request body must average after body_timeout_s (time the "
        "server itself is not reading is not counted); slower ones are closed.",
    )
    shutdown_grace_s: float = Field(
        10.0,
        ge=0,
        allow_inf_nan=False,
        description="On SIGTERM: how long requests in flight may take to finish before they are cancelled "
        "(long polls are answered at once).",
    )
    max_catch_up_bytes: int = Field(
        16 << 20,
        ge=1,
        description="Bytes of versions in one GET …/updates answer at most (always at least one "
        "version); the client asks again from where it stopped.",
    )
    max_catch_ups: int = Field(
        4,
        ge=1,
        description="GET …/updates answers of more than one version sent at once at most; beyond, "
        "429 busy with Retry-After.",
    )
    # The object-store data plane (docs/SERVER.md, "Object storage"; gradwire_server.object_store).
    object_store: str | None = Field(
        None,
        description="s3://bucket/prefix: frames and versions go through this S3-compatible bucket (nodes get "
        "presigned URLs; the server's own port carries small JSON only). Endpoint and credentials: "
        "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION or a profile "
        "(AWS_PROFILE). Unset: everything through the server's port and its data directory.",
    )
    object_store_public_url: str | None = Field(
        None,
        description="A public or CDN base URL of the bucket's prefix root (the key is appended): nodes GET "
        "versions and checkpoints there instead of through presigned URLs.",
    )
    object_store_url_expiry_s: int = Field(
        900, ge=60, le=7 * 24 * 3600, description="How long a presigned URL handed to a node stays valid."
    )
    object_store_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Connect and read timeout of each request the server makes to the store."
    )
    device: str = Field(
        "cpu",
        description="Where each run's master weights, moments and round math live: cpu, cuda or cuda:<index>. "
        "Only frames and checkpoints cross to the host.",
    )

    @model_validator(mode="after")
    def _one_admin_token(self) -> ServerSettings:
        if self.admin_token is not None and self.admin_token_file is not None:
            raise ValueError("set either admin_token or admin_token_file, not both")
        return self

    @field_validator("object_store")
    @classmethod
    def _store_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from .object_store import parse_store_url

        parse_store_url(value)  # raises ValueError naming what is wrong
        return value

    @field_validator("device")
    @classmethod
    def _device_available(cls, value: str) -> str:
        try:
            dev = torch.device(value)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device {value!r} is not a torch device: {exc}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device {value!r}: the server runs on cpu or cuda")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"device {value!r} was asked for, but CUDA is not available here "
                    f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); use --device cpu"
                )
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(f"device {value!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return value

    def torch_device(self) -> torch.device:
        dev = torch.device(self.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
