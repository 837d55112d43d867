"""Weft-core's imports point one way and close no cycle. Read with ast: nothing is imported (no torch).

Every import statement of every module under core/src/weft counts, those inside functions too: a
deferred import is still a dependency, deferring it only hides a cycle until the function runs.
An import under ``if TYPE_CHECKING:`` never runs, so it cannot close a cycle at runtime and the
cycle checks leave it out. The direction rules read it all the same: an annotation naming a layer
above is still a dependency on that layer. The exceptions are in :data:`TYPE_ONLY`, each with why.

The rules:

- no cycle between modules, and none between weft's packages: each subpackage (``weft.runner``,
  ``weft.distributed``, ...) and each top-level module (``weft.config``) is one, the contract layer
  is one;
- the contract layer (``weft.contracts`` and the modules of :data:`CONTRACT_LAYER`) imports nothing
  else of weft;
- the layers of :data:`FORBIDDEN` import none of the layers above them (the runner no engine, no
  server; the engine no server);
- nothing in core imports a plugin distribution's package (``weft_*``): core finds plugins through
  entry points only.
"""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "core" / "src"

CONTRACT_LAYER = {
    "weft.contracts": "the plugin API",
    "weft._version": "the release CORE_API is read from",
    "weft.sampling_params": "SamplingParams, carried by the executor contract's NewRequest; imports only contracts",
}
"""Module (or package) -> why it belongs to the contract layer, which may import only itself."""

FORBIDDEN = {
    "weft.runner": ("weft.engine", "weft.serve", "weft.entrypoints", "weft.cli"),
    "weft.engine": ("weft.serve", "weft.entrypoints", "weft.cli"),
}
"""Layer -> the layers above it, which it must not import (the engine drives the runner, the server the engine)."""

TYPE_ONLY = {
    ("weft.contracts.hooks", "weft.config"): (
        "the weft_configure hookspec names the type of the configuration it hands to plugins; weft.config "
        "is not in the contract layer while it loads plugins to validate their [plugins.*] tables"
    ),
}
"""Imports under TYPE_CHECKING that the direction rules allow: the importer names a type and nothing else."""


class Import(NamedTuple):
    source: str
    """The importing module."""
    target: str
    """The imported weft module (the longest prefix of the name that is one), or another package's name."""
    location: str
    """``file:line``."""
    where: str
    """``module level``, ``inside a function`` or ``under TYPE_CHECKING``."""

    @property
    def runs(self) -> bool:
        return self.where != "under TYPE_CHECKING"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.location}, {self.where})"


def module_names(sources: Path) -> dict[str, Path]:
    names = {}
    for path in sorted((sources / "weft").rglob("*.py")):
        parts = path.relative_to(sources).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def scan(sources: Path) -> list[Import]:
    """Every import of a weft module or of a plugin package (``weft_*``) made by a module under ``sources/weft``."""
    modules = module_names(sources)
    imports = []
    for module, path in modules.items():
        imports += imports_of(module, path, modules, path.relative_to(ROOT if path.is_relative_to(ROOT) else sources))
    return imports


def imports_of(module: str, path: Path, modules: dict[str, Path], shown: Path) -> list[Import]:
    """The imports of one module, in line order; ``from m import a, b`` is one import of ``m``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[Import] = set()

    def resolve(name: str) -> str:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or name

    def record(name: str, node: ast.stmt, where: str) -> None:
        if is_weft(name):
            target = resolve(name)
            if target != module:
                found.add(Import(module, target, f"{shown}:{node.lineno}", where))
        elif name.startswith("weft_"):
            found.add(Import(module, name, f"{shown}:{node.lineno}", where))

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                visit(child, "under TYPE_CHECKING")
            for child in node.orelse:
                visit(child, where)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and where == "module level":
            where = "inside a function"
        if isinstance(node, ast.Import):
            for alias in node.names:
                record(alias.name, node, where)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                record(submodule if submodule in modules else base, node, where)
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(ast.parse(path.read_text(), str(path)), "module level")
    return sorted(found, key=lambda edge: (int(edge.location.rpartition(":")[2]), edge.target))


def is_weft(name: str) -> bool:
    return name.split(".")[0] == "weft"


def in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def in_contract_layer(module: str) -> bool:
    return any(in_layer(module, layer) for layer in CONTRACT_LAYER)


def package_of(module: str) -> str:
    return "the contract layer" if in_contract_layer(module) else ".".join(module.split(".")[:2])


def cycles(edges: dict[tuple[str, str], list[Import]]) -> list[list[str]]:
    """Cycles of the graph ``edges`` spans, each as its nodes and a shortest one through its first node;
    every node that lies on a cycle is in one of them."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    found = []
    seen: set[str] = set()
    for start in sorted(graph):
        if start in seen:
            continue
        # Breadth-first from ``start``: the first path back to it is a shortest cycle through it.
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue and start not in came_from:
            node = queue.popleft()
            for successor in sorted(graph[node]):
                if successor not in came_from:
                    came_from[successor] = node
                    queue.append(successor)
        if start not in came_from:
            continue
        cycle = [start]
        while len(cycle) == 1 or cycle[-1] != start:
            cycle.append(came_from[cycle[-1]])
        cycle.reverse()
        seen.update(cycle)
        found.append(cycle)
    return found


def describe(cycle: list[str], edges: dict[tuple[str, str], list[Import]]) -> str:
    """The cycle and, for each of its arrows, the import that makes it (and how many others do)."""
    hops = []
    for source, target in pairwise(cycle):
        first, *others = edges[source, target]
        hops.append(f"    {first}" + (f" and {len(others)} more" if others else ""))
    return f"  {' -> '.join(cycle)}:\n" + "\n".join(hops)


def module_cycles(imports: list[Import]) -> list[str]:
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for edge in imports:
        if edge.runs and is_weft(edge.target):
            edges[edge.source, edge.target].append(edge)
    return [describe(cycle, edges) for cycle in cycles(edges)]


def package_cycles(imports: list[Import]) -> list[str]:
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for edge in imports:
        source, target = package_of(edge.source), package_of(edge.target)
        if edge.runs and source != target and is_weft(edge.target):
            edges[source, target].append(edge)
    return [describe(cycle, edges) for cycle in cycles(edges)]


def upward_imports(imports: list[Import]) -> list[str]:
    """Imports that break the contract-layer and FORBIDDEN rules, each with the fix."""
    problems = []
    for edge in imports:
        if not is_weft(edge.target) or (not edge.runs and (edge.source, edge.target) in TYPE_ONLY):
            continue
        if in_contract_layer(edge.source) and not in_contract_layer(edge.target):
            problems.append(f"  {edge}: the contract layer imports {package_of(edge.target)}; move what it needs "
                            f"into weft.contracts (implementations stay above and subclass it)")
        for layer, above in FORBIDDEN.items():
            for upper in above:
                if in_layer(edge.source, layer) and in_layer(edge.target, upper):
                    problems.append(f"  {edge}: {layer} imports {upper}, a layer above it; pass what it needs down "
                                    f"(in the step's output, an argument, a contract)")
    return problems


def plugin_imports(imports: list[Import]) -> list[str]:
    return [f"  {edge}: core imports a plugin; find it through its entry point (weft.plugins)"
            for edge in imports if edge.target.startswith("weft_")]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return scan(SOURCES)


def test_no_module_closes_an_import_cycle(imports):
    found = module_cycles(imports)
    assert not found, ("import cycles between modules (move what both need into a module both import):\n"
                       + "\n".join(found))


def test_no_package_closes_an_import_cycle(imports):
    found = package_cycles(imports)
    assert not found, ("import cycles between weft's packages (move the module that imports back up, or what "
                       "it imports down):\n" + "\n".join(found))


def test_no_module_imports_a_layer_above_it(imports):
    found = upward_imports(imports)
    assert not found, "upward imports:\n" + "\n".join(found)


def test_core_imports_no_plugin(imports):
    found = plugin_imports(imports)
    assert not found, "core imports plugin packages:\n" + "\n".join(found)


def test_every_type_only_exception_is_still_a_type_checking_import(imports):
    for (source, target), reason in TYPE_ONLY.items():
        edges = [edge for edge in imports if (edge.source, edge.target) == (source, target)]
        assert edges, f"TYPE_ONLY allows {source} -> {target}, which no longer exists; remove the entry"
        running = [str(edge) for edge in edges if edge.runs]
        assert not running, f"TYPE_ONLY allows {source} -> {target} for types only ({reason}), but it runs: {running}"


def test_the_checks_find_what_they_look_for(tmp_path):
    """A made-up tree with one problem of each kind, and a TYPE_CHECKING cycle that is none (while a
    TYPE_CHECKING import of a layer above is still one)."""
    files = {
        "weft/__init__.py": "",
        "weft/contracts/__init__.py": "",
        "weft/contracts/slot.py": "from weft.engine import loop\n",
        "weft/engine/__init__.py": "",
        "weft/engine/loop.py": "from weft.engine import typed\n\ndef f():\n    from weft.serve.app import handler\n",
        "weft/engine/typed.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from weft.engine.loop import f\n"
        ),
        "weft/runner/__init__.py": "",
        "weft/runner/step.py": "import weft_cuda.kernels\nfrom weft.distributed.state import groups\n",
        "weft/runner/hints.py": "import typing\nif typing.TYPE_CHECKING:\n    from weft.engine.loop import f\n",
        "weft/distributed/__init__.py": "",
        "weft/distributed/state.py": "def launch():\n    from weft.runner import step\n",
        "weft/serve/__init__.py": "",
        "weft/serve/app.py": "def create():\n    from .routes import handler\n",
        "weft/serve/routes.py": "from weft.serve.app import create\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = scan(tmp_path)

    assert [cycle.splitlines()[0] for cycle in module_cycles(found)] == [
        "  weft.distributed.state -> weft.runner.step -> weft.distributed.state:",
        "  weft.serve.app -> weft.serve.routes -> weft.serve.app:",
    ]
    assert "weft/serve/app.py:2, inside a function" in module_cycles(found)[1]
    assert [cycle.splitlines()[0] for cycle in package_cycles(found)] == [
        "  weft.distributed -> weft.runner -> weft.distributed:",
    ]
    upward = upward_imports(found)
    assert len(upward) == 3, upward
    assert upward[0].startswith("  weft.contracts.slot -> weft.engine.loop (weft/contracts/slot.py:1, module level): "
                                "the contract layer imports weft.engine")
    assert upward[1].startswith("  weft.engine.loop -> weft.serve.app (weft/engine/loop.py:4, inside a function): "
                                "weft.engine imports weft.serve")
    assert upward[2].startswith("  weft.runner.hints -> weft.engine.loop (weft/runner/hints.py:3, "
                                "under TYPE_CHECKING): weft.runner imports weft.engine")
    assert plugin_imports(found) == [
        "  weft.runner.step -> weft_cuda.kernels (weft/runner/step.py:1, module level): core imports a plugin; "
        "find it through its entry point (weft.plugins)"
    ]
