"""The digits demo: scikit-learn's bundled digits, a small MLP, and the runs ``gradwire demo`` compares.

The main job (:func:`run_demo`, behind ``gradwire demo``) is distributed: it starts the aggregation
server on loopback (:func:`local_server`), and for each of two runs — DCT compression both ways, and the
uncompressed baseline (identity codec both ways) — creates the run with the same initial weights,
registers N nodes and starts N worker processes (:mod:`gradwire.worker`), each training on its own shard
(:func:`run_distributed`). The server aggregates the gradients and applies AdamW; the workers apply the
published updates. At the end it prints a table (loss, accuracy, bytes per round each way, compression)
and plots loss against rounds and against bytes sent.

:func:`train_digits` is the single-process version: the same model trained with AdamW on gradients
passed through a codec with error feedback as bytes, with no server.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .codecs import Codec, IdentityCodec
from .feedback import ErrorFeedback
from .frame import decode_bundle

__all__ = [
    "DemoSettings",
    "DigitsData",
    "DistributedResult",
    "RunResult",
    "digits_mlp",
    "load_digits",
    "local_server",
    "run_demo",
    "run_distributed",
    "CharTask",
    "DigitsTask",
    "make_task",
    "train_digits",
]


@dataclass
class DigitsData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits(seed: int = 0, test_fraction: float = 0.25) -> DigitsData:
    """scikit-learn's bundled 8×8 digits (1797 images, no download), scaled to [0, 1], split at random."""
    from sklearn.datasets import load_digits as _load

    bunch = _load()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return DigitsData(x[train], y[train], x[test], y[test])


def digits_mlp(hidden: int = 128) -> nn.Module:
    """64 → hidden → hidden → 10 with ReLUs: about 26 k parameters at the default width."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@dataclass
class RunResult:
    label: str
    losses: list[float] = field(default_factory=list)
    bytes_per_step: list[int] = field(default_factory=list)
    test_accuracy: float = 0.0
    test_loss: float = 0.0

    @property
    def mean_bytes_per_step(self) -> float:
        return sum(self.bytes_per_step) / max(1, len(self.bytes_per_step))


def evaluate(model: nn.Module, data: DigitsData) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(data.x_test)
        loss = nn.functional.cross_entropy(logits, data.y_test).item()
        acc = (logits.argmax(1) == data.y_test).float().mean().item()
    model.train()
    return loss, acc


def train_digits(
    codec: Optional[Codec],
    *,
    label: str,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-2,
    seed: int = 0,
    data: Optional[DigitsData] = None,
    progress: bool = True,
    on_step: Optional[Callable[[int, float], None]] = None,
) -> RunResult:
    """Train the digits MLP for ``steps`` AdamW steps; ``codec=None`` sends dense fp32 gradients."""
    data = data or load_digits(seed)
    torch.manual_seed(seed)
    model = digits_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    feedback = ErrorFeedback(codec if codec is not None else IdentityCodec())
    g = torch.Generator().manual_seed(seed + 1)
    result = RunResult(label)
    bar = tqdm(range(steps), desc=label, disable=not progress, leave=False)
    for step in bar:
        idx = torch.randint(0, len(data.y_train), (batch_size,), generator=g)
        loss = nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        frame = feedback.encode_bundle(grads, round=step)
        decoded = decode_bundle(frame)
        for name, p in model.named_parameters():
            p.grad.copy_(decoded[name])
        opt.step()
        result.losses.append(loss.item())
        result.bytes_per_step.append(len(frame))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", bytes=len(frame))
        if on_step is not None:
            on_step(step, loss.item())
    result.test_loss, result.test_accuracy = evaluate(model, data)
    return result


# ---------------------------------------------------------------------------------------------
# What the distributed demo trains. A task builds the model, cuts the training data into one shard
# per worker (plain tensors, written as safetensors for the worker processes), computes one batch's
# loss on a shard, and evaluates a model on held-out data. Workers rebuild the task from its
# ``worker_args``.


class DigitsTask:
    """The digits MLP on scikit-learn's digits; shards are interleaved slices of the training split."""

    name = "digits"

    def __init__(self, hidden: int = 128, data_seed: int = 0, data: Optional[DigitsData] = None):
        self.hidden = hidden
        self.data_seed = data_seed
        self._data = data

    @property
    def data(self) -> DigitsData:
        if self._data is None:
            self._data = load_digits(self.data_seed)
        return self._data

    @property
    def title(self) -> str:
        return "digits MLP"

    def worker_args(self) -> list[str]:
        return ["--model", self.name, "--hidden", str(self.hidden)]

    def build(self) -> nn.Module:
        return digits_mlp(self.hidden)

    def shards(self, n: int) -> list[dict[str, torch.Tensor]]:
        d = self.data
        return [{"x": d.x_train[i::n].contiguous(), "y": d.y_train[i::n].contiguous()} for i in range(n)]

    def batch_loss(self, model: nn.Module, shard: Mapping[str, torch.Tensor], batch_size: int, gen: torch.Generator) -> torch.Tensor:
        x, y = shard["x"], shard["y"]
        idx = torch.randint(0, len(y), (min(batch_size, len(y)),), generator=gen)
        return nn.functional.cross_entropy(model(x[idx]), y[idx])

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """Test loss and accuracy."""
        return evaluate(model, self.data)


class CharTask:
    """A small character-level transformer on Python's bundled pydoc_data text (no download).

    The first 90 % of the text is cut into one contiguous shard per worker; the rest is held out.
    Accuracy is next-character accuracy on fixed held-out windows.
    """

    name = "transformer"
    held_out = 0.1
    eval_windows = 64

    def __init__(self, d_model: int = 128):
        from .models import CharVocab, load_pydoc_text

        self.d_model = d_model
        text = load_pydoc_text()
        self.vocab = CharVocab.of(text)
        self.tokens = self.vocab.encode(text)
        self.split = int(len(self.tokens) * (1 - self.held_out))

    @property
    def title(self) -> str:
        return f"char transformer (vocab {len(self.vocab)})"

    def worker_args(self) -> list[str]:
        return ["--model", self.name, "--hidden", str(self.d_model)]

    def build(self) -> nn.Module:
        from .models import CharTransformer

        return CharTransformer(len(self.vocab), d_model=self.d_model)

    def shards(self, n: int) -> list[dict[str, torch.Tensor]]:
        bounds = [self.split * i // n for i in range(n + 1)]
        return [{"tokens": self.tokens[bounds[i] : bounds[i + 1]].clone()} for i in range(n)]

    def batch_loss(self, model: nn.Module, shard: Mapping[str, torch.Tensor], batch_size: int, gen: torch.Generator) -> torch.Tensor:
        from .models import char_batch

        x, y = char_batch(shard["tokens"], batch_size, model.context, gen)
        logits = model(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """Held-out loss and next-character accuracy."""
        from .models import char_batch

        held = self.tokens[self.split :]
        x, y = char_batch(held, self.eval_windows, model.context, torch.Generator().manual_seed(0))
        model.eval()
        with torch.no_grad():
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
            acc = (logits.argmax(-1) == y).float().mean().item()
        model.train()
        return loss, acc


#: Tasks by the name ``gradwire demo --model`` takes.
TASKS = {DigitsTask.name: DigitsTask, CharTask.name: CharTask}


def make_task(name: str, hidden: Optional[int] = None):
    """The task called ``name`` (``digits`` or ``transformer``); ``hidden`` is its width if given."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown demo model {name!r}; known: {', '.join(TASKS)}") from None
    if hidden is None:
        return cls()
    return cls(hidden) if cls is DigitsTask else cls(d_model=hidden)


# ---------------------------------------------------------------------------------------------
# The distributed demo: a real server, real worker processes.


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _terminate(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


@contextlib.contextmanager
def local_server(
    data_dir: os.PathLike | str, *, admin_token: Optional[str] = None, ready_timeout: float = 60.0
) -> Iterator[tuple[str, str]]:
    """Run ``python -m gradwire_server`` on a free loopback port with its embedded defaults.

    Yields ``(url, admin_token)`` once ``/readyz`` answers; stops the server (SIGTERM, then SIGKILL)
    on exit. The server's log goes to ``<data_dir>/server.log``.
    """
    import importlib.util

    from .client import GradwireClient

    if importlib.util.find_spec("gradwire_server") is None:
        raise RuntimeError(
            "the aggregation server is not installed: `pip install ./server` from a gradwire checkout "
            "(`make demo` does it)"
        )
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    admin_token = admin_token or secrets.token_urlsafe(24)
    env = {**os.environ, "GRADWIRE_ADMIN_TOKEN": admin_token, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    last_error = ""
    for _attempt in range(3):  # a free port can be taken between probing and binding it
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        with open(data_dir / "server.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gradwire_server", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + ready_timeout
            with GradwireClient(url, admin_token, timeout=2.0) as probe:
                while proc.poll() is None and not probe.ready():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"gradwire server not ready after {ready_timeout} s; see {data_dir / 'server.log'}")
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=0.1)
            if proc.poll() is not None:
                last_error = (data_dir / "server.log").read_text(errors="replace")[-2000:]
                continue
            try:
                yield url, admin_token
            finally:
                _terminate(proc)
            return
        except BaseException:
            _terminate(proc)
            raise
    raise RuntimeError(f"gradwire server failed to start:\n{last_error}")


def codec_spec(codec: str, **params: Any) -> dict:
    """A codec as the server's RunConfig names it: ``{"codec": name, "params": {...}}``."""
    return {"codec": codec, "params": params}


@dataclass
class DistributedResult:
    """What one distributed run did: per-round loss and bytes, final quality and whether nodes agree."""

    label: str
    run_id: str
    workers: int
    rounds: int
    params: int
    losses: list[float] = field(default_factory=list)  # mean training loss over nodes, per round
    up_bytes: list[int] = field(default_factory=list)  # bytes all nodes sent, per round
    down_bytes: list[int] = field(default_factory=list)  # update bytes all nodes received, per round
    test_loss: float = float("nan")
    test_accuracy: float = float("nan")
    server_hash: str = ""
    node_hashes: dict[int, str] = field(default_factory=dict)
    joined: dict[int, int] = field(default_factory=dict)  # node id -> the version it started from
    rounds_missed: int = 0
    state_loads: int = 0
    seconds: float = 0.0
    title: str = ""  # what was trained

    @property
    def in_sync(self) -> bool:
        """Every node's own replica hashes to the server's weights at the final version."""
        return bool(self.node_hashes) and all(h == self.server_hash for h in self.node_hashes.values())

    @property
    def dense_bytes(self) -> int:
        """What one node's fp32 gradient (or one fp32 update) takes raw."""
        return 4 * self.params

    def _per_node_round(self, series: Sequence[int]) -> float:
        return sum(series) / max(1, len(series)) / max(1, self.workers)

    @property
    def up_per_node_round(self) -> float:
        return self._per_node_round(self.up_bytes)

    @property
    def down_per_node_round(self) -> float:
        return self._per_node_round(self.down_bytes)

    def final_train_loss(self, last: int = 10) -> float:
        tail = self.losses[-last:]
        return sum(tail) / max(1, len(tail))


class _WorkerEvents:
    """Reads each worker's JSON lines on a thread into one queue; ``None`` marks a closed stdout."""

    def __init__(self, procs: Mapping[int, subprocess.Popen]):
        self.queue: "queue.Queue[tuple[int, Optional[dict]]]" = queue.Queue()
        for node_id, proc in procs.items():
            threading.Thread(target=self._pump, args=(node_id, proc), daemon=True).start()

    def _pump(self, node_id: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            line = line.strip()
            if line.startswith(b"{"):
                with contextlib.suppress(ValueError):
                    self.queue.put((node_id, json.loads(line)))
        self.queue.put((node_id, None))


def run_distributed(
    url: str,
    admin_token: str,
    *,
    label: str,
    uplink: Mapping[str, Any],
    downlink: Mapping[str, Any],
    task=None,
    workers: int = 4,
    rounds: int = 100,
    batch_size: int = 32,
    lr: float = 3e-3,
    weight_decay: float = 1e-2,
    aggregation: str = "mean",
    seed: int = 0,
    run_config: Optional[Mapping[str, Any]] = None,
    join_at: Optional[Mapping[int, int]] = None,
    log_dir: Optional[os.PathLike | str] = None,
    progress: bool = True,
    timeout: float = 900.0,
) -> DistributedResult:
    """Train ``task`` (default :class:`DigitsTask`) on a running server with ``workers`` worker processes.

    Creates a run (``uplink``/``downlink`` codecs as ``{"codec", "params"}``, AdamW with ``lr``, quorum =
    every worker), puts the initial weights (seeded by ``seed``), registers the nodes and starts one
    ``python -m gradwire.worker`` process per node, each on its own shard, until the run reaches version
    ``rounds``. ``join_at`` maps a worker
    index to the version it waits for before joining (a late joiner); ``run_config`` overrides any
    RunConfig field. Raises if a worker fails or the run takes longer than ``timeout`` seconds.
    """
    from safetensors.torch import save_file

    from .client import GradwireClient

    task = task or DigitsTask()
    config: dict[str, Any] = {
        "uplink": dict(uplink),
        "downlink": dict(downlink),
        "optimizer": {"lr": lr, "weight_decay": weight_decay},
        "aggregation": {"rule": aggregation},
        "quorum": workers,
        "min_updates": 1,
        "round_deadline_s": 30.0,
    }
    config.update(run_config or {})
    torch.manual_seed(seed)
    model = task.build()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="gradwire-workers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    with GradwireClient(url, admin_token) as admin:
        run_id = admin.create_run(config)
        admin.put_state(run_id, initial)
        nodes = [admin.register_node(run_id, f"{label}-worker-{i}") for i in range(workers)]
        result = DistributedResult(
            label=label, run_id=run_id, workers=workers, rounds=rounds, params=sum(t.numel() for t in initial.values())
        )
        procs: dict[int, subprocess.Popen] = {}
        logs = []
        try:
            for i, ((node_id, token), shard) in enumerate(zip(nodes, task.shards(workers))):
                log = open(log_dir / f"{run_id}-node{node_id}.log", "wb")
                logs.append(log)
                shard_path = log_dir / f"{run_id}-shard{i}.safetensors"
                save_file(shard, str(shard_path))
                procs[node_id] = subprocess.Popen(
                    [
                        sys.executable, "-m", "gradwire.worker", *task.worker_args(),
                        "--url", url, "--run-id", run_id, "--node-id", str(node_id),
                        "--data", str(shard_path), "--rounds", str(rounds),
                        "--codec", json.dumps(dict(uplink)),
                        "--batch-size", str(batch_size), "--seed", str(seed),
                        "--join-at", str((join_at or {}).get(i, 0)),
                    ],
                    env={**os.environ, "GRADWIRE_TOKEN": token, "OMP_NUM_THREADS": "1"},
                    stdout=subprocess.PIPE,
                    stderr=log,
                )
            _collect(result, procs, log_dir, progress=progress, timeout=timeout)
        finally:
            for proc in procs.values():
                _terminate(proc)
            for log in logs:
                log.close()
        state, _version, result.server_hash = admin.state(run_id)
    final = task.build()
    final.load_state_dict(state, strict=False)
    result.test_loss, result.test_accuracy = task.evaluate(final)
    result.title = task.title
    result.seconds = time.perf_counter() - started
    return result


def _collect(result: DistributedResult, procs: Mapping[int, subprocess.Popen], log_dir: Path, *, progress: bool, timeout: float) -> None:
    """Gather the workers' reports into ``result`` while drawing one progress bar step per round."""
    events = _WorkerEvents(procs)
    losses: dict[int, list[float]] = {}
    up: dict[int, int] = {}
    down: dict[int, int] = {}
    open_streams = set(procs)
    deadline = time.monotonic() + timeout
    with tqdm(total=result.rounds, desc=result.label, unit="round", disable=not progress, leave=True) as bar:
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{result.label}: run {result.run_id} did not finish within {timeout} s")
            try:
                node_id, event = events.queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if event is None:
                open_streams.discard(node_id)
                proc = procs[node_id]
                code = proc.wait(timeout=30)
                if node_id not in result.node_hashes:
                    tail = (log_dir / f"{result.run_id}-node{node_id}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{result.label}: worker of node {node_id} exited with {code} before finishing:\n{tail}")
                continue
            if event["event"] == "round":
                r = int(event["round"])
                losses.setdefault(r, []).append(float(event["loss"]))
                up[r] = up.get(r, 0) + int(event["up"])
                down[r] = down.get(r, 0) + int(event["down"])
                if event["version"] > bar.n:
                    bar.update(min(result.rounds, event["version"]) - bar.n)
                    bar.set_postfix(loss=f"{sum(losses[r]) / len(losses[r]):.3f}")
            elif event["event"] == "joined":
                result.joined[int(node_id)] = int(event["version"])
            elif event["event"] == "done":
                result.node_hashes[int(node_id)] = event["weights_hash"]
                result.rounds_missed += int(event["rounds_missed"])
                result.state_loads += int(event["state_loads"])
    for r in sorted(losses):
        result.losses.append(sum(losses[r]) / len(losses[r]))
        result.up_bytes.append(up[r])
        result.down_bytes.append(down[r])


@dataclass
class DemoSettings:
    """The knobs of ``gradwire demo`` (defaults sized for a couple of minutes on two cores)."""

    model: str = "digits"
    workers: int = 4
    rounds: int = 150
    hidden: Optional[int] = None  # the task's default width
    batch_size: int = 32
    lr: float = 3e-3
    topk: int = 32
    chunk: int = 32
    aggregation: str = "mean"
    seed: int = 0
    out_dir: str = "demo_out"


def run_demo(
    settings: DemoSettings,
    *,
    url: Optional[str] = None,
    admin_token: Optional[str] = None,
    console=None,
    progress: bool = True,
) -> list[DistributedResult]:
    """The main job: the compressed run and the uncompressed baseline on one server, a table and a plot.

    Starts a server on loopback unless ``url`` (and ``admin_token``) name a running one. Writes
    ``<out_dir>/loss.png`` and ``<out_dir>/results.json``; returns both runs' results.
    """
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or logged: wide enough for the table on one line per run
            console = Console(width=120)
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dct = codec_spec("dct", chunk_shape=[settings.chunk, settings.chunk], topk=settings.topk)
    identity = codec_spec("identity")
    plans = [
        (f"DCT k={settings.topk}", dct, dct),
        ("fp32 dense", identity, identity),
    ]
    task = make_task(settings.model, settings.hidden)

    def train_all(server_url: str, token: str) -> list[DistributedResult]:
        results = []
        for label, uplink, downlink in plans:
            results.append(
                run_distributed(
                    server_url, token, label=label, uplink=uplink, downlink=downlink,
                    task=task, workers=settings.workers, rounds=settings.rounds,
                    batch_size=settings.batch_size, lr=settings.lr, aggregation=settings.aggregation,
                    seed=settings.seed, log_dir=out / "logs", progress=progress,
                )
            )
        return results

    if url is None:
        with tempfile.TemporaryDirectory(prefix="gradwire-demo-") as data_dir:
            with local_server(data_dir) as (server_url, token):
                console.print(f"server on {server_url} (data in {data_dir}); {settings.workers} workers per run")
                results = train_all(server_url, token)
    else:
        if not admin_token:
            raise ValueError("an existing server needs its admin token")
        results = train_all(url, admin_token)

    console.print(results_table(results, settings))
    plot_path = out / "loss.png"
    plot_distributed(results, plot_path)
    (out / "results.json").write_text(json.dumps([_result_json(r) for r in results], indent=2))
    console.print(f"loss plot: {plot_path}")
    return results


def results_table(results: Sequence[DistributedResult], settings: Optional[DemoSettings] = None):
    """The demo's rich table: one row per run."""
    from rich.table import Table

    first = results[0]
    title = f"{first.title} ({first.params:,} parameters), {first.workers} nodes, {first.rounds} rounds, AdamW on the server"
    table = Table(title=title, caption="bytes: per node per round; ×: raw fp32 model bytes ÷ those bytes")
    for col in ("run", "train loss", "test loss", "test acc", "bytes up", "bytes down", "× up", "× down", "in sync", "s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.label,
            f"{r.final_train_loss():.3f}",
            f"{r.test_loss:.3f}",
            f"{100 * r.test_accuracy:.1f}%",
            f"{r.up_per_node_round:,.0f}",
            f"{r.down_per_node_round:,.0f}",
            f"{r.dense_bytes / max(1.0, r.up_per_node_round):.1f}",
            f"{r.dense_bytes / max(1.0, r.down_per_node_round):.1f}",
            f"{sum(h == r.server_hash for h in r.node_hashes.values())}/{r.workers}",
            f"{r.seconds:.0f}",
        )
    return table


def _result_json(r: DistributedResult) -> dict:
    return {
        "label": r.label, "run_id": r.run_id, "workers": r.workers, "rounds": r.rounds, "params": r.params,
        "losses": r.losses, "up_bytes": r.up_bytes, "down_bytes": r.down_bytes, "test_loss": r.test_loss,
        "test_accuracy": r.test_accuracy, "server_hash": r.server_hash,
        "node_hashes": {str(k): v for k, v in r.node_hashes.items()}, "in_sync": r.in_sync,
        "joined": {str(k): v for k, v in r.joined.items()},
        "rounds_missed": r.rounds_missed, "state_loads": r.state_loads, "seconds": r.seconds,
    }


def _smooth(values: Sequence[float], window: int = 5) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot_distributed(results: Sequence[DistributedResult], path: os.PathLike | str) -> None:
    """Loss against rounds and against bytes one node sent and received, one line per run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        loss = _smooth(r.losses)
        per_node = [(u + d) / r.workers for u, d in zip(r.up_bytes, r.down_bytes)]
        cumulative, total = [], 0.0
        for b in per_node:
            total += b
            cumulative.append(total)
        ax1.plot(range(len(loss)), loss, label=r.label)
        ax2.plot(cumulative, loss, label=r.label)
    ax1.set(xlabel="round", ylabel="training loss (5-round mean over nodes)", yscale="log")
    ax2.set(xlabel="bytes one node sent + received", ylabel="training loss (5-round mean over nodes)", xscale="log", yscale="log")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
