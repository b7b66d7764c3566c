"""The layout of the test suite (``tests/README.md``):

* every folder of tests is one pytest collects: pytest skips folders matching
  ``norecursedirs``, whose default includes ``dist`` (tests/dist went unrun by ``make test``
  until pyproject.toml set its own list);
* shared helpers live in ``tests/support`` (on ``pythonpath`` in pyproject.toml, and on the
  harness's workers' ``PYTHONPATH``), and no file under ``tests/`` edits ``sys.path``;
* ``tests/unit`` starts no process.
"""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
_SUPPORT = _TESTS / "support"
_PY_FILES = sorted(p for p in _TESTS.rglob("*.py") if "__pycache__" not in p.parts)

# sys.path.insert / .append / .extend / .remove, sys.path[...] = ..., sys.path += ..., sys.path = ...
_EDITS_SYS_PATH = re.compile(r"\bsys\s*\.\s*path\s*(\.\s*(insert|append|extend|remove|pop|clear)\b|\[[^\]]*\]\s*=(?!=)|\+=|=(?!=))")
# What starts a process: a subprocess, a fork, a multiprocessing context, the harness's pools.
_STARTS_A_PROCESS = re.compile(
    r"\b(subprocess|multiprocessing|run_distributed|run_group|run_forked)\b|\bos\.(fork\w*|system|spawn\w*|posix_spawn\w*|exec\w*)\s*\("
)


def _code(path: Path) -> str:
    """The file without its ``#`` comments (a comment may name what the code avoids)."""
    return "\n".join(line.split("#", 1)[0] for line in path.read_text(encoding="utf-8").splitlines())


def test_every_folder_holding_tests_is_collected(pytestconfig):
    skipped = pytestconfig.getini("norecursedirs")
    folders = sorted({path.parent for path in _TESTS.rglob("test_*.py")})
    assert len(folders) >= 8, folders
    for folder in folders:
        for part in folder.relative_to(_TESTS).parts:
            matched = [pattern for pattern in skipped if fnmatch(part, pattern)]
            assert not matched, f"pytest would skip {folder} ({part!r} matches norecursedirs {matched})"


def test_no_file_under_tests_edits_sys_path():
    offenders = [
        f"{path.relative_to(_TESTS)}:{n}: {line.strip()}"
        for path in _PY_FILES
        if path != Path(__file__).resolve()
        for n, line in enumerate(_code(path).splitlines(), 1)
        if _EDITS_SYS_PATH.search(line)
    ]
    assert not offenders, (
        "put shared helpers in tests/support (on pytest's pythonpath and the workers' PYTHONPATH) "
        "instead of editing sys.path:\n" + "\n".join(offenders)
    )


def test_the_support_folder_is_on_pythonpath():
    ini = tomllib.loads((_TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "tests/support" in ini["pythonpath"]
    assert not list(_SUPPORT.glob("test_*.py")), "tests/support holds helpers, not tests"


def test_helper_modules_live_in_tests_support():
    misplaced = [
        str(path.relative_to(_TESTS))
        for path in _PY_FILES
        if path.parent != _SUPPORT and not path.name.startswith("test_") and path.name != "conftest.py"
    ]
    assert not misplaced, f"move these helpers to tests/support (imported by bare name): {misplaced}"


def test_unit_tests_start_no_process():
    offenders = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted((_TESTS / "unit").glob("*.py"))
        if path != Path(__file__).resolve()
        for n, line in enumerate(_code(path).splitlines(), 1)
        if _STARTS_A_PROCESS.search(line)
    ]
    assert not offenders, "tests/unit runs in the pytest process only; move these to tests/dist, tests/cli, ...:\n" + "\n".join(offenders)
