"""The package's seams, checked on the source: no class working on private state that
another class sets (a mixin split by size, not by job), no file touching another file's
private attributes, no import cycles (function-level imports included), and a learner that
knows no engine and no environment."""
from __future__ import annotations

import ast
import functools
import os


ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "pipelinerl_jax")
# Mixins that work on private attributes their host class sets in another file: known debt
# (compose instead). The list may only shrink.
SHARED_STATE_DEBT = set()
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


def _parse(path: str) -> ast.Module:
    """A file's syntax tree, parsed once per content for all the checks."""
    with open(path) as f:
        return _parse_source(f.read(), path)


@functools.lru_cache(maxsize=None)
def _parse_source(source: str, path: str) -> ast.Module:
    return ast.parse(source, path)


def _library(path: str) -> bool:
    rel = os.path.relpath(path, ROOT)
    return not any(e in rel for e in EXEMPT)


def _imports(name: str, path: str, modules):
    """Modules of `modules` that `name` imports anywhere in its source: module level, inside
    functions and under `if TYPE_CHECKING` alike. An import inside a function runs later, so
    it dodges the import-time error of a cycle, but the two modules still depend on each
    other: a function-level import is how a cycle hides, so it counts."""
    tree = _parse(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
    out = set()
    for m in found:
        # Importing a.b.c runs package a.b's __init__ first: a dependency on every package
        # above the target that `name` is not itself inside.
        parts = m.split(".")
        for i in range(1, len(parts) + 1):
            dep = ".".join(parts[:i])
            if dep in modules and dep != name and not name.startswith(dep + "."):
                out.add(dep)
    return out


def import_cycle(modules):
    """The first import cycle among `modules` ({dotted name: path}) as a list of names
    (first == last), or None."""
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
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
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _private_names(tree):
    """(private names a module defines: functions, classes, module globals, attributes it
    assigns; [(name, line)] of the private attributes it reads off anything but self/cls,
    and of the private names it imports)."""
    defined, touched = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute):
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                defined.add(node.attr)
            elif not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                touched.append((node.attr, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            touched.extend((a.name, node.lineno) for a in node.names)
    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    return {n for n in defined if private(n)}, [(n, ln) for n, ln in touched if private(n)]


def foreign_private_uses(paths):
    """["file:line name (defined in other files)"] for every private attribute (`x._name`,
    `module._helper`, `from m import _helper`) a file uses that it does not define itself
    but another of `paths` does: a file reaching into another file's internals."""
    scanned = {p: _private_names(_parse(p)) for p in paths}
    owners = {}
    for p, (defined, _) in scanned.items():
        for n in defined:
            owners.setdefault(n, set()).add(p)
    out = []
    for p, (defined, touched) in scanned.items():
        for n, line in touched:
            if n not in defined and owners.get(n):
                where = sorted(os.path.basename(o) for o in owners[n])
                out.append(f"{os.path.relpath(p, os.path.dirname(ROOT))}:{line} {n} "
                           f"(defined in {', '.join(where)})")
    return out


def test_no_file_touches_another_files_private_attributes():
    """A leading underscore means "this file's business": a class or function that reads
    `other._state` or calls `module._helper` from another file couples to internals that file
    may change freely. Public attributes or methods say what is shared."""
    offenders = foreign_private_uses([p for p in MODULES.values() if _library(p)])
    assert not offenders, "private attributes used outside their file:\n" + "\n".join(offenders)


def test_reaching_into_another_files_private_state_is_found(tmp_path):
    """The check can fail: a class reading another file's private attribute, and a private
    helper imported across files, are both named; the same reads within one file are not."""
    (tmp_path / "owner.py").write_text(
        "class Pool:\n    def __init__(self):\n        self._free = []\n\n\n"
        "def _helper():\n    return 1\n")
    (tmp_path / "user.py").write_text(
        "from pkg.owner import _helper\n\n\nclass Engine:\n"
        "    def pages(self, pool):\n        return len(pool._free) + _helper()\n")
    found = foreign_private_uses([str(tmp_path / "owner.py"), str(tmp_path / "user.py")])
    assert len(found) == 2 and all("user.py" in f and "owner.py" in f for f in found), found
    assert any(" _free " in f for f in found) and any(" _helper " in f for f in found)
    (tmp_path / "user.py").write_text(
        "class Engine:\n    def pages(self, pool):\n        return len(pool.free)\n")
    assert foreign_private_uses([str(tmp_path / "owner.py"), str(tmp_path / "user.py")]) == []


def _class_index():
    """{class name: (bases, names it defines or assigns: methods, class attributes,
    self.<name> targets)} over every library module."""
    index = {}
    for path in MODULES.values():
        if not _library(path):
            continue
        for node in ast.walk(_parse(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                     for b in node.bases]
            defined, reads, methods = set(), set(), set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(item.name)
                    methods.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    defined.update(t.id for t in targets if isinstance(t, ast.Name))
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                        and sub.value.id == "self" and sub.attr.startswith("_") \
                        and not sub.attr.startswith("__"):
                    (defined if isinstance(sub.ctx, (ast.Store, ast.Del)) else reads).add(
                        sub.attr)
            index[node.name] = (bases, defined, reads, methods)
    return index


def _own_and_inherited(name, index, seen=()):
    if name not in index or name in seen:
        return set()
    bases, defined = index[name][:2]
    out = set(defined)
    for b in bases:
        out |= _own_and_inherited(b, index, seen + (name,))
    return out


def test_no_class_reads_private_state_it_does_not_own():
    """A class reads only the private attributes it (or a base) defines or assigns: a mixin
    whose methods use `self._x` set in its host's __init__, in another file, shares private
    state across files — a split by size, not by job."""
    index = _class_index()
    # A base calling a method its subclasses implement (a template-method hook, e.g.
    # LengthDistribution._raw) reads no state: only data attributes count.
    hooks = {}
    for sub, (bases, _, _, methods) in index.items():
        for b in bases:
            hooks.setdefault(b, set()).update(methods)
    offenders = {}
    for name, (_, _, reads, _) in index.items():
        foreign = reads - _own_and_inherited(name, index) - hooks.get(name, set())
        if foreign:
            offenders[name] = sorted(foreign)[:5]
    assert set(offenders) <= SHARED_STATE_DEBT, \
        f"classes reading private state they do not own: { {k: v for k, v in offenders.items() if k not in SHARED_STATE_DEBT} }"
    assert SHARED_STATE_DEBT <= set(offenders), \
        f"no longer shares state (remove from SHARED_STATE_DEBT): {SHARED_STATE_DEBT - set(offenders)}"


def test_no_import_cycles():
    cycle = import_cycle(MODULES)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_hidden_in_a_function_level_import_is_found(tmp_path):
    """The check sees through the usual hiding place: `b` imports `a` at module level, `a`
    imports `b` only inside a function (Python would import both without an error)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n    return g()\n")
    (pkg / "b.py").write_text("from pkg import a\n\n\ndef g():\n    return 1\n")
    modules = {"pkg": str(pkg / "__init__.py"), "pkg.a": str(pkg / "a.py"),
               "pkg.b": str(pkg / "b.py")}
    assert import_cycle(modules) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])
    (pkg / "a.py").write_text("def f():\n    return 1\n")  # the function-level edge gone
    assert import_cycle(modules) is None


def test_the_learner_imports_no_engine_or_environment_and_never_branches_on_the_sampler_kind():
    """The learner trains on tokens: it knows no engine (rollout/) and no environment (envs/);
    a warm start's demonstrations are encoded in launch/."""
    for name, path in MODULES.items():
        if not name.startswith("pipelinerl_jax.learner"):
            continue
        src = open(path).read()
        deps = _imports(name, path, MODULES)
        for banned in ("pipelinerl_jax.rollout", "pipelinerl_jax.envs"):
            assert not {d for d in deps if d == banned or d.startswith(banned + ".")}, \
                f"{path} imports from {banned}"
        assert "sampler.kind" not in src, f"{path} branches on sampler.kind"


def test_the_readme_package_table_names_every_module():
    """Docs match the layout: each top-level package and module of pipelinerl_jax is named
    in the README's package table (a row, or a file named in a row)."""
    readme = open(os.path.join(os.path.dirname(ROOT), "README.md"), encoding="utf-8").read()
    table = readme[readme.index("| package | owns |"):]
    table = table[:table.index("\n\n")]
    pkg = ROOT
    missing = []
    for name in sorted(os.listdir(pkg)):
        if name.startswith(("_", ".")) or name == "py.typed":
            continue
        if os.path.isdir(os.path.join(pkg, name)):
            if f"`pipelinerl_jax/{name}/`" not in table:
                missing.append(name + "/")
        elif name.endswith(".py") and f"`{name}`" not in table \
                and f"`pipelinerl_jax/{name}`" not in table:
            missing.append(name)
    assert not missing, f"not in the README package table: {missing}"
