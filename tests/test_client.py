"""GradwireClient against a real HTTP server on 127.0.0.1 that answers from a script.

The script plays the parts the aggregation server cannot be made to play on demand (failing N times,
dropping connections, answering slowly, sending hostile bodies); the client's behaviour against the
real server is covered by tests/test_end_to_end.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import httpx
import pytest
import torch

import gradwire
from gradwire.client import (
    AuthError,
    ConflictError,
    FrameRejectedError,
    GradwireClient,
    GradwireConnectionError,
    GradwireHTTPError,
    NotFoundError,
    OutOfSyncError,
    ProtocolError,
    RequestRejectedError,
    RoundClosedError,
    TooFarBehindError,
    split_frames,
)
from gradwire.frame import SERVER_SENDER
from gradwire.state import state_hash, state_to_bytes

DROP = "drop"  # close the connection without answering


class ScriptedServer:
    """A threaded HTTP server whose answers per (method, path) are queued by the test."""

    def __init__(self):
        self.script: dict[tuple[str, str], deque] = defaultdict(deque)
        self.requests: list[dict] = []
        self.release = threading.Event()  # set at teardown so held requests finish
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                parts = urlsplit(self.path)
                server.requests.append(
                    {
                        "method": self.command,
                        "path": parts.path,
                        "query": parts.query,
                        "headers": dict(self.headers),
                        "body": body,
                    }
                )
                queue = server.script[(self.command, parts.path)]
                action = queue.popleft() if queue else (500, {}, b"unscripted")
                if action == DROP:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if action[0] == "hold":
                    _, seconds, action = action
                    server.release.wait(seconds)
                status, headers, payload = action
                if isinstance(payload, (dict, list)):
                    payload = json.dumps(payload).encode()
                    headers = {"Content-Type": "application/json", **headers}
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, str(v))
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def add(self, method: str, path: str, *actions) -> None:
        self.script[(method, path)].extend(actions)

    def count(self, method: str, path: str) -> int:
        return sum(1 for r in self.requests if r["method"] == method and r["path"] == path)


@pytest.fixture(scope="module")
def _running_server():
    s = ScriptedServer()
    s.thread.start()
    yield s
    s.release.set()
    s.httpd.shutdown()
    s.httpd.server_close()


@pytest.fixture
def server(_running_server):
    _running_server.script.clear()
    _running_server.requests.clear()
    return _running_server


def _client(server, **kw):
    kw.setdefault("backoff", 0.001)
    kw.setdefault("timeout", 5.0)
    return GradwireClient(server.url, "tok-123", **kw)


def _err(status, error, detail="why"):
    return (status, {}, {"error": error, "detail": detail})


def _downlink(versions, *, sender=SERVER_SENDER):
    """Real update frames publishing ``versions``, like the server's (bundle, sender 0xFFFFFFFF)."""
    codec = gradwire.IdentityCodec()
    out = []
    for v in versions:
        tensors = {"w": torch.full((3, 2), float(v)), "b": torch.arange(2, dtype=torch.float32) * v}
        out.append(codec.encode_bundle(tensors, round=v, sender=sender))
    return out


SUBMIT = "/v1/runs/r1/rounds/4/updates"
UPDATES = "/v1/runs/r1/updates"


# -- retries and back-off -------------------------------------------------------------------------


def test_retries_5xx_and_429_then_succeeds(server):
    server.add("POST", SUBMIT, _err(503, "busy"), _err(502, "bad_gateway"), (429, {"Retry-After": "0"}, {}))
    server.add("POST", SUBMIT, (202, {}, {"round": 4, "node_id": 1, "duplicate": False, "submitted": 1}))
    with _client(server, retries=3) as c:
        assert c.submit("r1", 4, b"frame-bytes") == {"round": 4, "node_id": 1, "duplicate": False, "submitted": 1}
    assert server.count("POST", SUBMIT) == 4
    bodies = {r["body"] for r in server.requests}
    assert bodies == {b"frame-bytes"}  # every retry resends the same bytes: idempotent on the server
    assert all(r["headers"]["Authorization"] == "Bearer tok-123" for r in server.requests)
    assert all(r["headers"]["Content-Type"] == "application/octet-stream" for r in server.requests)


def test_gives_up_after_retries_with_the_last_error(server):
    server.add("GET", "/v1/runs/r1", *[_err(503, "not_ready", "recovering")] * 3)
    with _client(server, retries=2) as c, pytest.raises(GradwireHTTPError) as info:
        c.status("r1")
    assert (info.value.status, info.value.error, info.value.detail) == (503, "not_ready", "recovering")
    assert server.count("GET", "/v1/runs/r1") == 3


def test_non_idempotent_calls_are_not_repeated_after_a_500_or_a_dropped_connection(server):
    server.add("POST", "/v1/runs", _err(500, "internal"))
    server.add("POST", "/v1/runs/r1/nodes", DROP)
    with _client(server, retries=4) as c:
        with pytest.raises(GradwireHTTPError) as info:
            c.create_run({})
        assert info.value.status == 500
        with pytest.raises(GradwireConnectionError):
            c.register_node("r1", "n")
    assert server.count("POST", "/v1/runs") == 1
    assert server.count("POST", "/v1/runs/r1/nodes") == 1


def test_non_idempotent_calls_retry_when_the_server_refused_outright(server):
    server.add("POST", "/v1/runs", _err(503, "not_ready"), (201, {}, {"run_id": "abc"}))
    server.add("POST", "/v1/runs/abc/nodes", (429, {}, {}), (201, {}, {"node_id": 1, "token": "t"}))
    with _client(server) as c:
        assert c.create_run({"quorum": 2}) == "abc"
        assert c.register_node("abc", "alpha") == (1, "t")
    create = [r for r in server.requests if r["path"] == "/v1/runs"]
    assert [json.loads(r["body"]) for r in create] == [{"quorum": 2}] * 2
    nodes = [r for r in server.requests if r["path"] == "/v1/runs/abc/nodes"]
    assert json.loads(nodes[-1]["body"]) == {"name": "alpha"}


def test_submission_is_resent_after_a_dropped_connection(server):
    server.add("POST", SUBMIT, DROP, DROP, (202, {}, {"round": 4, "node_id": 2, "duplicate": True, "submitted": 3}))
    with _client(server, retries=2) as c:
        assert c.submit("r1", 4, b"x" * 100)["duplicate"] is True
    assert server.count("POST", SUBMIT) == 3


def test_unreachable_server_raises_a_one_line_connection_error_without_a_chain_after_retries():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with GradwireClient(f"http://127.0.0.1:{port}", "t", retries=2, backoff=0.001) as c:
        with pytest.raises(GradwireConnectionError) as info:
            c.health()
        assert c.ready() is False
    message = str(info.value)
    assert message.startswith(f"no gradwire server answers at http://127.0.0.1:{port}: is it running?")
    assert "Connection refused" in message and "3 attempts over" in message and "\n" not in message
    # Not chained: an uncaught one prints the caller's frames and this line, not httpx's and httpcore's.
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert isinstance(info.value.cause, httpx.ConnectError)


def test_timeout_is_a_connection_error_and_long_polls_get_their_wait_on_top(server):
    empty = (200, {"X-Gradwire-Version": "7", "X-Gradwire-Weights-Hash": "h"}, b"")
    server.add("GET", "/v1/runs/r1", ("hold", 5.0, (200, {}, {})))
    server.add("GET", UPDATES, ("hold", 0.6, empty))
    with _client(server, timeout=0.3, retries=0) as c:
        with pytest.raises(GradwireConnectionError, match="ReadTimeout"):
            c.status("r1")
        batch = c.updates("r1", since=7, wait=2.0)  # held 0.6 s > timeout, < timeout + wait
    assert (batch.frames, batch.version, batch.weights_hash) == ([], 7, "h")
    poll = [r for r in server.requests if r["path"] == UPDATES][0]
    assert poll["query"] in ("since=7&wait=2.0", "wait=2.0&since=7")


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status,error,cls",
    [
        (401, "missing_token", AuthError),
        (401, "invalid_token", AuthError),
        (403, "forbidden", AuthError),
        (404, "unknown_run", NotFoundError),
        (409, "conflicting_submission", ConflictError),
        (409, "round_not_open", ConflictError),
        (410, "round_closed", RoundClosedError),
        (400, "bad_frame", FrameRejectedError),
        (413, "frame_too_large", FrameRejectedError),
        (422, "tensor_mismatch", FrameRejectedError),
        (422, "non_finite", FrameRejectedError),
        (422, "norm_too_large", FrameRejectedError),
    ],
)
def test_submission_errors_map_to_typed_exceptions(server, status, error, cls):
    server.add("POST", SUBMIT, _err(status, error, f"detail of {error}"))
    with _client(server) as c, pytest.raises(cls) as info:
        c.submit("r1", 4, b"f")
    assert (info.value.status, info.value.error, info.value.detail) == (status, error, f"detail of {error}")
    assert error in str(info.value)
    assert server.count("POST", SUBMIT) == 1  # 4xx is final: never retried


def test_other_errors_map_by_status_and_reason(server):
    server.add("GET", UPDATES, _err(410, "too_far_behind"), _err(422, "version_ahead"))
    server.add("POST", "/v1/runs", (422, {}, {"detail": [{"loc": ["body", "quorum"], "msg": "bad"}]}))
    server.add("GET", "/metrics", (418, {}, b"plain text, not json"))
    with _client(server) as c:
        with pytest.raises(TooFarBehindError):
            c.updates("r1", since=0)
        with pytest.raises(RequestRejectedError) as info:
            c.updates("r1", since=99)
        assert not isinstance(info.value, FrameRejectedError)
        with pytest.raises(RequestRejectedError, match="quorum") as info:
            c.create_run({"quorum": -1})
        assert info.value.error == "http_422"
        with pytest.raises(GradwireHTTPError) as info:
            c.metrics()
        assert (info.value.status, info.value.error, info.value.detail) == (418, "http_418", "plain text, not json")


# -- downlink bodies -----------------------------------------------------------------------------


def test_updates_splits_concatenated_frames_in_order(server):
    frames = _downlink([5, 6, 7])
    server.add("GET", UPDATES, (200, {"X-Gradwire-Version": "7", "X-Gradwire-Weights-Hash": "abc"}, b"".join(frames)))
    with _client(server) as c:
        batch = c.updates("r1", since=4)
    assert batch.frames == frames and batch.version == 7 and batch.weights_hash == "abc"
    assert c.bytes_received == sum(map(len, frames))
    assert gradwire.decode_bundle(batch.frames[1])["b"].tolist() == [0.0, 6.0]


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda b: b[:-1], id="truncated-last-byte"),
        pytest.param(lambda b: b[:50], id="truncated-inside-first"),
        pytest.param(lambda b: b[:20], id="shorter-than-a-header"),
        pytest.param(lambda b: b + b"\0" * 40, id="trailing-garbage"),
        pytest.param(lambda b: b"\x00" * len(b), id="zeros"),
        pytest.param(lambda b: b"GET / HTTP/1.1\r\n" * 20, id="text"),
        pytest.param(lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], id="bit-flip"),
        pytest.param(lambda b: b[:8] + (2**63).to_bytes(8, "little") + b[16:], id="huge-total-len"),
        pytest.param(lambda b: b[:8] + (3).to_bytes(8, "little") + b[16:], id="tiny-total-len"),
    ],
)
def test_hostile_update_bodies_raise_frame_error(server, mangle):
    body = mangle(b"".join(_downlink([1, 2])))
    with pytest.raises(gradwire.FrameError):
        split_frames(body)
    server.add("GET", UPDATES, (200, {"X-Gradwire-Version": "2", "X-Gradwire-Weights-Hash": "h"}, body))
    with _client(server) as c, pytest.raises(gradwire.FrameError):
        c.updates("r1", since=0)


@pytest.mark.parametrize(
    "frames,headers",
    [
        pytest.param(_downlink([1, 3]), {"X-Gradwire-Version": "3", "X-Gradwire-Weights-Hash": "h"}, id="gap"),
        pytest.param(_downlink([2, 1]), {"X-Gradwire-Version": "2", "X-Gradwire-Weights-Hash": "h"}, id="out-of-order"),
        pytest.param(_downlink([1]), {"X-Gradwire-Version": "2", "X-Gradwire-Weights-Hash": "h"}, id="short"),
        pytest.param(
            _downlink([1, 2], sender=3), {"X-Gradwire-Version": "2", "X-Gradwire-Weights-Hash": "h"}, id="node-sender"
        ),
        pytest.param(_downlink([1, 2]), {"X-Gradwire-Weights-Hash": "h"}, id="no-version"),
        pytest.param(_downlink([1, 2]), {"X-Gradwire-Version": "2"}, id="no-hash"),
    ],
)
def test_update_bodies_that_break_the_contract_raise_protocol_error(server, frames, headers):
    server.add("GET", UPDATES, (200, headers, b"".join(frames)))
    with _client(server) as c, pytest.raises(ProtocolError):
        c.updates("r1", since=0)


def test_state_is_checked_against_its_hash(server):
    state = {"w": torch.randn(4, 3), "b": torch.zeros(3)}
    good = {"X-Gradwire-Version": "12", "X-Gradwire-Weights-Hash": state_hash(state)}
    server.add("GET", "/v1/runs/r1/state", (200, good, state_to_bytes(state)))
    server.add("GET", "/v1/runs/r1/state", (200, {**good, "X-Gradwire-Weights-Hash": "0" * 32}, state_to_bytes(state)))
    server.add("GET", "/v1/runs/r1/state", (200, good, b"not safetensors"))
    with _client(server) as c:
        got, version, h = c.state("r1")
        assert version == 12 and h == state_hash(state)
        assert all(torch.equal(got[n], state[n]) for n in state)
        with pytest.raises(OutOfSyncError):
            c.state("r1")
        with pytest.raises(ProtocolError):
            c.state("r1")


def test_put_state_sends_safetensors(server):
    state = {"w": torch.randn(2, 2)}
    server.add("PUT", "/v1/runs/r1/state", (200, {}, {"version": 0, "weights_hash": state_hash(state)}))
    with _client(server) as c:
        assert c.put_state("r1", state) == {"version": 0, "weights_hash": state_hash(state)}
    sent = server.requests[-1]
    assert sent["headers"]["Content-Type"] == "application/octet-stream"
    assert torch.equal(gradwire.state.state_from_bytes(sent["body"])["w"], state["w"])


def test_an_idle_connection_is_dropped_by_the_client_before_the_server_closes_it(live_server):
    # At equal bounds a request can go out on a connection the server is closing at that moment: an upload
    # then fails with "server disconnected" and, being a POST, is not repeated. The client's bound is the
    # shorter, so the pool never offers a connection the server may be closing.
    from gradwire.client.http_client import KEEPALIVE_EXPIRY_S
    from gradwire_server.serving import KEEP_ALIVE_S

    assert KEEPALIVE_EXPIRY_S < KEEP_ALIVE_S
    with GradwireClient(live_server.url, retries=0) as client:

        def port() -> int:  # the local port of the connection this request went out on
            response = client._request("GET", "/healthz", idempotent=True)
            return response.extensions["network_stream"].get_extra_info("client_addr")[1]

        first = port()
        assert port() == first  # reused while fresh
        time.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # idle past the client's bound, still within the server's
        assert port() != first
