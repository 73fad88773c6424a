"""No outage from stalled uploads: a body with no valid token is refused before it is read, sockets stalled
in a body make room at the connection cap like sockets stalled in headers, and one client address cannot
take the whole cap. Real uvicorn on loopback, raw sockets."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from live_server import LiveServer


def _stalled_post(
    port: int, path: str, token: str | None, length: int = 100_000, source: str = "127.0.0.1"
) -> socket.socket:
    """A complete header block announcing ``length`` bytes of body, then one byte of it, then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n{{".encode()
    )
    return sock


def _read_response(sock: socket.socket, deadline_s: float = 10.0) -> bytes:
    sock.settimeout(deadline_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            want = int(line.split(b":")[1])
            while len(body) < want:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                body += chunk
    return head + b"\r\n\r\n" + body


def _closed_by_server(sock: socket.socket, deadline_s: float) -> bool:
    sock.settimeout(deadline_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("token", [None, "not-a-token", "Basic abc"])
def test_body_without_a_valid_token_is_refused_before_it_is_read(tmp_path, token):
    server = LiveServer(tmp_path / "data")
    try:
        header_token = None if token is None else token
        sock = _stalled_post(server.port, "/v1/runs", None)
        if header_token is not None:
            sock.close()
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            scheme = "" if header_token.startswith("Basic") else "Bearer "
            sock.sendall(
                f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: {scheme}{header_token}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{".encode()
            )
        started = time.monotonic()
        response = _read_response(sock)
        assert time.monotonic() - started < 5.0  # not after the 20 s body deadline
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401"), head
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"] in ("missing_token", "invalid_token")
        # And the connection is closed by the server soon after (its linger), not held for the body.
        assert _closed_by_server(sock, 10.0)
        sock.close()
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    finally:
        server.close()


def test_update_submission_without_a_token_is_refused_before_its_body(tmp_path):
    server = LiveServer(tmp_path / "data")
    try:
        sock = _stalled_post(server.port, "/v1/runs/anything/updates", None)
        head = _read_response(sock).partition(b"\r\n\r\n")[0]
        assert head.startswith(b"HTTP/1.1 401"), head
        sock.close()
    finally:
        server.close()


def test_stalled_bodies_with_a_valid_token_make_room_at_the_cap(tmp_path):
    # 40 stalled admin uploads against a cap of 16, and more arriving with every normal request: the one
    # silent longest makes room, so every normal request is answered.
    server = LiveServer(
        tmp_path / "data", env={"GRADWIRE_MAX_CONNECTIONS": "16", "GRADWIRE_MAX_CONNECTIONS_PER_ADDRESS": "0"}
    )
    socks = [_stalled_post(server.port, "/v1/runs", "test-admin") for _ in range(40)]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the first answer: some stalled body is old enough to close
            try:
                assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
                break
            except httpx.TransportError:
                continue
        else:
            pytest.fail("no normal request answered within 30 s of the stalled uploads")
        for _ in range(10):
            socks.append(_stalled_post(server.port, "/v1/runs", "test-admin"))
            assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'cause="evicted_body"' in metrics
    finally:
        for s in socks:
            s.close()
        server.close()


def test_one_address_cannot_take_the_whole_cap(tmp_path):
    server = LiveServer(
        tmp_path / "data", env={"GRADWIRE_MAX_CONNECTIONS": "64", "GRADWIRE_MAX_CONNECTIONS_PER_ADDRESS": "8"}
    )
    socks = []
    try:
        # 30 idle sockets from 127.0.0.2: that address keeps at most 8 of them open.
        for _ in range(30):
            socks.append(
                socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=("127.0.0.2", 0))
            )
        closed = sum(_closed_by_server(s, 0.2) for s in socks)
        assert closed >= 30 - 8
        # Another address is not affected.
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'cause="per_address"' in metrics
    finally:
        for s in socks:
            s.close()
        server.close()
