"""The install step's torch (scripts/install_torch.py): a machine without a GPU gets torch's CPU build from
torch's index; an unreachable index falls back to PyPI in one line that says what that costs; a torch already
there is kept (the system's is never reinstalled); GRADWIRE_TORCH forces either build. Decided and printed,
never downloaded: the CLI runs with --dry-run against a real index page on loopback, or a closed port."""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "install_torch.py"
spec = importlib.util.spec_from_file_location("install_torch", SCRIPT)
install_torch = sys.modules["install_torch"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_torch)

CUDA = install_torch.Torch("2.15.0+cu132", "13.2", "/usr/lib/python3/site-packages/torch/__init__.py")
CPU = install_torch.Torch("2.15.0+cpu", None, "/venv/site-packages/torch/__init__.py")


def reachable(index):
    return None


def unreachable(index):
    return "[Errno -2] Name or service not known"


@pytest.mark.parametrize(
    "choice, present, gpu, reach, source",
    [
        ("auto", None, False, reachable, "cpu-index"),  # a CPU machine: the CPU build
        ("auto", None, False, unreachable, "pypi"),  # ... unless torch's index is out of reach
        ("auto", None, True, reachable, "pypi"),  # a GPU: PyPI's CUDA build
        ("auto", CUDA, False, reachable, None),  # a torch present is kept, whichever build
        ("auto", CPU, True, reachable, None),
        ("cpu", CUDA, True, reachable, "cpu-index"),  # forced: the CPU build into .venv over the system's
        ("cpu", CUDA, False, unreachable, None),  # ... out of reach: the present one kept, not 5.7 GB more
        ("cpu", CPU, False, reachable, None),
        ("cpu", None, True, unreachable, "pypi"),
        ("cuda", None, False, reachable, "pypi"),
        ("cuda", CPU, False, reachable, "pypi"),
        ("cuda", CUDA, False, reachable, None),
        ("keep", None, False, reachable, None),
        ("keep", CPU, True, unreachable, None),
    ],
)
def test_the_decision(choice, present, gpu, reach, source):
    plan = install_torch.decide(choice, present, gpu, reach)
    assert plan.source == source, plan
    assert len(plan.lines) == 1


def test_the_fallback_says_so_in_one_line_with_its_cost():
    (line,) = install_torch.decide("auto", None, False, unreachable).lines
    assert "torch's CPU index https://download.pytorch.org/whl/cpu cannot be reached" in line
    assert "installing torch from PyPI instead" in line and "Name or service not known" in line
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert "about 5.7 GB" in line


def test_an_unknown_choice_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"GRADWIRE_TORCH='gpu': choose one of auto, cpu, cuda, keep"):
        install_torch.decide("gpu", None, False, reachable)


@contextlib.contextmanager
def _index(tmp_path: Path):
    """A PEP 503 page for torch on loopback, as torch's index serves one."""
    page = tmp_path / "site" / "whl" / "cpu" / "torch"
    page.mkdir(parents=True)
    (page / "index.html").write_text('<a href="torch-2.15.0+cpu-cp311-none-linux_x86_64.whl">torch</a>\n')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(tmp_path / "site"), **kw)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    finally:
        server.shutdown()
        server.server_close()


def _dry_run(tmp_path: Path, index: str, choice: str = "auto") -> subprocess.CompletedProcess:
    """The script for a fresh environment with no torch (a bare venv) on this machine (no nvidia-smi)."""
    bare = tmp_path / "bare"
    if not bare.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    env = {**os.environ, "GRADWIRE_TORCH": choice, "GRADWIRE_TORCH_INDEX": index}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--python", str(bare / "bin" / "python")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_a_machine_without_a_gpu_gets_the_cpu_build_from_the_index(tmp_path):
    with _index(tmp_path) as index:
        done = _dry_run(tmp_path, index)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"torch: no GPU here (no nvidia-smi listing one): torch's CPU build from {index} (about 200 MB)" in lines
    assert lines[-1].endswith(f"-m pip install --progress-bar on torch --index-url {index}")


def test_an_unreachable_index_falls_back_to_pypi_in_one_line(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        index = f"http://127.0.0.1:{s.getsockname()[1]}/whl/cpu"
    done = _dry_run(tmp_path, index, choice="cpu")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if "cannot be reached" in line]
    assert len(said) == 1 and "GRADWIRE_TORCH=cpu, but torch's CPU index" in said[0], done.stdout
    assert "installing torch from PyPI instead" in said[0]
    assert done.stdout.splitlines()[-1].endswith("-m pip install --progress-bar on torch")
