"""``/healthz`` (process alive), ``/readyz`` (store open, recovery done, the store writes) and ``/metrics``
(Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import STORAGE_RETRY_AFTER_S
from .common import server

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict:
    return {"status": "ok"}


_READY_503 = {
    "description": "starting or shutting down (`starting`), or the store cannot write (`storage_failing`, "
    "with the cause in `detail`)",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"status": {"type": "string"}, "detail": {"type": "string"}},
                "required": ["status"],
            }
        }
    },
}


@router.get(
    "/readyz",
    summary="Readiness: the store is open, recovery is done and the store writes (else 503)",
    description='200 `{"status": "ready", "runs": {"active": n, "paused": n, "failed": n}}` '
    "(with `failed_runs`: run id → cause when the server exposes run ids). A failed run does "
    "not make the server unready: the other runs still train.",
    responses={503: _READY_503},
)
async def readyz(request: Request):
    ctx = server(request)
    if not ctx.ready:
        return JSONResponse({"status": "starting"}, status_code=503)
    if not await ctx.store_writable():
        return JSONResponse(
            {"status": "storage_failing", "detail": ctx.store.write_failure or "unknown"},
            status_code=503,
            headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)},
        )
    statuses = ctx.engine.statuses()
    body: dict = {"status": "ready", "runs": {s: statuses.count(s) for s in ("active", "paused", "failed")}}
    if ctx.settings.metrics_run_ids:
        body["failed_runs"] = ctx.engine.failed_runs()
    return body


@router.get(
    "/metrics", summary="Prometheus metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}}
)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(server(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
