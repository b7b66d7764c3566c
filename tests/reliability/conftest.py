"""Fixtures of the reliability and security tests (issue 6).

``run_distributed`` comes from ``tests/conftest.py`` (the harness of ``tests/support``, one set
of pools for every suite); ``rel_helpers``, ``hostile`` and ``dist_helpers`` are in
``tests/support``.

``template`` is a real checkpoint saved once per session by 3 ranks (FSDP2 model and AdamW
optimizer, plus flat-sharded and replicated tensors) of a forked gloo group; ``ckpt`` is a
private copy of it at ``<tmp>/run/step10`` for a test to damage.
"""

from __future__ import annotations

import shutil

import pytest
import rel_helpers


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The number of fuzz examples run (and of known bugs they hit), for the record."""
    if rel_helpers.FUZZ_STATS:
        runs = ", ".join(f"{n} {what}" for what, n in sorted(rel_helpers.FUZZ_STATS.items()))
        terminalreporter.write_line(f"fuzz: {sum(rel_helpers.FUZZ_STATS.values())} examples run ({runs})")
        for bug, n in sorted(rel_helpers.FUZZ_KNOWN_HITS.items()):
            terminalreporter.write_line(f"fuzz: {n} loader calls hit a known bug: {bug}")


@pytest.fixture(scope="session")
def template(tmp_path_factory) -> rel_helpers.Template:
    """A valid checkpoint of 3 ranks (a forked gloo group), saved once; tests damage copies."""
    root = tmp_path_factory.mktemp("template")
    results = rel_helpers.run_group(rel_helpers.save_template, 3, str(root), timeout=180)
    return rel_helpers.Template(str(root), rel_helpers.values(results)[0])


@pytest.fixture(scope="session")
def compact_template(tmp_path_factory) -> rel_helpers.Template:
    """The template's checkpoint in format 2 (shard rules, checksums in the rank files)."""
    root = tmp_path_factory.mktemp("compact_template")
    results = rel_helpers.run_group(rel_helpers.save_template, 3, str(root), True, timeout=180)
    return rel_helpers.Template(str(root), rel_helpers.values(results)[0])


@pytest.fixture
def compact_ckpt(compact_template, tmp_path) -> rel_helpers.Copy:
    """A private copy of the format-2 template."""
    dst = tmp_path / "run" / "step10"
    shutil.copytree(compact_template.root, dst)
    return rel_helpers.Copy(str(dst), compact_template.expected)


@pytest.fixture
def ckpt(template, tmp_path) -> rel_helpers.Copy:
    """A private copy of the template: ``top`` (model/ and optim/), ``model``, ``optim``, ``flat``."""
    dst = tmp_path / "run" / "step10"
    shutil.copytree(template.root, dst)
    return rel_helpers.Copy(str(dst), template.expected)
