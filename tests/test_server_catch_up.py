"""Catch-ups against a real server: ``GET …/updates?since=0`` comes in pages under ``max_catch_up_bytes``,
each streamed from the version files, and ``GradwireClient`` joins the pages into exactly the published
bytes."""

from __future__ import annotations

import httpx
import pytest

from gradwire.client import GradwireClient
from gradwire.protocol import LATEST_VERSION_HEADER, VERSION_HEADER
from gradwire_server.launcher import LoopbackServer
from server_helpers import dct_frame, make_run, random_grads

ADMIN = "test-admin"
#: A few of the tiny model's published versions per page.
CAP = 4096
VERSIONS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--max-catch-up-bytes", str(CAP), "--max-catch-ups", "2"]
    with LoopbackServer(tmp_path_factory.mktemp("catch-up"), admin_token=ADMIN, extra_args=args) as srv:
        yield srv


def test_a_catch_up_comes_in_pages_under_the_cap_and_the_client_joins_them_bit_identically(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        run = make_run(client, ADMIN, n_nodes=1, quorum=1)
        node = run.nodes[0]
        run.publish_rounds(lambda rnd, n: dct_frame(random_grads(100 + rnd), rnd, n), 0, VERSIONS)
        diffs = server.data_dir / "runs" / run.run_id / "diffs"
        published = [(diffs / f"v{v:09d}.gwf").read_bytes() for v in range(1, VERSIONS + 1)]
        assert sum(map(len, published)) > 2 * CAP  # so that there are pages to follow

        since, pages = 0, []
        while since < VERSIONS:
            r = client.get(run.url("/updates"), params={"since": since}, headers=node.headers)
            assert r.status_code == 200, r.text
            assert int(r.headers[LATEST_VERSION_HEADER]) == VERSIONS
            reached = int(r.headers[VERSION_HEADER])
            assert reached > since
            assert len(r.content) <= CAP or reached == since + 1, (len(r.content), since, reached)
            assert r.content == b"".join(published[since:reached])  # each page: whole versions, in order
            pages.append(r.content)
            since = reached
        assert len(pages) > 2

        with GradwireClient(server.url, node.token) as gc:
            batch = gc.updates(run.run_id, 0)
        assert batch.frames == published
        assert batch.version == VERSIONS and batch.weights_hash == run.status()["weights_hash"]
