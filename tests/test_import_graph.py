"""The import graph of docs/ARCHITECTURE.md: no cycles, and the library never imports the apps or the server.

Every ``import`` statement counts, also those inside functions (a lazy import that closes a cycle is
still a cycle: it only moves the failure to the first call). Edges are taken as written: ``from . import
wire`` is an edge to ``gradwire.wire`` when that is a module, ``from ..frame import Entry`` one to
``gradwire.frame``, ``import gradwire`` one to the package itself.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The import graph and docs/ARCHITECTURE.md's table are read by scripts/architecture.py (`make architecture`,
# which rewrites the table's generated parts): one copy of that code, loaded here from its file.
_spec = importlib.util.spec_from_file_location("architecture", REPO / "scripts" / "architecture.py")
architecture = sys.modules["architecture"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architecture)

LIBRARY = architecture.LIBRARY
ARCHITECTURE = architecture.ARCHITECTURE
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

# The names this file had before the graph moved to the script (brief/fix_arch.py and friends read them).
_modules = architecture.modules
_graph = architecture.graph
_cycles = architecture.cycles
_row_of = architecture.row_of


def _library_table() -> dict[str, set[str]]:
    return architecture.library_table(ARCHITECTURE.read_text())


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


def test_make_architecture_leaves_the_document_unchanged():
    """The generated parts (import column, row order, floors, data-path sketch) are what the code says."""
    text = ARCHITECTURE.read_text()
    new, problems = architecture.rewrite(text, _graph())
    assert not problems, problems
    assert new == text, "docs/ARCHITECTURE.md's generated parts are out of date: run `make architecture`"


def test_every_row_comes_after_the_rows_it_imports():
    keys = [k for k in _library_table() if k != architecture.NOT_A_MODULE_ROW]
    late = architecture.out_of_order(keys, architecture.measured_rows(_graph(), keys))
    assert not late, late


def test_no_row_names_a_module_that_does_not_exist():
    assert not architecture.rows_without_module(_graph(), list(_library_table()))


def test_the_floor_order_check_sees_a_row_above_its_import():
    deps = {"frame": {"errors"}, "errors": set(), "codecs/": {"frame", "errors"}}
    assert architecture.out_of_order(["frame", "errors", "codecs/"], deps) == [
        "`frame` is above `errors`, which it imports"
    ]
    assert architecture.floor_order(["frame", "errors", "codecs/"], deps) == ["errors", "frame", "codecs/"]
    assert architecture.floors(deps) == {"frame": 1, "errors": 0, "codecs/": 2}


def _folder_row(folder: str) -> str:
    rows = [line for line in ARCHITECTURE.read_text().splitlines() if line.startswith(f"| `{folder}` |")]
    assert len(rows) == 1, f"docs/ARCHITECTURE.md has {len(rows)} rows for {folder}"
    return rows[0]


def test_the_rust_core_row_names_every_module_of_the_crate():
    named = set(re.findall(r"`([a-z_0-9]+)`", _folder_row("rust/core")))
    crate = {p.stem for p in (REPO / "rust" / "core" / "src").glob("*.rs")} - {"lib"}
    assert "alignment" in crate
    assert not crate - named, f"docs/ARCHITECTURE.md's rust/core row does not name {sorted(crate - named)}"


def test_the_scripts_row_names_every_script():
    named = set(re.findall(r"`([a-z_0-9]+\.py)`", _folder_row("scripts/")))
    scripts = {p.name for p in (REPO / "scripts").glob("*.py")}
    assert not scripts - named, f"docs/ARCHITECTURE.md's scripts/ row does not name {sorted(scripts - named)}"


def test_the_apps_and_server_paragraphs_name_every_module():
    """The server's and the apps' modules have no table rows; their paragraphs name each one (``routes/*``
    stands for the routers)."""
    section = ARCHITECTURE.read_text().split("## The apps and the server", 1)[1].split("\n## ", 1)[0]
    apps_text, server_text = section.split("- `gradwire_server`", 1)
    missing = []
    for top, text in (("gradwire_apps", apps_text), ("gradwire_server", server_text)):
        root = architecture.ROOTS[top]
        named = set(re.findall(r"`([a-z_/]+)`", text))
        for path in sorted(root.rglob("*.py")):
            rel = str(path.relative_to(root).with_suffix(""))
            if path.stem in ("__init__", "__main__") or rel.startswith("routes/"):
                continue
            if rel not in named:
                missing.append(f"{top}/{rel}")
    assert not missing, f"docs/ARCHITECTURE.md's 'The apps and the server' does not name {missing}"


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
