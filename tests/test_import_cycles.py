"""No import cycle in pycomm/: the graph of pycomm-internal imports,
parsed from the source with ``ast`` (nothing is imported), has no cycle.

What counts as an import: every ``import`` / ``from ... import`` statement
anywhere in a module, at the top, inside a function, or under
``if TYPE_CHECKING:``. A lazy import or a type-only one hides a circle from
the interpreter, not from the reader who has to understand one module before
the other (``_setup.py`` <-> ``comm.py`` once imported each other that way).
An import names the module it loads: ``from . import _setup`` is an edge to
``pycomm._setup``, ``from .comm import Communicator`` one to ``pycomm.comm``;
the implicit import of a parent package is not an edge (every submodule
would otherwise close a cycle through its package's ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pycomm"
#: Compiled modules (a file only after a build): ``from . import _C`` loads
#: the extension, not the package's ``__init__``.
NATIVE = {"pycomm._C"}


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that module ``name`` (file ``path``) imports."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in modules:  # import pycomm.x.y: the deepest module
                    target = target.rpartition(".")[0]
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:  # from . import _setup: the submodule
                    found.add(sub)
                elif source in modules:  # from .comm import Communicator
                    found.add(source)
    found.discard(name)
    return found & set(modules) - NATIVE


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root, package)
    known = set(modules) | {m for m in NATIVE if m.startswith(package + ".")}
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_imports_are_resolved(tmp_path):
    """Relative, absolute, package and function-level imports all count."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .b import thing\nimport pkg.sub.c\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import b\nfrom ..a import x\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.sub.c"}, "pkg.b": {"pkg.a"},
                     "pkg.sub": set(), "pkg.sub.c": {"pkg.b", "pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_no_import_cycle_in_pycomm():
    graph = import_graph()
    assert "pycomm.comm" in graph and "pycomm._setup" in graph["pycomm.comm"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in pycomm/: " + " -> ".join(cycle or [])
