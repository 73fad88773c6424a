"""Which torch the install step puts into .venv, and from where: the README's `make demo` and `make test` run this
before the dependencies.

    python scripts/install_torch.py [--python .venv/bin/python] [--dry-run]

PyPI's torch for Linux x86-64 is the CUDA build: about 5.7 GB with its nvidia-* and triton wheels, useless on a
machine without a GPU. So, by ``GRADWIRE_TORCH``:

- ``auto`` (the default): a torch the environment already has (the system Python's, which .venv reuses) is
  kept, whichever build it is: nothing is downloaded and the system's torch is never touched. Without one, a
  machine with a GPU (``nvidia-smi -L`` lists one) gets PyPI's CUDA build and a machine without gets torch's
  CPU build from torch's own index (``GRADWIRE_TORCH_INDEX``, default https://download.pytorch.org/whl/cpu).
- ``cpu``: the CPU build, from that index, into .venv (a CUDA build the system Python has is left there and
  shadowed); kept if the torch present is a CPU build already.
- ``cuda``: PyPI's CUDA build into .venv; kept if the torch present is a CUDA build already.
- ``keep``: whatever torch there is, or none (pip then takes PyPI's with gradwire's dependencies).

Where torch's index cannot be reached (no route, DNS, a proxy), it says so in one line, with what the fallback
costs, and installs from PyPI instead — unless a torch is there already, which is then kept. The downloads
show pip's own progress (a line per file, a bar on a terminal); a failed install is retried
``PIP_TRIES`` times (default 3: PyPI's CDN sometimes cuts a large wheel short, and pip resumes cut downloads
``PIP_RESUME_RETRIES`` times, which the Makefile sets).

``--dry-run`` prints the decision and the pip command without running it (tests/test_install_torch.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CHOICES = ("auto", "cpu", "cuda", "keep")
#: What PyPI's torch weighs on Linux x86-64 (the CUDA build and the wheels it pulls), and the CPU build.
CUDA_BUILD_COST = "the CUDA build, about 5.7 GB with its nvidia-* and triton wheels (3.0 GB nvidia-*, 1.0 GB triton)"
CPU_BUILD_COST = "about 200 MB"


@dataclasses.dataclass(frozen=True)
class Torch:
    """The torch an interpreter imports: its version and the CUDA version it was built for (None: CPU build)."""

    version: str
    cuda: str | None
    where: str

    @property
    def build(self) -> str:
        return f"CUDA {self.cuda} build" if self.cuda else "CPU build"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do: ``source`` is None (keep what there is), ``"cpu-index"`` or ``"pypi"``; ``lines`` say why."""

    source: str | None
    lines: tuple[str, ...]


def has_gpu() -> bool:
    """Whether ``nvidia-smi`` is on PATH and lists a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def probe_torch(python: str) -> Torch | None:
    """The torch ``python`` imports, or None."""
    code = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, torch.__file__]))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    version, cuda, where = json.loads(out.stdout.strip().splitlines()[-1])
    return Torch(version, cuda, where)


def index_reachable(index: str, timeout_s: float = 10.0) -> str | None:
    """None when the index's torch page answers, else why not (one line)."""
    url = index.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return " ".join(str(reason).split()) or type(exc).__name__


def pypi_cost() -> str:
    """What torch from PyPI costs on this platform."""
    if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
        return CUDA_BUILD_COST
    return "the build PyPI has for this platform"


def decide(choice: str, present: Torch | None, gpu: bool, reach, index: str = CPU_INDEX) -> Plan:
    """The plan for ``choice`` given the torch ``present``, whether there is a ``gpu``, and ``reach(index)``
    (None when torch's index answers, else why not). Pure but for calling ``reach``: tested on its own."""
    if choice not in CHOICES:
        raise ValueError(f"GRADWIRE_TORCH={choice!r}: choose one of {', '.join(CHOICES)}")
    if present is not None:
        kept = f"torch {present.version} ({present.build}, {present.where}) is installed"
        if choice in ("auto", "keep") or (choice == "cpu") == (present.cuda is None):
            why = {"auto": "kept (GRADWIRE_TORCH=cpu or cuda installs another build into .venv)"}
            return Plan(None, (f"{kept}: {why.get(choice, 'kept')}",))
    elif choice == "keep":
        return Plan(None, ("no torch installed: pip installs PyPI's with gradwire's dependencies",))
    wants_cpu = choice == "cpu" or (choice == "auto" and not gpu)
    if not wants_cpu:
        said = "GRADWIRE_TORCH=cuda" if choice == "cuda" else "a GPU (nvidia-smi lists one)"
        return Plan("pypi", (f"{said}: torch's CUDA build from PyPI ({pypi_cost()})",))
    said = "GRADWIRE_TORCH=cpu" if choice == "cpu" else "no GPU here (no nvidia-smi listing one)"
    failure = reach(index)
    if failure is None:
        return Plan("cpu-index", (f"{said}: torch's CPU build from {index} ({CPU_BUILD_COST})",))
    unreachable = f"torch's CPU index {index} cannot be reached ({failure})"
    if present is not None:
        return Plan(None, (f"{said}, but {unreachable}: torch {present.version} ({present.build}) kept",))
    return Plan(
        "pypi",
        (
            f"{said}, but {unreachable}: installing torch from PyPI instead, {pypi_cost()} "
            f"(GRADWIRE_TORCH_INDEX can name a mirror of the CPU index)",
        ),
    )


def pip_command(python: str, source: str, index: str) -> list[str]:
    cmd = [python, "-m", "pip", "install", "--progress-bar", "on", "torch"]
    return cmd + (["--index-url", index] if source == "cpu-index" else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="the interpreter to install into (default: this one)")
    ap.add_argument("--dry-run", action="store_true", help="print the decision and the pip command only")
    args = ap.parse_args(argv)
    choice = os.environ.get("GRADWIRE_TORCH", "auto").strip().lower() or "auto"
    index = os.environ.get("GRADWIRE_TORCH_INDEX", CPU_INDEX).strip() or CPU_INDEX
    print(f"torch: checking what {args.python} has (GRADWIRE_TORCH={choice})", flush=True)
    try:
        plan = decide(choice, probe_torch(args.python), has_gpu(), index_reachable, index)
    except ValueError as exc:
        print(f"torch: {exc}", file=sys.stderr)
        return 2
    for line in plan.lines:
        print(f"torch: {line}", flush=True)
    if plan.source is None:
        return 0
    cmd = pip_command(args.python, plan.source, index)
    print(f"torch: {' '.join(cmd)}", flush=True)
    if args.dry_run:
        return 0
    tries = max(1, int(os.environ.get("PIP_TRIES", "3")))
    for attempt in range(1, tries + 1):
        if subprocess.run(cmd).returncode == 0:
            return 0
        print(f"torch: pip install failed (try {attempt} of {tries}){'; retrying' if attempt < tries else ''}")
        if attempt < tries:
            time.sleep(10)
    return 1


if __name__ == "__main__":
    sys.exit(main())
