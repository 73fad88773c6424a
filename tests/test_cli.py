"""The ``gradwire`` command (gradwire_apps.cli): ``gradwire demo`` end to end, ``gradwire serve`` with every
server setting, ``--version``, usage errors for wrong values, and what it says when the apps extra or the
server is missing."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import annotated_types
from typer.testing import CliRunner

from gradwire.client import GradwireClient
from gradwire_apps.cli import build_app
from gradwire_server.launcher import free_port
from gradwire_server.settings import ServerSettings


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def test_demo_command_runs_end_to_end(tmp_path):
    out = tmp_path / "demo_out"
    proc = subprocess.run(
        # The transformer here; the digits MLP (the default) runs through the same workers in test_end_to_end.py.
        [
            sys.executable,
            "-m",
            "gradwire_apps.cli",
            "demo",
            "--model",
            "transformer",
            "--hidden",
            "32",
            "--batch-size",
            "4",
            "--steps",
            "4",
            "--sync-every",
            "2",
            "--sparseloco-topk",
            "8",
            "--workers",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(COLUMNS="200"),
        cwd=tmp_path,
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
    # stderr is a pipe: plain progress lines (gradwire_apps.progress), at most one per tenth, the last at 100%.
    assert "\r" not in proc.stderr
    line = re.compile(
        r"(.+): (\d+)/(\d+) version \(\d+%\), \d+:\d\d elapsed(, about \d+:\d\d left)?"
        r"(, train loss \d+\.\d{4})?"
    )
    shown: dict[str, list[tuple[int, int]]] = {}
    for text in proc.stderr.splitlines():
        m = line.fullmatch(text)
        if m:
            shown.setdefault(m[1], []).append((int(m[2]), int(m[3])))
    assert {label: lines[-1] for label, lines in shown.items()} == {
        "SparseLoCo H=2 k=8": (2, 2),
        "DeMo k=4": (4, 4),
        "dense AdamW": (4, 4),
    }, proc.stderr
    assert all(len(lines) <= 10 for lines in shown.values())
    sparseloco, demo, dense = results
    assert dense["up_ratio"] < 1.01 and dense["down_ratio"] < 1.01
    # Both ways compressed: the re-encoded aggregate down is about one node's frame up.
    for r in (sparseloco, demo):
        assert r["up_ratio"] > 20 and r["down_ratio"] > 20, r
        assert 0.5 < r["down_ratio"] / r["up_ratio"] < 2.0, r


def test_demo_refuses_an_unknown_run_with_a_usage_error(tmp_path):
    result = CliRunner().invoke(build_app(), ["demo", "--runs", "dense,adam", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "unknown run" in result.output and "adam" in result.output
    assert isinstance(result.exception, SystemExit)  # a usage error, not a traceback


def _gradwire(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gradwire_apps.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(COLUMNS="200"),
    )


def test_version_names_both_distributions():
    proc = _gradwire("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"gradwire {importlib.metadata.version('gradwire')}",
        f"gradwire-server {importlib.metadata.version('gradwire-server')}",
    ]


def _flat(text: str) -> str:
    """A usage error's words on one line: typer draws them in a box, wrapped to the terminal's width."""
    return " ".join(text.replace("│", " ").split())


def test_demo_typos_are_usage_errors_before_anything_starts(tmp_path):
    out = tmp_path / "out"
    app, runner = build_app(), CliRunner()
    model = runner.invoke(app, ["demo", "--model", "gpt", "--out", str(out)])
    assert model.exit_code == 2, model.output
    assert "'--model'" in _flat(model.output) and "'gpt' is not one of 'digits', 'transformer'" in _flat(model.output)
    rule = runner.invoke(app, ["demo", "--aggregation", "avg", "--out", str(out)])
    assert rule.exit_code == 2, rule.output
    assert "unknown aggregation rule 'avg'" in _flat(rule.output) and "clipped_mean" in rule.output
    command = runner.invoke(app, ["dmeo"])
    assert command.exit_code == 2 and "No such command 'dmeo'" in command.output
    for result in (model, rule, command):
        assert isinstance(result.exception, SystemExit) and "server on" not in result.output
    assert not out.exists()  # the demo makes its output directory first thing when it runs


def _other_value(name: str, annotation, default, metadata, tmp_path: Path):
    """A valid value of a ServerSettings field other than its default, for any field type the settings use."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    # ``Optional[X]`` and ``X | None`` (types.UnionType) alike.
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kind = args[0] if union and len(args) == 1 else annotation
    if typing.get_origin(kind) is typing.Literal:
        return next(c for c in typing.get_args(kind) if c != default)
    if kind is bool:
        return not default
    if kind is Path:
        return str(tmp_path / f"{name}-given")
    if kind in (int, float):
        low = max(
            [m.ge for m in metadata if isinstance(m, annotated_types.Ge)]
            + [m.gt + 1 for m in metadata if isinstance(m, annotated_types.Gt)]
            + [0]
        )
        value = kind(default + 1 if default is not None else max(low, 1))
        high = [m.le for m in metadata if isinstance(m, annotated_types.Le)]
        return value if not high or value <= high[0] else kind(default - 1)
    # Text settings: a non-default value each settings validator accepts here.
    return {
        "host": "0.0.0.0",
        "device": "cpu:0",
        "object_store": "s3://gradwire-test/runs",
        "object_store_public_url": "https://cdn.example.org/gradwire",
    }.get(name, default)


def test_every_server_setting_is_an_option_of_serve_or_a_secret_from_the_environment(tmp_path):
    """Each ServerSettings field, set alone to a value other than its default on `gradwire serve`'s command
    line (a secret in GRADWIRE_<NAME>: never on a command line), arrives in the settings the server would
    run with (`--check` prints them)."""
    app, runner = build_app(), CliRunner()
    defaults = json.loads(runner.invoke(app, ["serve", "--check"]).stdout)
    assert set(defaults) == set(ServerSettings.model_fields)
    for name, field in ServerSettings.model_fields.items():
        option = "--" + name.replace("_", "-")
        if "SecretStr" in repr(field.annotation):
            given = runner.invoke(app, ["serve", "--check"], env={f"GRADWIRE_{name.upper()}": "from-the-environment"})
            assert given.exit_code == 0, given.output
            assert json.loads(given.stdout)[name] == "**********"  # set, and masked in the printout
            assert runner.invoke(app, ["serve", "--check", option, "x"]).exit_code == 2  # no such option
            continue
        value = _other_value(
            name, field.annotation, field.get_default(call_default_factory=True), field.metadata, tmp_path
        )
        argv = [option if value else f"--no-{option[2:]}"] if isinstance(value, bool) else [option, str(value)]
        given = runner.invoke(app, ["serve", "--check", *argv])
        assert given.exit_code == 0, (argv, given.output)
        settings = json.loads(given.stdout)
        assert settings[name] == value != defaults[name], (name, settings[name], value)
        assert {k: v for k, v in settings.items() if k != name} == {k: v for k, v in defaults.items() if k != name}


def test_serve_refuses_a_setting_the_server_refuses_with_a_usage_error():
    result = CliRunner().invoke(build_app(), ["serve", "--check", "--port", "70000", "--log-level", "debug"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--port'" in _flat(result.output) and "65535" in result.output
    assert isinstance(result.exception, SystemExit)  # a usage error, not an exception


def test_serve_command_runs_the_server_until_sigterm(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        # Two of the settings `python -m gradwire_server` long had alone, on `gradwire serve` too.
        [
            sys.executable,
            "-m",
            "gradwire_apps.cli",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--device",
            "cpu",
            "--checkpoint-every",
            "3",
        ],
        env=_env(GRADWIRE_ADMIN_TOKEN="serve-admin"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
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


# Never `pip install 'gradwire[apps]'`: gradwire-server is on no registry, so that install cannot succeed.


def test_serve_without_the_server_package_says_how_to_install_it():
    proc = _main_without(["gradwire_server"], "serve")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "gradwire serve needs gradwire_server: pip install ./server from a gradwire checkout "
        "(gradwire-server is on no registry)"
    )


def test_command_line_without_typer_says_what_to_install():
    proc = _main_without(["typer"], "demo")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "gradwire: the command line needs typer: pip install typer"


def test_demo_without_its_dependencies_says_what_to_install_from_where(tmp_path):
    proc = _main_without(["sklearn", "matplotlib"], "demo", "--steps", "8", "--out", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "gradwire demo needs sklearn, matplotlib: pip install scikit-learn matplotlib"
    assert not list(tmp_path.iterdir())  # nothing was started or written
