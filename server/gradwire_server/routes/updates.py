"""Submitting a round's update (``POST …/rounds/{round}/updates``) and fetching published diffs."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel

from gradwire.protocol import API_PREFIX, LATEST_VERSION_HEADER, MAX_WAIT_S

from ..auth import Principal, principal
from ..downlink import PageResponse
from .common import ERROR, VERSION_HEADERS, declared_length, octet_request, octet_response, read_body, server

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["updates"])


class Accepted(BaseModel):
    round: int
    node_id: int
    duplicate: bool
    submitted: int
    #: SHA-256 (hex) of the bytes recorded for this node and round: through an object store, whether the
    #: upload that counts is the one the node meant (a key written before, e.g. before a restart, is not).
    sha256: str | None = None


@router.post(
    "/rounds/{round}/updates",
    status_code=202,
    response_model=Accepted,
    summary="Submit this node's compressed gradient bundle for the open round",
    description="Answers 202 only once the frame is durably recorded (file fsynced and SQLite committed). "
    "The same bytes again are a duplicate (202, counted once); different bytes for the same node "
    "and round are refused (409).",
    openapi_extra=octet_request(
        "A BUNDLE frame (docs/FORMAT.md) whose sender is the token's node and whose "
        "round is {round}, holding every parameter of the run's model."
    ),
    responses={
        400: ERROR,
        401: ERROR,
        403: ERROR,
        404: ERROR,
        409: ERROR,
        410: ERROR,
        413: ERROR,
        422: ERROR,
        429: ERROR,
        503: ERROR,
        507: ERROR,
    },
)
async def submit_update(
    request: Request, run_id: str, round: int = Path(ge=0), who: Principal = Depends(principal)
) -> dict:
    ctx = server(request)
    rt = ctx.engine.runtime(run_id)
    node_id = who.require_node(run_id)
    declared = declared_length(request, rt.config.max_frame_bytes)
    # Everything that needs no body is checked before its first byte is read (docs/API.md, the order).
    async with ctx.engine.upload(run_id, node_id, round, declared):
        body = await read_body(request, rt.config.max_frame_bytes)
        ctx.metrics.bytes_in.inc(len(body))
        return await ctx.engine.submit(run_id, node_id, round, body)


@router.get(
    "/updates",
    response_class=Response,
    summary="The diff frames publishing versions since+1 … current, concatenated, in pages",
    description="Each frame is self-delimiting (its header's total_len); header round = the version it "
    "produces, sender = 0xFFFFFFFF. Empty when `since` is current; `wait` long-polls for a newer "
    "version. One answer holds at most the server's max_catch_up_bytes (at least one version): "
    "X-Gradwire-Version says where it ends, X-Gradwire-Latest-Version the run's version; ask again "
    "from the former until it reaches the latter. 410 `too_far_behind` when those diffs are no "
    "longer kept: fetch the state instead. 429 `busy` when too many catch-ups are being sent.",
    responses={
        200: octet_response(
            "concatenated frames", {**VERSION_HEADERS, LATEST_VERSION_HEADER: "the run's current version"}
        ),
        401: ERROR,
        403: ERROR,
        404: ERROR,
        409: ERROR,
        410: ERROR,
        422: ERROR,
        429: ERROR,
    },
)
async def get_updates(
    request: Request,
    run_id: str,
    since: int = Query(ge=0),
    wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S),
    who: Principal = Depends(principal),
) -> Response:
    ctx = server(request)
    ctx.engine.runtime(run_id)
    who.require_member(run_id)
    page = await ctx.engine.updates_since(run_id, since, wait)
    ctx.metrics.bytes_out.inc(page.nbytes)
    return PageResponse(page)
