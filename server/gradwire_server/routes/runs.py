"""``POST /v1/runs`` (create, admin) and ``GET /v1/runs/{run_id}`` (status)."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from gradwire.protocol import API_PREFIX

from ..auth import Principal, principal
from ..config import RunConfig
from .common import ERROR, server

router = APIRouter(prefix=f"{API_PREFIX}/runs", tags=["runs"])


class RunCreated(BaseModel):
    run_id: str


class RunStatus(BaseModel):
    run_id: str
    version: int
    open_round: int
    weights_hash: Optional[str]
    submitted: int
    quorum: int
    nodes: int
    deadline_in_s: Optional[float]
    config: RunConfig
    #: What the run's config leaves unsafe, e.g. an aggregation rule that does not bound one node's
    #: influence (docs/SERVER.md, "Rogue nodes"); empty for a safe config.
    warnings: list[str] = []


@router.post("", status_code=201, response_model=RunCreated, summary="Create a run (admin)",
             responses={401: ERROR, 403: ERROR, 422: ERROR})
async def create_run(request: Request, config: Optional[RunConfig] = None,
                     who: Principal = Depends(principal)) -> RunCreated:
    who.require_admin()
    ctx = server(request)
    config = config or RunConfig()
    if "max_frame_bytes" not in config.model_fields_set:
        config = config.model_copy(update={"max_frame_bytes": ctx.settings.max_frame_bytes})
    return RunCreated(run_id=await ctx.engine.create_run(config))


@router.get("/{run_id}", response_model=RunStatus, summary="A run's version, open round and progress",
            responses={401: ERROR, 403: ERROR, 404: ERROR})
async def run_status(run_id: str, request: Request, who: Principal = Depends(principal)) -> dict:
    engine = server(request).engine
    engine.runtime(run_id)
    who.require_member(run_id)
    return engine.status(run_id)
