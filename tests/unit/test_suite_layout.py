"""Every folder of tests is one pytest collects: pytest skips folders matching
``norecursedirs``, whose default includes ``dist`` (tests/dist went unrun by ``make test``
until pyproject.toml set its own list)."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]


def test_every_folder_holding_tests_is_collected(pytestconfig):
    skipped = pytestconfig.getini("norecursedirs")
    folders = sorted({path.parent for path in _TESTS.rglob("test_*.py")})
    assert len(folders) >= 8, folders
    for folder in folders:
        for part in folder.relative_to(_TESTS).parts:
            matched = [pattern for pattern in skipped if fnmatch(part, pattern)]
            assert not matched, f"pytest would skip {folder} ({part!r} matches norecursedirs {matched})"

