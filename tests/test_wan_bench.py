"""bench/wan.py's pieces: time to loss on curves a real node logged, the node's stop at the target, the
command line and its plain "needs root" answer; the emulated link itself (delay and rate) only where
this process is root and may create network namespaces (skipped otherwise)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up; wan.py imports its siblings by name
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def wan():
    names = ("wan_curves", "wan_net", "wan")
    mods = [_load(n) for n in names]
    yield mods[2]
    for n in names:
        sys.modules.pop(n, None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp: Path, name: str, *extra: str) -> Path:
    """One node of the dense row (a group of one on loopback): 24 steps of the char transformer."""
    log = tmp / f"{name}.jsonl"
    cmd = [
        sys.executable,
        str(BENCH / "wan_node.py"),
        "train",
        "--mode",
        "dense",
        "--model",
        "chars",
        "--rank",
        "0",
        "--world",
        "1",
        "--steps",
        "24",
        "--lr",
        "0.01",
        "--batch",
        "4",
        "--eval-every",
        "8",
        "--log",
        str(log),
        "--master",
        f"127.0.0.1:{_free_port()}",
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return log


@pytest.fixture(scope="module")
def logged(wan, tmp_path_factory):
    """A curve a real node logged, and the same run told to stop at its loss after 16 steps."""
    tmp = tmp_path_factory.mktemp("wan")
    curve, done = wan.wan_curves.read_curve(_train(tmp, "full"))
    by_step = {p.step: p for p in curve}
    target = by_step[16].loss + (by_step[8].loss - by_step[16].loss) / 4  # between the losses at 8 and 16
    stopped = wan.wan_curves.read_curve(_train(tmp, "stopped", f"--target={target!r}"))
    return curve, done, target, stopped


def test_a_logged_curve_has_every_evaluation_on_the_training_clock(logged):
    curve, done, _, _ = logged
    assert [p.step for p in curve] == [0, 8, 16, 24]
    assert all(math.isfinite(p.loss) for p in curve)
    assert curve[-1].loss < curve[0].loss - 0.5  # it trained (from about ln(vocab) = 4.6)
    seconds = [p.seconds for p in curve]
    assert seconds == sorted(seconds) and seconds[0] < seconds[1]
    assert done["steps"] == 24 and done["params"] > 400_000
    assert done["t"] >= curve[-1].seconds  # the clock leaves evaluations out, and runs on to the end


def test_time_to_loss_is_the_first_evaluation_at_or_below_the_target(wan, logged):
    curves = wan.wan_curves
    curve, _, target, _ = logged
    final = curves.final_loss(curve)
    hit = curves.time_to_loss(curve, final)
    assert hit.loss <= final and all(p.loss > final for p in curve if p.step < hit.step)
    assert curves.time_to_loss(curve, target).step == 16
    assert curves.time_to_loss(curve, curve[0].loss) == curve[0]
    assert curves.time_to_loss(curve, min(p.loss for p in curve) - 1e-3) is None
    with pytest.raises(ValueError, match="NaN"):
        curves.time_to_loss(curve, float("nan"))
    with pytest.raises(ValueError, match="empty"):
        curves.final_loss([])


def test_speedup_is_the_ratio_of_times_to_the_target(wan, logged):
    curves = wan.wan_curves
    curve, _, target, _ = logged
    at16, at24 = curves.time_to_loss(curve, target), curve[-1]
    assert curves.speedup(at24, at16) == pytest.approx(at24.seconds / at16.seconds)
    assert curves.speedup(at24, at16) > 1.0
    assert curves.speedup(None, at16) is None and curves.speedup(at24, None) is None
    with pytest.raises(ValueError, match="started there"):
        curves.speedup(at24, curve[0])  # a target above the initial loss measures nothing


def test_a_node_stops_at_its_first_evaluation_at_or_below_the_target(logged):
    curve, _, target, (stopped, done) = logged
    assert [p.step for p in stopped] == [0, 8, 16]
    assert stopped[-1].loss <= target < stopped[-2].loss
    assert done["steps"] == 16
    # Same seeds, same batches, one thread: the stopped run is the full one's beginning.
    assert [p.loss for p in stopped] == pytest.approx([p.loss for p in curve[:3]], rel=1e-5)


def test_command_line_errors(wan, tmp_path):
    with pytest.raises(SystemExit) as e:
        wan.main(["--models", "chars", "chars10m", "--steps", "10", "--log-dir", str(tmp_path)])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        wan.main(["--links", "10gbit", "--log-dir", str(tmp_path)])
    assert e.value.code == 2


def test_without_root_it_says_so_plainly(wan, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(wan.wan_net.NeedsRoot, match="needs root"):
        wan.wan_net.check_root()
    assert wan.main(["--quick", "--log-dir", str(tmp_path), "--out", str(tmp_path / "wan.md")]) == 2
    assert "needs root" in capsys.readouterr().err
    assert not (tmp_path / "wan.md").exists()


def _can_build_namespaces(wan_net) -> bool:
    try:
        wan_net.check_root()
    except wan_net.NeedsRoot:
        return False
    return True


def test_the_emulated_link_has_its_delay_and_rate(wan, tmp_path):
    """Host to host over a 100 Mbit/s, 25 ms link: a round trip takes about 50 ms, 8 MB about 0.7 s."""
    wan_net = wan.wan_net
    if not _can_build_namespaces(wan_net):
        pytest.skip("needs root and network namespaces")
    sink = (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('0.0.0.0', 5001)); s.listen(); c, _ = s.accept(); c.sendall(c.recv(1))\n"
        "while c.recv(1 << 20): pass\n"
        "c.sendall(b'k')\n"
    )
    source = (
        "import socket, time, json\n"
        "deadline = time.monotonic() + 30\n"
        "while True:  # until the receiver listens\n"
        "    try:\n"
        f"        c = socket.create_connection(('{wan_net.host_ip(1)}', 5001), timeout=30); break\n"
        "    except ConnectionRefusedError:\n"
        "        if time.monotonic() > deadline: raise\n"
        "        time.sleep(0.05)\n"
        "t = time.perf_counter(); c.sendall(b'x'); c.recv(1); rtt = time.perf_counter() - t\n"
        "t = time.perf_counter(); c.sendall(bytes(8 << 20)); c.shutdown(socket.SHUT_WR); c.recv(1)\n"
        "print(json.dumps({'rtt': rtt, 'seconds': time.perf_counter() - t}))\n"
    )
    link = wan_net.Link("test", 100.0, 25.0)
    net = wan_net.Wan(2, link, tmp_path, prefix=f"gwwt{os.getpid()}")
    try:
        net.__enter__()
    except subprocess.CalledProcessError as e:  # root, but a kernel without HTB or TUN
        pytest.skip(f"cannot build the emulated network here: {e.stderr.strip()}")
    try:
        receiver = net.run_in(1, [sys.executable, "-c", sink])
        sender = net.run_in(0, [sys.executable, "-c", source], stdout=subprocess.PIPE, text=True)
        out, _ = sender.communicate(timeout=60)
        receiver.wait(timeout=30)
    finally:
        net.__exit__(None, None, None)
    measured = json.loads(out)
    assert 0.048 <= measured["rtt"] <= 0.15, measured
    floor = 8 * 8 * 1.048576 / 100  # 8 MiB at 100 Mbit/s: 0.67 s
    assert floor * 0.95 <= measured["seconds"] <= floor * 4, measured
    report = net.delay_report()
    assert report["packets"] > 900 and report["delay_ms"] == 25.0
    assert report["mean_late_ms"] < 10.0
    assert not any(
        line.startswith(f"gwwt{os.getpid()}-")
        for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    )
