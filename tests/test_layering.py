"""Weft-core's imports point one way and close no cycle. Read with ast: nothing is imported (no torch).

Every import statement of every module under core/src/weft counts, those inside functions too: a
deferred import is still a dependency, deferring it only hides a cycle until the function runs.
An import under ``if TYPE_CHECKING:`` counts as well: it never runs, but a type named across a
cycle ties the two modules as tightly as a call does (neither can be read, moved or split without
the other). The exceptions are in :data:`TYPE_ONLY`, each with why.

The rules:

- no cycle between modules, and none between weft's packages: each subpackage (``weft.runner``,
  ``weft.distributed``, ...) and each top-level module (``weft.config``) is one, the contract layer
  is one; imports under TYPE_CHECKING close cycles too;
- the contract layer (``weft.contracts`` and the modules of :data:`CONTRACT_LAYER`) imports nothing
  else of weft;
- the layers of :data:`FORBIDDEN` import none of the layers above them (the runner no engine, no
  server; the engine no server);
- nothing in core imports a plugin distribution's package (``weft_*``): core finds plugins through
  entry points only;
- nothing in core imports :mod:`weft.api`, which loads the modules it names lazily (an import through
  it would hide the dependency from these checks): core imports the module that defines the name;
- an in-tree plugin (``plugins/*/src``, ``plugins-*/src``) imports core only through the plugin API,
  :data:`PLUGIN_API`: what no API version covers may change in any release.
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

PLUGIN_API = ("weft.contracts", "weft.api")
"""What a plugin may import of core (modules, or packages with their modules): the contracts, and what
:mod:`weft.api` lists; both are versioned by ``CORE_API``."""

TYPE_ONLY = {
    ("weft.contracts.hooks", "weft.config"): (
        "the weft_configure hookspec names the type of the configuration it hands to plugins; weft.config "
        "is not in the contract layer while it loads plugins to validate their [plugins.*] tables"
    ),
    ("weft.plugins.lock", "weft.config"): (
        "the lock helpers name the configuration they read [plugins] lock from; weft.config loads plugins "
        "(inside a function) to validate their [plugins.*] tables: the schema and the loading are split apart "
        "on branch arch-split, after which this entry goes where the schema imports no plugin"
    ),
    ("weft.plugins.selection", "weft.config"): (
        "the [use] checks name the UseConfig they read; weft.config loads plugins (inside a function) to "
        "validate their [plugins.*] tables (as weft.plugins.lock's entry)"
    ),
}
"""Imports under TYPE_CHECKING that the checks allow, the direction rules and the cycle checks alike: the
importer names a type and nothing else."""


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

    @property
    def allowed_type_only(self) -> bool:
        """An import under TYPE_CHECKING that :data:`TYPE_ONLY` allows."""
        return not self.runs and (self.source, self.target) in TYPE_ONLY

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
        imports += imports_of(module, path, modules, shown_path(path, sources))
    return imports


def shown_path(path: Path, sources: Path) -> Path:
    return path.relative_to(ROOT if path.is_relative_to(ROOT) else sources)


def plugin_sources(root: Path) -> list[Path]:
    """The source folders of the in-tree plugin distributions under ``root``."""
    return sorted([*root.glob("plugins/*/src"), *root.glob("plugins-*/src")])


def scan_plugins(root: Path, core: Path) -> list[Import]:
    """Every import of a weft module made by a module of an in-tree plugin under ``root`` (``core``: the sources of
    the weft package its imports resolve against)."""
    modules = module_names(core)
    imports = []
    for folder in plugin_sources(root):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found = imports_of(module, path, modules, path.relative_to(root))
            imports += [edge for edge in found if is_weft(edge.target)]
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
        if not edge.allowed_type_only and is_weft(edge.target):
            edges[edge.source, edge.target].append(edge)
    return [describe(cycle, edges) for cycle in cycles(edges)]


def package_cycles(imports: list[Import]) -> list[str]:
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for edge in imports:
        source, target = package_of(edge.source), package_of(edge.target)
        if not edge.allowed_type_only and source != target and is_weft(edge.target):
            edges[source, target].append(edge)
    return [describe(cycle, edges) for cycle in cycles(edges)]


def upward_imports(imports: list[Import]) -> list[str]:
    """Imports that break the contract-layer, FORBIDDEN and plugin-API rules, each with the fix."""
    problems = []
    for edge in imports:
        if not is_weft(edge.target) or edge.allowed_type_only:
            continue
        if edge.target == "weft.api":
            problems.append(
                f"  {edge}: core imports the plugin API, which hides the module it names from these "
                f"checks; import the module that defines the name"
            )
        if in_contract_layer(edge.source) and not in_contract_layer(edge.target):
            problems.append(
                f"  {edge}: the contract layer imports {package_of(edge.target)}; move what it needs "
                f"into weft.contracts (implementations stay above and subclass it)"
            )
        for layer, above in FORBIDDEN.items():
            for upper in above:
                if in_layer(edge.source, layer) and in_layer(edge.target, upper):
                    problems.append(
                        f"  {edge}: {layer} imports {upper}, a layer above it; pass what it needs down "
                        f"(in the step's output, an argument, a contract)"
                    )
    return problems


def plugin_imports(imports: list[Import]) -> list[str]:
    return [
        f"  {edge}: core imports a plugin; find it through its entry point (weft.plugins)"
        for edge in imports
        if edge.target.startswith("weft_")
    ]


def outside_plugin_api(imports: list[Import]) -> list[str]:
    """Plugin imports of core modules that :data:`PLUGIN_API` does not list, each with the fix."""
    return [
        f"  {edge}: a plugin imports {edge.target}, which no core API version covers; import it from "
        f"weft.api (add the name to weft.api's NAMES where a plugin needs it)"
        for edge in imports
        if not any(in_layer(edge.target, allowed) for allowed in PLUGIN_API)
    ]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return scan(SOURCES)


def test_no_module_closes_an_import_cycle(imports):
    found = module_cycles(imports)
    assert not found, "import cycles between modules (move what both need into a module both import):\n" + "\n".join(
        found
    )


def test_no_package_closes_an_import_cycle(imports):
    found = package_cycles(imports)
    assert not found, (
        "import cycles between weft's packages (move the module that imports back up, or what "
        "it imports down):\n" + "\n".join(found)
    )


def test_no_module_imports_a_layer_above_it(imports):
    found = upward_imports(imports)
    assert not found, "upward imports:\n" + "\n".join(found)


def test_core_imports_no_plugin(imports):
    found = plugin_imports(imports)
    assert not found, "core imports plugin packages:\n" + "\n".join(found)


def test_plugins_import_core_only_through_the_plugin_api():
    assert len(plugin_sources(ROOT)) >= 10, plugin_sources(ROOT)  # the scan sees the plugins it is meant to
    found = outside_plugin_api(scan_plugins(ROOT, SOURCES))
    assert not found, "plugins import core outside the plugin API:\n" + "\n".join(found)


def test_every_type_only_exception_is_still_a_type_checking_import(imports):
    for (source, target), reason in TYPE_ONLY.items():
        edges = [edge for edge in imports if (edge.source, edge.target) == (source, target)]
        assert edges, f"TYPE_ONLY allows {source} -> {target}, which no longer exists; remove the entry"
        running = [str(edge) for edge in edges if edge.runs]
        assert not running, f"TYPE_ONLY allows {source} -> {target} for types only ({reason}), but it runs: {running}"


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checks_find_what_they_look_for(tmp_path):
    """A made-up tree with one problem of each kind; a cycle closed under TYPE_CHECKING is one, as is a
    TYPE_CHECKING import of a layer above."""
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
    write_tree(tmp_path, files)
    found = scan(tmp_path)

    assert [cycle.splitlines()[0] for cycle in module_cycles(found)] == [
        "  weft.distributed.state -> weft.runner.step -> weft.distributed.state:",
        "  weft.engine.loop -> weft.engine.typed -> weft.engine.loop:",
        "  weft.serve.app -> weft.serve.routes -> weft.serve.app:",
    ]
    assert "weft/engine/typed.py:3, under TYPE_CHECKING" in module_cycles(found)[1]
    assert "weft/serve/app.py:2, inside a function" in module_cycles(found)[2]
    assert [cycle.splitlines()[0] for cycle in package_cycles(found)] == [
        "  weft.distributed -> weft.runner -> weft.distributed:",
    ]
    upward = upward_imports(found)
    assert len(upward) == 3, upward
    assert upward[0].startswith(
        "  weft.contracts.slot -> weft.engine.loop (weft/contracts/slot.py:1, module level): "
        "the contract layer imports weft.engine"
    )
    assert upward[1].startswith(
        "  weft.engine.loop -> weft.serve.app (weft/engine/loop.py:4, inside a function): "
        "weft.engine imports weft.serve"
    )
    assert upward[2].startswith(
        "  weft.runner.hints -> weft.engine.loop (weft/runner/hints.py:3, "
        "under TYPE_CHECKING): weft.runner imports weft.engine"
    )
    assert plugin_imports(found) == [
        "  weft.runner.step -> weft_cuda.kernels (weft/runner/step.py:1, module level): core imports a plugin; "
        "find it through its entry point (weft.plugins)"
    ]


def test_a_type_only_cycle_fails_the_cycle_checks(tmp_path):
    """The runner's old shape: a module naming a type of the module that imports it, only under TYPE_CHECKING.
    Across packages it closes a package cycle too; an import TYPE_ONLY allows closes none."""
    write_tree(
        tmp_path,
        {
            "weft/__init__.py": "",
            "weft/runner/__init__.py": "",
            "weft/runner/model_runner.py": "from weft.runner.sampler import Sampler\n\nclass RequestState: ...\n",
            "weft/runner/sampler.py": (
                "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n\n"
                "if TYPE_CHECKING:\n    from weft.runner.model_runner import RequestState\n"
            ),
            "weft/layers/__init__.py": "",
            "weft/layers/attention.py": "from weft.runner.sampler import Sampler\n",
            "weft/runner/batch.py": "import typing\nif typing.TYPE_CHECKING:\n    import weft.layers.attention\n",
            "weft/config.py": "def validate():\n    from weft.plugins.lock import lock_path\n",
            "weft/plugins/__init__.py": "",
            "weft/plugins/lock.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from weft.config import "
            "WeftConfig\n",
        },
    )
    found = scan(tmp_path)

    modules = module_cycles(found)
    assert [cycle.splitlines()[0] for cycle in modules] == [
        "  weft.runner.model_runner -> weft.runner.sampler -> weft.runner.model_runner:",
    ]
    assert (
        "weft.runner.sampler -> weft.runner.model_runner (weft/runner/sampler.py:5, under TYPE_CHECKING)" in modules[0]
    )
    packages = package_cycles(found)
    assert [cycle.splitlines()[0] for cycle in packages] == ["  weft.layers -> weft.runner -> weft.layers:"]
    assert "weft.runner.batch -> weft.layers.attention (weft/runner/batch.py:3, under TYPE_CHECKING)" in packages[0]
    assert ("weft.plugins.lock", "weft.config") in TYPE_ONLY  # the config <-> plugins pair is the allowed one


def test_a_plugin_importing_core_outside_the_plugin_api_fails(tmp_path):
    """Plugins under plugins/*/src and plugins-*/src, importing core through the API and around it."""
    write_tree(
        tmp_path,
        {
            "core/src/weft/__init__.py": "",
            "core/src/weft/api.py": "",
            "core/src/weft/contracts/__init__.py": "",
            "core/src/weft/contracts/tokenizer.py": "",
            "core/src/weft/runner/__init__.py": "",
            "core/src/weft/runner/worker.py": "",
            "core/src/weft/engine/__init__.py": "",
            "core/src/weft/engine/scheduler.py": "",
            "plugins/good/src/weft_good/__init__.py": (
                "from weft.api import HFTokenizer\nfrom weft.contracts.tokenizer import Tokenizer\n"
                "from weft.contracts import CORE_API\nfrom . import model\n"
            ),
            "plugins/bad/src/weft_bad/model.py": (
                "from weft.runner.worker import resolve_dtype\n\ndef build():\n    import weft.engine.scheduler\n"
            ),
            "plugins-xpu/src/weft_xpu/__init__.py": "from weft import __version__\n",
        },
    )
    assert plugin_sources(tmp_path) == [
        tmp_path / name for name in ("plugins/bad/src", "plugins/good/src", "plugins-xpu/src")
    ]

    found = outside_plugin_api(scan_plugins(tmp_path, tmp_path / "core/src"))
    assert [line.partition(":")[0] for line in found] == [
        "  weft_bad.model -> weft.runner.worker (plugins/bad/src/weft_bad/model.py",
        "  weft_bad.model -> weft.engine.scheduler (plugins/bad/src/weft_bad/model.py",
        "  weft_xpu -> weft (plugins-xpu/src/weft_xpu/__init__.py",
    ]
    assert found[0].endswith(
        "a plugin imports weft.runner.worker, which no core API version covers; import it "
        "from weft.api (add the name to weft.api's NAMES where a plugin needs it)"
    )
    assert "model.py:4, inside a function" in found[1]


def test_core_may_not_import_the_plugin_api(tmp_path):
    write_tree(
        tmp_path,
        {
            "weft/__init__.py": "",
            "weft/api.py": "",
            "weft/runner/__init__.py": "",
            "weft/runner/worker.py": "def build():\n    from weft.api import build_worker\n",
        },
    )
    assert upward_imports(scan(tmp_path)) == [
        "  weft.runner.worker -> weft.api (weft/runner/worker.py:2, inside a function): core imports the plugin "
        "API, which hides the module it names from these checks; import the module that defines the name"
    ]
