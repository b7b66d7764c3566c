"""Fixtures shared by every suite: ``run_distributed`` over one set of session-wide worker pools.

``run_distributed(fn, world_size, *args, timeout=120, init_pg=True)`` runs the module-level
function ``fn(rank, world_size, *args)`` on every rank of a session-wide pool of that world
size and returns the per-rank results; a failing rank fails the test with its traceback.
``init_pg=False`` runs it in workers with no process group at all; ``dead_ok=True`` lets a
rank's process exit (its result is ``"died"``, and the pool is restarted for the next test);
``backend="nccl"`` runs it in a pool whose ranks each hold a GPU.
"""

from __future__ import annotations

import mmap
import os

import pytest
from harness import DistributedTestFailure, PoolManager  # tests/support, on pythonpath (pyproject.toml)


PRESTART_MIN_TESTS = 6


def _takes_o_direct(directory: str) -> bool:
    path = os.path.join(directory, ".o_direct_probe")
    buf = mmap.mmap(-1, 4096)  # page aligned
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        buf.close()
        return False
    try:
        return os.pwrite(fd, buf, 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


@pytest.fixture
def takes_o_direct():
    """``takes_o_direct(directory)``: whether one aligned 4 KiB ``O_DIRECT`` write works there
    (probed without the library)."""
    return _takes_o_direct


def pytest_collection_modifyitems(session, config, items):
    """Note how many collected tests use the pools: enough of them, and all pools start at once."""
    config._dist_pool_tests = sum(1 for item in items if "run_distributed" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def _pool_manager(pytestconfig):
    manager = PoolManager()
    if getattr(pytestconfig, "_dist_pool_tests", 0) >= PRESTART_MIN_TESTS:
        manager.prestart([(ws, True) for ws in (1, 2, 3, 4)])
    yield manager
    manager.shutdown()


@pytest.fixture(scope="session")
def run_distributed(_pool_manager):
    def run(fn, world_size, *args, timeout=120.0, init_pg=True, dead_ok=False, backend="gloo", **kwargs):
        __tracebackhide__ = True
        try:
            return _pool_manager.run(
                fn, world_size, *args, timeout=timeout, init_pg=init_pg, dead_ok=dead_ok, backend=backend, **kwargs
            )
        except DistributedTestFailure as e:
            report = str(e)
        pytest.fail(report, pytrace=False)

    return run
