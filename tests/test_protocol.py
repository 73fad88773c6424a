"""The REST protocol is written once: every reason has one status, is documented, and is what the server answers."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from gradwire import protocol
from gradwire.protocol import Reason
from gradwire_server.http_errors import STATUS

API_MD = (Path(__file__).resolve().parent.parent / "docs" / "API.md").read_text()


def test_every_reason_has_a_4xx_status():
    # http_error keeps whatever status the web framework raised (an unexpected one); every other reason has one.
    assert set(STATUS) == set(Reason) - {Reason.HTTP_ERROR}
    # The storage's reasons are 5xx: the request was fine, the server's disk is full (507) or failing (503),
    # or its object store cannot be reached (503).
    storage = {Reason.INSUFFICIENT_STORAGE: 507, Reason.STORAGE_UNAVAILABLE: 503, Reason.OBJECT_STORE_UNAVAILABLE: 503}
    assert {r: STATUS[r] for r in storage} == storage
    assert all(400 <= s < 500 for r, s in STATUS.items() if r not in storage)


def test_every_reason_is_documented_in_api_md():
    missing = [r.value for r in Reason if f"`{r.value}`" not in API_MD]
    assert not missing, missing


def test_documented_statuses_match_the_server_table():
    # Rows of the endpoint tables: | status | `reason`, `reason` | when |
    for status, reasons in re.findall(r"^\| (\d{3}) \| ([^|]*`[a-z_]+`[^|]*)\|", API_MD, flags=re.M):
        for name in re.findall(r"`([a-z_]+)`", reasons):
            assert STATUS[Reason(name)] == int(status), (
                f"{name}: API.md says {status}, the server {STATUS[Reason(name)]}"
            )


def test_the_server_answers_with_the_protocols_names(live_server):
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        r = c.get(f"{protocol.API_PREFIX}/runs/nope", headers={"Authorization": f"Bearer {live_server.admin_token}"})
        assert r.status_code == STATUS[Reason.UNKNOWN_RUN]
        assert r.json()["error"] == Reason.UNKNOWN_RUN.value
        r = c.get(f"{protocol.API_PREFIX}/runs/nope")
        assert (r.status_code, r.json()["error"]) == (401, Reason.MISSING_TOKEN.value)
