"""The stub ``gradwire/_native.pyi`` against the built ``gradwire._native``.

Both directions: every public name of the module is in the stub and every name of the stub is in
the module, with the same kind (function, exception class, constant); every function has the same
parameters (names, kinds, defaults) as the signature PyO3 gives the built function; every class
attribute the stub declares exists on the native class; every constant has the stub's type.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import gradwire
from gradwire import _native

STUB = Path(gradwire.__file__).with_name("_native.pyi")

_KIND = {
    "posonlyargs": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "kwonlyargs": inspect.Parameter.KEYWORD_ONLY,
}
_TYPES = {"int": int, "str": str, "bytes": bytes, "bool": bool, "dict": dict, "tuple": tuple}


def _public(name: str) -> bool:
    return not name.startswith("_")


def _default(node: ast.expr | None):
    if node is None:
        return inspect.Parameter.empty
    try:
        return ast.literal_eval(node)
    except ValueError:  # an expression such as 2**31
        return eval(compile(ast.Expression(node), str(STUB), "eval"), {"__builtins__": {}})


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, inspect._ParameterKind, object]]:
    a = fn.args
    positional = [(arg, "posonlyargs") for arg in a.posonlyargs] + [(arg, "args") for arg in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [(arg.arg, _KIND[k], _default(d)) for (arg, k), d in zip(positional, defaults)]
    if a.vararg:
        params.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    params += [(arg.arg, _KIND["kwonlyargs"], _default(d)) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    return params


def _native_params(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _annotation_type(node: ast.expr) -> type | None:
    """The runtime type a constant's annotation names: ``Final[dict[str, int]]`` is ``dict``."""
    while isinstance(node, ast.Subscript):
        if isinstance(node.value, ast.Name) and node.value.id == "Final":
            node = node.slice
        else:
            node = node.value
    return _TYPES.get(node.id) if isinstance(node, ast.Name) else None


def stub_mismatches(source: str, module) -> list[str]:
    """Every disagreement between a stub's source and a module, one line each."""
    tree = ast.parse(source)
    functions: dict[str, ast.FunctionDef] = {}
    classes: dict[str, ast.ClassDef] = {}
    constants: dict[str, ast.expr | None] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            constants[node.target.id] = node.annotation
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    constants[t.id] = None
    stubbed = {n for n in [*functions, *classes, *constants] if _public(n)}
    built = {n for n in dir(module) if _public(n)}

    problems = [f"{n}: in the module, not in the stub" for n in sorted(built - stubbed)]
    problems += [f"{n}: in the stub, not in the module" for n in sorted(stubbed - built)]
    for name in sorted(stubbed & built):
        obj = getattr(module, name)
        if name in functions:
            if isinstance(obj, type) or not callable(obj):
                problems.append(f"{name}: a function in the stub, {type(obj).__name__} in the module")
            elif obj.__text_signature__ is None:
                problems.append(f"{name}: the built function has no __text_signature__")
            else:
                want, got = _stub_params(functions[name]), _native_params(obj)
                if want != got:
                    problems.append(f"{name}: stub parameters {want} != built {got}")
        elif name in classes:
            if not isinstance(obj, type):
                problems.append(f"{name}: a class in the stub, {type(obj).__name__} in the module")
                continue
            stub_bases = [ast.unparse(b) for b in classes[name].bases]
            built_bases = [b.__name__ for b in obj.__bases__]
            if stub_bases != built_bases:
                problems.append(f"{name}: stub bases {stub_bases} != built {built_bases}")
            for item in classes[name].body:
                attr = item.target.id if isinstance(item, ast.AnnAssign) else getattr(item, "name", None)
                if attr is not None and not hasattr(obj, attr):
                    problems.append(f"{name}.{attr}: in the stub, not on the built class")
        else:
            if callable(obj):
                problems.append(f"{name}: a constant in the stub, callable in the module")
            ann = constants[name]
            want_type = _annotation_type(ann) if ann is not None else None
            if want_type is not None and not isinstance(obj, want_type):
                problems.append(f"{name}: stub says {ast.unparse(ann)}, built value is {obj!r}")
    return problems


def test_stub_matches_the_built_module():
    assert stub_mismatches(STUB.read_text(), _native) == []


def test_every_native_function_has_a_text_signature():
    for name in dir(_native):
        obj = getattr(_native, name)
        if _public(name) and callable(obj) and not isinstance(obj, type):
            assert obj.__text_signature__, name
            inspect.signature(obj)  # parses: defaults are literals


def _edit(old: str, new: str) -> str:
    source = STUB.read_text()
    assert source.count(old) == 1, old
    return source.replace(old, new)


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        # A function the module has and the stub lost.
        ("def crc32c(", "def _crc32c(", "crc32c: in the module, not in the stub"),
        # A function in the stub the module does not have.
        ("def crc32c(", "def crc32d(data: int) -> int: ...\ndef crc32c(", "crc32d: in the stub, not in the module"),
        # A renamed parameter, a changed default, a parameter made keyword-only.
        ("def crc32c(data:", "def crc32c(buf:", "crc32c: stub parameters"),
        ("value: int = 0)", "value: int = 1)", "crc32c: stub parameters"),
        ("uint64], kind: str) -> bytes:", "uint64], *, kind: str) -> bytes:", "elias_encode: stub parameters"),
        # A constant or class attribute the module does not have, a constant of another type.
        ("MAX_NAME_BYTES: Final[int]", "MAX_NAME_BYTES: Final[int]\nMAX_DIMS: int", "MAX_DIMS: in the stub"),
        ("    kind: str\n\nclass FrameError", "    kind: str\n    rule: str\n\nclass FrameError", "WireError.rule"),
        ("FRAME_MAGIC: Final[bytes]", "FRAME_MAGIC: Final[str]", "FRAME_MAGIC: stub says"),
    ],
)
def test_a_drifted_stub_is_caught(old, new, expect):
    problems = stub_mismatches(_edit(old, new), _native)
    assert any(p.startswith(expect) for p in problems), problems
