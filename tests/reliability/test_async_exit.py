"""An async save in flight when the process ends is finished, or its failure is printed naming
the checkpoint with exit status 1; ``destroy_process_group`` waits for it. Real processes:
each job is a Python script run as a subprocess (world size 1, and 2 over gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

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


def _expected_model(side: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(side, side)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, side)).sum().backward()
    optim.step()
    return model


def _run(tmp_path, out: str, world: int, mode: str = "plain") -> list[subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=REPO, CHECKPOINTER_TIMEOUT_S="60")
    rendezvous = str(tmp_path / "rendezvous")
    procs = [
        subprocess.Popen([sys.executable, "-c", JOB, out, str(world), str(rank), mode, rendezvous],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(world)
    ]
    done = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


def _check_saved(out: str, side: int = 256) -> None:
    expected = _expected_model(side)
    model = torch.nn.Linear(side, side)
    checkpointer.load_model_and_optim_state(out, model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))


def test_returning_from_main_finishes_the_async_save(tmp_path):
    out = str(tmp_path / "run" / "step1")
    (done,) = _run(tmp_path, out, 1)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert checkpointer.latest_checkpoint(str(tmp_path / "run")) == out
    _check_saved(out)


def test_destroy_process_group_waits_for_the_async_save(tmp_path):
    out = str(tmp_path / "run" / "step1")
    for rank, done in enumerate(_run(tmp_path, out, 2)):
        assert done.returncode == 0, f"rank {rank}: {done.stderr}"
        assert "error" not in done.stderr, f"rank {rank}: {done.stderr}"
    assert checkpointer.latest_checkpoint(str(tmp_path / "run")) == out
    _check_saved(out)


def test_a_failed_async_save_no_one_read_is_printed_and_fails_the_exit(tmp_path):
    out = str(tmp_path / "run" / "step1")
    (done,) = _run(tmp_path, out, 1, "exists")
    assert done.returncode == 1, done
    assert f"the async save of {out} failed" in done.stderr and "FileExistsError" in done.stderr, done.stderr


def test_an_async_save_still_writing_in_parallel_at_exit_is_finished(tmp_path):
    """The exit starts while the save's writer threads still have blocks to write: new work for
    them must be taken (concurrent.futures refuses it once the interpreter exits)."""
    out = str(tmp_path / "run" / "step1")
    (done,) = _run(tmp_path, out, 1, "slow")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert checkpointer.latest_checkpoint(str(tmp_path / "run")) == out
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


def test_an_async_save_where_no_thread_can_start_runs_on_the_kept_ones(tmp_path):
    """Python 3.12.0-3.12.2 start no thread at exit: a save with a cached plan (claimed and
    locked on the writer thread) then runs on threads earlier saves left idle, its lock's
    heartbeat too, and commits with no lock left behind."""
    env = dict(os.environ, PYTHONPATH=REPO, CHECKPOINTER_LOCK_LEASE_S="0.4")
    done = subprocess.run([sys.executable, "-c", NO_NEW_THREADS, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "['metadata.json', 'rank_0.safetensors'] ['metadata.json', 'rank_0.safetensors']", done.stdout
    torch.manual_seed(3)
    saved = torch.nn.Linear(64, 64)
    loaded = torch.nn.Linear(64, 64)
    checkpointer.load_model_and_optim_state(str(tmp_path / "step2"), loaded)
    assert torch.equal(loaded.weight, saved.weight) and torch.equal(loaded.bias, saved.bias)
