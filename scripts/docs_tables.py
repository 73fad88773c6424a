"""`make docs-tables`: the README's and the tutorial's printed outputs, rewritten from a run of today's code.

    .venv/bin/python scripts/docs_tables.py [--only demo,torchrun,server]

Each output sits in its document between two markers, and only there::

    <!-- docs-tables:demo torch=2.15.0+cu132 date=2026-12-01 -->
    ```text
    ...what the command printed...
    ```
    <!-- /docs-tables:demo -->

- ``demo``: ``gradwire demo`` with its defaults (what `make demo` runs; seed 0), its table: in README.md and
  docs/tutorial.md. tests/test_readme_demo_table.py runs the same command and fails when a figure but the
  seconds differs.
- ``torchrun``: examples/quickstart_torchrun.py on 2 ranks (``python -m torch.distributed.run``).
- ``server``: examples/quickstart_server.py against a ``gradwire serve`` it starts on a free port, the admin
  token read from the data directory the server wrote it to. Both in docs/tutorial.md; tests/test_quickstarts.py
  runs them and compares.

Every command runs on torch's portable CPU kernels (:mod:`gradwire_apps.demo.kernels`; ``gradwire demo`` sets
them itself). That is not enough for the same bits on every machine: measured on 2026-12-02, the same torch
and seed printed SparseLoCo +3.1 % on one x86-64 machine (AVX-512 with AMX) and +9.9 % on another. So the marker
names the torch *and* the processor (:func:`cpu_fingerprint`) the figures were made on, and the tests compare
every figure exactly only on that pair; elsewhere they compare what does not hang on the last bits of a
kernel's rounding (the rows, the lines, the bytes, the nodes in sync). The figures change whenever the code's
numbers do (a new default aggregation rule, a codec): rerun this and commit the documents.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from gradwire_apps.demo.kernels import PORTABLE_KERNELS  # noqa: E402

#: Which documents hold which output.
PLACES = {"demo": ("README.md", "docs/tutorial.md"), "torchrun": ("docs/tutorial.md",), "server": ("docs/tutorial.md",)}
MARKER = re.compile(
    r"(?P<open><!-- docs-tables:(?P<name>[\w-]+)(?P<attrs>[^>]*)-->\n)"
    r"(?P<body>.*?)(?P<close><!-- /docs-tables:(?P=name) -->)",
    re.S,
)


def environment() -> dict[str, str]:
    """This environment with the portable kernels (and one thread each for the example's ranks)."""
    return {**os.environ, **PORTABLE_KERNELS, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def cpu_fingerprint() -> str:
    """The processor the figures were made on: the first 10 hex digits of a SHA-256 of its model name and its
    sorted feature flags (``/proc/cpuinfo``), so two machines of one kind match and any other does not;
    ``unknown`` where there is no ``/proc/cpuinfo``."""
    import hashlib

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", info, re.M)
    key = (model.group(1) if model else "") + "|" + " ".join(sorted((flags.group(1) if flags else "").split()))
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def made_here(attrs: dict[str, str], torch: str) -> bool:
    """Whether a block's figures were made with this torch on this kind of processor (exact comparison)."""
    return attrs.get("torch") == torch and attrs.get("cpu") == cpu_fingerprint()


def torch_version() -> str:
    import importlib.metadata

    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip() or importlib.metadata.version("torch")


def demo_table(stdout: str) -> str:
    """The table `gradwire demo` printed: from its title to the last line of its footnote."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "parameters)" in line and "nodes" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("loss plot:"))
    return "\n".join(line.rstrip() for line in lines[start:end]).strip("\n") + "\n"


def run_demo() -> str:
    with tempfile.TemporaryDirectory(prefix="docs-tables-") as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "gradwire_apps.cli", "demo", "--no-progress", "--out", str(Path(tmp) / "out")],
            capture_output=True,
            text=True,
            env=environment(),
            cwd=tmp,
            timeout=3600,
        )
    if done.returncode != 0:
        raise SystemExit(f"gradwire demo failed:\n{done.stdout}\n{done.stderr}")
    return demo_table(done.stdout)


def run_torchrun() -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "quickstart_torchrun.py"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=environment(), timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"quickstart_torchrun.py failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(workdir: Path, env: dict[str, str]) -> Iterator[str]:
    """``gradwire serve`` on a free loopback port with its data in ``workdir/gradwire-data`` (its admin token
    generated there), until the block ends."""
    port = free_port()
    log = open(workdir / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradwire_apps.cli", "serve", "--port", str(port)],
        cwd=workdir,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/readyz", timeout=2).status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"gradwire serve did not become ready:\n{(workdir / 'serve.log').read_text()}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def run_server_example(workdir: Path | None = None) -> str:
    """examples/quickstart_server.py against a fresh ``gradwire serve``, GRADWIRE_ADMIN_TOKEN unset (the
    example reads the token the server wrote into gradwire-data/admin_token)."""
    env = {k: v for k, v in environment().items() if k != "GRADWIRE_ADMIN_TOKEN"}
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="docs-tables-")))
        with serving(workdir, env) as url:
            done = subprocess.run(
                [sys.executable, str(ROOT / "examples" / "quickstart_server.py")],
                capture_output=True,
                text=True,
                env={**env, "GRADWIRE_URL": url},
                cwd=workdir,
                timeout=900,
            )
    if done.returncode != 0:
        raise SystemExit(f"quickstart_server.py failed:\n{done.stdout}\n{done.stderr}")
    # The run id is random: the one figure of the output that is not the code's.
    return re.sub(r"^run [0-9a-f]+:", "run <id>:", done.stdout, flags=re.M)


RUNNERS = {"demo": run_demo, "torchrun": run_torchrun, "server": run_server_example}


def blocks(text: str) -> dict[str, tuple[dict[str, str], str]]:
    """``{name: (attributes, the fenced block's text)}`` of a document's generated blocks."""
    out = {}
    for m in MARKER.finditer(text):
        attrs = dict(re.findall(r"(\w+)=(\S+)", m["attrs"]))
        body = re.search(r"```text\n(.*?)```", m["body"], re.S)
        out[m["name"]] = (attrs, body.group(1) if body else "")
    return out


def rewrite(text: str, name: str, output: str, torch: str, date: str, load: str = "", cpu: str = "") -> str:
    """``text`` with the block ``name`` holding ``output``; ``ValueError`` if it has no such block."""
    found = False

    def replace(m: re.Match) -> str:
        nonlocal found
        if m["name"] != name:
            return m[0]
        found = True
        said = f" cpu={cpu}" if cpu else ""
        said += f" load={load}" if load else ""  # the machine's load average as the run began: the seconds are its
        return f"<!-- docs-tables:{name} torch={torch} date={date}{said} -->\n```text\n{output}```\n{m['close']}"

    new = MARKER.sub(replace, text)
    if not found:
        raise ValueError(f"no docs-tables:{name} block")
    return new


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", default=",".join(RUNNERS), help=f"which outputs, comma-separated, of {', '.join(RUNNERS)}"
    )
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        ap.error(f"unknown output {unknown}: choose from {', '.join(RUNNERS)}")
    torch, date = torch_version(), datetime.date.today().isoformat()
    for name in names:
        started = time.monotonic()
        print(f"docs-tables: running {name} ...", flush=True)
        load = f"{os.getloadavg()[0]:.1f}"
        output = RUNNERS[name]()
        for doc in PLACES[name]:
            path = ROOT / doc
            path.write_text(rewrite(path.read_text(), name, output, torch, date, load, cpu_fingerprint()))
        print(f"docs-tables: {name} written to {', '.join(PLACES[name])} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
