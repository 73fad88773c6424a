"""`make architecture`: the parts of docs/ARCHITECTURE.md that the code decides, rewritten from the code.

    python scripts/architecture.py [--check]

Rewritten (``--check`` exits 1 and prints what is out of date instead):

- the table "The library, top to bottom": each row's last column, the gradwire modules its modules import
  (measured from every ``import`` statement, function-level ones too); a row for a module that no longer
  exists is dropped; the rows in floor order (a row below every row it imports: a stable topological order,
  so rows already in order keep their places);
- the floors figure: floor 0 imports nothing of gradwire, floor n + 1 imports floor n at most;
- the data-path sketch, whose every name is checked to be defined by the module it names.

A module without a row is printed and fails the run: what it owns is written by hand (the "owns" column).
tests/test_import_graph.py imports this file for the import graph (one copy of it), checks that this script
leaves the document unchanged, and checks what no script can write.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
ROOTS = {
    "gradwire": REPO / "python" / "gradwire",
    "gradwire_apps": REPO / "python" / "gradwire_apps",
    "gradwire_server": REPO / "server" / "gradwire_server",
}
LIBRARY = "gradwire"
LIBRARY_SECTION = "## The library, top to bottom"
#: Rows that are not one module: the public API re-exports "the above".
NOT_A_MODULE_ROW = "__init__"
FLOORS_START = "<!-- architecture:floors (written by scripts/architecture.py) -->"
FLOORS_END = "<!-- /architecture:floors -->"
FIGURE_WIDTH = 110
DATA_PATH_START = "<!-- architecture:data-path (written by scripts/architecture.py) -->"
DATA_PATH_END = "<!-- /architecture:data-path -->"

#: The data-path sketch, and the (module, name) pairs it names: each must be defined where it says.
DATA_PATH = """\
```text
uplink    torch tensor ─Codec.compress─▶ Entry records ─write_frame─▶ bytes ─▶ HTTP body (server)
            (gradwire.codecs, .dct)      (gradwire.frame)  (Rust: layout,       or collective (torch)
                                                            limits, CRC)
aggregate bytes ─read_frame─▶ Entry ─accumulate / decode─▶ the rule's weighted sum, in the codec's domain
                                                            (gradwire.aggregation.aggregate, exact_mean)
downlink  "diff" runs (AdamW): the server's step, its compressed weight diff ─▶ apply_update
          "mean" runs (DeMo, SparseLoCo): mean + residual ─ReencodeFeedback─▶ one re-encoded frame
            ─write_published_aggregate─▶ version ─read_published─▶ apply_mean ─▶ the same bits on every node
            (publish="frames": every node frame verbatim, write_published; a sharded torch owner
             re-encodes its pieces' mean the same way)
```"""
DATA_PATH_NAMES = (
    ("gradwire.codecs.base", "Codec"),
    ("gradwire.frame", "Entry"),
    ("gradwire.frame", "write_frame"),
    ("gradwire.frame", "read_frame"),
    ("gradwire.aggregation", "aggregate"),
    ("gradwire.aggregation", "exact_mean"),
    ("gradwire.state", "apply_update"),
    ("gradwire.reencode", "ReencodeFeedback"),
    ("gradwire.published", "write_published_aggregate"),
    ("gradwire.published", "write_published"),
    ("gradwire.published", "read_published"),
    ("gradwire.published", "apply_mean"),
)


# -- the import graph ---------------------------------------------------------------------------------


def modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
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


def nearest(dotted: str, mods: dict[str, Path]) -> str:
    """The innermost known module of ``dotted``, or its top-level name for outside packages."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in mods:
            return cand
    return parts[0]


def edges(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every module named by an import statement of ``name`` (internal ones resolved, others by top name)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(nearest(alias.name, mods))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in mods else nearest(target, mods))
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    """``{module: the modules its import statements name}`` over the three packages."""
    mods = modules()
    return {name: edges(name, path, mods) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
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
        for w in g.get(v, ()):
            if w not in g:
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


# -- the library table --------------------------------------------------------------------------------


def _cells(line: str) -> list[str] | None:
    """A table row's three cells when it is a row of a module (its first cell a backticked key)."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 3 or not cells[0].startswith("`"):
        return None
    return cells


def library_table(text: str) -> dict[str, set[str]]:
    """``{row key: the names in its "imports (of gradwire)" cell}``, in the table's order: a key is a module
    (``frame``, ``torch/overlap``) or a package with everything in it that has no row of its own (``codecs/``)."""
    section = text.split(LIBRARY_SECTION, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = _cells(line)
        if cells is not None:
            rows[cells[0].split("`")[1]] = set(cells[2].split("`")[1::2])
    return rows


def row_of(module: str, keys: list[str]) -> str | None:
    """The row whose key names ``module`` most closely (``gradwire.`` omitted, dots as slashes)."""
    rel = module.removeprefix(LIBRARY).lstrip(".").replace(".", "/")
    best = None
    for key in keys:
        if rel == key.rstrip("/") or (key.endswith("/") and rel.startswith(key)):
            if best is None or len(key) > len(best):
                best = key
    return best


def library_modules(g: dict[str, set[str]]) -> list[str]:
    return sorted(m for m in g if m.startswith(LIBRARY + "."))


def unmapped_modules(g: dict[str, set[str]], keys: list[str]) -> list[str]:
    """Library modules that no row names."""
    keys = [k for k in keys if k != NOT_A_MODULE_ROW]
    return [m for m in library_modules(g) if row_of(m, keys) is None]


def rows_without_module(g: dict[str, set[str]], keys: list[str]) -> list[str]:
    """Rows that name no module of the library."""
    keys = [k for k in keys if k != NOT_A_MODULE_ROW]
    lib = library_modules(g)
    return [k for k in keys if not any(row_of(m, keys) == k for m in lib)]


def imported_modules(g: dict[str, set[str]], keys: list[str]) -> dict[str, set[str]]:
    """``{row key: the library modules its modules import}`` (dotted, ``gradwire.`` omitted), imports of
    modules in the same row left out."""
    keys = [k for k in keys if k != NOT_A_MODULE_ROW]
    out: dict[str, set[str]] = {k: set() for k in keys}
    for module in library_modules(g):
        row = row_of(module, keys)
        if row is None:
            continue
        for dep in g[module]:
            if dep.startswith(LIBRARY + "."):
                target = row_of(dep, keys)
                if target is not None and target != row:
                    out[row].add(dep.removeprefix(LIBRARY + "."))
    return out


def measured_rows(g: dict[str, set[str]], keys: list[str]) -> dict[str, set[str]]:
    """``{row key: the rows its modules import}``."""
    keys = [k for k in keys if k != NOT_A_MODULE_ROW]
    return {k: {row_of(f"{LIBRARY}.{m}", keys) for m in mods} for k, mods in imported_modules(g, keys).items()}


def floors(deps: dict[str, set[str]]) -> dict[str, int]:
    """Each row's floor: 0 for a row importing no other row, else one above the highest row it imports."""
    out: dict[str, int] = {}

    def floor(k: str) -> int:
        if k not in out:
            out[k] = 0  # a cycle (the import test fails on it) must not recurse forever
            out[k] = 1 + max((floor(d) for d in deps[k] if d in deps), default=-1)
        return out[k]

    for k in deps:
        floor(k)
    return out


def floor_order(keys: list[str], deps: dict[str, set[str]]) -> list[str]:
    """``keys`` in an order where each row comes after every row it imports, as close to the given order as
    that allows (each place taken by the first row, in the given order, whose imports are all placed)."""
    placed: list[str] = []
    left = list(keys)
    while left:
        for k in left:
            if all(d in placed or d not in left for d in deps.get(k, ())):
                break
        else:  # a cycle: keep the given order for the rest
            placed += left
            break
        placed.append(k)
        left.remove(k)
    return placed


def out_of_order(keys: list[str], deps: dict[str, set[str]]) -> list[str]:
    """Rows placed above a row they import."""
    seen: set[str] = set()
    late = []
    for k in keys:
        above = [d for d in sorted(deps.get(k, ())) if d in deps and d not in seen]
        late += [f"`{k}` is above `{d}`, which it imports" for d in above]
        seen.add(k)
    return late


# -- names the sketch uses ----------------------------------------------------------------------------


def defines(path: Path, name: str) -> bool:
    """Whether the module at ``path`` binds ``name`` at its top level (def, class, assignment, import)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
    return False


def missing_sketch_names() -> list[str]:
    mods = modules()
    return [f"{m}.{n}" for m, n in DATA_PATH_NAMES if m not in mods or not defines(mods[m], n) or n not in DATA_PATH]


# -- the rewrite --------------------------------------------------------------------------------------


def _between(text: str, start: str, end: str, body: str) -> str:
    if start not in text or end not in text:
        raise SystemExit(f"docs/ARCHITECTURE.md lacks the markers {start!r} … {end!r}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def _import_cell(names: set[str]) -> str:
    return ", ".join(f"`{n}`" for n in sorted(names)) or "—"


def floors_figure(order: list[str], deps: dict[str, set[str]]) -> str:
    level = floors(deps)
    lines = ["```text"]
    for f in range(max(level.values(), default=-1) + 1):
        line = f"floor {f:>2} "
        for k in (k for k in order if level.get(k) == f):
            if len(line) + len(k) + 2 > FIGURE_WIDTH:
                lines.append(line.rstrip())
                line = " " * 9
            line += f" {k},"
        lines.append(line.rstrip(","))
    lines.append("```")
    return "\n".join(lines)


def rewrite(text: str, g: dict[str, set[str]]) -> tuple[str, list[str]]:
    """The document with its generated parts rewritten from ``g``, and what needs a hand (rows to write)."""
    head, rest = text.split(LIBRARY_SECTION, 1)
    section, sep, tail = rest.partition("\n## ")
    lines = section.split("\n")
    row_lines = [i for i, line in enumerate(lines) if _cells(line) is not None]
    rows = {_cells(lines[i])[0].split("`")[1]: lines[i] for i in row_lines}
    keys = list(rows)
    problems = [f"no row for {m}: write its row (what it owns) in the library table" for m in unmapped_modules(g, keys)]
    gone = set(rows_without_module(g, keys))
    keys = [k for k in keys if k not in gone]
    imports = imported_modules(g, keys)
    deps = measured_rows(g, keys)
    module_keys = [k for k in keys if k != NOT_A_MODULE_ROW]
    order = floor_order(module_keys, deps) + ([NOT_A_MODULE_ROW] if NOT_A_MODULE_ROW in rows else [])
    new_rows = []
    for k in order:
        cells = _cells(rows[k])
        cell = cells[2] if k == NOT_A_MODULE_ROW else _import_cell(imports[k])
        new_rows.append(f"| {cells[0]} | {cells[1]} | {cell} |")
    first, last = (row_lines[0], row_lines[-1]) if row_lines else (len(lines), len(lines) - 1)
    lines = lines[:first] + new_rows + lines[last + 1 :]
    text = head + LIBRARY_SECTION + "\n".join(lines) + sep + tail
    text = _between(text, FLOORS_START, FLOORS_END, floors_figure([k for k in order if k != NOT_A_MODULE_ROW], deps))
    text = _between(text, DATA_PATH_START, DATA_PATH_END, DATA_PATH)
    problems += [f"the data-path sketch names {n}, which the code does not define" for n in missing_sketch_names()]
    return text, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the document is not what this would write")
    args = ap.parse_args(argv)
    text = ARCHITECTURE.read_text()
    new, problems = rewrite(text, graph())
    for p in problems:
        print(p, file=sys.stderr)
    if args.check:
        if new != text:
            sys.stdout.writelines(
                difflib.unified_diff(text.splitlines(True), new.splitlines(True), "ARCHITECTURE.md", "generated")
            )
            print("docs/ARCHITECTURE.md is out of date: run `make architecture`", file=sys.stderr)
            return 1
    elif new != text:
        ARCHITECTURE.write_text(new)
        print("rewrote docs/ARCHITECTURE.md")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
