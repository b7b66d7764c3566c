"""The package's layers: a module imports only from its own layer or lower ones.

Lowest first: errors, format, planning, storage, dist, sharding, engine, tools, models (model and optimizer
helpers), api, cli. The package's
``__init__`` and ``__main__`` may import anything. Above them all, ``integrations/`` (backends for
training frameworks) imports the public API only: ``checkpointer`` itself, nothing inside it. ``format/``, ``planning/`` and ``storage/``
never touch ``torch.distributed``. And no two modules import each other, however indirectly
(an import inside a function counts): :func:`test_no_import_cycles` names the cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "checkpointer"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE  # found without importing it
# STYLE.md's order: `tools` (offline tools and format conversion: export, verify, lazy_load, convert;
# uses the engine, used by api and cli) after engine.
LAYERS = ["errors", "format", "planning", "storage", "dist", "sharding", "engine", "tools", "models", "api", "cli"]
# Leaf helpers outside the list above, placed with errors (the lowest layer): anything may
# import them and they may import nothing of the package but errors and each other. A new
# top-level module fails test_no_upward_imports until it is given a place here or in LAYERS.
LEAF_HELPERS = {"buffers", "checksums", "progress", "settings"}
TOP = len(LAYERS)  # the package's __init__ / __main__
INTEGRATIONS = TOP + 1  # checkpointer/integrations: may import the package's public API only
NO_TORCH_DISTRIBUTED = {"format", "planning", "storage"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def layer_of(module: str) -> int | None:
    """The layer index of a ``checkpointer...`` module; TOP for the package itself; None if unknown."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return TOP
    if parts[1] in LEAF_HELPERS:
        return 0
    if parts[1] == "integrations":
        return INTEGRATIONS
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def imports_of(tree: ast.AST, module: str, package: bool, exists=None) -> list[tuple[int, str]]:
    """Every module a file imports (anywhere in it, relative ones resolved), with line numbers.

    ``from X import name`` counts as importing ``X.name`` when that is a module of the package
    (``exists``) or X is outside the package (``from torch import distributed``), else ``X``.
    """
    exists = exists or module_exists
    # The package a relative import is relative to.
    base = module.split(".") if package else module.split(".")[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                if node.level - 1 > len(base) - 1:
                    raise AssertionError(f"{module}:{node.lineno}: relative import leaves the package")
                target = ".".join(up + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                outside = target.split(".")[0] != PACKAGE
                out.append((node.lineno, sub if outside or exists(sub) else target))
    return out


def module_exists(module: str) -> bool:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return False
    path = ROOT.joinpath(*parts[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def uses_torch_distributed(tree: ast.AST, imported: list[tuple[int, str]]) -> list[int]:
    lines = [line for line, name in imported if name == "torch.distributed" or name.startswith("torch.distributed.")]
    for node in ast.walk(tree):
        # torch.distributed.xxx used through a plain `import torch`
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
    return sorted(lines)


def package_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def violations_of(path: Path, source: str, module: str) -> list[str]:
    tree = ast.parse(source, filename=str(path))
    own = layer_of(module)
    imported = imports_of(tree, module, is_package(path))
    found = []
    if own is None:
        return [f"{module}: not in any layer {LAYERS}"]
    for line, name in imported:
        if name.split(".")[0] != PACKAGE:
            continue
        other = layer_of(name)
        if own == INTEGRATIONS:
            if other not in (TOP, INTEGRATIONS) or name.endswith("__main__"):
                found.append(f"{module}:{line} (integrations) imports {name}: only the public API, `checkpointer`")
            continue
        if other is None:
            found.append(f"{module}:{line} imports {name}, which is in no layer")
        elif other > own:
            found.append(f"{module}:{line} ({LAYERS[own] if own < TOP else 'top'}) imports {name} (higher layer)")
    if own < TOP and LAYERS[own] in NO_TORCH_DISTRIBUTED:
        for line in uses_torch_distributed(tree, imported):
            found.append(f"{module}:{line} uses torch.distributed")
    return found


def test_package_files_found():
    names = {module_name(p) for p in package_files()}
    assert {"checkpointer.errors", "checkpointer.format.metadata", "checkpointer.planning.plan"} <= names


MAX_MODULE_LINES = 450
MAX_ENGINE_MODULES = 11


def test_modules_stay_small():
    """Small modules that each own one thing: none over 450 lines, at most 11 in the engine."""
    long = {str(p.relative_to(ROOT)): n for p in package_files() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
    engine = [p for p in package_files() if p.parent.name == "engine" and p.name != "__init__.py"]
    assert len(engine) <= MAX_ENGINE_MODULES, sorted(p.name for p in engine)


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_upward_imports(path):
    assert violations_of(path, path.read_text(), module_name(path)) == []


# ---------------------------------------------------------------------------------------------
# The checker itself can fail
# ---------------------------------------------------------------------------------------------


FAKE_ROOT = Path("/fake/checkpointer")


def check_fake(rel: str, source: str) -> list[str]:
    path = FAKE_ROOT / rel
    return violations_of(path, source, module_name(path, FAKE_ROOT))


@pytest.mark.parametrize(
    "rel, source",
    [
        ("format/x.py", "from ..engine import save\n"),
        ("format/x.py", "from ..planning.plan import build_save_plan\n"),
        ("format/x.py", "from checkpointer.storage import local\n"),
        ("format/x.py", "import checkpointer.dist\n"),
        ("format/x.py", "from .. import dist\n"),
        ("format/x.py", "from checkpointer import load_model_and_optim_state\n"),  # the top-level package
        ("errors.py", "from .format import metadata\n"),
        ("planning/plan.py", "def f():\n    from ..storage.base import Storage\n"),  # import in a function
        ("storage/local.py", "import typing\nif typing.TYPE_CHECKING:\n    from ..engine.save import X\n"),
        ("storage/__init__.py", "from ..sharding import piece_of\n"),
        ("dist.py", "from .sharding import x\n"),
        ("engine/save.py", "from ..api import y\n"),
        ("engine/load.py", "from ..tools.hf import HFSource\n"),
        ("api.py", "from .cli import main\n"),
        ("planning/x.py", "import torch.distributed as dist\n"),
        ("format/x.py", "from torch.distributed import all_gather\n"),
        ("storage/x.py", "from torch import distributed\n"),
        ("storage/x.py", "import torch\ntorch.distributed.barrier()\n"),
        ("storage/x.py", "from torch.distributed.tensor import DTensor\n"),
        ("format/x.py", "from ..unknown_layer import z\n"),
        ("unknown_layer.py", "import os\n"),
        ("buffers.py", "from .format.dtypes import itemsize\n"),
        ("integrations/x.py", "from checkpointer.api import save_model_and_optim_state\n"),
        ("integrations/x.py", "from ..engine.checkpointer import Checkpointer\n"),
        ("api.py", "from .integrations import torchtitan\n"),
    ],
)
def test_checker_catches(rel, source):
    assert check_fake(rel, source) != []


@pytest.mark.parametrize(
    "rel, source",
    [
        ("format/x.py", "from ..errors import CorruptCheckpointError\nfrom .dtypes import itemsize\nimport torch\n"),
        ("planning/plan.py", "from ..format.metadata import StorageMetadata\nfrom . import overlap\n"),
        ("storage/__init__.py", "from .base import Storage\n"),
        ("dist.py", "import torch.distributed as dist\nfrom .errors import RankFailedError\n"),
        ("engine/save.py", "from ..dist import barrier\nfrom ..sharding import x\nfrom . import load\n"),
        ("cli.py", "from .api import y\nfrom .engine.load import z\n"),
        ("__init__.py", "from .cli import main\nfrom .api import *\n"),
        ("__main__.py", "from checkpointer.cli import main\n"),
        ("format/x.py", "from ..buffers import memoryview_of\n"),
        ("checksums.py", "import ctypes\nfrom .errors import CheckpointError\n"),
        ("integrations/x.py", "import checkpointer\nimport torch\n"),
        ("integrations/x.py", "from checkpointer import Checkpointer\n"),
    ],
)
def test_checker_allows(rel, source):
    assert check_fake(rel, source) == []


def test_relative_import_resolution():
    tree = ast.parse("from ..format import metadata\nfrom . import overlap\nfrom .plan import x\nfrom .. import errors\n")
    got = imports_of(
        tree,
        "checkpointer.planning.sub",
        package=False,
        exists=lambda m: m in {"checkpointer.format.metadata", "checkpointer.planning.overlap"},
    )
    assert got == [
        (1, "checkpointer.format.metadata"),
        (2, "checkpointer.planning.overlap"),
        (3, "checkpointer.planning.plan"),
        (4, "checkpointer"),  # `errors` is not a module per `exists`: an attribute of the package
    ]
    # In a package's __init__, `.` is the package itself.
    tree = ast.parse("from .base import Storage\nfrom .. import errors\n")
    got = imports_of(tree, "checkpointer.storage", package=True, exists=lambda m: m == "checkpointer.errors")
    assert got == [(1, "checkpointer.storage.base"), (2, "checkpointer.errors")]


def test_relative_import_leaving_the_package_fails():
    with pytest.raises(AssertionError, match="leaves the package"):
        imports_of(ast.parse("from ... import y\n"), "checkpointer.planning.sub", package=False)


# ---------------------------------------------------------------------------------------------
# No import cycles between modules
# ---------------------------------------------------------------------------------------------


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """Module -> {module of the package it imports: the first line that does}, from
    ``{module: (source, is_package)}``. Every import counts, also one inside a function."""
    exists = sources.__contains__
    graph: dict[str, dict[str, int]] = {}
    for module, (source, package) in sources.items():
        edges = graph[module] = {}
        for line, name in imports_of(ast.parse(source), module, package, exists=exists):
            if name in sources and name != module:
                edges.setdefault(name, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """One cycle per group of modules that import each other (strongly connected components,
    Tarjan), each as ``a:LINE -> b:LINE -> a``; ``[]`` when there is none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:
        members, start = set(group), min(group)
        # The shortest way round from `start` back to itself, within the group (breadth first).
        came_from: dict[str, str] = {}
        todo, end = [start], None
        while todo and end is None:
            nxt = []
            for v in todo:
                for w in sorted(graph[v]):
                    if w == start:
                        end = v
                        break
                    if w in members and w not in came_from:
                        came_from[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            todo = nxt
        path = [end]
        while path[-1] != start:
            path.append(came_from[path[-1]])
        path.reverse()
        hops = [f"{a}:{graph[a][b]}" for a, b in zip(path, path[1:] + [start])]
        found.append(" -> ".join(hops + [start]))
    return sorted(found)


def test_no_import_cycles():
    sources = {module_name(p): (p.read_text(), is_package(p)) for p in package_files()}
    assert import_cycles(import_graph(sources)) == []


def test_cycle_checker_reports_a_cycle_through_a_function_level_import():
    sources = {
        "checkpointer.format.a": ("from .b import x\n", False),
        "checkpointer.format.b": ("import os\n\n\ndef f():\n    from .c import y\n", False),
        "checkpointer.format.c": ("from checkpointer.format import a\n", False),
        "checkpointer.format.d": ("from . import a, b\n", False),  # imports the cycle, is not in it
        "checkpointer.storage": ("from .base import Storage\n", True),
        "checkpointer.storage.base": ("def f():\n    from .local import LocalStorage\n", False),
        "checkpointer.storage.local": ("from .base import Storage\n", False),
    }
    assert import_cycles(import_graph(sources)) == [
        "checkpointer.format.a:1 -> checkpointer.format.b:5 -> checkpointer.format.c:1 -> checkpointer.format.a",
        "checkpointer.storage.base:2 -> checkpointer.storage.local:1 -> checkpointer.storage.base",
    ]


def test_cycle_checker_allows_a_tree():
    sources = {
        "checkpointer.storage": ("from .base import Storage\nfrom .dispatch import open_storage\n", True),
        "checkpointer.storage.base": ("import os\n", False),
        "checkpointer.storage.dispatch": ("from .base import Storage\ndef f():\n    from .local import L\n", False),
        "checkpointer.storage.local": ("from .base import Storage\n", False),
    }
    assert import_cycles(import_graph(sources)) == []
