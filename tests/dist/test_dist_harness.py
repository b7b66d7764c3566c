"""The harness itself: results, tracebacks, timeouts and dead workers."""

from __future__ import annotations

import os
import time

import pytest


def _echo(rank, world_size, value):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return (rank, world_size, value, int(t.item()), os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang_on_rank0(rank, world_size):
    if rank == 0:
        time.sleep(60)
    return rank


def _die_on_rank1(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def _no_pg(rank, world_size):
    import torch.distributed as dist

    return dist.is_initialized()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_per_rank(run_distributed, world_size):
    out = run_distributed(_echo, world_size, "x")
    total = world_size * (world_size + 1) // 2
    assert out == [(r, world_size, "x", total, "1", 1) for r in range(world_size)]


def test_no_process_group(run_distributed):
    assert run_distributed(_no_pg, 1, init_pg=False) == [False]


def test_failure_shows_traceback_and_pool_survives(run_distributed):
    with pytest.raises(pytest.fail.Exception) as info:
        run_distributed(_raise_on_rank1, 2)
    msg = str(info.value)
    assert "rank 1" in msg and "boom from rank one" in msg and "Traceback" in msg
    assert run_distributed(_echo, 2, 1)[0][3] == 3


def test_timeout_kills_the_pool(run_distributed):
    run_distributed(_no_pg, 2, init_pg=False)  # start-up is not part of the timeout
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as info:
        run_distributed(_hang_on_rank0, 2, timeout=3, init_pg=False)
    assert time.monotonic() - t0 < 30
    msg = str(info.value)
    assert "timed out" in msg and "rank(s) [0]" in msg and "_hang_on_rank0" in msg
    assert "in _hang_on_rank0\n" in msg  # the faulthandler dump of the hung rank


def test_dead_worker_after_restart(run_distributed):
    # The pool killed by the timeout above is started afresh here.
    with pytest.raises(pytest.fail.Exception) as info:
        run_distributed(_die_on_rank1, 2, init_pg=False)
    msg = str(info.value)
    assert "rank 1 died" in msg and "status 3" in msg
