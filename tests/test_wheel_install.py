"""The wheel `make wheel` builds installs into a fresh virtual environment, with no Rust toolchain on PATH,
and works there: the package imports from that environment and round-trips a frame through the native
module. torch and numpy come from the environment running the tests (a .pth file), as a system torch
would; gradwire itself only from the wheel."""

from __future__ import annotations

import os
import shutil
import site as site_module
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: `make wheel`'s (this machine's glibc) and, when `make release` ran, the manylinux2014 one.
WHEELS = sorted((ROOT / "dist").glob("gradwire-*.whl")) + sorted((ROOT / "dist" / "release").glob("gradwire-*.whl"))

ROUND_TRIP = """
import gradwire, torch
from gradwire.frame import read_frame
t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
frame = gradwire.IdentityCodec().encode_bundle({"w": t}, round=7, sender=2)
f = read_frame(frame)
assert (f.round, f.sender) == (7, 2)
assert torch.equal(gradwire.decode_bundle(frame)["w"], t)
print(gradwire.__file__)
"""


@pytest.mark.skipif(not WHEELS, reason="no wheel in dist/: `make test` builds one first (make wheel)")
@pytest.mark.parametrize("wheel", WHEELS or [None], ids=lambda w: w.name if w else "none")
def test_the_wheel_installs_and_round_trips_a_frame_in_a_fresh_venv(tmp_path, wheel):
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    no_rust = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CARGO_HOME", "RUSTUP_HOME")}
    no_rust["PATH"] = os.pathsep.join(
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if p and not (Path(p) / "cargo").exists() and not (Path(p) / "rustc").exists()
    )
    assert shutil.which("cargo", path=no_rust["PATH"]) is None
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        env=no_rust,
        timeout=300,
    )
    # Then the dependencies (torch is GBs) from this environment, after the fresh one's own site-packages
    # (written after the install, so pip finds no gradwire but the wheel's).
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    deps = list(dict.fromkeys([*site_module.getsitepackages(), sysconfig.get_paths()["purelib"]]))
    (site / "zz_test_deps.pth").write_text("\n".join(deps) + "\n")
    out = subprocess.run(
        [str(py), "-c", ROUND_TRIP], capture_output=True, text=True, env=no_rust, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site)), out.stdout  # gradwire came from the wheel, not a checkout
