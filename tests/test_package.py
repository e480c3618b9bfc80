# SPDX-License-Identifier: BSD-3-Clause
"""The package's house rules: no import cycle among groupnorm_ext's modules (module-level imports), and one
module per operator in groupnorm_ext/ops/ for every op of the schema."""
from __future__ import annotations

import ast
import pathlib

import torch

import groupnorm_ext  # noqa: F401

PKG = pathlib.Path(groupnorm_ext.__file__).resolve().parent


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """groupnorm_ext modules imported at module level (not inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("groupnorm_ext"):
                if node.module:  # from .x import y: module x (and y, if y is a module)
                    found.add(mod)
                found.update(f"{mod}.{a.name}" for a in node.names)  # from . import y: module y
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("groupnorm_ext"))
    return found


def test_no_import_cycles():
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {m: sorted(i for i in _imports(p) if i in modules and i != m) for m, p in modules.items()}
    # A package's __init__ importing its submodules is the normal direction; a submodule importing a name of its
    # package's __init__ back would close a loop.
    for m, deps in graph.items():
        assert not any(m.startswith(n + ".") for n in deps), f"{m} imports from its own package's __init__"
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [m, n]))
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_one_module_per_op():
    """Every op of the schema has its module: ops/<op>.py, or the module of its family (<family>_backward,
    <family>_merge, ...: the module's name is a prefix of the op's), and every module an op."""
    files = {p.stem for p in (PKG / "ops").glob("*.py") if p.stem != "__init__"}
    ops = set(torch.ops.gnext)
    owner = {op: max((f for f in files if op == f or op.startswith(f + "_")), key=len, default=None) for op in ops}
    assert all(owner.values()), [op for op, f in owner.items() if f is None]
    assert set(owner.values()) == files
