"""The packages' import structure, read from the source with `ast` (nothing is imported).

- no import circles among the modules of the packages: neither among the imports that run
  when a module loads, nor once deferred imports (inside functions) and
  `if TYPE_CHECKING:` imports are counted too;
- the shared libraries depend on nothing of the servers: wire/ (the wire contract) on
  nothing of ours, derender/ (the derender core) and plumbing/ (the process plumbing) on
  wire/ alone;
- engine/ never imports gateway/ or onehop/, gateway/ never imports engine/ or onehop/:
  each server runs without the other, and what they share is in the shared libraries;
- so onehop/ (the command line, `onehop serve`) is the one place that wires the two together.

The rules count deferred and `if TYPE_CHECKING:` imports too.

An import names the module it loads: `from a.b import c` is `a.b.c` when that is a module
of the package, else `a.b`. A package's `__init__` that a submodule import runs on the way
is not counted as imported (each such edge would make every package a circle with its
own modules).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Mapping, Set
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("wire", "derender", "plumbing", "engine", "gateway", "onehop")

RULES: dict[str, tuple[str, ...]] = {
    "wire": ("derender", "plumbing", "engine", "gateway", "onehop"),
    "derender": ("plumbing", "engine", "gateway", "onehop"),
    "plumbing": ("derender", "engine", "gateway", "onehop"),
    "engine": ("gateway", "onehop"),
    "gateway": ("engine", "onehop"),
}
"""Package → what none of its modules may import (each name with its submodules)."""

Graph = Mapping[str, Set[str]]


# ------------------------------------------------------------ reading the imports


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name → its file, for every module under `packages`."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _load_time(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module loads: at the top, in classes and in
    if/try/with/for blocks; not in functions, nor under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from _load_time(node.orelse)
            continue
        yield node
        for block in _blocks(node):
            yield from _load_time(block)


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    blocks = [getattr(node, name) for name in ("body", "orelse", "finalbody") if hasattr(node, name)]
    blocks += [handler.body for handler in getattr(node, "handlers", ())]
    blocks += [case.body for case in getattr(node, "cases", ())]
    return blocks


def _imported(node: ast.stmt, module: str, is_package: bool, modules: Set[str]) -> Iterator[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{alias.name}" for alias in node.names]
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            yield name


def parse_modules(files: Mapping[str, Path]) -> dict[str, tuple[ast.Module, bool]]:
    """Module → its syntax tree, and whether it is a package's `__init__`."""
    return {
        module: (ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), path.name == "__init__.py")
        for module, path in files.items()
    }


def import_graph(modules: Mapping[str, tuple[ast.Module, bool]], *, deferred: bool) -> dict[str, set[str]]:
    """Module → the package modules it imports: at load time only, or (`deferred`) anywhere,
    `if TYPE_CHECKING:` and function bodies included."""
    graph: dict[str, set[str]] = {}
    for module, (tree, is_package) in modules.items():
        nodes = ast.walk(tree) if deferred else _load_time(tree.body)
        graph[module] = {
            name
            for node in nodes
            if isinstance(node, ast.stmt)
            for name in _imported(node, module, is_package, modules.keys())
        }
    return graph


# ------------------------------------------------------------ finding circles


def cycles(graph: Graph) -> list[list[str]]:
    """The import circles: each strongly connected component of more than one module, or a
    module that imports itself (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            step = next(targets, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def _describe(graph: Graph, circles: list[list[str]]) -> str:
    lines = []
    for circle in circles:
        members = set(circle)
        lines.append(" ".join(f"{m} -> {sorted(graph[m] & members)};" for m in circle))
    return "\n".join(lines)


# ------------------------------------------------------------ forbidden imports


def _within(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


def forbidden_imports(graph: Graph, rules: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Each `importer -> imported` edge of `graph` that `rules` forbid, sorted."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for package, banned in rules.items()
        if _within(module, package)
        for target in targets
        if any(_within(target, name) for name in banned)
    )


# ------------------------------------------------------------ the detectors themselves


def test_cycles_finds_a_circle_and_only_its_members() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_cycles_finds_each_circle_and_a_self_import() -> None:
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}, "s": {"s"}, "x": {"a", "c"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d"], ["s"]]


def test_cycles_passes_a_graph_without_circles() -> None:
    graph = {"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}
    assert cycles(graph) == []


def test_import_graph_reads_the_forms_of_import(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    sources = {
        "pkg/__init__.py": "",
        "pkg/a.py": (
            "from __future__ import annotations\n"
            "from typing import TYPE_CHECKING\n"
            "import json\n"
            "from pkg.sub import c\n"  # a module: pkg.sub.c
            "from .b import NAME\n"  # a name in pkg.b
            "try:\n    import pkg.sub\nexcept ImportError:\n    pass\n"
            "if TYPE_CHECKING:\n    from pkg.d import Hint\n"
            "def later():\n    from pkg import e\n"
        ),
        "pkg/b.py": "NAME = 1\n",
        "pkg/d.py": "from . import a\n",
        "pkg/e.py": "",
        "pkg/sub/__init__.py": "from .c import VALUE\n",
        "pkg/sub/c.py": "from ..b import NAME\nVALUE = NAME\n",
    }
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    modules = parse_modules(module_files(tmp_path, ("pkg",)))
    loaded = import_graph(modules, deferred=False)
    assert loaded["pkg.a"] == {"pkg.sub.c", "pkg.b", "pkg.sub"}
    assert loaded["pkg.sub"] == {"pkg.sub.c"}
    assert loaded["pkg.sub.c"] == {"pkg.b"}
    assert loaded["pkg.d"] == {"pkg.a"}
    assert cycles(loaded) == []
    everywhere = import_graph(modules, deferred=True)
    assert everywhere["pkg.a"] == {"pkg.sub.c", "pkg.b", "pkg.sub", "pkg.d", "pkg.e"}
    assert cycles(everywhere) == [["pkg.a", "pkg.d"]]


def test_forbidden_imports_flags_each_forbidden_edge_and_only_those() -> None:
    graph = {
        "gateway.a": {"engine.backends.hf", "plumbing.http_server", "derender.chat", "engineering.x"},
        "gateway.b": {"engine", "onehop.serve", "wire.protocol"},
        "gateway.c": {"engine.backends", "gateway.a"},
        "engine.x": {"gateway.b", "onehop", "wire.protocol", "derender.chat"},
        "derender.chat": {"wire.openai_schema", "engine.outputs"},
        "wire.protocol": {"wire.openai_schema", "derender.vocab"},
        "onehop.cli": {"engine.app", "engine.backends.base", "gateway.a"},
    }
    assert forbidden_imports(graph, RULES) == [
        "derender.chat -> engine.outputs",
        "engine.x -> gateway.b",
        "engine.x -> onehop",
        "gateway.a -> engine.backends.hf",
        "gateway.b -> engine",
        "gateway.b -> onehop.serve",
        "gateway.c -> engine.backends",
        "wire.protocol -> derender.vocab",
    ]


def test_forbidden_imports_counts_deferred_and_type_checking_imports(tmp_path: Path) -> None:
    for folder in ("engine/backends", "gateway", "plumbing"):
        (tmp_path / folder).mkdir(parents=True)
    sources = {
        "engine/__init__.py": "",
        "plumbing/__init__.py": "",
        "plumbing/http_server.py": "",
        "engine/backends/__init__.py": "",
        "engine/backends/base.py": "",
        "engine/app.py": "",
        "gateway/__init__.py": "",
        "gateway/late.py": "def later():\n    from engine.backends.base import BackendError\n",
        "gateway/hint.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine import app\n",
        "gateway/shared.py": "from plumbing.http_server import *\n",
    }
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    modules = parse_modules(module_files(tmp_path, ("engine", "gateway", "plumbing")))
    assert forbidden_imports(import_graph(modules, deferred=False), RULES) == []
    assert forbidden_imports(import_graph(modules, deferred=True), RULES) == [
        "gateway.hint -> engine.app",
        "gateway.late -> engine.backends.base",
    ]


# ------------------------------------------------------------ the package


@functools.cache
def _modules() -> dict[str, tuple[ast.Module, bool]]:
    return parse_modules(module_files(ROOT, PACKAGES))


@functools.cache
def _graph(deferred: bool) -> dict[str, set[str]]:
    return import_graph(_modules(), deferred=deferred)


def test_the_graph_is_read_from_the_real_package() -> None:
    graph = _graph(False)
    assert len(graph) > 100
    assert "gateway.relay.splice" in graph["gateway.relay.engine"]
    assert "wire.protocol" in graph["engine.outputs"]
    assert sum(len(targets) for targets in graph.values()) > 300
    assert {"engine.app", "gateway.serving.app", "onehop.preflight"} <= graph["onehop.serve"] | graph["onehop.cli"]
    assert "plumbing.http_server" in graph["gateway.serving.app"]  # the shared plumbing the rules allow
    assert "derender.chat" in graph["engine.outputs"] and "derender.chat" in graph["gateway.flow.endpoints"]


def test_no_import_circles_when_modules_load() -> None:
    graph = _graph(False)
    circles = cycles(graph)
    assert not circles, "import circles among modules as they load:\n" + _describe(graph, circles)


def test_no_import_circles_counting_deferred_and_type_checking_imports() -> None:
    graph = _graph(True)
    circles = cycles(graph)
    assert not circles, "import circles (deferred and TYPE_CHECKING imports counted):\n" + _describe(graph, circles)


def test_engine_never_imports_gateway_or_onehop() -> None:
    wrong = forbidden_imports(_graph(True), {"engine": RULES["engine"]})
    assert not wrong, "engine modules that import gateway or onehop modules:\n" + "\n".join(wrong)


def test_gateway_never_imports_engine_or_onehop() -> None:
    wrong = forbidden_imports(_graph(True), {"gateway": RULES["gateway"]})
    assert not wrong, "gateway modules that import engine or onehop modules:\n" + "\n".join(wrong)


def test_the_shared_libraries_depend_on_no_server() -> None:
    shared = {package: RULES[package] for package in ("wire", "derender", "plumbing")}
    wrong = forbidden_imports(_graph(True), shared)
    assert not wrong, "shared library modules that import a server's or each other's modules:\n" + "\n".join(wrong)


GATEWAY_EDGE = frozenset(
    {
        "gateway.edge.access_log",
        "gateway.serving.app",
        "gateway.edge.auth",
        "gateway.edge.context",
        "gateway.edge.errors",
        "gateway.flow.lookups",
        "gateway.flow.pipeline",
        "gateway.relay.responder",
        "gateway.serving.state",
    }
)
"""The gateway's modules that see aiohttp's server side: the app and its middlewares, the edge
that makes a request's context (`pipeline.serve`, `context.Edge.of`), the responder that writes
to the client's connection, the app's key for its state. Every other step takes a context."""


def server_side_users(files: Mapping[str, Path]) -> set[str]:
    """The modules that import `aiohttp.web` (or one of its modules), at any depth."""
    found = set()
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                web = node.module == "aiohttp" and any(alias.name == "web" for alias in node.names)
                if web or node.module.startswith("aiohttp.web"):
                    found.add(name)
            elif isinstance(node, ast.Import) and any(alias.name.startswith("aiohttp.web") for alias in node.names):
                found.add(name)
    return found


def test_server_side_users_reads_each_form(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    sources = {
        "a": "from aiohttp import web\n",
        "b": "def f():\n    from aiohttp.web_request import Request\n",
        "c": "import aiohttp.web\n",
        "d": "import aiohttp\nfrom aiohttp import ClientSession\n",
    }
    for name, source in sources.items():
        (tmp_path / "pkg" / f"{name}.py").write_text(source, encoding="utf-8")
    files = {f"pkg.{name}": tmp_path / "pkg" / f"{name}.py" for name in sources}
    assert server_side_users(files) == {"pkg.a", "pkg.b", "pkg.c"}


def test_only_the_gateway_edge_sees_the_aiohttp_request() -> None:
    files = {name: path for name, path in module_files(ROOT, ("gateway",)).items()}
    assert server_side_users(files) == GATEWAY_EDGE
