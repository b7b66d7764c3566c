"""No hangs: an error on any rank during a save or a load makes every other rank raise, within
a bounded time, with the failing rank and its error in the message. World size 3.

A rank that raises runs on the session's harness pool (``tests/support/harness.py``), which
survives it. A rank that dies (``os._exit`` mid-write or mid-read) runs in a gloo group of
forked processes of its own (``rel_helpers.run_group``), so no pool has to be restarted.
``CHECKPOINTER_TIMEOUT_S`` is 20 s in the workers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from unittest import mock

import pytest

import rel_helpers
import torch
from dist_helpers import catch

import checkpointer
from checkpointer import Checkpointer

TIMEOUT_S = 20.0  # CHECKPOINTER_TIMEOUT_S in the workers
ALIVE_S = 10.0  # a failing rank that is alive must be reported well before the timeout
DEAD_S = TIMEOUT_S + 15.0  # a dead rank: within the timeout, plus start-up slack


def names_rank(msg: str, rank: int) -> bool:
    return re.search(rf"rank\D{{0,3}}{rank}\b", msg) is not None


def _fail_writes(rank: int) -> mock._patch:
    def write_rank_file(*args, **kwargs):
        raise OSError(errno.EIO, f"injected I/O error while writing on rank {rank}")

    return mock.patch("checkpointer.engine.save.write_rank_file", write_rank_file)


def _fail_reads(rank: int) -> mock._patch:
    """Every read of tensor bytes fails: into destinations, and in hashed blocks (verified)."""
    def fail(self, name, *args, **kwargs):
        raise OSError(errno.EIO, f"injected I/O error while reading {name} on rank {rank}")

    return mock.patch.multiple("checkpointer.storage.local.LocalStorage", read_into=fail, read_blocks=fail)


def _die_mid_write(self, buffers, _real=None):
    os._exit(17)


def _die_mid_read(self, name, requests):
    os._exit(17)


# --------------------------------------------------------------------------------------
# Tasks, run on every rank
# --------------------------------------------------------------------------------------


def _save_task(rank, world_size, path, failing, how):
    with mock.patch.dict(os.environ, {"CHECKPOINTER_TIMEOUT_S": str(TIMEOUT_S)}):
        state = rel_helpers.flat_local(rank, world_size)
        if rank != failing:
            return catch(Checkpointer().save, path, state)
        if how == "raise":
            with _fail_writes(rank):
                return catch(Checkpointer().save, path, state)
        with (
            mock.patch("checkpointer.storage.local.LocalWriter.write", _die_mid_write),
            mock.patch("checkpointer.storage.local.LocalWriter.write_stable", _die_mid_write),
        ):
            Checkpointer().save(path, state)
        return "did not die"


def _load_task(rank, world_size, path, failing, how, strategy, verify=False):
    with mock.patch.dict(os.environ, {"CHECKPOINTER_TIMEOUT_S": str(TIMEOUT_S)}):
        state = rel_helpers.zeros_local(rank, world_size)
        if rank != failing:
            return catch(Checkpointer().load, path, state, strategy=strategy, verify=verify)
        if how == "raise":
            with _fail_reads(rank):
                return catch(Checkpointer().load, path, state, strategy=strategy, verify=verify)
        with mock.patch("checkpointer.storage.local.LocalStorage.read_into", _die_mid_read):
            Checkpointer().load(path, state, strategy=strategy)
        return "did not die"


def _load_optim_task(rank, world_size, top, failing):
    """load_model_and_optim_state, with the optimizer refusing its state on rank ``failing``
    only: the last step of the load, after every tensor has been read."""
    from dist_helpers import build_model, build_optim

    with mock.patch.dict(os.environ, {"CHECKPOINTER_TIMEOUT_S": str(TIMEOUT_S)}):
        model = build_model(world_size, seed=1)
        optim = build_optim(model, "adamw", fresh=True)
        if rank == failing:

            def refuse(state_dict):
                raise ValueError(f"injected optimizer error on rank {rank}")

            optim.load_state_dict = refuse
        return catch(checkpointer.load_model_and_optim_state, top, model, optim)


def _async_stage_task(rank, world_size, path, failing, planned_before):
    """An async save whose staging (the copy into host buffers) fails on rank ``failing`` only;
    then a plain save into the same directory, which a lock left behind would refuse. With
    ``planned_before``, the saver has saved the same state elsewhere: rank 0 takes the lock in
    the background, after staging."""
    from checkpointer.engine.async_save import AsyncSaver

    def no_memory(self, index, planned):
        raise MemoryError(f"injected staging failure on rank {rank}")

    with mock.patch.dict(os.environ, {"CHECKPOINTER_TIMEOUT_S": str(TIMEOUT_S)}):
        state = rel_helpers.flat_local(rank, world_size)
        saver = Checkpointer()
        if planned_before:
            saver.async_save(f"{path}_before", state).result(timeout=3 * TIMEOUT_S)
        with mock.patch.object(AsyncSaver, "_stage", no_memory) if rank == failing else contextlib.nullcontext():
            error = catch(lambda: saver.async_save(path, state).result(timeout=3 * TIMEOUT_S))
        return error, catch(Checkpointer().save, path, state)


def _failed_overwrite_task(rank, world_size, run, how):
    """A model + optimizer step saved, then an overwrite of it that fails before any rank writes:
    rank 1's model has another shape (refused while planning, ``sync`` or ``async``), or rank 1's
    staging fails in an async save whose plans are cached (``staging``). Returns the overwrite's
    error, whether the step is still the run's latest, and whether it loads the first values."""
    from checkpointer.engine.async_save import AsyncSaver

    def no_memory(self, index, planned):
        raise MemoryError(f"injected staging failure on rank {rank}")

    def async_save(*args, **kwargs):
        return checkpointer.async_save_model_and_optim_state(*args, **kwargs).result(timeout=3 * TIMEOUT_S)

    with mock.patch.dict(os.environ, {"CHECKPOINTER_TIMEOUT_S": str(TIMEOUT_S)}):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optim = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        optim.step()
        step = f"{run}/step100"
        async_save(step, model, optim)  # the plans are cached
        if how == "staging":
            with mock.patch.object(AsyncSaver, "_stage", no_memory) if rank == 1 else contextlib.nullcontext():
                error = catch(async_save, step, model, optim, save_overwrite=True)
        else:
            other = torch.nn.Linear(5 if rank == 1 else 4, 3)
            save = checkpointer.save_model_and_optim_state if how == "sync" else async_save
            error = catch(save, step, other, torch.optim.AdamW(other.parameters()), save_overwrite=True)
        back = torch.nn.Linear(4, 3)
        checkpointer.load_model_and_optim_state(step, back, torch.optim.AdamW(back.parameters()))
        same = all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
        return error, checkpointer.latest_checkpoint(run) == step, same


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------


def check_raised_rank(results, failing: int, needle: str) -> None:
    """The failing rank raised its own error; every other rank a CheckpointError naming it and its error."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        assert r is not None, f"rank {rank} raised nothing"
        assert r["seconds"] < ALIVE_S, f"rank {rank} took {r['seconds']:.1f}s to raise"
        assert needle in r["msg"], f"rank {rank}: {r['type']}: {r['msg']}"
        if rank != failing:
            assert "CheckpointError" in r["mro"], f"rank {rank} raised {r['type']}: {r['msg']}"
            assert names_rank(r["msg"], failing), f"rank {rank}'s error does not name rank {failing}: {r['msg']}"


def check_dead_rank(results: list[rel_helpers.ForkResult], failing: int) -> None:
    """The failing rank died; every other rank raised a CheckpointError in bounded time."""
    __tracebackhide__ = True
    assert results[failing].exitcode == 17, f"rank {failing} did not die: {results[failing]}"
    for rank, res in enumerate(results):
        if rank == failing:
            continue
        assert res.exitcode == 0 and res.error is None, f"rank {rank}: {res.error}\n{res.traceback}"
        r = res.value
        assert r is not None, f"rank {rank} raised nothing although rank {failing} died"
        assert "CheckpointError" in r["mro"], f"rank {rank} raised {r['type']}: {r['msg']}\n{r['traceback']}"
        assert r["seconds"] < DEAD_S, f"rank {rank} took {r['seconds']:.1f}s to raise"


def check_incomplete(path: str) -> None:
    __tracebackhide__ = True
    for call in (
        lambda: Checkpointer().get_metadata(path),
        lambda: Checkpointer().unshard(path),
        lambda: rel_helpers.load_part(path, rel_helpers.flat_full()),
    ):
        with pytest.raises(checkpointer.IncompleteCheckpointError):
            call()


@pytest.fixture
def saved_flat(ckpt):
    return ckpt.part("flat")


# --------------------------------------------------------------------------------------
# A rank that raises (harness pool)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("failing", [0, 1])
def test_save_with_a_rank_that_raises(run_distributed, tmp_path, failing):
    path = str(tmp_path / "ckpt")
    results = run_distributed(_save_task, 3, path, failing, "raise", timeout=120)
    check_raised_rank(results, failing, "injected I/O error")
    check_incomplete(path)


@pytest.mark.parametrize("verify", [False, True], ids=["", "verify"])
@pytest.mark.parametrize("strategy", ["default", "two_stage"])
def test_load_with_a_rank_that_raises(run_distributed, saved_flat, strategy, verify):
    """With verify, the ranks that received what the failing rank could not read name its error,
    not a checksum mismatch of the bytes it sent them (two-stage)."""
    results = run_distributed(_load_task, 3, saved_flat, 2, "raise", strategy, verify, timeout=120)
    check_raised_rank(results, 2, "injected I/O error")


def test_optimizer_load_with_a_rank_that_raises(run_distributed, ckpt):
    results = run_distributed(_load_optim_task, 3, ckpt.top, 1, timeout=120)
    check_raised_rank(results, 1, "injected optimizer error")


@pytest.mark.parametrize("planned_before", [False, True], ids=["first_save", "plan_cached"])
def test_async_save_with_a_rank_whose_staging_fails(run_distributed, tmp_path, planned_before):
    path = str(tmp_path / "ckpt")
    results = run_distributed(_async_stage_task, 3, path, 1, planned_before, timeout=120)
    check_raised_rank([error for error, _ in results], 1, "injected staging failure")
    assert [again for _, again in results] == [None] * 3, "a save after the failed one was refused"
    assert torch.equal(rel_helpers.load_part(path, rel_helpers.flat_full())["flat.w"], rel_helpers.flat_full()["flat.w"])


@pytest.mark.parametrize("how", ["sync", "async", "staging"])
def test_an_overwrite_that_fails_before_writing_keeps_the_step(run_distributed, tmp_path, how):
    """A refused save never damages an earlier checkpoint, even with ``save_overwrite``: the old
    step is retired only once every rank has planned (and, async, staged)."""
    results = run_distributed(_failed_overwrite_task, 2, str(tmp_path / "run"), how, timeout=120)
    needle = "injected staging failure" if how == "staging" else "is [3, 4] F32 on one rank and [3, 5] F32 on rank 1"
    for rank, (error, latest, same) in enumerate(results):
        assert error is not None and needle in error["msg"], f"rank {rank}: {error}"
        assert latest and same, f"rank {rank}: the failed overwrite retired the step (latest: {latest}, same values: {same})"


# --------------------------------------------------------------------------------------
# A rank that exits (a forked group per case, run once and shared by the tests below)
# --------------------------------------------------------------------------------------

EXIT_CASES = [("save", 0), ("save", 1), ("load", "default"), ("load", "two_stage")]


@pytest.fixture(scope="module")
def exit_runs(tmp_path_factory, template):
    """Each case of EXIT_CASES, run the first time a test asks for it: (checkpoint path, results)."""
    cache: dict[tuple, tuple[str, list[rel_helpers.ForkResult]]] = {}

    def run(op, arg):
        if (op, arg) not in cache:
            if op == "save":
                path = str(tmp_path_factory.mktemp("exit") / "ckpt")
                results = rel_helpers.run_group(_save_task, 3, path, arg, "exit", timeout=DEAD_S + 60)
            else:
                path = os.path.join(template.root, "flat")
                results = rel_helpers.run_group(_load_task, 3, path, 2, "exit", arg, timeout=DEAD_S + 60)
            cache[(op, arg)] = (path, results)
        return cache[(op, arg)]

    return run


@pytest.mark.parametrize("failing", [0, 1])
def test_save_with_a_rank_that_exits(exit_runs, failing):
    path, results = exit_runs("save", failing)
    check_dead_rank(results, failing)
    check_incomplete(path)


@pytest.mark.parametrize("strategy", ["default", "two_stage"])
def test_load_with_a_rank_that_exits(exit_runs, strategy):
    _, results = exit_runs("load", strategy)
    check_dead_rank(results, 2)


@pytest.mark.parametrize(
    "case", [("save", 0), ("save", 1), ("load", "default"), ("load", "two_stage")], ids=["save_rank0", "save", "load", "two_stage"]
)
def test_a_rank_that_exits_is_named_by_the_others(exit_runs, case):
    """Each rank counts its arrival at every collective in the rendezvous store; the survivors
    name the rank that never arrived. The two-stage load's data broadcasts count too: there the
    rank dies reading a unit it was to broadcast, and the others wait in that broadcast."""
    _, results = exit_runs(*case)
    failing = case[1] if case[0] == "save" else 2
    for rank, res in enumerate(results):
        if rank != failing:
            assert names_rank(res.value["msg"], failing), f"rank {rank}: {res.value['msg']}"


def test_the_store_host_that_exits_is_named_by_the_others(tmp_path):
    """Under tcp:// rank 0 hosts the store: when it dies, the others cannot ask the store who
    arrived, and must still raise in bounded time naming rank 0."""
    results = rel_helpers.run_group(_save_task, 3, str(tmp_path / "ckpt"), 0, "exit", timeout=DEAD_S + 60, rendezvous="tcp")
    check_dead_rank(results, 0)
    for rank in (1, 2):
        msg = results[rank].value["msg"]
        assert names_rank(msg, 0) and "store" in msg, f"rank {rank}: {msg}"


# --------------------------------------------------------------------------------------
# A collective call made by some ranks only
# --------------------------------------------------------------------------------------


def _wait_for(flag: str) -> None:
    """A rank that stays alive but never makes the call: it leaves once rank 0 has its answer."""
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.1)


def _save_on_rank_0_only(rank, world_size, top, flag):
    import time

    if rank != 0:
        return _wait_for(flag)
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        checkpointer.save_model_and_optim_state(top, model, optim)
    except checkpointer.CheckpointError as ex:
        return f"{type(ex).__name__}: {ex}", time.monotonic() - start
    finally:
        open(flag, "w").close()
    return "saved", time.monotonic() - start


def test_a_save_called_by_rank_0_only_says_every_rank_must_call_it(tmp_path):
    results = rel_helpers.run_group(
        _save_on_rank_0_only, 2, str(tmp_path / "step1"), str(tmp_path / "flag"), checkpointer_timeout_s=3.0
    )
    (first, seconds), second = rel_helpers.values(results)
    assert second is None
    assert seconds < 3.0 + 1.5, f"the error came {seconds:.1f}s after the call, CHECKPOINTER_TIMEOUT_S=3"
    assert first.startswith("RankFailedError"), first
    assert "rank 1" in first and "never entered this collective" in first, first
    assert "Every rank must call it together" in first and "no_dist=True" in first, first


def _save_with_train_state_on_rank_0_only(rank, world_size, top):
    import time

    model = torch.nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        checkpointer.save_model_and_optim_state(top, model, optim, train_state={"step": 1} if rank == 0 else None)
    except checkpointer.CheckpointError as ex:
        return f"{type(ex).__name__}: {ex}", time.monotonic() - start
    return "saved", time.monotonic() - start


def test_train_state_on_rank_0_only_says_the_calls_differ(tmp_path):
    """Both ranks call the save, one with ``train_state``: their collectives differ, and both wait
    in one. Both say so, within the timeout (it said a rank had stopped inside a collective)."""
    results = rel_helpers.run_group(
        _save_with_train_state_on_rank_0_only, 2, str(tmp_path / "step1"), checkpointer_timeout_s=3.0
    )
    for rank, (message, seconds) in enumerate(rel_helpers.values(results)):
        assert seconds < 3.0 + 1.5, f"rank {rank}: the error came {seconds:.1f}s after the call, CHECKPOINTER_TIMEOUT_S=3"
        assert message.startswith("RankFailedError") and "the ranks are in different collectives" in message, message
        assert f"this rank, {rank}, in an all-reduce" in message or f"this rank, {rank}, in a broadcast" in message, message
        assert "train_state=" in message and "same arguments" in message, message
    assert not os.path.exists(tmp_path / "step1" / "optim" / "metadata.json")


def _load_with_two_strategies(rank, world_size, top):
    import time

    state = {"w": torch.arange(64.0).reshape(8, 8)}
    Checkpointer().save(top, state)
    start = time.monotonic()
    try:
        Checkpointer().load(top, {"w": torch.zeros(8, 8)}, strategy="two_stage" if rank == 1 else "default")
    except checkpointer.CheckpointError as ex:
        return f"{type(ex).__name__}: {ex}", time.monotonic() - start
    return "loaded", time.monotonic() - start


def test_a_load_with_another_strategy_on_one_rank_says_the_calls_differ(tmp_path):
    """Rank 1 loads two-stage, rank 0 by default: their collectives differ (one rank read a
    reduction of another kind as a width, and raised a bare torch RuntimeError)."""
    results = rel_helpers.values(rel_helpers.run_group(
        _load_with_two_strategies, 2, str(tmp_path / "ckpt"), checkpointer_timeout_s=3.0))
    assert all(message.startswith("RankFailedError") and seconds < 3.0 + 1.5 for message, seconds in results), results
    said = [m for m, _ in results if "do not match" in m or "different collectives" in m]
    assert said and all("strategy=" in m and "same arguments" in m for m in said), results


def _prune_on_rank_0_only(rank, world_size, run, flag):
    if rank != 0:
        return _wait_for(flag)
    try:
        return f"returned {checkpointer.prune(run, keep_last=1)}"
    except checkpointer.CheckpointError as ex:
        return f"{type(ex).__name__}: {ex}"
    finally:
        open(flag, "w").close()


def test_a_prune_called_by_rank_0_only_deletes_nothing_and_says_so(tmp_path):
    """prune under ``if rank == 0:`` deleted, then returned normally: its broadcast does not wait
    for the others, and left the group one collective out of step (found by a review)."""
    from prune_helpers import make_run

    run = str(tmp_path / "run")
    make_run(run)
    before = sorted(os.listdir(run))
    first, second = rel_helpers.values(
        rel_helpers.run_group(_prune_on_rank_0_only, 2, run, str(tmp_path / "flag"), checkpointer_timeout_s=3.0)
    )
    assert second is None
    assert first.startswith("RankFailedError") and "never entered this collective" in first, first
    assert sorted(os.listdir(run)) == before


def _async_save_on_rank_0_only(rank, world_size, top, flag):
    if rank != 0:
        return _wait_for(flag)
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        checkpointer.async_save_model_and_optim_state(top, model, optim).result(timeout=60)
    except checkpointer.CheckpointError as ex:
        return f"{type(ex).__name__}: {ex}"
    finally:
        open(flag, "w").close()
    return "saved"


def test_a_first_async_save_on_rank_0_only_is_a_rank_failure_naming_it(tmp_path):
    """Its process group timed out in torch's store: a bare DistStoreError (found by a review)."""
    first, second = rel_helpers.values(rel_helpers.run_group(
        _async_save_on_rank_0_only, 2, str(tmp_path / "step1"), str(tmp_path / "flag"), checkpointer_timeout_s=3.0))
    assert second is None
    assert first.startswith("RankFailedError") and "every rank must make its first async save together" in first, first
