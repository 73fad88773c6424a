"""``PUT /v1/runs/{run_id}/state`` (initial model, admin) and ``GET`` (current fp32 master weights)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel

from gradwire.protocol import API_PREFIX

from ..auth import Principal, principal
from ..errors import Reason
from .common import (
    ERROR,
    VERSION_HEADERS,
    declared_length,
    octet_request,
    octet_response,
    server,
    spool_body,
    versioned_octets,
)

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}/state", tags=["state"])


class StateSet(BaseModel):
    version: int
    weights_hash: str


@router.put(
    "",
    response_model=StateSet,
    summary="Set the initial model (admin): safetensors bytes, spooled to disk",
    openapi_extra=octet_request("The model's tensors as safetensors; stored as fp32 master weights."),
    responses={400: ERROR, 401: ERROR, 403: ERROR, 404: ERROR, 409: ERROR, 413: ERROR, 503: ERROR, 507: ERROR},
)
async def put_state(run_id: str, request: Request, who: Principal = Depends(principal)) -> dict:
    who.require_admin()
    ctx = server(request)
    ctx.engine.runtime(run_id)
    declared_length(request, ctx.settings.max_state_bytes, Reason.STATE_TOO_LARGE)
    await ctx.engine.require_not_started(run_id)  # before the body: it can be gigabytes
    with ctx.store.writing(f"the initial state upload of run {run_id}"):  # a full disk: 507, not a 500
        path = await spool_body(
            request, ctx.settings.max_state_bytes, ctx.store.run_dir(run_id), Reason.STATE_TOO_LARGE
        )
    try:
        return await ctx.engine.set_state(run_id, path)
    finally:
        path.unlink(missing_ok=True)


@router.get(
    "",
    response_class=Response,
    summary="The fp32 master weights at the current version",
    responses={
        200: octet_response("safetensors bytes", VERSION_HEADERS),
        401: ERROR,
        403: ERROR,
        404: ERROR,
        409: ERROR,
    },
)
async def get_state(run_id: str, request: Request, who: Principal = Depends(principal)) -> Response:
    ctx = server(request)
    ctx.engine.runtime(run_id)
    who.require_member(run_id)
    data, version, h = await ctx.engine.state_bytes(run_id)
    ctx.metrics.bytes_out.inc(len(data))
    return versioned_octets(data, version, h)


@router.get(
    "/algorithm",
    response_class=Response,
    summary="What a node needs beside the weights to apply the next versions (SparseLoCo's outer momentum)",
    description="gradwire.state.pack_state_dict bytes (safetensors, structure as JSON metadata) of the "
    'algorithm\'s state at the version in the headers: `{"outer": {"buffers": …}}` for '
    "SparseLoCo runs, `{}` otherwise.",
    responses={
        200: octet_response("packed state dict", VERSION_HEADERS),
        401: ERROR,
        403: ERROR,
        404: ERROR,
        409: ERROR,
    },
)
async def get_algorithm_state(run_id: str, request: Request, who: Principal = Depends(principal)) -> Response:
    ctx = server(request)
    ctx.engine.runtime(run_id)
    who.require_member(run_id)
    data, version, h = await ctx.engine.algorithm_state_bytes(run_id)
    ctx.metrics.bytes_out.inc(len(data))
    return versioned_octets(data, version, h)
