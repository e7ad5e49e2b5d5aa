"""The package's seams, checked on the source (issue 13): small library files, no import
cycles, and a learner that knows no engine."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "pipelinerl_jax")
MAX_LINES = 600
# Test doubles and generated protobuf code are not library code in this sense.
EXEMPT = ("testing" + os.sep, "_pb2")


def _modules():
    """{dotted module name: path} of every library module."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3]
            name = rel.replace(os.sep, ".")
            out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()


def _library(path: str) -> bool:
    rel = os.path.relpath(path, ROOT)
    return not any(e in rel for e in EXEMPT)


def _top_level_imports(name: str, path: str):
    """Package modules imported when `name` is imported (module-level statements only;
    imports inside functions run later and cannot form an import-time cycle)."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def test_library_files_stay_small():
    big = {os.path.relpath(p, ROOT): n for p in MODULES.values() if _library(p)
           for n in [sum(1 for _ in open(p))] if n > MAX_LINES}
    assert not big, f"library files over {MAX_LINES} lines: {big}"


def test_no_import_cycles():
    graph = {m: _top_level_imports(m, p) for m, p in MODULES.items()}
    # Importing a.b.c imports package a.b first: an edge from a package's __init__ to its
    # own submodule is how packages re-export, not a cycle.
    for m in graph:
        graph[m] = {d for d in graph[m] if not d.startswith(m + ".")}
    state, stack = {}, []

    def visit(m):
        state[m] = "active"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "active":
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_learner_imports_no_engine_and_never_branches_on_the_sampler_kind():
    for name, path in MODULES.items():
        if not name.startswith("pipelinerl_jax.learner"):
            continue
        src = open(path).read()
        assert "pipelinerl_jax.rollout" not in src, f"{path} imports from rollout/"
        assert "sampler.kind" not in src, f"{path} branches on sampler.kind"
