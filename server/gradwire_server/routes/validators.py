"""A run's validators (docs/SERVER.md, "Validators"): the admin registers one (``POST /v1/runs/{run_id}/validators``,
its token shown once) and lists them; a validator reads a round's candidate updates
(``GET …/rounds/{round}/candidates``: every one once the round waits for scores, or with ``since`` as they arrive,
so that it scores while the round fills and only the last few remain at its quorum) and posts its scores
(``POST …/rounds/{round}/scores``); the admin reads every round's scores and weights
(``GET /v1/runs/{run_id}/scores``). A node's token gets 403 on the last three: nothing a node sends can raise its
own weight."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, Field

from gradwire.protocol import API_PREFIX, OCTET_STREAM

from ..auth import Principal, admin, hash_token, new_token, principal
from ..errors import Reason, Rejected
from ..scores import check_scores
from .common import ERROR, octet_response, server

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["validators"])

#: The headers of a candidates body: the round whose candidate updates it holds, how many candidates the round
#: holds, and whether it waits for scores (1) or is still filling (0).
ROUND_HEADER = "X-Gradwire-Round"
CANDIDATES_HEADER = "X-Gradwire-Candidates"
SCORING_HEADER = "X-Gradwire-Scoring"
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
    summary="The round's candidate updates: once it waits for scores, or as they arrive (validators)",
    responses={
        200: octet_response(
            "The round's update frames, concatenated (split them with split_frames): without ``since``, every "
            "candidate in node-id order once the round waits for scores; with ``since``, the candidates after "
            "the first ``since`` in commit order",
            {
                ROUND_HEADER: "the round",
                CANDIDATES_HEADER: "how many candidates the round holds (pass it as the next since)",
                SCORING_HEADER: "1 once the round waits for scores (score and post), else 0",
            },
        ),
        204: {"description": "Nothing to read yet after wait seconds (not waiting for scores; no new candidate)."},
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
    wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S, description="Seconds to wait for something to read."),
    since: int | None = Query(
        None,
        ge=0,
        le=MAX_VERSION,
        description="Read the round as it fills: the candidates after the first since (in commit order), "
        "as soon as there is one, or none once the round waits for scores; the round not open yet is waited "
        "for too. Without it: every candidate, once the round waits for scores.",
    ),
    who: Principal = Depends(validator),
) -> Response:
    rt = server(request).engine.runtime(run_id)
    loop = asyncio.get_running_loop()
    end = loop.time() + wait
    while True:
        news = rt.round_news  # taken before looking: anything that changes after it wakes the wait below
        if rt.deleted:
            raise Rejected(Reason.UNKNOWN_RUN, f"run {run_id} was deleted")
        answer = _candidates_now(rt, round, since)
        if answer is not None:
            return answer
        remaining = end - loop.time()
        if remaining <= 0:
            return Response(status_code=204, headers={ROUND_HEADER: str(round)})
        try:
            await asyncio.wait_for(news.wait(), timeout=remaining)
        except asyncio.TimeoutError:
            pass


def _candidates_now(rt, round: int, since: int | None) -> Response | None:
    """The answer of a candidates request now, or ``None`` if it has nothing to read yet."""
    if since is not None and round > rt.version:
        return None  # read as it fills: the round opens later, wait for it
    _open_round(rt, round)
    scoring = rt.scoring_since is not None
    if since is None:
        if not scoring:
            return None
        updates = [rt.pending[k] for k in sorted(rt.pending)]
    else:
        held = list(rt.pending.values())  # commit order: only ever appended to while the round is open
        if len(held) == since and not scoring:
            return None
        # A since beyond what the round holds (a stale count) answers at once with the count, and no frame.
        updates = held[since:]
    headers = {ROUND_HEADER: str(round), CANDIDATES_HEADER: str(len(rt.pending)), SCORING_HEADER: str(int(scoring))}
    return Response(b"".join(u.raw for u in updates), media_type=OCTET_STREAM, headers=headers)


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
