"""``/healthz`` (process alive), ``/readyz`` (store open, recovery done) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .common import server

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: the store is open and recovery is done (else 503)",
            responses={503: {"description": "still starting or shutting down"}})
async def readyz(request: Request):
    if not server(request).ready:
        return JSONResponse({"status": "starting"}, status_code=503)
    return {"status": "ready"}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    return Response(generate_latest(server(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
