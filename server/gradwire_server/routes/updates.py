"""Submitting a round's update (``POST …/rounds/{round}/updates``) and fetching published diffs."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel

from gradwire.protocol import API_PREFIX, MAX_WAIT_S

from ..auth import Principal, principal
from .common import ERROR, VERSION_HEADERS, octet_request, octet_response, read_body, server, versioned_octets

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["updates"])


class Accepted(BaseModel):
    round: int
    node_id: int
    duplicate: bool
    submitted: int


@router.post(
    "/rounds/{round}/updates", status_code=202, response_model=Accepted,
    summary="Submit this node's compressed gradient bundle for the open round",
    description="Answers 202 only once the frame is durably recorded (file fsynced and SQLite committed). "
                "The same bytes again are a duplicate (202, counted once); different bytes for the same node "
                "and round are refused (409).",
    openapi_extra=octet_request("A BUNDLE frame (docs/FORMAT.md) whose sender is the token's node and whose "
                                "round is {round}, holding every parameter of the run's model."),
    responses={400: ERROR, 401: ERROR, 403: ERROR, 404: ERROR, 409: ERROR, 410: ERROR, 413: ERROR, 422: ERROR},
)
async def submit_update(request: Request, run_id: str, round: int = Path(ge=0),
                        who: Principal = Depends(principal)) -> dict:
    ctx = server(request)
    rt = ctx.engine.runtime(run_id)
    node_id = who.require_node(run_id)
    body = await read_body(request, rt.config.max_frame_bytes)
    ctx.metrics.bytes_in.inc(len(body))
    return await ctx.engine.submit(run_id, node_id, round, body)


@router.get(
    "/updates", response_class=Response,
    summary="The diff frames publishing versions since+1 … current, concatenated",
    description="Each frame is self-delimiting (its header's total_len); header round = the version it "
                "produces, sender = 0xFFFFFFFF. Empty when `since` is current; `wait` long-polls for a newer "
                "version. 410 `too_far_behind` when those diffs are no longer kept: fetch the state instead.",
    responses={200: octet_response("concatenated frames", VERSION_HEADERS), 401: ERROR, 403: ERROR, 404: ERROR,
               409: ERROR, 410: ERROR, 422: ERROR},
)
async def get_updates(request: Request, run_id: str, since: int = Query(ge=0),
                      wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S),
                      who: Principal = Depends(principal)) -> Response:
    ctx = server(request)
    ctx.engine.runtime(run_id)
    who.require_member(run_id)
    data, version, h = await ctx.engine.updates_since(run_id, since, wait)
    ctx.metrics.bytes_out.inc(len(data))
    return versioned_octets(data, version, h)
