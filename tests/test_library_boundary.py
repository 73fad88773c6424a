"""The library is a library: importing gradwire brings nothing of the applications or the server, and
the installed distribution's metadata names their dependencies only under an extra. (That no library
module so much as names them is tests/test_import_graph.py's, with every other import rule.)"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys

#: Import names that belong to the applications (gradwire_apps, the apps extra) or to the server.
APP_MODULES = (
    "typer",
    "rich",
    "tqdm",
    "sklearn",
    "matplotlib",
    "fastapi",
    "uvicorn",
    "starlette",
    "gradwire_server",
    "gradwire_apps",
)
#: The same, as distribution names in the metadata.
APP_DISTRIBUTIONS = (
    "typer",
    "rich",
    "tqdm",
    "scikit-learn",
    "matplotlib",
    "fastapi",
    "uvicorn",
    "starlette",
    "gradwire-server",
)


def _modules_after(imports: str, blocked=()) -> list[str]:
    """Which of APP_MODULES a fresh interpreter has loaded after ``imports`` (``blocked`` cannot import)."""
    block = "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    code = (
        f"import json, sys\n{block}{imports}\n"
        f"print(json.dumps(sorted(m for m in {list(APP_MODULES)!r} if sys.modules.get(m) is not None)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_library_imports_nothing_of_the_apps_or_the_server():
    # The library's own dependencies may load some of these when they are installed (torch.hub loads
    # tqdm, httpx loads rich for its command line): that much is theirs, not gradwire's.
    theirs = set(_modules_after("import numpy, torch, safetensors.torch, httpx"))
    loaded = set(_modules_after("import gradwire, gradwire.client, gradwire.torch"))
    assert loaded <= theirs, sorted(loaded - theirs)
    assert not loaded & {"gradwire_apps", "gradwire_server", "typer", "sklearn", "matplotlib", "fastapi", "uvicorn"}


def test_the_library_imports_without_any_of_the_apps_dependencies():
    # As after `pip install gradwire` with no extra: none of them can be imported at all.
    assert _modules_after("import gradwire, gradwire.client, gradwire.torch", blocked=APP_MODULES) == []


def _name(requirement: str) -> str:
    return re.split(r"[\s;\[<>=!~(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_installed_metadata_requires_the_apps_dependencies_only_under_an_extra():
    requires = importlib.metadata.requires("gradwire") or []
    hard = [_name(r) for r in requires if "extra ==" not in r.replace('"', "'").replace("extra==", "extra ==")]
    assert sorted(hard) == ["blake3", "httpx", "numpy", "safetensors", "torch"], requires
    apps = [_name(r) for r in requires if re.search(r"""extra\s*==\s*['"]apps['"]""", r)]
    for dist in ("typer", "rich", "tqdm", "scikit-learn", "matplotlib", "gradwire-server"):
        assert dist in apps, requires
    assert not set(hard) & set(APP_DISTRIBUTIONS)
