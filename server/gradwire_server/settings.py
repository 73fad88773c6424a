"""Server settings: environment variables (prefix ``GRADWIRE_``) and command-line flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from gradwire.frame import MIN_FRAME_BYTES

__all__ = ["ServerSettings"]


class ServerSettings(BaseSettings):
    """Everything the server process needs; each field is ``GRADWIRE_<NAME>`` or ``--<name>``."""

    model_config = SettingsConfigDict(env_prefix="GRADWIRE_", cli_kebab_case=True, cli_prog_name="gradwire-server")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8470, ge=0, le=65535, description="TCP port (0: any free port).")
    data_dir: Path = Field(Path("gradwire-data"), description="SQLite database and safetensors/frame files.")
    admin_token: Optional[SecretStr] = Field(
        None, description="Admin bearer token; if unset one is generated into <data_dir>/admin_token (mode 0600)."
    )
    max_frame_bytes: int = Field(64 << 20, ge=MIN_FRAME_BYTES, description="Default per-run ceiling on a submitted frame.")
    max_state_bytes: int = Field(4 << 30, ge=1, description="Ceiling on an initial-state upload (PUT state).")
    live_window_rounds: int = Field(5, ge=1, description="A node is live if it submitted in this many last rounds.")
    log_json: bool = Field(False, description="Structured JSON log lines instead of plain text.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info")
