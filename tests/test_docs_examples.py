"""Every code block in the docs (docs/**/*.md, README.md, server/README.md) runs as written, or says why not.

A block's info string says what it is:

- ``python``: run here, in a fresh namespace (a real server on loopback where it talks to one). The docs
  write the server's default address (``127.0.0.1:8470`` / ``localhost:8470``); this test points it at
  its own server and sets ``GRADWIRE_ADMIN_TOKEN`` to that server's admin token.
  ``python given=<fixture>[,<fixture>]`` starts from the names a fixture of :data:`GIVEN` defines (a model
  with gradients, a one-rank gloo group, a registered node): what a reader has at hand at that point.
  ``python signature``: call signatures, each compared with the real one (``inspect.signature``).
  ``python excerpt=<file>``: the short form of a complete script: every line of the block is a line of the
  file, in order (:func:`test_an_excerpt_is_the_lines_of_its_file`); the file itself is run by a test that
  names it, and the block is run here only if it also says ``given=``.
- ``sh``: run here with bash, against the same server, where it is cheap.
- ``json``: parsed; ``json RunConfig`` must be a config the server takes, naming every field of it;
  ``json status`` must name every field of a real run status.
- ``text``: output, diagrams, grammars: not code.
- ``<language> no-run``: not run; the block's first line is a comment saying why, or the flag says it
  (``no-run=minutes-each``), so a reader's first block need not talk about this test. A shell block's
  scripts and make targets must still exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gradwire.client import GradwireClient
from live_server import LiveServer

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md", ROOT / "server" / "README.md"]
#: Where the docs say the server is (its default address).
DOCS_ADDRESSES = ("http://127.0.0.1:8470", "http://localhost:8470", "localhost:8470")
COMMENT = re.compile(r"^\s*(#|//|--|;|<!--|/\*)")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    language: str
    flags: tuple[str, ...]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def flag(self, name: str) -> str | None:
        """The value of ``name=value`` in the info string (``""`` for a bare ``name``), else None."""
        for f in self.flags:
            key, _, value = f.partition("=")
            if key == name:
                return value
        return None


def code_blocks(path: Path) -> Iterator[Block]:
    """The fenced code blocks of a Markdown file (``` or ~~~, indented or not)."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        start = i
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^\s*{fence[0]}{{{len(fence)},}}\s*$", lines[i]):
            line = lines[i]
            body.append(line[indent:] if not indent or line[:indent].isspace() else line.lstrip())
            i += 1
        words = info.split()
        yield Block(path, start + 1, words[0] if words else "", tuple(words[1:]), "\n".join(body) + "\n")
        i += 1


BLOCKS = [b for path in DOCS for b in code_blocks(path)]
KNOWN = {"python", "sh", "json", "text"}


def _of(language: str, *, running: bool) -> list[Block]:
    """The blocks of ``language`` this test runs (``running``) or does not: ``no-run``, or an excerpt whose file
    another test runs."""
    return [b for b in BLOCKS if b.language == language and _runs(b) == running]


def _runs(block: Block) -> bool:
    if block.flag("no-run") is not None:
        return False
    return block.flag("excerpt") is None or block.flag("given") is not None


def test_every_block_says_what_it_is():
    unmarked = [b.id for b in BLOCKS if not b.language]
    assert not unmarked, (
        f"code blocks without an info string: {unmarked}; give each one: python or sh (run by "
        f"{Path(__file__).name}), json, text (output, diagrams), or '<language> no-run' with a "
        f"first-line comment saying why"
    )
    unknown = [f"{b.id} ({b.language})" for b in BLOCKS if b.language not in KNOWN and "no-run" not in b.flags]
    assert not unknown, f"blocks in a language this test cannot run, not marked no-run: {unknown}"
    silent = [
        b.id
        for b in BLOCKS
        if b.flag("no-run") == "" and not COMMENT.match(b.code.splitlines()[0] if b.code.strip() else "")
    ]
    assert not silent, f"no-run blocks whose first line is not a comment saying why: {silent}"
    assert len(_of("python", running=True)) >= 5  # the harness found the examples


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.flag("excerpt") is not None], ids=lambda b: b.id)
def test_an_excerpt_is_the_lines_of_its_file(block):
    """A short form shows lines of the complete script, in order (blank lines aside), so the two cannot
    drift; and a test runs that script (it names the file)."""
    path = ROOT / block.flag("excerpt")
    assert path.is_file(), f"{block.id}: {path} does not exist"
    lines = [line.strip() for line in path.read_text().splitlines()]
    at = 0
    for line in filter(None, (line.strip() for line in block.code.splitlines())):
        assert line in lines[at:], f"{block.id}: {line!r} is not a line of {path.name} after line {at}"
        at = lines.index(line, at) + 1
    runners = [
        t for t in (ROOT / "tests").glob("test_*.py") if path.name in t.read_text() and t.name != Path(__file__).name
    ]
    assert runners, f"{block.id}: no test runs {path.name}"


# ---------------------------------------------------------------------------------------------
# What a reader has at hand where a block begins (``given=``)


def _small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


@contextlib.contextmanager
def given_model(ctx) -> Iterator[dict]:
    """``model`` (a small MLP) with a gradient in every parameter, ``data``/``loader`` (two batches of
    ``(x, y)``), ``loss_fn`` (cross-entropy), ``step`` and ``node_id``."""
    model = _small_model()
    x, y = _batches(1)[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    yield dict(
        model=model, data=_batches(), loader=_batches(), loss_fn=torch.nn.functional.cross_entropy, step=0, node_id=1
    )


@contextlib.contextmanager
def given_gloo(ctx) -> Iterator[dict]:
    """A one-rank gloo group in this process and what :func:`given_model` gives, ``net`` the same model."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", init_method=f"file://{ctx.tmp_path}/pg", rank=0, world_size=1)
    try:
        with given_model(ctx) as names:
            yield {**names, "net": names["model"]}
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def given_ddp(ctx) -> Iterator[dict]:
    """:func:`given_gloo`, with ``model`` and ``ddp_model`` the model wrapped in DDP (no hook yet)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with given_gloo(ctx) as names:
        ddp = DDP(_small_model())
        yield {**names, "model": ddp, "ddp_model": ddp}


@contextlib.contextmanager
def given_node(ctx) -> Iterator[dict]:
    """:func:`given_model`, and a run on the test's server holding that model (AdamW, the uplink the README
    names, quorum 1) with one registered node: ``run_id``, ``node_id``, ``token``."""
    with given_model(ctx) as names, GradwireClient(ctx.server.url, ctx.server.admin_token) as admin:
        run_id = admin.create_run(
            {"quorum": 1, "uplink": {"codec": "dct", "params": {"chunk_shape": [64, 64], "topk": 32}}}
        )
        admin.put_state(run_id, names["model"].state_dict())
        node_id, token = admin.register_node(run_id, "docs")
        yield {**names, "run_id": run_id, "node_id": node_id, "token": token}


GIVEN: dict[str, Callable] = {"model": given_model, "gloo": given_gloo, "ddp": given_ddp, "node": given_node}


# ---------------------------------------------------------------------------------------------
# Running them


@dataclasses.dataclass
class Context:
    server: LiveServer
    tmp_path: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = LiveServer(tmp_path_factory.mktemp("docs-server"))
    yield live
    live.close()


def _at(server: LiveServer, code: str) -> str:
    for address in DOCS_ADDRESSES:
        scheme = "http://" if address.startswith("http://") else ""
        code = code.replace(address, scheme + server.url.removeprefix("http://"))
    return code


def _needs_server(block: Block) -> bool:
    return "node" in (block.flag("given") or "").split(",") or any(a in block.code for a in DOCS_ADDRESSES)


@pytest.mark.parametrize("block", _of("python", running=True), ids=lambda b: b.id)
def test_python_block_runs(block, request, tmp_path, monkeypatch):
    if block.flag("signature") is not None:
        _check_signatures(block)
        return
    server = request.getfixturevalue("server") if _needs_server(block) else None
    monkeypatch.chdir(tmp_path)
    if server is not None:
        monkeypatch.setenv("GRADWIRE_ADMIN_TOKEN", server.admin_token)
    code = _at(server, block.code) if server is not None else block.code
    ctx = Context(server, tmp_path)
    with contextlib.ExitStack() as stack:
        namespace: dict = {"__name__": "__docs_example__"}
        for name in filter(None, (block.flag("given") or "").split(",")):
            assert name in GIVEN, f"{block.id}: unknown given={name}; known: {', '.join(GIVEN)}"
            namespace.update(stack.enter_context(GIVEN[name](ctx)))
        exec(compile(code, block.id, "exec"), namespace)


def _check_signatures(block: Block) -> None:
    """Each ``dotted.name(params)`` of the block (continued on indented lines) is the real signature."""
    import importlib

    entries: list[str] = []
    for line in block.code.splitlines():
        if line.strip():
            if line[0].isspace() and entries:
                entries[-1] += " " + line.strip()
            else:
                entries.append(line.strip())
    assert entries, f"{block.id}: no signatures"
    for entry in entries:
        m = re.fullmatch(r"([\w.]+)(\(.*\))", entry)
        assert m, f"{block.id}: {entry!r} is not name(parameters)"
        dotted, params = m.groups()
        module_name, _, attr = dotted.rpartition(".")
        real = inspect.signature(getattr(importlib.import_module(module_name), attr))
        real = real.replace(
            parameters=[p.replace(annotation=inspect.Parameter.empty) for p in real.parameters.values()],
            return_annotation=inspect.Signature.empty,
        )  # the docs leave the types out
        documented = inspect.signature(_function_from(params))
        assert str(documented) == str(real), f"{block.id}: {dotted}{documented}\n  but the code says {dotted}{real}"


def _function_from(params: str):
    namespace: dict = {}
    exec(f"def documented{params}: pass", namespace)
    return namespace["documented"]


# ---------------------------------------------------------------------------------------------
# Shell blocks


def _commands(block: Block) -> list[list[str]]:
    """The block's commands as words (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", block.code)
    out = []
    for line in joined.splitlines():
        with contextlib.suppress(ValueError):
            words = shlex.split(line, comments=True)
            if words:
                out.append(words)
    return out


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "sh"], ids=lambda b: b.id)
def test_shell_block_names_what_exists(block):
    """Run or not, what a shell block calls exists: the scripts it runs and the make targets."""
    targets = _make_targets()
    for words in _commands(block):
        for w in words:
            if re.fullmatch(r"[\w./-]+\.py", w) and "/" in w and not w.startswith("/"):
                assert (ROOT / w).is_file(), f"{block.id}: {w} does not exist"
        if words[0] == "make":
            missing = [t for t in words[1:] if not t.startswith("-") and "=" not in t and t not in targets]
            assert not missing, f"{block.id}: make targets {missing} are not in the Makefile"


@pytest.mark.parametrize("block", _of("sh", running=True), ids=lambda b: b.id)
def test_shell_block_runs(block, server, tmp_path):
    """A runnable shell block, with bash -e, against the test's server, given what :func:`_shell_setup`
    makes."""
    missing = sorted({words[0] for words in _commands(block) if not shutil.which(words[0])})
    if missing:
        pytest.skip(f"{block.id} needs {', '.join(missing)}, not installed here")
    env = {**os.environ, "ADMIN": server.admin_token, "GRADWIRE_ADMIN_TOKEN": server.admin_token}
    setup = _shell_setup(block, server, tmp_path)
    env.update(setup)
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _at(server, block.code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"{block.id}:\n{proc.stdout}\n{proc.stderr}"


def _shell_setup(block: Block, server: LiveServer, tmp_path: Path) -> dict[str, str]:
    """What the API's curl example assumes: ``$ADMIN`` (the admin token), ``$RUN`` (a run with its state),
    ``$NODE`` (a node's token) and ``update.gwf`` (that node's frame for round 0)."""
    import gradwire

    model = _small_model()
    with GradwireClient(server.url, server.admin_token) as admin:
        run_id = admin.create_run({"quorum": 1})
        admin.put_state(run_id, model.state_dict())
        node_id, token = admin.register_node(run_id, "curl")
    x, y = _batches(1)[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    frame = gradwire.ErrorFeedback(gradwire.DCTCodec()).encode_bundle(grads, round=0, sender=node_id)
    (tmp_path / "update.gwf").write_bytes(frame)
    return {"RUN": run_id, "NODE": token}


# ---------------------------------------------------------------------------------------------
# JSON blocks


@pytest.mark.parametrize("block", _of("json", running=True), ids=lambda b: b.id)
def test_json_block_is_what_the_server_says(block, request):
    doc = json.loads(block.code)
    if block.flag("RunConfig") is not None:
        from gradwire_server.config import RunConfig

        RunConfig.model_validate(doc)  # a config the server takes
        assert set(doc) == set(RunConfig.model_fields), f"{block.id}: documents {sorted(doc)}"
    if block.flag("status") is not None:
        server = request.getfixturevalue("server")
        with GradwireClient(server.url, server.admin_token) as admin:
            status = admin.status(admin.create_run({}))
        assert set(doc) == set(status), f"{block.id}: documents {sorted(doc)}, a run status has {sorted(status)}"
