"""``POST /v1/runs`` (create, admin), ``GET /v1/runs`` (every run, paged, admin), ``GET /v1/runs/{run_id}`` (status),
and the admin's hold on a run: ``POST …/pause``, ``POST …/resume``, ``DELETE /v1/runs/{run_id}``."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, Field

from gradwire.protocol import API_PREFIX

from ..auth import Principal, admin, principal
from ..config import RunConfig
from ..errors import Reason, Rejected
from .common import ERROR, server

router = APIRouter(prefix=f"{API_PREFIX}/runs", tags=["runs"])


class RunCreated(BaseModel):
    run_id: str


class RunStatus(BaseModel):
    run_id: str
    version: int
    open_round: int
    weights_hash: str | None
    status: Literal["active", "paused", "failed"] = Field(
        description="active; paused by the admin (no round closes, updates refused with 409 run_paused); failed: "
        "its round close failed the same way close_failures_before_failed times in a row (updates "
        "refused with 409 run_failed) until the admin resumes it"
    )
    status_detail: str | None = Field(description="Why a run failed (the cause of its last failed close).")
    submitted: int
    quorum: int
    nodes: int
    deadline_in_s: float | None
    config: RunConfig
    #: What the run's config leaves unsafe, e.g. an aggregation rule that does not bound one node's
    #: influence (docs/SERVER.md, "Rogue nodes"); empty for a safe config.
    warnings: list[str] = []
    #: Whether frames and versions go through the server's object store (POST …/rounds/{r}/slot, GET
    #: …/objects) rather than its own port (docs/SERVER.md, "Object storage").
    object_store: bool = False


@router.post(
    "",
    status_code=201,
    response_model=RunCreated,
    summary="Create a run (admin)",
    responses={401: ERROR, 403: ERROR, 409: ERROR, 422: ERROR, 503: ERROR, 507: ERROR},
)
async def create_run(request: Request, config: RunConfig | None = None, who: Principal = Depends(admin)) -> RunCreated:
    ctx = server(request)
    config = config or RunConfig()
    if "max_frame_bytes" not in config.model_fields_set:
        config = config.model_copy(update={"max_frame_bytes": ctx.settings.max_frame_bytes})
    return RunCreated(run_id=await ctx.engine.create_run(config))


#: Runs per page of ``GET /v1/runs``: the default, and the most one page holds.
RUNS_PAGE, RUNS_PAGE_MAX = 100, 1000


class RunPage(BaseModel):
    runs: list[RunStatus] = Field(
        description="Runs in the order they were created, each as GET /v1/runs/{run_id} says."
    )
    next: str | None = Field(
        description="The last run of this page: pass it as `after` for the next page; null on the last page."
    )


@router.get(
    "",
    response_model=RunPage,
    summary="Every run, oldest first, a page at a time (admin)",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 422: ERROR},
)
async def list_runs(
    request: Request,
    limit: int = Query(RUNS_PAGE, ge=1, le=RUNS_PAGE_MAX),
    after: str | None = Query(None, description="Start after this run (a page's `next`)."),
    who: Principal = Depends(admin),
) -> dict:
    engine = server(request).engine
    ids = list(engine.runs)  # loaded oldest first, then created in order: the order of creation
    start = 0
    if after is not None:
        if after not in engine.runs:
            raise Rejected(Reason.NOT_FOUND, f"no run {after!r} to page after (deleted? start again without `after`)")
        start = ids.index(after) + 1
    page = ids[start : start + limit]
    more = start + limit < len(ids)
    return {"runs": [engine.status(r) for r in page], "next": page[-1] if more and page else None}


@router.get(
    "/{run_id}",
    response_model=RunStatus,
    summary="A run's version, open round and progress",
    responses={401: ERROR, 403: ERROR, 404: ERROR},
)
async def run_status(run_id: str, request: Request, who: Principal = Depends(principal)) -> dict:
    engine = server(request).engine
    engine.runtime(run_id)
    who.require_member(run_id)
    return engine.status(run_id)


@router.post(
    "/{run_id}/pause",
    response_model=RunStatus,
    summary="Pause a run (admin): no round closes, updates refused (409 run_paused); catch-ups and state reads go on",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 503: ERROR, 507: ERROR},
)
async def pause_run(run_id: str, request: Request, who: Principal = Depends(principal)) -> dict:
    engine = server(request).engine
    engine.runtime(run_id)
    who.require_admin()
    return await engine.set_status(run_id, "paused")


@router.post(
    "/{run_id}/resume",
    response_model=RunStatus,
    summary="Resume a paused or failed run (admin): its round close is tried again at once",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 503: ERROR, 507: ERROR},
)
async def resume_run(run_id: str, request: Request, who: Principal = Depends(principal)) -> dict:
    engine = server(request).engine
    engine.runtime(run_id)
    who.require_admin()
    return await engine.set_status(run_id, "active")


@router.delete(
    "/{run_id}",
    status_code=204,
    response_class=Response,
    summary="Delete a run (admin): its versions, updates, nodes (their tokens stop working) and files",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 503: ERROR, 507: ERROR},
)
async def delete_run(run_id: str, request: Request, who: Principal = Depends(principal)) -> Response:
    engine = server(request).engine
    engine.runtime(run_id)
    who.require_admin()
    await engine.delete_run(run_id)
    return Response(status_code=204)
