"""Fixtures of the lazy-loading and two-stage tests.

``run_distributed`` is the one of ``tests/dist`` (same harness, a pool per world size for
this directory's tests); this directory is put on ``sys.path`` for ``lazy_helpers``.
"""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(_HERE)
for _p in (os.path.dirname(_TESTS), os.path.join(_TESTS, "dist"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from harness import DistributedTestFailure, PoolManager  # noqa: E402


@pytest.fixture(scope="session")
def _lazy_pool_manager():
    manager = PoolManager()
    yield manager
    manager.shutdown()


@pytest.fixture(scope="session")
def run_distributed(_lazy_pool_manager):
    def run(fn, world_size, *args, timeout=120.0, init_pg=True, **kwargs):
        __tracebackhide__ = True
        try:
            return _lazy_pool_manager.run(fn, world_size, *args, timeout=timeout, init_pg=init_pg, **kwargs)
        except DistributedTestFailure as e:
            pytest.fail(str(e), pytrace=False)

    return run
