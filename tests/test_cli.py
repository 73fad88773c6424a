"""The ``gradwire`` command (gradwire_apps.cli): ``gradwire demo`` end to end, ``gradwire serve``, and
what it says when the apps extra or the server is missing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from gradwire.client import GradwireClient
from gradwire_server.launcher import free_port


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def test_demo_command_runs_end_to_end(tmp_path):
    out = tmp_path / "demo_out"
    proc = subprocess.run(
        # The transformer here; the digits MLP (the default) runs through the same workers in test_end_to_end.py.
        [sys.executable, "-m", "gradwire_apps.cli", "demo", "--model", "transformer", "--hidden", "32", "--batch-size", "4",
         "--steps", "4", "--sync-every", "2", "--sparseloco-topk", "8", "--workers", "2", "--out", str(out),
         "--no-progress"],
        capture_output=True, text=True, timeout=300, env=_env(COLUMNS="200"), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "char transformer" in proc.stdout and "2 nodes, 4 steps per node" in proc.stdout
    assert "gap vs dense" in proc.stdout
    assert proc.stdout.count("2/2") == 3  # every run: both nodes in sync with the server
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    results = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in results] == ["SparseLoCo H=2 k=8", "DeMo k=4", "dense AdamW"]
    assert all(r["in_sync"] and r["steps"] == 4 for r in results)
    assert [r["rounds"] for r in results] == [2, 4, 4]  # SparseLoCo publishes a version every 2 steps
    sparseloco, demo, dense = results
    assert dense["up_ratio"] < 1.01 and dense["down_ratio"] < 1.01
    # Both ways compressed: the re-encoded aggregate down is about one node's frame up.
    for r in (sparseloco, demo):
        assert r["up_ratio"] > 20 and r["down_ratio"] > 20, r
        assert 0.5 < r["down_ratio"] / r["up_ratio"] < 2.0, r


def test_demo_refuses_an_unknown_run_with_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gradwire_apps.cli", "demo", "--runs", "dense,adam", "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown run" in proc.stderr and "adam" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_command_runs_the_server_until_sigterm(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradwire_apps.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path / "data")],
        env=_env(GRADWIRE_ADMIN_TOKEN="serve-admin"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        with GradwireClient(f"http://127.0.0.1:{port}", "serve-admin", timeout=2.0) as admin:
            deadline = time.monotonic() + 60
            while not admin.ready():
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.1)
            assert admin.health() == {"status": "ok"}
            run_id = admin.create_run({})
            assert admin.status(run_id)["version"] == 0
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal so the exit status still shows it.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        log = proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Application shutdown complete" in log, log


def _main_without(modules: list[str], *argv: str) -> subprocess.CompletedProcess:
    """``gradwire *argv`` in a fresh interpreter where ``modules`` cannot be imported."""
    hide = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    code = f"import sys; {hide}sys.argv = ['gradwire', *{list(argv)!r}]; from gradwire_apps.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_serve_without_the_server_package_says_how_to_install_it():
    proc = _main_without(["gradwire_server"], "serve")
    assert proc.returncode == 2
    assert "pip install 'gradwire[apps]'" in proc.stderr and "pip install ./server" in proc.stderr


def test_command_line_without_the_apps_extra_says_how_to_install_it():
    proc = _main_without(["typer"], "demo")
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'gradwire[apps]'" in proc.stderr and "typer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_demo_without_its_dependencies_says_how_to_install_them(tmp_path):
    proc = _main_without(["sklearn", "matplotlib"], "demo", "--steps", "8", "--out", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "sklearn, matplotlib" in proc.stderr and "pip install 'gradwire[apps]'" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing was started or written
