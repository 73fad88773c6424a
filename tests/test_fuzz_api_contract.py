"""The REST API against its own contract: schemathesis drives a real server on loopback from its live
``/openapi.json`` and checks every answer against it (no 5xx, statuses, content types, headers and bodies
as declared, schema-valid input accepted, invalid input refused, ``Allow`` on 405) — with the admin token,
a node's token, and on a real run as well as on made-up run ids. Then docs/API.md's order of checks: a
node token on an admin endpoint is 403 whatever the body (permission before the request itself).

The budget is bounded: ``EXAMPLES`` generated requests per operation and token (about 30 s here);
``GRADWIRE_CONTRACT_EXAMPLES`` raises it for a longer run.
"""

from __future__ import annotations

import os
import tempfile

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from gradwire_server.app import create_app
from gradwire_server.settings import ServerSettings
from live_server import LiveServer
from server_helpers import bearer, make_run

ADMIN = "contract-admin"
EXAMPLES = int(os.environ.get("GRADWIRE_CONTRACT_EXAMPLES", "8"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LiveServer(tmp_path_factory.mktemp("contract"), admin_token=ADMIN)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def run(server):
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        yield make_run(client, ADMIN, n_nodes=1)


def _openapi() -> dict:
    """The OpenAPI document the server serves, built by the same app factory (no server needed to collect
    the tests; ``test_the_schema_is_the_live_one`` checks it equals the live ``/openapi.json``)."""
    with tempfile.TemporaryDirectory() as data_dir:
        return create_app(ServerSettings(data_dir=data_dir, admin_token=ADMIN)).openapi()


OPENAPI = _openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)


def test_the_schema_is_the_live_one(server):
    assert httpx.get(f"{server.url}/openapi.json").json() == OPENAPI


#: Refusals that depend on what binary bytes hold or on the run's state, which no schema can say: a
#: schema-valid request may get these (each documented for its operation), and only these.
CONTENT_OR_STATE = {
    "bad_frame",
    "bad_state",
    "not_a_bundle",
    "sender_mismatch",
    "round_mismatch",
    "tensor_mismatch",
    "non_finite",
    "norm_too_large",
    "version_ahead",
    "too_far_behind",
    "round_closed",
    "frame_too_large",
    "state_too_large",
    "run_binding_mismatch",
    "run_binding_missing",
}


def _seconds(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _reason(response) -> str | None:
    try:
        return response.json().get("error")
    except (ValueError, AttributeError):
        return None


def _lax_body(case) -> bool:
    """A run config is more than its schema says, both ways (known drift, docs/API.md "RunConfig"): pydantic's
    lax mode lets `0`/`1` pass as booleans and numeric strings as numbers, which the schema's types do not
    allow; and the library's config checks (codec parameters, `total_rounds >= 1`, a cosine schedule needs
    `total_rounds` …) refuse some configs the schema allows, with 422 invalid_request ("Value error").
    Those two checks are not held against POST /v1/runs for those answers; every other check is."""
    return case.method.upper() == "POST" and case.path == "/v1/runs"


def _destructive(case) -> bool:
    """Operations that would end the shared real run or its node's token: they get made-up run ids only."""
    return case.method.upper() == "DELETE" or case.path.endswith("/token")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
def test_every_operation_keeps_the_contract(case, run, server):
    # each generated request as is (a made-up run id: an unknown run) and on the real run, with the admin
    # token and with a node's
    on_run = "run_id" in (case.path_parameters or {}) and not _destructive(case)
    if _seconds((case.query or {}).get("wait")) > 0.1:
        case.query["wait"] = 0.1  # a long-poll waits for a version that never comes: keep it short
    for run_id in [None] + ([run.run_id] if on_run else []):
        if run_id is not None:
            case.path_parameters["run_id"] = run_id
        for token in (ADMIN, run.nodes[0].token):
            response = case.call(base_url=server.url, headers=bearer(token))
            reason = _reason(response) if 400 <= response.status_code < 500 else None
            excluded = [positive_data_acceptance] if reason in CONTENT_OR_STATE else []
            if _lax_body(case):
                excluded.append(negative_data_rejection)
                if reason == "invalid_request" and "Value error" in response.json()["detail"]:
                    excluded.append(positive_data_acceptance)
            case.validate_response(response, excluded_checks=excluded)


def test_server_survives_the_contract_run(server):
    # the same process answered every request above and still does
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert server.process.poll() is None


@pytest.fixture
def fresh_run(server):
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        yield make_run(client, ADMIN, n_nodes=1)


@pytest.mark.parametrize("body", [b"{not json", b'{"quorum": "many"}', b'{"algorithm": 7}'])
def test_a_node_token_on_an_admin_endpoint_is_403_whatever_the_body(fresh_run, server, body):
    run = fresh_run
    node = {**bearer(run.nodes[0].token), "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        for path in ("/v1/runs", f"/v1/runs/{run.run_id}/nodes"):
            r = client.post(path, content=body, headers=node)
            assert r.status_code == 403, (path, r.status_code, r.text)
            assert r.json()["error"] == "forbidden"
        # the admin gets the 422 for the same bodies: the order is permission, then the body
        r = client.post("/v1/runs", content=body, headers={**bearer(ADMIN), "Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["error"] == "invalid_request", r.text


def test_405_names_the_allowed_methods(server):
    r = httpx.delete(f"{server.url}/healthz")
    assert r.status_code == 405
    assert r.json()["error"] == "method_not_allowed"
    assert "GET" in r.headers["allow"]
