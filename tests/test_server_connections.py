"""Bounded connections against a real server process: slow headers and slow bodies are closed at their
deadlines, the connection cap never keeps a prompt client out, an update's body is never read when the
request can be refused without it, and SIGTERM is not held by an abandoned long poll."""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from gradwire_server.connections import FD_RESERVE
from gradwire_server.launcher import LoopbackServer, ServerStartError, free_port
from server_helpers import dct_frame, make_run, metric, random_grads

ADMIN = "test-admin"
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
MIN_BODY_RATE = 2000
MAX_CONNECTIONS = 24


#: The soft open-files limit the module's server starts under: below what MAX_CONNECTIONS needs, so it
#: must raise it (the hard limit allows that).
SOFT_NOFILE = 200


def limited_python(folder: Path, limit: str) -> str:
    """A wrapper that starts this Python under ``ulimit <limit>`` (e.g. ``-Sn 200``)."""
    path = folder / "python-limited"
    path.write_text(f'#!/bin/bash\nulimit {limit} || exit 97\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = [
        "--header-timeout-s",
        str(HEADER_TIMEOUT_S),
        "--body-timeout-s",
        str(BODY_TIMEOUT_S),
        "--min-body-rate",
        str(MIN_BODY_RATE),
        "--max-connections",
        str(MAX_CONNECTIONS),
    ]
    folder = tmp_path_factory.mktemp("connections")
    with LoopbackServer(
        folder / "data", admin_token=ADMIN, extra_args=args, python=limited_python(folder, f"-Sn {SOFT_NOFILE}")
    ) as srv:
        yield srv


def test_the_open_files_limit_is_raised_only_as_far_as_the_connections_need(server):
    soft = int(Path(f"/proc/{server.process.pid}/limits").read_text().split("Max open files")[1].split()[0])
    assert soft == MAX_CONNECTIONS + FD_RESERVE
    assert f"from {SOFT_NOFILE} to {MAX_CONNECTIONS + FD_RESERVE}" in server.log()


def test_a_server_whose_hard_limit_cannot_hold_its_connections_refuses_to_start(tmp_path):
    # max_connections 512 (the default) needs 768; a fixed port: no retry on another one.
    srv = LoopbackServer(
        tmp_path / "data",
        admin_token=ADMIN,
        port=free_port(),
        python=limited_python(tmp_path, "-n 300"),
        ready_timeout_s=60,
    )
    with pytest.raises(ServerStartError, match="max_connections 512 needs 768 file descriptors"):
        srv.start()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def closed_after(sock: socket.socket, timeout: float = 10.0) -> float:
    """Seconds until the server closes ``sock`` (what it sends before is read and dropped)."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def read_response(sock: socket.socket, timeout: float = 5.0) -> tuple[int, bytes]:
    """The status and the bytes of one whole response (head and Content-Length body), read within ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _response_length(data):
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response: {data!r}"
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def _response_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(head) + 4


def upload_head(path: str, token: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_slow_headers_are_closed_at_the_deadline_and_prompt_clients_are_served(server, client):
    late = metric(client, "gradwire_connections_closed_total", 'cause="header_deadline"')
    slow = connect(server)
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the end of the headers
    t0 = time.monotonic()
    assert client.get("/healthz").status_code == 200  # served meanwhile
    closed_after(slow)
    waited = time.monotonic() - t0
    assert HEADER_TIMEOUT_S * 0.8 <= waited <= HEADER_TIMEOUT_S + 2.0, waited
    # Dribbling a byte at a time does not extend the deadline.
    dribbler = connect(server)
    t0 = time.monotonic()
    try:
        for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            dribbler.sendall(bytes([b]))
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass
    closed_after(dribbler)
    assert time.monotonic() - t0 <= HEADER_TIMEOUT_S + 2.0
    # (the client's own idle keep-alive connection may be closed by the same 1 s deadline too)
    assert metric(client, "gradwire_connections_closed_total", 'cause="header_deadline"') >= late + 2


def test_the_cap_closes_the_oldest_waiting_connections_never_a_prompt_client(server, client):
    evicted = metric(client, "gradwire_connections_closed_total", 'cause="evicted"')
    # The fixture's client keeps its connection open between requests: to the server an idle connection
    # waiting for its next request, as old as the test, which the cap may rightly close first (and a
    # request racing that close fails). A prompt client here sends each request on a fresh connection.
    client.close()
    idle = [connect(server) for _ in range(3 * MAX_CONNECTIONS)]
    for s in idle:
        s.sendall(b"GET /he")
    # Every request of a prompt client is served though three times the cap sit open and silent.
    with httpx.Client(base_url=server.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as prompt:
        for _ in range(10):
            assert prompt.get("/healthz").status_code == 200
    client = httpx.Client(base_url=server.url, timeout=30)
    closed = 0
    for s in idle[: 2 * MAX_CONNECTIONS]:
        s.settimeout(0.5)
        try:
            closed += s.recv(1) == b""
        except ConnectionResetError:
            closed += 1
        except TimeoutError:
            pass
    assert closed >= MAX_CONNECTIONS, closed  # the oldest went first
    assert metric(client, "gradwire_connections_closed_total", 'cause="evicted"') - evicted >= 2 * MAX_CONNECTIONS
    assert metric(client, "gradwire_connections_open") <= MAX_CONNECTIONS
    client.close()
    for s in idle:
        s.close()


def test_a_slow_body_is_closed_at_its_rate_deadline(server, client):
    run = make_run(client, ADMIN, n_nodes=1, quorum=1)
    node = run.nodes[0]
    s = connect(server)
    s.sendall(upload_head(f"/v1/runs/{run.run_id}/rounds/0/updates", node.token, 1 << 20))
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 10:
            s.sendall(b"\0" * 100)  # 200 B/s against a minimum of 2,000 B/s
            time.sleep(0.5)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert time.monotonic() - t0 <= BODY_TIMEOUT_S + 3.0
    # The node's upload slot is free again: its update is accepted at once.
    r = run.submit(node, 0, dct_frame(random_grads(1), 0, node.node_id))
    assert r.status_code == 202, r.text


@pytest.mark.parametrize("case", ["bad_token", "round_ahead", "round_closed", "upload_in_progress"])
def test_an_update_body_is_never_read_when_the_request_is_refused_without_it(server, client, case):
    run = make_run(client, ADMIN, n_nodes=2, quorum=1)
    a, b = run.nodes
    assert run.submit(a, 0, dct_frame(random_grads(1), 0, a.node_id)).status_code == 202
    run.wait_version(1)
    token, round, expected = {
        "bad_token": ("not-a-token", 1, (401, b"invalid_token")),
        "round_ahead": (b.token, 5, (409, b"round_not_open")),
        "round_closed": (b.token, 0, (410, b"round_closed")),
        "upload_in_progress": (b.token, 1, (429, b"upload_in_progress")),
    }[case]
    path = f"/v1/runs/{run.run_id}/rounds/{round}/updates"
    holder = None
    if case == "upload_in_progress":  # the node's first upload, its body still coming
        holder = connect(server)
        holder.sendall(upload_head(path, b.token, 60 << 20) + b"\0" * 1000)
        time.sleep(0.2)
    bytes_in = metric(client, "gradwire_bytes_in_total")
    s = connect(server)
    s.sendall(upload_head(path, token, 60 << 20))  # 60 MiB announced, not one byte of it sent
    status, head = read_response(s)
    assert status == expected[0] and expected[1] in head, head
    # ...and told the client not to send another request on this connection, which drops what comes next.
    assert b"\r\nconnection: close\r\n" in head.lower(), head
    # The answer came without the body; the connection then closes (after a short linger), and the
    # server counted no body bytes.
    assert closed_after(s) <= 5.0
    assert metric(client, "gradwire_bytes_in_total") == bytes_in
    if holder is not None:
        holder.close()


def test_a_state_upload_is_refused_before_its_body_once_the_run_started(server, client):
    run = make_run(client, ADMIN, n_nodes=1, quorum=1)  # the state itself was spooled to disk and accepted
    assert run.submit(run.nodes[0], 0, dct_frame(random_grads(1), 0, 1)).status_code == 202
    s = connect(server)
    s.sendall(
        f"PUT /v1/runs/{run.run_id}/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
        f"Content-Length: {1 << 30}\r\n\r\n".encode()
    )  # 1 GiB announced, none sent
    status, response = read_response(s)
    assert status == 409 and b"already_started" in response, response
    s.close()


def test_sigterm_is_not_held_by_an_abandoned_long_poll(server, client):
    """Last in this file: it stops the module's server."""
    run = make_run(client, ADMIN, n_nodes=1, quorum=1)
    poll = connect(server)
    poll.sendall(
        f"GET /v1/runs/{run.run_id}/updates?since=0&wait=60 HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {ADMIN}\r\n\r\n".encode()
    )
    time.sleep(0.5)  # the poll is waiting in the server; its client will never read the answer
    t0 = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=30)
    took = time.monotonic() - t0
    poll.close()
    # uvicorn re-raises the signal it handled once it has shut down: killed by SIGTERM, after a clean stop.
    assert code in (0, -signal.SIGTERM) and "stopped cleanly" in server.log(), server.log()
    assert took < 5.0, f"SIGTERM took {took:.1f} s with a long poll open (it waits up to 60 s)"
