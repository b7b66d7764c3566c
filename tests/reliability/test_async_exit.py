"""An async save in flight when the process ends is finished, or its failure is printed naming
the checkpoint with exit status 1; ``destroy_process_group`` waits for it. Real processes:
each job is a Python script run as a subprocess (world size 1, and 2 over gloo), all started
together before the first test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from launches import Launches

import checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JOB = r"""
import os, sys
import torch
import torch.distributed as dist
import checkpointer

out, world, rank, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if world > 1:
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[5]}", rank=rank, world_size=world)
torch.manual_seed(0)
side = 1024 if mode == "slow" else 256
model = torch.nn.Linear(side, side)
optim = torch.optim.AdamW(model.parameters())
model(torch.ones(2, side)).sum().backward()
optim.step()
if mode == "slow":  # each parallel block write and upload takes a while: the exit starts mid-save
    import time
    from checkpointer.storage import direct, parallel
    write_block = direct.DirectStream._write_block
    direct.DirectStream._write_block = lambda *a: (time.sleep(0.2), write_block(*a))[1]
    submit = parallel.Workers.submit
    parallel.Workers.submit = lambda self, fn, *a: submit(self, lambda *b: (time.sleep(0.2), fn(*b))[1], *a)
    checkpointer.async_save_model_and_optim_state(out, model, optim, train_state={"step": 7})
    sys.exit(0)
if mode == "exists":
    checkpointer.save_model_and_optim_state(out, model, optim)
checkpointer.async_save_model_and_optim_state(out, model, optim)  # its future is never read
if world > 1:
    dist.destroy_process_group()
"""


JOBS = [("plain", 1, "plain"), ("two_ranks", 2, "plain"), ("exists", 1, "exists"), ("slow", 1, "slow")]
"""(name, world size, mode) of each job running JOB."""


def _expected_model(side: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(side, side)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, side)).sum().backward()
    optim.step()
    return model


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Iterator[tuple[Path, Launches]]:
    """Every test's job, started together before the first test (each takes seconds to start):
    the job of test ``name`` saves under ``root / name``."""
    root = tmp_path_factory.mktemp("jobs")
    launches = Launches(root)
    env = dict(os.environ, PYTHONPATH=REPO, CHECKPOINTER_TIMEOUT_S="60")
    for name, world, mode in JOBS:
        out = str(root / name / "run" / "step1")
        for rank in range(world):
            argv = [sys.executable, "-c", JOB, out, str(world), str(rank), mode, str(root / f"{name}.rendezvous")]
            launches.start(f"{name}.{rank}", argv, env)
    launches.start("no_new_threads", [sys.executable, "-c", NO_NEW_THREADS, str(root / "no_new_threads")],
                   dict(env, CHECKPOINTER_LOCK_LEASE_S="0.4"))
    yield root, launches
    launches.close()


def _run(jobs: tuple[Path, Launches], name: str) -> tuple[str, list[subprocess.CompletedProcess]]:
    """Job ``name``'s checkpoint path and its ranks' finished processes."""
    root, launches = jobs
    world = next(world for job, world, _ in JOBS if job == name)
    return str(root / name / "run" / "step1"), [launches.result(f"{name}.{rank}") for rank in range(world)]


def _check_saved(out: str, side: int = 256) -> None:
    expected = _expected_model(side)
    model = torch.nn.Linear(side, side)
    checkpointer.load_model_and_optim_state(out, model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))


def test_returning_from_main_finishes_the_async_save(jobs):
    out, (done,) = _run(jobs, "plain")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert checkpointer.latest_checkpoint(os.path.dirname(out)) == out
    _check_saved(out)


def test_destroy_process_group_waits_for_the_async_save(jobs):
    out, ranks = _run(jobs, "two_ranks")
    for rank, done in enumerate(ranks):
        assert done.returncode == 0, f"rank {rank}: {done.stderr}"
        assert "error" not in done.stderr, f"rank {rank}: {done.stderr}"
    assert checkpointer.latest_checkpoint(os.path.dirname(out)) == out
    _check_saved(out)


def test_a_failed_async_save_no_one_read_is_printed_and_fails_the_exit(jobs):
    out, (done,) = _run(jobs, "exists")
    assert done.returncode == 1, done
    assert f"the async save of {out} failed" in done.stderr and "FileExistsError" in done.stderr, done.stderr


def test_an_async_save_still_writing_in_parallel_at_exit_is_finished(jobs):
    """The exit starts while the save's writer threads still have blocks to write: new work for
    them must be taken (concurrent.futures refuses it once the interpreter exits)."""
    out, (done,) = _run(jobs, "slow")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert checkpointer.latest_checkpoint(os.path.dirname(out)) == out
    _check_saved(out, 1024)
    assert checkpointer.load_model_and_optim_state(out, torch.nn.Linear(1024, 1024), train_state={}).train_state["step"] == 7


NO_NEW_THREADS = r"""
import os, sys, threading, time
import torch
import checkpointer

out = sys.argv[1]
torch.manual_seed(3)
model = torch.nn.Linear(64, 64)
optim = torch.optim.AdamW(model.parameters())
checkpointer.async_save_model_and_optim_state(f"{out}/step1", model, optim).result()  # its plan is kept
time.sleep(1.0)  # the lock's heartbeat ends a quarter lease after the last lock goes

def refuse(self):
    raise RuntimeError("can't create new thread at interpreter shutdown")

threading.Thread.start = refuse  # Python 3.12.0-3.12.2, once the interpreter exits
checkpointer.async_save_model_and_optim_state(f"{out}/step2", model, optim).result()
print(sorted(os.listdir(f"{out}/step2/model")), sorted(os.listdir(f"{out}/step2/optim")))
"""


def test_an_async_save_where_no_thread_can_start_runs_on_the_kept_ones(jobs):
    """Python 3.12.0-3.12.2 start no thread at exit: a save with a cached plan (claimed and
    locked on the writer thread) then runs on threads earlier saves left idle, its lock's
    heartbeat too, and commits with no lock left behind."""
    root, launches = jobs
    done = launches.result("no_new_threads")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "['metadata.json', 'rank_0.safetensors'] ['metadata.json', 'rank_0.safetensors']", done.stdout
    torch.manual_seed(3)
    saved = torch.nn.Linear(64, 64)
    loaded = torch.nn.Linear(64, 64)
    checkpointer.load_model_and_optim_state(str(root / "no_new_threads" / "step2"), loaded)
    assert torch.equal(loaded.weight, saved.weight) and torch.equal(loaded.bias, saved.bias)
