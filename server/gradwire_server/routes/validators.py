"""A run's validators (docs/SERVER.md, "Validators"): the admin registers one (``POST /v1/runs/{run_id}/validators``,
its token shown once) and lists them; a validator reads a round's candidate updates
(``GET …/rounds/{round}/candidates``) and posts its scores (``POST …/rounds/{round}/scores``); the admin reads every
round's scores and weights (``GET /v1/runs/{run_id}/scores``). A node's token gets 403 on the last three: nothing
a node sends can raise its own weight."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, Field

from gradwire.protocol import API_PREFIX, OCTET_STREAM

from ..auth import Principal, admin, hash_token, new_token, principal
from ..errors import Reason, Rejected
from ..scores import check_scores
from .common import ERROR, octet_response, server

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["validators"])

#: The header of a candidates body: the round whose candidate updates it holds.
ROUND_HEADER = "X-Gradwire-Round"
#: Versions per answer of ``GET …/scores``, at most, and the largest version it takes (SQLite's integers).
PAGE, MAX_VERSION = 1000, 2**62
#: How long a candidates request may wait for its round to become ready, at most.
MAX_WAIT_S = 60.0


class ValidatorRequest(BaseModel):
    name: str | None = Field(None, max_length=200)


class ValidatorCreated(BaseModel):
    validator_id: int = Field(description="The validator's id in the run (from 1).")
    token: str = Field(description="The validator's bearer token; stored only hashed, never shown again.")


class ValidatorInfo(BaseModel):
    validator_id: int
    name: str | None
    created_at: float = Field(description="Unix time of its registration.")


class Scores(BaseModel):
    scores: dict[int, float] = Field(
        description="One score in [0, 1] per candidate update, by its sender's node id: the weight this "
        "validator gives it (the server takes the median over the run's validators)."
    )


class ScoresPosted(BaseModel):
    round: int
    scored: int = Field(description="How many candidates this validator scored.")


class RoundWeights(BaseModel):
    version: int = Field(description="The version the round published (its round is version - 1).")
    scored: bool = Field(description="Whether the round closed with the validators' weights (else: structural).")
    weights: dict[int, float] = Field(description="The score weight of each sender (empty when not scored).")
    scores: dict[int, dict[int, float]] = Field(description="Each validator's posted scores, by node id.")


@router.post(
    "/validators",
    status_code=201,
    response_model=ValidatorCreated,
    summary="Register a validator (admin)",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 503: ERROR, 507: ERROR},
)
async def register_validator(
    run_id: str, request: Request, body: ValidatorRequest | None = None, who: Principal = Depends(admin)
) -> ValidatorCreated:
    ctx = server(request)
    token = new_token()
    validator_id = await asyncio.to_thread(
        ctx.store.add_validator, run_id, (body or ValidatorRequest()).name, hash_token(token)
    )
    return ValidatorCreated(validator_id=validator_id, token=token)


@router.get(
    "/validators",
    response_model=list[ValidatorInfo],
    summary="The run's validators (admin)",
    responses={401: ERROR, 403: ERROR, 404: ERROR},
)
async def list_validators(run_id: str, request: Request, who: Principal = Depends(admin)) -> list[ValidatorInfo]:
    return [
        ValidatorInfo(validator_id=v.validator_id, name=v.name, created_at=v.created_at)
        for v in server(request).store.validators_of(run_id)
    ]


async def validator(request: Request) -> Principal:
    """FastAPI dependency of the validators' endpoints: the token (401), the run of the path (404), then a
    validator of it (403), all before the body is read and validated (as :func:`..auth.admin` does)."""
    who = await principal(request)
    run_id = request.path_params["run_id"]
    server(request).engine.runtime(run_id)
    who.require_validator(run_id)
    return who


def _open_round(rt, round: int) -> None:
    if round < rt.version:
        raise Rejected(Reason.ROUND_CLOSED, f"round {round} is closed (the run is at version {rt.version})")
    if round > rt.version:
        raise Rejected(Reason.ROUND_NOT_OPEN, f"round {round} is not open yet (the open round is {rt.version})")


@router.get(
    "/rounds/{round}/candidates",
    summary="The round's candidate updates, once it waits for scores (validators)",
    responses={
        200: octet_response(
            "The round's update frames, concatenated in node-id order (split them with split_frames)",
            {ROUND_HEADER: "the round"},
        ),
        204: {"description": "The round is not waiting for scores yet: ask again."},
        401: ERROR,
        403: ERROR,
        404: ERROR,
        409: ERROR,
        410: ERROR,
    },
)
async def candidates(
    run_id: str,
    round: int,
    request: Request,
    wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S, description="Seconds to wait for the round to be ready."),
    who: Principal = Depends(validator),
) -> Response:
    rt = server(request).engine.runtime(run_id)
    end = time.monotonic() + wait
    while True:
        _open_round(rt, round)
        if rt.scoring_since is not None:
            frames = [rt.pending[k].raw for k in sorted(rt.pending)]
            return Response(b"".join(frames), media_type=OCTET_STREAM, headers={ROUND_HEADER: str(round)})
        if time.monotonic() >= end:
            return Response(status_code=204, headers={ROUND_HEADER: str(round)})
        await asyncio.sleep(0.02)


@router.post(
    "/rounds/{round}/scores",
    response_model=ScoresPosted,
    summary="Post this validator's scores of the round's candidates (validators)",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 409: ERROR, 410: ERROR, 422: ERROR, 503: ERROR, 507: ERROR},
)
async def post_scores(
    run_id: str, round: int, body: Scores, request: Request, who: Principal = Depends(validator)
) -> ScoresPosted:
    ctx = server(request)
    rt = ctx.engine.runtime(run_id)
    validator_id = who.require_validator(run_id)
    async with rt.lock:
        _open_round(rt, round)
        scores = check_scores(body.scores, {node for node, _ in rt.pending}, round)
        await asyncio.to_thread(ctx.store.record_scores, run_id, round, validator_id, scores)
        rt.round_scores[validator_id] = scores
    rt.wake.set()
    return ScoresPosted(round=round, scored=len(scores))


@router.get(
    "/scores",
    response_model=list[RoundWeights],
    summary="The score weights and validators' scores of versions first … last, a page at a time (admin)",
    responses={401: ERROR, 403: ERROR, 404: ERROR, 422: ERROR},
)
async def scores_log(
    run_id: str,
    request: Request,
    first: int = Query(1, ge=1, le=MAX_VERSION, description="The first version."),
    last: int | None = Query(
        None, ge=1, le=MAX_VERSION, description=f"The last version (at most the run's and first + {PAGE - 1})."
    ),
    who: Principal = Depends(admin),
) -> list[RoundWeights]:
    ctx = server(request)
    rt = ctx.engine.runtime(run_id)
    last = min(rt.version if last is None else last, rt.version, first + PAGE - 1)
    weights = await asyncio.to_thread(ctx.store.version_weights, run_id, first, last)
    scores = await asyncio.to_thread(ctx.store.round_scores, run_id, first - 1, last - 1)
    return [
        RoundWeights(version=v, scored=v in weights, weights=weights.get(v, {}), scores=scores.get(v - 1, {}))
        for v in range(first, last + 1)
    ]
