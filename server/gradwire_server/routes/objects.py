"""The object-store data plane's routes (docs/SERVER.md, "Object storage"): an upload slot (a presigned
PUT), the tell that a frame was written there, and the manifest of versions (and checkpoint) to GET from
the store. Each answer is small JSON: the frames and the versions never pass through this port."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, Field

from gradwire.protocol import API_PREFIX, MAX_WAIT_S

from ..auth import Principal, principal
from .common import ERROR, server
from .updates import Accepted

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["object store"])


class SlotRequest(BaseModel):
    nbytes: int = Field(ge=1, description="The frame's size in bytes: bound into the presigned PUT.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The frame's SHA-256, hex: bound into the PUT.")


class Slot(BaseModel):
    key: str
    url: str = Field(description="PUT the frame here, with exactly `headers` and the declared length.")
    headers: dict[str, str]
    expires_at: float
    max_bytes: int


class Uploaded(BaseModel):
    key: str = Field(max_length=1024)


class StoredEntry(BaseModel):
    url: str
    nbytes: int
    sha256: str


class StoredVersion(StoredEntry):
    version: int
    weights_hash: str


class StoredCheckpoint(BaseModel):
    version: int
    weights_hash: str
    weights: StoredEntry
    algorithm: StoredEntry | None = None


class Manifest(BaseModel):
    version: int = Field(description="The version the listed versions reach (the checkpoint's, if none).")
    latest: int = Field(description="The run's version: ask again from `version` while it is behind.")
    weights_hash: str
    checkpoint: StoredCheckpoint | None
    versions: list[StoredVersion]


@router.post(
    "/rounds/{round}/slot",
    response_model=Slot,
    summary="A presigned PUT for this node's one key of the round (object-store servers)",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 409: ERROR, 410: ERROR, 413: ERROR, 422: ERROR, 429: ERROR},
)
async def upload_slot(
    request: Request, run_id: str, slot: SlotRequest, round: int = Path(ge=0), who: Principal = Depends(principal)
) -> dict:
    ctx = server(request)
    ctx.engine.runtime(run_id)
    node_id = who.require_node(run_id)
    return await ctx.engine.upload_slot(run_id, node_id, round, slot.nbytes, slot.sha256)


@router.post(
    "/rounds/{round}/uploaded",
    status_code=202,
    response_model=Accepted,
    summary="Record the frame this node wrote to its slot's key (object-store servers)",
    description="The server reads the object's size (refused above the run's cap before a byte is read) and "
    "its store timestamp (refused when written after the round's deadline), then reads and records it as a "
    "submitted body: 202 only once it is durably recorded; the same key again is a duplicate.",
    responses={
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
async def uploaded(
    request: Request, run_id: str, body: Uploaded, round: int = Path(ge=0), who: Principal = Depends(principal)
) -> dict:
    ctx = server(request)
    ctx.engine.runtime(run_id)
    node_id = who.require_node(run_id)
    return await ctx.engine.submit_uploaded(run_id, node_id, round, body.key)


@router.get(
    "/objects",
    response_model=Manifest,
    summary="Where the versions after `since` are in the object store (and, without `since`, the checkpoint)",
    description="Without `since` (a node with no state): the store's last checkpoint and the versions after "
    "it. With `since`: the versions after it (`wait` long-polls for one), or the checkpoint too when they "
    "are no longer kept. At most 64 versions an answer: ask again from `version` while it is below `latest`.",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 409: ERROR, 410: ERROR, 422: ERROR},
)
async def objects(
    request: Request,
    run_id: str,
    since: int | None = Query(None, ge=0),
    wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S),
    who: Principal = Depends(principal),
) -> dict:
    ctx = server(request)
    ctx.engine.runtime(run_id)
    who.require_member(run_id)
    return await ctx.engine.objects_since(run_id, since, wait)
