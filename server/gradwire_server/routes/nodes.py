"""A run's nodes (admin): ``POST /v1/runs/{run_id}/nodes`` registers one (its token is shown once), ``GET``
lists them; a node's token is revoked (``DELETE …/nodes/{node_id}/token``) or replaced (``POST …/token``),
and a node deleted (``DELETE …/nodes/{node_id}``)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel, Field

from gradwire.protocol import API_PREFIX

from ..auth import Principal, admin, hash_token, new_token, principal
from ..errors import Reason, Rejected
from .common import ERROR, server

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}/nodes", tags=["nodes"])

_STORAGE = {503: ERROR, 507: ERROR}


class NodeRequest(BaseModel):
    name: str | None = Field(None, max_length=200)


class NodeCreated(BaseModel):
    node_id: int = Field(description="The node's id: the `sender` of its frames (from 1).")
    token: str = Field(description="The node's bearer token; stored only hashed, never shown again.")


class NodeInfo(BaseModel):
    node_id: int
    name: str | None
    created_at: float = Field(description="Unix time of its registration.")
    token: str = Field(description="`active`, or `revoked` (POST …/token gives it a new one).")


def _admin_of(run_id: str, request: Request, who: Principal):
    ctx = server(request)
    ctx.engine.runtime(run_id)
    who.require_admin()
    return ctx


def _unknown_node(run_id: str, node_id: int) -> Rejected:
    return Rejected(Reason.UNKNOWN_NODE, f"run {run_id} has no node {node_id}")


@router.post(
    "",
    status_code=201,
    response_model=NodeCreated,
    summary="Register a node (admin)",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 409: ERROR, **_STORAGE},
)
async def register_node(
    run_id: str, request: Request, body: NodeRequest | None = None, who: Principal = Depends(admin)
) -> NodeCreated:
    ctx = _admin_of(run_id, request, who)
    token = new_token()
    node_id = await asyncio.to_thread(
        ctx.store.add_node, run_id, (body or NodeRequest()).name, hash_token(token), ctx.settings.max_nodes_per_run
    )
    return NodeCreated(node_id=node_id, token=token)


@router.get(
    "", response_model=list[NodeInfo], summary="The run's nodes (admin)", responses={401: ERROR, 403: ERROR, 404: ERROR}
)
async def list_nodes(run_id: str, request: Request, who: Principal = Depends(principal)) -> list[NodeInfo]:
    ctx = _admin_of(run_id, request, who)
    return [
        NodeInfo(
            node_id=n.node_id,
            name=n.name,
            created_at=n.created_at,
            token="revoked" if n.revoked_at is not None else "active",
        )
        for n in await asyncio.to_thread(ctx.store.list_nodes, run_id)
    ]


@router.post(
    "/{node_id}/token",
    status_code=201,
    response_model=NodeCreated,
    summary="A new token for a node (admin); its old token stops working at once",
    responses={401: ERROR, 403: ERROR, 404: ERROR, **_STORAGE},
)
async def replace_token(
    run_id: str, request: Request, node_id: int = Path(ge=1), who: Principal = Depends(admin)
) -> NodeCreated:
    ctx = _admin_of(run_id, request, who)
    token = new_token()
    if not await asyncio.to_thread(ctx.store.set_node_token, run_id, node_id, hash_token(token)):
        raise _unknown_node(run_id, node_id)
    return NodeCreated(node_id=node_id, token=token)


@router.delete(
    "/{node_id}/token",
    status_code=204,
    response_class=Response,
    summary="Revoke a node's token (admin): 401 invalid_token from now on; the node stays registered",
    responses={401: ERROR, 403: ERROR, 404: ERROR, **_STORAGE},
)
async def revoke_token(
    run_id: str, request: Request, node_id: int = Path(ge=1), who: Principal = Depends(admin)
) -> Response:
    ctx = _admin_of(run_id, request, who)
    if not await asyncio.to_thread(ctx.store.set_node_token, run_id, node_id, None):
        raise _unknown_node(run_id, node_id)
    return Response(status_code=204)


@router.delete(
    "/{node_id}",
    status_code=204,
    response_class=Response,
    summary="Delete a node (admin): its token stops working, its id is never given again, the updates "
    "it had acknowledged stay counted",
    responses={401: ERROR, 403: ERROR, 404: ERROR, **_STORAGE},
)
async def delete_node(
    run_id: str, request: Request, node_id: int = Path(ge=1), who: Principal = Depends(admin)
) -> Response:
    ctx = _admin_of(run_id, request, who)
    if not await asyncio.to_thread(ctx.store.delete_node, run_id, node_id):
        raise _unknown_node(run_id, node_id)
    return Response(status_code=204)
