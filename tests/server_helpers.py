"""Small helpers shared by the server tests: a tiny model, runs, nodes and frames over plain httpx."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx
import torch
import uvicorn

import gradwire
from gradwire.state import state_to_bytes

#: A tiny two-layer model: about 2.5 k parameters, four tensors (one of them not a multiple of any chunk).
SHAPES = {"fc1.weight": (32, 64), "fc1.bias": (32,), "fc2.weight": (10, 32), "fc2.bias": (10,)}


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.1 for n, s in SHAPES.items()}


def random_grads(seed: int, scale: float = 1.0, shapes=SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Node:
    node_id: int
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.token)


@dataclass
class Run:
    client: httpx.Client
    run_id: str
    admin: dict[str, str]
    nodes: list[Node]

    def url(self, suffix: str = "") -> str:
        return f"/v1/runs/{self.run_id}{suffix}"

    def submit(self, node: Node, round: int, frame: bytes) -> httpx.Response:
        return self.client.post(self.url(f"/rounds/{round}/updates"), content=frame, headers=node.headers)

    def status(self) -> dict:
        r = self.client.get(self.url(), headers=self.admin)
        r.raise_for_status()
        return r.json()

    def publish_rounds(self, frame: Callable[[int, int], bytes], first: int, last: int) -> None:
        """Rounds ``first`` … ``last - 1``: every node submits ``frame(round, node_id)`` (202 each), then the
        version is waited for."""
        for rnd in range(first, last):
            for node in self.nodes:
                r = self.submit(node, rnd, frame(rnd, node.node_id))
                assert r.status_code == 202, r.text
            self.wait_version(rnd + 1)

    def wait_version(self, version: int, timeout: float = 30.0) -> httpx.Response:
        """Long-poll until the run publishes ``version`` (bounded); returns the diff response."""
        r = self.client.get(self.url("/updates"), params={"since": version - 1, "wait": timeout}, headers=self.admin)
        assert r.status_code == 200, r.text
        assert int(r.headers["X-Gradwire-Version"]) >= version, f"version {version} not published in {timeout}s"
        return r


@contextlib.contextmanager
def served(app, timeout: float = 30.0) -> Iterator[httpx.Client]:
    """``app`` under a real uvicorn on a free loopback port, in a thread of this process (so that a test can
    reach into ``app.state``), with an ``httpx.Client`` on it; leaving stops uvicorn and runs the app's
    shutdown, as SIGTERM would."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=timeout) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


def make_run(client: httpx.Client, admin_token: str, n_nodes: int = 2, state: dict | None = None, **config) -> Run:
    """Create a run with ``config``, register ``n_nodes`` nodes, upload ``state`` (the tiny model)."""
    admin = bearer(admin_token)
    r = client.post("/v1/runs", json=config, headers=admin)
    assert r.status_code == 201, r.text
    run_id = r.json()["run_id"]
    nodes = []
    for i in range(n_nodes):
        r = client.post(f"/v1/runs/{run_id}/nodes", json={"name": f"node-{i}"}, headers=admin)
        assert r.status_code == 201, r.text
        nodes.append(Node(**r.json()))
    r = client.put(f"/v1/runs/{run_id}/state", content=state_to_bytes(state or tiny_state()), headers=admin)
    assert r.status_code == 200, r.text
    return Run(client, run_id, admin, nodes)


def dct_frame(grads: dict[str, torch.Tensor], round: int, sender: int, topk: int = 8) -> bytes:
    return gradwire.DCTCodec(chunk_shape=(64,), topk=topk).encode_bundle(grads, round=round, sender=sender)


def dense_frame(grads: dict[str, torch.Tensor], round: int, sender: int) -> bytes:
    return gradwire.IdentityCodec().encode_bundle(grads, round=round, sender=sender)


def eventually(read: Callable[[], object], expected: object, timeout: float = 10.0) -> object:
    """``read()`` once it returns ``expected``, or its last value after ``timeout`` seconds. For what the
    server does after a version is readable (pruning old files is housekeeping no reader waits for)."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """The value of one sample in /metrics (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def train_together(
    nodes: Sequence, loss: Callable[[torch.nn.Module, int, int], torch.Tensor], steps: int, timeout: float = 300.0
) -> None:
    """Each :class:`gradwire.client.Node` on its own thread: ``steps`` times zero its gradients, backward
    ``loss(module, node_id, step)`` and ``node.step()``; re-raises the first failure in the caller."""
    errors: list = []

    def train(node) -> None:
        try:
            for step in range(steps):
                node.module.zero_grad()
                loss(node.module, node.node_id, step).backward()
                node.step()
        except BaseException as exc:  # surfaced by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def published_across_a_crash(
    data_dir,
    env: dict,
    configs: Sequence[dict],
    frame: Callable[[int, int], bytes],
    n_nodes: int,
    crash_after: int,
    last: int,
) -> tuple[list[bytes], list[bytes]]:
    """Every config's run published to version ``last`` twice: by a server left alone, and by one killed
    (-9) and restarted once version ``crash_after`` is out. Returns each run's ``/updates`` bytes from both,
    ``(uninterrupted, restarted)``; the restarted server must not have logged a replay that made other frames."""
    from live_server import LiveServer  # a subprocess server: only the tests that crash one need it

    published = []
    for crash in (False, True):
        with (
            LiveServer(data_dir / f"crash-{crash}", env=env) as srv,
            httpx.Client(base_url=srv.url, timeout=30) as client,
        ):
            runs = [make_run(client, srv.admin_token, n_nodes=n_nodes, **config) for config in configs]
            for run in runs:
                run.publish_rounds(frame, 0, crash_after)
            if crash:
                srv.kill()
                srv.start()
            got = []
            for run in runs:
                run.publish_rounds(frame, crash_after, last)
                r = client.get(run.url("/updates"), params={"since": 0}, headers=run.admin)
                assert r.status_code == 200 and int(r.headers["X-Gradwire-Version"]) == last
                got.append(r.content)
            published.append(got)
            if crash:
                assert "made frames other than the published ones" not in (srv.data_dir / "server.log").read_text()
    return published[0], published[1]
