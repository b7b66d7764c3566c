"""Every third-party module the package imports (anywhere in a file, lazily too) belongs to a
distribution that ``pyproject.toml`` declares as a runtime dependency: one that only arrives as
a dependency of a dependency (``botocore`` through ``boto3``) can be dropped by that package's
next release. The standard library is ``sys.stdlib_module_names``."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "checkpointer"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_canonical(re.match(r"[A-Za-z0-9._-]+", req).group(0)) for req in requirements}


def declared_runtime() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return _names(project["dependencies"])


def declared_extra(name: str) -> set[str]:
    """The distributions of the optional extra ``checkpointer[name]`` (empty when there is none)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return _names(project.get("optional-dependencies", {}).get(name, []))


def extra_of(where: str) -> str | None:
    """``checkpointer/integrations/X.py:LINE`` is the integration with framework X, whose own
    imports come from the extra ``checkpointer[X]``; None for every other module."""
    match = re.match(r"checkpointer/integrations/(\w+)\.py:", where)
    return match.group(1) if match and match.group(1) != "__init__" else None


@functools.cache
def third_party_imports() -> dict[str, list[str]]:
    """Absolute imports of modules outside the standard library and the package: module -> where
    (scanned once per session; callers do not change it)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from google.cloud import storage` imports the module google.cloud.storage
                modules = [_submodule_or_self(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in ("checkpointer", "__future__"):
                    continue
                found.setdefault(module, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def _submodule_or_self(module: str, name: str) -> str:
    if module.split(".")[0] in sys.stdlib_module_names or module.split(".")[0] == "checkpointer":
        return module
    try:
        return f"{module}.{name}" if importlib.util.find_spec(f"{module}.{name}") is not None else module
    except (ImportError, ValueError):
        return module


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution_of(module: str) -> str | None:
    """The installed distribution whose files hold ``module`` (namespace packages such as
    ``google`` are shared by several: the module's own file decides)."""
    top = module.split(".")[0]
    candidates = _packages_distributions().get(top, [])
    if len(set(candidates)) == 1:
        return _canonical(candidates[0])
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin in (None, "namespace"):
        return None
    origin = os.path.realpath(spec.origin)
    for dist in sorted(set(candidates)):
        files = importlib.metadata.distribution(dist).files or ()
        if any(os.path.realpath(str(f.locate())) == origin for f in files):
            return _canonical(dist)
    return None


def test_the_scan_sees_the_imports_it_must():
    imports = third_party_imports()
    for module in ("torch", "numpy", "pydantic", "boto3", "botocore.exceptions", "google_crc32c", "urllib3"):
        assert module in imports, module
    assert not any(m.split(".")[0] in ("os", "json", "checkpointer") for m in imports)


def test_integration_imports_belong_to_their_extra():
    assert extra_of("checkpointer/integrations/torchtitan.py:40") == "torchtitan"
    assert extra_of("checkpointer/integrations/__init__.py:1") is None
    assert extra_of("checkpointer/api.py:3") is None
    assert "torchtitan" in declared_extra("torchtitan")


def test_namespace_packages_resolve_to_their_own_distribution():
    assert distribution_of("google.cloud.storage") == "google-cloud-storage"
    assert distribution_of("google.auth.exceptions") == "google-auth"
    assert distribution_of("google.api_core.exceptions") == "google-api-core"


@pytest.mark.parametrize("module", sorted(third_party_imports()))
def test_every_import_is_a_declared_dependency(module):
    places = third_party_imports()[module]
    where = ", ".join(places)
    extras = {extra_of(p) for p in places}
    if None not in extras:
        # Only integrations import it: their extras declare it (installed or not here).
        (extra,) = extras
        dist = distribution_of(module) if importlib.util.find_spec(module.split(".")[0]) else None
        declared = declared_extra(extra) | declared_runtime()
        assert (dist or _canonical(module.split(".")[0])) in declared, (
            f"{module} (imported at {where}) is not declared by the extra checkpointer[{extra}]"
        )
        return
    dist = distribution_of(module)
    assert dist is not None, f"{module} (imported at {where}) is not installed, or not found in any distribution"
    assert dist in declared_runtime(), (
        f"{module} (imported at {where}) comes from {dist!r}, which pyproject.toml's [project] "
        "dependencies do not declare"
    )
