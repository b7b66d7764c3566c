"""Async saves: the checkpoint holds the state at the call, while training goes on meanwhile."""

from __future__ import annotations

import os
import time

import torch
from dist_helpers import (
    assert_local_same,
    assert_same,
    barrier,
    batch,
    build_model,
    build_optim,
    catch,
    collectives_called,
    files_under,
    model_full_state,
    optim_full_state,
    to_layout,
    train,
    zeros_like_layout,
)

from checkpointer import (
    Checkpointer,
    async_save_model_and_optim_state,
    load_model_and_optim_state,
    save_model_and_optim_state,
)
from checkpointer.format.layout import LOCK_FILENAME


def _async_save_and_train(rank, world_size, ckpt_a, ckpt_b):
    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(2))
    at_a = (model_full_state(model), optim_full_state(model, optim))
    fut_a = async_save_model_and_optim_state(ckpt_a, model, optim)
    train(model, optim, range(2, 4))  # parameters and state change in place while A is written
    at_b = (model_full_state(model), optim_full_state(model, optim))
    fut_b = async_save_model_and_optim_state(ckpt_b, model, optim)  # waits for A
    train(model, optim, range(4, 5))
    files_a, files_b = fut_a.result(timeout=60), fut_b.result(timeout=60)
    again = async_save_model_and_optim_state(ckpt_a, model, optim)
    error = catch(again.result, timeout=60)
    return at_a, at_b, [str(f) for f in files_a], [str(f) for f in files_b], error


def _load(rank, world_size, ckpt, expected_model, expected_optim):
    model = build_model(world_size, seed=1)
    optim = build_optim(model, "adamw", fresh=True)
    load_model_and_optim_state(ckpt, model, optim)
    assert_same(expected_model, model_full_state(model), "model")
    assert_same(expected_optim, optim_full_state(model, optim), "optimizer")
    return True


def test_async_save_snapshots_state(run_distributed, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    results = run_distributed(_async_save_and_train, 2, a, b)
    at_a, at_b = results[0][0], results[0][1]
    assert run_distributed(_load, 3, a, *at_a) == [True] * 3
    assert run_distributed(_load, 1, b, *at_b) == [True]
    created_a = set().union(*(set(r[2]) for r in results))
    assert len(created_a) == len(files_under(a)), (sorted(created_a), sorted(files_under(a)))
    for rank, r in enumerate(results):
        assert r[4] is not None and "FileExistsError" in r[4]["mro"], f"rank {rank}: {r[4]}"


def _train_waiting_for_staging(model, optim, steps, future):
    """As torchtitan's trainer: forward and backward overlap the staging; the optimizer step waits."""
    for step in steps:
        ids, target = batch(step)
        (model(ids) - target).pow(2).mean().backward()
        future.staged.result(timeout=60)
        optim.step()
        optim.zero_grad()


def _background_staging(rank, world_size, ckpt_a, ckpt_b):
    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(2))
    at_a = (model_full_state(model), optim_full_state(model, optim))
    counter = {"step": 7}
    fut_a = async_save_model_and_optim_state(ckpt_a, model, optim, train_state={"counter": counter}, stage_in_background=True)
    counter["step"] = 8  # train_state is taken before the call returns, even so
    _train_waiting_for_staging(model, optim, range(2, 4), fut_a)
    at_b = (model_full_state(model), optim_full_state(model, optim))
    fut_b = async_save_model_and_optim_state(ckpt_b, model, optim, stage_in_background=True)  # waits for A
    _train_waiting_for_staging(model, optim, range(4, 5), fut_b)
    fut_a.result(timeout=60), fut_b.result(timeout=60)
    restored = load_model_and_optim_state(ckpt_a, build_model(world_size, seed=1), None,
                                          train_state={"counter": None}).train_state
    refused = async_save_model_and_optim_state(ckpt_a, model, optim, stage_in_background=True)
    error = catch(refused.result, timeout=60)
    return at_a, at_b, restored.get("counter"), refused.staged.done(), error


def test_background_staging_saves_the_state_at_the_call(run_distributed, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    results = run_distributed(_background_staging, 2, a, b)
    at_a, at_b, counter, staged_done, error = results[0]
    assert counter == {"step": 7}
    assert staged_done and error is not None and "FileExistsError" in error["mro"], error
    assert run_distributed(_load, 2, a, *at_a) == [True] * 2
    assert run_distributed(_load, 2, b, *at_b) == [True] * 2


def _flat_async(rank, world_size, ckpt):
    full = {"w": torch.arange(91.0).reshape(7, 13), "r": torch.ones(4, dtype=torch.bfloat16)}
    state = {"w": to_layout(full["w"], "shard1@2"), "r": full["r"].clone()}
    ckpt_saver = Checkpointer()
    fut = ckpt_saver.async_save(ckpt, state)
    state["w"].to_local().add_(1000)  # changed after staging: must not reach the file
    state["r"].zero_()
    metadata, created = fut.result(timeout=60)
    assert set(metadata.tensors) == {"w", "r"}
    target = zeros_like_layout({"w": to_layout(full["w"], "shard1@2"), "r": full["r"]})
    Checkpointer().load(ckpt, target)
    assert_local_same(full, target)
    return True


def test_checkpointer_async_save(run_distributed, tmp_path):
    assert run_distributed(_flat_async, 2, str(tmp_path / "flat")) == [True, True]


def _failed_write_leaves_no_lock(rank, world_size, top):
    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    blocker = os.path.join(top, "model", f"rank_{world_size - 1}.safetensors")
    if rank == 0:
        os.makedirs(blocker)  # the last rank's model file cannot be renamed into place
    barrier()
    error = catch(async_save_model_and_optim_state(top, model, optim).result, timeout=60)
    barrier()
    left = sorted(f for f in files_under(top) if f.endswith(LOCK_FILENAME))
    if rank == 0:
        os.rmdir(blocker)
    barrier()
    retry = catch(save_model_and_optim_state, top, model, optim)  # the same step, saved again
    return error, left, retry


def test_failed_async_write_releases_every_lock(run_distributed, tmp_path):
    """The model part fails to write: the optimizer part, planned but never written, must not
    keep its save lock, or saving that step again says another save is in progress."""
    top = str(tmp_path / "step1")
    for rank, (error, left, retry) in enumerate(run_distributed(_failed_write_leaves_no_lock, 2, top)):
        assert error is not None, f"rank {rank}: the failed save reported no error"
        assert left == [], f"rank {rank}: locks left behind: {left}"
        assert retry is None, f"rank {rank}: saving again failed: {retry}"


def _load_while_async_save_writes(rank, world_size, ckpt):
    from unittest import mock

    from checkpointer.engine import async_save

    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(2))
    saved = (model_full_state(model), optim_full_state(model, optim))
    real_write = async_save.write_and_commit

    def slow_write(*args, **kwargs):
        time.sleep(1.0)  # the load below starts while this is still writing
        return real_write(*args, **kwargs)

    with mock.patch.object(async_save, "write_and_commit", slow_write):
        future = async_save_model_and_optim_state(ckpt, model, optim)
        fresh = build_model(world_size, seed=1)
        fresh_optim = build_optim(fresh, "adamw", fresh=True)
        load_model_and_optim_state(ckpt, fresh, fresh_optim)
        assert future.done()
    assert_same(saved[0], model_full_state(fresh), "model")
    assert_same(saved[1], optim_full_state(fresh, fresh_optim), "optimizer")
    unsharded = Checkpointer().unshard(os.path.join(ckpt, "model"))
    return sorted(unsharded)


def test_load_waits_for_an_async_save_into_the_same_directory(run_distributed, tmp_path):
    keys = run_distributed(_load_while_async_save_writes, 2, str(tmp_path / "ckpt"))
    assert keys[0] == keys[1] and keys[0]



def _blocking_collectives_then_a_refused_part(rank, world_size, base):
    """The collectives each of three async saves issues before it returns (in the caller's
    thread); then a save refused because only ``optim/`` holds a checkpoint."""
    import shutil

    from checkpointer import api

    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    api._DEFAULT._plan_cache.clear()  # this worker process saved the same model in earlier tests
    per_save = []
    for step in range(3):
        with collectives_called() as calls:
            future = async_save_model_and_optim_state(f"{base}/step{step}", model, optim)
        per_save.append(calls)
        future.result(timeout=60)
        train(model, optim, range(step + 1, step + 2))
    if rank == 0:
        shutil.rmtree(f"{base}/step1/model")
    barrier()
    refused = catch(async_save_model_and_optim_state(f"{base}/step1", model, optim).result, timeout=60)
    barrier()
    return per_save, refused, sorted(files_under(f"{base}/step1/model")), os.path.exists(f"{base}/step1/model")


def test_a_repeated_async_save_blocks_for_one_all_reduce(run_distributed, tmp_path):
    """Once planned, an async save keeps its caller for the copy and one all-reduce (the plans
    are unchanged on every rank); the directory checks and locks go to the background, which
    still refuses, before any rank writes, a save with a part already saved."""
    base = str(tmp_path)
    for rank, (per_save, refused, model_files, model_dir) in enumerate(
        run_distributed(_blocking_collectives_then_a_refused_part, 2, base)
    ):
        # The first save plans (from the FSDP2 layouts: all-reduces, no pieces all-gathered).
        assert len(per_save[0]) > 1 and "all_gather" not in per_save[0], f"rank {rank}: {per_save[0]}"
        assert per_save[1] == per_save[2] == ["all_reduce"], f"rank {rank}: {per_save}"
        assert refused is not None and "FileExistsError" in refused["mro"], f"rank {rank}: {refused}"
        assert "optim" in refused["msg"], refused["msg"]
        assert model_files == [] and not model_dir, f"rank {rank}: the refused save wrote {model_files}"


def _collectives_with_a_growing_train_state(rank, world_size, base):
    """The collectives of three async saves whose per-rank training state grows every step (as
    a data loader's token buffer does), and that state read back from the last."""
    from checkpointer import PerRank, api

    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    api._DEFAULT._plan_cache.clear()
    per_save = []
    for step in range(3):
        position = {"tokens": list(range(300 * (step + 1) * (rank + 1)))}
        with collectives_called() as calls:
            future = async_save_model_and_optim_state(
                f"{base}/step{step}", model, optim, train_state={"step": step, "loader": PerRank(position)})
        per_save.append(calls)
        future.result(timeout=60)
    loaded = load_model_and_optim_state(f"{base}/step2", model, optim, train_state={"step": None, "loader": None})
    return per_save, loaded.train_state["loader"] == position, loaded.train_state["step"]


def test_a_changed_train_state_is_planned_alone(run_distributed, tmp_path):
    """A training state whose size changes between saves is planned again; the model's and the
    optimizer's plans are reused (no pieces all-gathered for them, one all-reduce for all three)."""
    for rank, (per_save, same_loader, step) in enumerate(
        run_distributed(_collectives_with_a_growing_train_state, 2, str(tmp_path))
    ):
        assert same_loader and step == 2, f"rank {rank}"
        # train/ is planned from all-gathered pieces each time and agreed on; the first save
        # then plans model/ and optim/ from their layouts (an all-reduce and an agreement each),
        # the others reuse both plans and take their locks under one agreement
        assert per_save[0][-5:] == ["all_reduce"] * 5, f"rank {rank}: {per_save[0]}"
        assert per_save[1] == per_save[2] == per_save[0][:-4] + ["all_reduce"], f"rank {rank}: {per_save}"


def _collectives_over_many_saves_with_a_growing_train_state(rank, world_size, base):
    from checkpointer import PerRank, api

    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    api._DEFAULT._plan_cache.clear()
    per_save = []
    for step in range(10):
        position = {"tokens": list(range(300 * (step + 1)))}
        with collectives_called() as calls:
            future = async_save_model_and_optim_state(
                f"{base}/step{step}", model, optim, train_state={"loader": PerRank(position)})
        per_save.append(calls)
        future.result(timeout=60)
    return per_save


def test_reused_plans_stay_cached_while_the_train_state_keeps_changing(run_distributed, tmp_path):
    """Each new training-state plan goes into the plan cache: the model's and the optimizer's
    plans, reused every save, must not be the ones pushed out (they would be planned again)."""
    for rank, per_save in enumerate(
        run_distributed(_collectives_over_many_saves_with_a_growing_train_state, 2, str(tmp_path))
    ):
        assert all(calls == per_save[1] for calls in per_save[2:]), f"rank {rank}: {per_save}"


def _collectives_with_a_counter_that_gains_digits(rank, world_size, base):
    from checkpointer import api

    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    api._DEFAULT._plan_cache.clear()
    per_save = []
    for step in (9, 10, 1000):
        with collectives_called() as calls:
            future = async_save_model_and_optim_state(f"{base}/step{step}", model, optim, train_state={"step": step})
        per_save.append(calls)
        future.result(timeout=60)
    return per_save


def test_a_training_state_whose_json_grows_a_little_keeps_its_plan(run_distributed, tmp_path):
    """A step counter gaining digits changes its JSON's length, not the stored tensor's (padded):
    every part's plan is reused. An all-reduce each: the training state's phase, its job values'
    comparison, the plans' confirmation."""
    for rank, per_save in enumerate(run_distributed(_collectives_with_a_counter_that_gains_digits, 2, str(tmp_path))):
        assert per_save[1] == per_save[2] == ["all_reduce"] * 3, f"rank {rank}: {per_save}"
