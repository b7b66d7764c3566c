"""Crash safety of the training state: a save with ``train_state`` killed at any point never
leaves a step that ``latest_checkpoint`` returns without its train state. ``train/`` commits
before ``optim/``, whose commit is the checkpoint's, and ``latest_checkpoint`` counts a step
complete only when every part it holds committed."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import rel_helpers
import torch
from dist_helpers import build_model, build_optim, model_full_state, train

import checkpointer
from checkpointer import RNGState


def _train_state(step: int) -> dict:
    return {"step": step, "data": {"epoch": 2, "batch": step}, "rng": RNGState(), "t": torch.arange(4) * step}


def _killed_save(top, point, part, overwrite, use_async):
    model = build_model(1, seed=5)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    rel_helpers.install_kill(point, part)
    save = checkpointer.async_save_model_and_optim_state if use_async else checkpointer.save_model_and_optim_state
    out = save(top, model, optim, train_state=_train_state(20), save_overwrite=overwrite)
    if use_async:
        out.result()
    return "the save finished: the kill point was never reached"


def _check(run_dir: str, top: str, earlier: str) -> bool:
    """The newest complete step is the new one with its train state, or the earlier one."""
    latest = checkpointer.latest_checkpoint(run_dir)
    assert latest in (top, earlier), latest
    if latest != top:
        return False
    assert os.path.exists(os.path.join(top, "train", "metadata.json")), "a complete step without its train state"
    model = build_model(1, seed=9)
    optim = build_optim(model, "adamw")
    ts = checkpointer.load_model_and_optim_state(top, model, optim).train_state
    assert ts["step"] == 20 and torch.equal(ts["t"], torch.arange(4) * 20) and "rng" in ts
    return True


POINTS = ("rank_file_mid_write", "after_rank_files_before_metadata", "metadata_before_rename", "after_metadata_before_unlock")
# The async save shares the sync save's commit: two points a part suffice for it.
KILLS = [
    (point, part, overwrite, use_async)
    for part in ("train", "model", "optim")
    for use_async in (False, True)
    for point in (POINTS if not use_async else POINTS[:2])
    for overwrite in (False, True)
]


@pytest.mark.parametrize(
    "point,part,overwrite,use_async", KILLS,
    ids=[f"{p}-{q}-{'overwrite' if o else 'new'}-{'async' if a else 'sync'}" for p, q, o, a in KILLS],
)
def test_a_killed_save_never_leaves_a_step_without_its_train_state(ckpt, point, part, overwrite, use_async):
    top = os.path.join(ckpt.run_dir, "step20")
    if overwrite:  # the step was saved before, with another train state
        shutil.copytree(ckpt.top, top)
        model = build_model(1, seed=3)
        optim = build_optim(model, "adamw")
        checkpointer.save_model_and_optim_state(top, model, optim, train_state={"step": 1}, save_overwrite=True)
    result = rel_helpers.run_forked(_killed_save, top, point, part, overwrite, use_async, timeout=120)
    assert result.exitcode == -signal.SIGKILL, f"the save was not killed: {result}"
    whole = _check(ckpt.run_dir, top, ckpt.top)
    assert whole == (point == "after_metadata_before_unlock" and part == "optim")
    if not whole:  # recovery: the same step saved again with save_overwrite is complete, train state and all
        model = build_model(1, seed=5)
        optim = build_optim(model, "adamw")
        checkpointer.save_model_and_optim_state(top, model, optim, train_state=_train_state(20), save_overwrite=True)
        assert _check(ckpt.run_dir, top, ckpt.top)
        assert torch.equal(model_full_state(model)["proj.weight"], checkpointer.unshard_model_state(top)["proj.weight"])


def test_overwriting_without_train_state_removes_the_old_one(ckpt):
    top = os.path.join(ckpt.run_dir, "step20")
    model = build_model(1, seed=3)
    optim = build_optim(model, "adamw")
    checkpointer.save_model_and_optim_state(top, model, optim, train_state={"step": 1})
    checkpointer.save_model_and_optim_state(top, model, optim, save_overwrite=True)
    assert not os.path.exists(os.path.join(top, "train", "metadata.json"))
    assert checkpointer.latest_checkpoint(ckpt.run_dir) == top
    assert checkpointer.load_model_and_optim_state(top, model, optim).train_state == {}
    with pytest.raises(checkpointer.CheckpointMismatchError, match="step"):
        checkpointer.load_model_and_optim_state(top, model, optim, train_state={"step": RNGState()})


SAVES = ["sync", "async", "async-cached"]


@pytest.mark.parametrize("train_committed", [True, False], ids=["train-committed", "train-uncommitted"])
@pytest.mark.parametrize("how", SAVES)
def test_a_save_without_train_state_takes_over_a_crashed_saves_step(ckpt, how, train_committed):
    """A save killed after ``train/`` committed (or while writing it) leaves it behind; a save
    without ``train_state`` and without ``save_overwrite`` into that step (a restarted job
    re-reaching it) succeeds, async too (the step claimed in the background where the save's plan
    is cached), and the old ``train/`` is gone: never read as the new checkpoint's, nor making
    the new step look incomplete."""
    top = os.path.join(ckpt.run_dir, "step20")
    model = build_model(1, seed=3)
    optim = build_optim(model, "adamw")
    checkpointer.save_model_and_optim_state(top, model, optim, train_state={"step": 1})
    for part in ("model", "optim") + (() if train_committed else ("train",)):  # as if killed after train/ committed, or in it
        os.remove(os.path.join(top, part, "metadata.json"))
    other = torch.nn.Linear(5, 7)  # a model never saved: its plan is made in full, not reused
    other_optim = torch.optim.AdamW(other.parameters())
    if how == "async-cached":  # the same state saved once before: the next save reuses its plan
        checkpointer.async_save_model_and_optim_state(os.path.join(ckpt.run_dir, "step15"), other, other_optim).result()
    if how != "sync":
        checkpointer.async_save_model_and_optim_state(top, other, other_optim).result()
    else:
        checkpointer.save_model_and_optim_state(top, other, other_optim)
    train_dir = os.path.join(top, "train")
    assert not os.path.exists(train_dir) or os.listdir(train_dir) == []
    assert checkpointer.latest_checkpoint(ckpt.run_dir) == top
    loaded = torch.nn.Linear(5, 7)
    assert checkpointer.load_model_and_optim_state(top, loaded).train_state == {}
    assert torch.equal(loaded.weight, other.weight)
    with pytest.raises(FileExistsError, match="optim"):  # a complete step still refuses a save
        checkpointer.save_model_and_optim_state(top, other, other_optim)
