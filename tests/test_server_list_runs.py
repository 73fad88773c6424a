"""`GET /v1/runs` lists every run for the admin, oldest first, a page at a time (it was 405); a node's token
is refused 403 and no token 401. Real server on loopback."""

from __future__ import annotations

import httpx
import pytest

from gradwire.client import GradwireClient
from gradwire.client.errors import GradwireHTTPError


def test_admin_pages_through_every_run_in_creation_order(live_server):
    with GradwireClient(live_server.url, live_server.admin_token) as admin:
        made = [admin.create_run({"quorum": 1}) for _ in range(5)]
        seen, after, pages = [], None, 0
        while True:
            page = admin.list_runs(limit=2, after=after)
            pages += 1
            seen += [r["run_id"] for r in page["runs"]]
            assert all({"version", "status", "config"} <= set(r) for r in page["runs"])
            if page["next"] is None:
                break
            after = page["next"]
        assert seen == made and pages == 3
        assert [r["run_id"] for r in admin.list_runs()["runs"]] == made
        with pytest.raises(GradwireHTTPError) as exc:
            admin.list_runs(after="no-such-run")
        assert exc.value.status == 404 and exc.value.error == "not_found"


def test_list_runs_needs_the_admin(live_server):
    with GradwireClient(live_server.url, live_server.admin_token) as admin:
        run_id = admin.create_run({"quorum": 1})
        _, token = admin.register_node(run_id)
    r = httpx.get(f"{live_server.url}/v1/runs", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 403
    assert httpx.get(f"{live_server.url}/v1/runs", timeout=30).status_code == 401
    r = httpx.get(
        f"{live_server.url}/v1/runs",
        params={"limit": 0},
        headers={"Authorization": f"Bearer {live_server.admin_token}"},
        timeout=30,
    )
    assert r.status_code == 422
