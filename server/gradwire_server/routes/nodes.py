"""``POST /v1/runs/{run_id}/nodes``: register a node (admin); its token is shown once."""

from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from gradwire.protocol import API_PREFIX

from ..auth import Principal, hash_token, new_token, principal
from .common import ERROR, server

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}/nodes", tags=["nodes"])


class NodeRequest(BaseModel):
    name: Optional[str] = Field(None, max_length=200)


class NodeCreated(BaseModel):
    node_id: int = Field(description="The node's id: the `sender` of its frames (from 1).")
    token: str = Field(description="The node's bearer token; stored only hashed, never shown again.")


@router.post("", status_code=201, response_model=NodeCreated, summary="Register a node (admin)",
             responses={401: ERROR, 403: ERROR, 404: ERROR})
async def register_node(run_id: str, request: Request, body: Optional[NodeRequest] = None,
                        who: Principal = Depends(principal)) -> NodeCreated:
    who.require_admin()
    ctx = server(request)
    ctx.engine.runtime(run_id)
    token = new_token()
    node_id = await asyncio.to_thread(ctx.store.add_node, run_id, (body or NodeRequest()).name, hash_token(token))
    return NodeCreated(node_id=node_id, token=token)
