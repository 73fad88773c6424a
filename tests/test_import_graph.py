"""The import graph of docs/ARCHITECTURE.md: no cycles, and the library never imports the apps or the server.

Every ``import`` statement counts, also those inside functions (a lazy import that closes a cycle is
still a cycle: it only moves the failure to the first call). Edges are taken as written: ``from . import
wire`` is an edge to ``gradwire.wire`` when that is a module, ``from ..frame import Entry`` one to
``gradwire.frame``, ``import gradwire`` one to the package itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {
    "gradwire": REPO / "python" / "gradwire",
    "gradwire_apps": REPO / "python" / "gradwire_apps",
    "gradwire_server": REPO / "server" / "gradwire_server",
}
LIBRARY = "gradwire"
#: Packages the library must never import, directly or through another module of it.
NOT_FOR_THE_LIBRARY = (
    "gradwire_apps",
    "gradwire_server",
    "typer",
    "rich",
    "tqdm",
    "sklearn",
    "matplotlib",
    "fastapi",
    "uvicorn",
    "starlette",
    "pydantic_settings",
    "prometheus_client",
)


def _modules() -> dict[str, Path]:
    mods = {}
    for top, root in ROOTS.items():
        if not root.is_dir():
            continue
        # A compiled module (gradwire._native) is known by its stub; it imports nothing of ours.
        for path in sorted(root.rglob("*.py")) + [p for p in root.rglob("*.pyi") if not p.with_suffix(".py").exists()]:
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([top, *parts])] = path
    return mods


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module named by an import statement of ``name`` (internal ones resolved, others by top name)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(_nearest(alias.name, modules))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in modules else _nearest(target, modules))
    out.discard(name)
    return out


def _nearest(dotted: str, modules: dict[str, Path]) -> str:
    """The innermost known module of ``dotted``, or its top-level name for outside packages."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in modules:
            return cand
    return parts[0]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_every_package_and_lazy_imports():
    graph = _graph()
    assert "gradwire.frame" in graph and "gradwire_server.rounds" in graph and "gradwire_apps" in graph
    # A function-level import counts: the server's package imports its app lazily, in __getattr__.
    assert "gradwire_server.app" in graph["gradwire_server"]
    assert "gradwire._native" in graph["gradwire.frame"]


def test_no_import_cycles_anywhere():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" ↔ ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_never_imports_the_apps_the_server_or_their_dependencies():
    graph = _graph()
    offenders = sorted(
        f"{name} imports {dep}"
        for name, deps in graph.items()
        if name == LIBRARY or name.startswith(LIBRARY + ".")
        for dep in deps
        if dep.split(".")[0] in NOT_FOR_THE_LIBRARY
    )
    assert not offenders, offenders


def test_nothing_reaches_code_through_sys_path():
    hits = [
        str(path.relative_to(REPO))
        for folder in ("python", "server", "tests", "bench", "examples")
        for path in (REPO / folder).rglob("*.py")
        if path != Path(__file__).resolve()
        and ("sys.path.insert" in path.read_text() or "sys.path.append" in path.read_text())
    ]
    assert not hits, hits


# -- docs/ARCHITECTURE.md's table "The library, top to bottom" against the measured imports -----------

ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"


def _library_table() -> dict[str, set[str]]:
    """``{row key: the names in its "imports (of gradwire)" cell}``: a key is a module (``frame``,
    ``torch/optimizers``) or a package with everything in it that has no row of its own (``codecs/``)."""
    text = ARCHITECTURE.read_text()
    section = text.split("## The library, top to bottom", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        key = cells[0].split("`")[1]
        rows[key] = set(cells[2].split("`")[1::2])
    return rows


def _row_of(module: str, keys: list[str]) -> str | None:
    """The row whose key names ``module`` most closely (``gradwire.`` omitted, dots as slashes)."""
    rel = module.removeprefix(LIBRARY).lstrip(".").replace(".", "/")
    best = None
    for key in keys:
        if rel == key.rstrip("/") or (key.endswith("/") and rel.startswith(key)):
            if best is None or len(key) > len(best):
                best = key
    return best


def test_the_architecture_table_maps_every_library_module_and_its_imports():
    graph = _graph()
    table = _library_table()
    skip = {"__init__"}  # the public API: it re-exports "the above"
    keys = [k for k in table if k not in skip]
    library = sorted(m for m in graph if m.startswith(LIBRARY + ".") or m == LIBRARY)
    unmapped = [m for m in library if m != LIBRARY and _row_of(m, keys) is None]
    assert not unmapped, f"modules missing from docs/ARCHITECTURE.md's library table: {unmapped}"

    measured: dict[str, set[str]] = {k: set() for k in keys}
    for module in library:
        if module == LIBRARY:
            continue
        row = _row_of(module, keys)
        for dep in graph[module]:
            if dep.startswith(LIBRARY + "."):
                target = _row_of(dep, keys)
                if target is not None and target != row:
                    measured[row].add(target)
    wrong = []
    for key in keys:
        documented = {_row_of(f"{LIBRARY}.{name}", keys) for name in table[key]}
        documented.discard(key)
        if documented != measured[key]:
            wrong.append(
                f"`{key}`: table says {sorted(d or '?' for d in documented)}, imports are {sorted(measured[key])}"
            )
    assert not wrong, "docs/ARCHITECTURE.md's library table is out of date:\n" + "\n".join(wrong)


def test_the_architecture_table_check_sees_a_wrong_row():
    keys = ["frame", "codecs/", "torch/", "torch/optimizers"]
    assert _row_of("gradwire.codecs.dct", keys) == "codecs/"
    assert _row_of("gradwire.torch.optimizers", keys) == "torch/optimizers"
    assert _row_of("gradwire.torch.hooks", keys) == "torch/"
    assert _row_of("gradwire.frame", keys) == "frame"
    assert _row_of("gradwire.state", keys) is None


# -- the DCT codec's package: no module reaches into another's private names ------------------------

DCT_PACKAGE = "gradwire.dct"


def _private_imports(name: str, source: str, package: str, is_package: bool = False) -> list[str]:
    """``name``'s imports of private names (``_x``) from other modules of ``package`` (``is_package``:
    ``name`` is a package's ``__init__``, which relative imports start from)."""
    own_package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = own_package.split(".")
            target = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target != package and not target.startswith(package + ".") or target == name:
            continue
        out += [f"{name} imports {alias.name} from {target}" for alias in node.names if alias.name.startswith("_")]
    return out


def test_no_module_of_the_dct_package_imports_a_private_name_of_another():
    modules = {m: p for m, p in _modules().items() if m == DCT_PACKAGE or m.startswith(DCT_PACKAGE + ".")}
    assert len(modules) > 10
    offenders = [
        hit
        for m, p in sorted(modules.items())
        for hit in _private_imports(m, p.read_text(), DCT_PACKAGE, p.name == "__init__.py")
    ]
    assert not offenders, offenders


def test_the_private_import_check_sees_one():
    source = "from .transform import _basis_f64, dct\nfrom ..frame import _private\nfrom . import _native\n"
    assert _private_imports("gradwire.dct.decode", source, "gradwire.dct") == [
        "gradwire.dct.decode imports _basis_f64 from gradwire.dct.transform",
        "gradwire.dct.decode imports _native from gradwire.dct",
    ]
    assert _private_imports("gradwire.dct", "from .basis import _CACHE\n", "gradwire.dct", is_package=True) == [
        "gradwire.dct imports _CACHE from gradwire.dct.basis"
    ]
