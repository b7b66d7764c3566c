"""Crash safety: a save killed at any point (SIGKILL mid-write, a full disk, a failing upload)
leaves either the complete new checkpoint or a directory every loader reports as incomplete,
and never touches an earlier checkpoint in another directory. ``latest_checkpoint`` finds the
newest complete checkpoint and skips incomplete ones.

The killed saves run in forked processes (torch already imported, so no start-up cost) that
patch one function of ``checkpointer.storage.local`` or ``checkpointer.engine.save`` to
``SIGKILL`` themselves at the chosen point (``rel_helpers.install_kill``).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
import time
from typing import Any

import pytest
import rel_helpers
import torch
from dist_helpers import build_model, build_optim, model_full_state, train

import checkpointer
from checkpointer import Checkpointer, IncompleteCheckpointError
from checkpointer.storage.base import Writer
from checkpointer.storage.local import LocalStorage
from checkpointer.storage.memory import MemoryStorage

# --------------------------------------------------------------------------------------
# SIGKILL at chosen points of save_model_and_optim_state
# --------------------------------------------------------------------------------------


def _killed_save(
    top: str, model, optim, point: str, part: str, overwrite: bool, use_async: bool = False, planned_before: bool = False
) -> str:
    if planned_before:  # elsewhere, before the kill is installed: the killed save's plans are cached
        elsewhere = tempfile.mkdtemp()
        checkpointer.async_save_model_and_optim_state(elsewhere, model, optim).result()
        shutil.rmtree(elsewhere)
    rel_helpers.install_kill(point, part)
    if use_async:
        checkpointer.async_save_model_and_optim_state(top, model, optim, save_overwrite=overwrite).result()
    else:
        checkpointer.save_model_and_optim_state(top, model, optim, save_overwrite=overwrite)
    return "the save finished: the kill point was never reached"


def job_state(seed: int = 5):
    model = build_model(1, seed=seed)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    return model, optim


def loaders_of_dir(path: str, like: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "load": lambda: rel_helpers.load_part(path, like),
        "unshard": lambda: Checkpointer().unshard(path),
        "get_metadata": lambda: Checkpointer().get_metadata(path),
        "lazy_load": lambda: rel_helpers.lazy_all(path),
    }


def _lazy_no_checkpoint(outcome: rel_helpers.Outcome) -> bool:
    """lazy_load's answer for a directory with no rank file yet (see test_lazy_load_calls_a_crashed_save_incomplete)."""
    return (
        outcome.name == "lazy_load"
        and isinstance(outcome.error, checkpointer.CorruptCheckpointError)
        and "no checkpoint found" in str(outcome.error)
    )


def assert_incomplete(outcomes: dict[str, rel_helpers.Outcome], where: str) -> None:
    __tracebackhide__ = True
    bad = [
        o.describe()
        for o in outcomes.values()
        if not isinstance(o.error, IncompleteCheckpointError) and not _lazy_no_checkpoint(o)
    ]
    assert not bad, f"{where}: a loader did not report an incomplete checkpoint:\n" + "\n".join(bad)


def check_after_crash(top: str, saved_model: dict[str, torch.Tensor], earlier) -> bool:
    """Either the complete new checkpoint, or incomplete for every loader. Returns whether complete."""
    __tracebackhide__ = True
    complete = {p: os.path.exists(os.path.join(top, p, "metadata.json")) for p in ("model", "optim")}
    watched = (os.path.dirname(os.path.dirname(top)),)
    if complete["model"]:
        got = rel_helpers.load_part(os.path.join(top, "model"), saved_model)
        assert all(torch.equal(got[k], v) for k, v in saved_model.items()), "model/ is complete but holds other data"
    else:
        outcomes = rel_helpers.run_loaders(loaders_of_dir(os.path.join(top, "model"), saved_model), top, watched)
        assert_incomplete(outcomes, "model/")
    if not complete["optim"]:
        calls = {
            "get_metadata": lambda: Checkpointer().get_metadata(os.path.join(top, "optim")),
            "unshard": lambda: Checkpointer().unshard(os.path.join(top, "optim")),
            "unshard_optim_state": lambda: checkpointer.unshard_optim_state(top),
        }
        assert_incomplete(rel_helpers.run_loaders(calls, top, watched), "optim/")
    whole = all(complete.values())
    top_level = rel_helpers.run_loaders({"load_model_and_optim_state": lambda: rel_helpers.load_model_top(top)}, top, watched)
    if whole:
        assert top_level["load_model_and_optim_state"].ok, top_level["load_model_and_optim_state"].describe()
        got = top_level["load_model_and_optim_state"].value
        assert all(torch.equal(got[k], v) for k, v in saved_model.items())
    else:
        assert_incomplete(top_level, "the top-level checkpoint")
    latest = checkpointer.latest_checkpoint(os.path.dirname(top))
    assert latest == (top if whole else earlier.top), f"latest_checkpoint gave {latest}"
    return whole


KILLS = [
    ("rank_file_mid_write", "model", False),
    ("rank_file_mid_write", "optim", False),
    ("rank_file_before_rename", "model", False),
    ("after_rank_files_before_metadata", "model", False),
    ("after_rank_files_before_metadata", "optim", False),
    ("metadata_mid_write", "model", False),
    ("metadata_before_rename", "optim", False),
    ("after_metadata_before_unlock", "model", False),
    ("after_metadata_before_unlock", "optim", False),
    ("rank_file_mid_write", "model", True),
    ("after_rank_files_before_metadata", "model", True),
    ("metadata_before_rename", "model", True),
    ("after_metadata_before_unlock", "model", True),
]


@pytest.mark.parametrize("point,part,overwrite", KILLS, ids=[f"{p}-{q}{'-overwrite' if o else ''}" for p, q, o in KILLS])
def test_save_killed_with_sigkill(ckpt, point, part, overwrite):
    earlier = rel_helpers.snapshot(ckpt.top)
    top = os.path.join(ckpt.run_dir, "step20")
    if overwrite:  # an older, complete checkpoint (of another world size) is being replaced
        shutil.copytree(ckpt.top, top)
    model, optim = job_state()
    saved_model = model_full_state(model)

    result = rel_helpers.run_forked(_killed_save, top, model, optim, point, part, overwrite, timeout=120)
    assert result.exitcode == -signal.SIGKILL, f"the save was not killed: {result}"

    whole = check_after_crash(top, saved_model, ckpt)
    assert whole == (point == "after_metadata_before_unlock" and part == "optim")
    assert rel_helpers.snapshot(ckpt.top) == earlier, "the earlier checkpoint in another directory changed"

    # Recovery: the killed save's locks are stale (its process is gone), so a plain save into the
    # step succeeds, also where a part committed before the kill (the step is incomplete: a
    # restarted job re-reaching it is not blocked); the part is retired, never mixed in.
    if not whole:
        checkpointer.save_model_and_optim_state(top, model, optim)
        assert check_after_crash(top, saved_model, ckpt)
        left = [n for p in ("model", "optim") for n in os.listdir(os.path.join(top, p)) if n.startswith(".checkpointer-save")]
        assert not left, f"locks or takeover markers left: {left}"


ASYNC_KILLS = [
    ("rank_file_mid_write", "model", False, False),
    ("after_rank_files_before_metadata", "optim", False, False),
    ("rank_file_mid_write", "model", True, True),
    ("after_rank_files_before_metadata", "optim", True, True),
]


@pytest.mark.parametrize(
    "point,part,overwrite,planned_before",
    ASYNC_KILLS,
    ids=[f"{p}-{q}{'-overwrite-plan_cached' if o else ''}" for p, q, o, _ in ASYNC_KILLS],
)
def test_async_save_killed_with_sigkill(ckpt, point, part, overwrite, planned_before):
    """The same for an async save: the process dies while the background thread writes. With
    its plans cached, the save takes its locks (retiring the old checkpoint) in the background."""
    earlier = rel_helpers.snapshot(ckpt.top)
    top = os.path.join(ckpt.run_dir, "step20")
    if overwrite:
        shutil.copytree(ckpt.top, top)
    model, optim = job_state()
    result = rel_helpers.run_forked(_killed_save, top, model, optim, point, part, overwrite, True, planned_before, timeout=120)
    assert result.exitcode == -signal.SIGKILL, f"the save was not killed: {result}"
    assert not check_after_crash(top, model_full_state(model), ckpt)
    assert rel_helpers.snapshot(ckpt.top) == earlier


def test_lazy_load_calls_a_crashed_save_incomplete(ckpt):
    top = os.path.join(ckpt.run_dir, "step20")
    model, optim = job_state()
    result = rel_helpers.run_forked(_killed_save, top, model, optim, "rank_file_mid_write", "model", False, timeout=120)
    assert result.exitcode == -signal.SIGKILL, f"the save was not killed: {result}"
    for path in (top, os.path.join(top, "model")):
        with pytest.raises(IncompleteCheckpointError):
            rel_helpers.lazy_all(path)


# --------------------------------------------------------------------------------------
# A full disk (ENOSPC) and a failing upload
# --------------------------------------------------------------------------------------


class _LimitedWriter(Writer):
    def __init__(self, inner: Writer, name: str, budget: list[int], path: str):
        self.inner, self.name, self.budget, self.path = inner, name, budget, path

    def write(self, buffers):
        for b in buffers:
            b = memoryview(b).cast("B")
            if len(b) > self.budget[0]:
                if self.budget[0]:
                    self.inner.write([b[: self.budget[0]]])
                self.budget[0] = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
            self.inner.write([b])
            self.budget[0] -= len(b)

    def commit(self):
        self.inner.commit()

    def abort(self):
        self.inner.abort()


class FullDisk(LocalStorage):
    """A local directory whose file ``name`` hits ENOSPC after ``after`` bytes."""

    def __init__(self, root: str, name: str, after: int):
        super().__init__(root)
        self.name, self.budget = name, [after]

    def open_writer(self, name: str):
        writer = super().open_writer(name)
        if name != self.name:
            return writer
        return _LimitedWriter(writer, name, self.budget, self.join(name))


def no_temp_files(path: str) -> list[str]:
    return [n for n in os.listdir(path) if ".tmp-" in n]


ENOSPC_POINTS = [
    ("rank_0.safetensors", 0, False),
    ("rank_0.safetensors", 200, False),
    ("metadata.json", 0, False),
    ("metadata.json", 100, False),
    ("rank_0.safetensors", 200, True),
    ("metadata.json", 100, True),
]
BUG_LOCK_AFTER_COMMIT_ERROR = ()  # was an expected failure; fixed


@pytest.mark.parametrize(
    "name,after,overwrite",
    [
        pytest.param(*p, marks=BUG_LOCK_AFTER_COMMIT_ERROR if p[0] == "metadata.json" and not p[2] else ())
        for p in ENOSPC_POINTS
    ],
    ids=[f"{n}@{a}{'-overwrite' if o else ''}" for n, a, o in ENOSPC_POINTS],
)
def test_disk_full(ckpt, name, after, overwrite):
    earlier = rel_helpers.snapshot(ckpt.top)
    path = os.path.join(ckpt.run_dir, "step20")
    full = rel_helpers.flat_full()
    if overwrite:
        Checkpointer().save(path, {k: v + 1 for k, v in full.items()})
    with pytest.raises(OSError) as info:
        Checkpointer().save(FullDisk(path, name, after), full, save_overwrite=overwrite)
    assert info.value.errno == errno.ENOSPC or "No space left" in str(info.value), repr(info.value)
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    assert not no_temp_files(path), f"temp files left behind: {no_temp_files(path)}"
    outcomes = rel_helpers.run_loaders(loaders_of_dir(path, full), path, (ckpt.run_dir,))
    assert_incomplete(outcomes, "the directory of the failed save")
    assert rel_helpers.snapshot(ckpt.top) == earlier
    assert checkpointer.latest_checkpoint(ckpt.run_dir) == ckpt.top
    # Space is back: the same save, not forced, succeeds.
    Checkpointer().save(path, full, save_overwrite=overwrite)
    got = rel_helpers.load_part(path, full)
    assert all(torch.equal(got[k], v) for k, v in full.items())


class FailingUpload(MemoryStorage):
    """An object store whose upload of ``name`` fails (a 503 after the retries)."""

    def __init__(self, fail: str, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fail = fail

    def child(self, name: str) -> "FailingUpload":
        return FailingUpload(self.fail, self._key(name), _files=self._files)

    def write(self, name: str, data: bytes) -> None:
        if name == self.fail:
            raise OSError(f"upload of {self.join(name)} failed: 503 Service Unavailable")
        super().write(name, data)

    def open_writer(self, name: str):
        writer = super().open_writer(name)
        if name != self.fail:
            return writer
        url = self.join(name)

        class Failing(type(writer)):
            def commit(self):
                self.abort()
                raise OSError(f"upload of {url} failed: 503 Service Unavailable")

        writer.__class__ = Failing
        return writer


@pytest.mark.parametrize("fail", ["rank_0.safetensors", "metadata.json"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_upload_failing(fail, overwrite):
    root = FailingUpload(fail)
    full = rel_helpers.flat_full()
    earlier = {k: v * 3 for k, v in full.items()}
    Checkpointer().save(MemoryStorage("step10", _files=root._files), earlier)
    before = dict(root._files.data)
    target = root.child("step20")
    if overwrite:
        Checkpointer().save(MemoryStorage("step20", _files=root._files), {k: v - 1 for k, v in full.items()})
    with pytest.raises(OSError, match="503"):
        Checkpointer().save(target, full, save_overwrite=overwrite)
    outcomes = rel_helpers.run_loaders(loaders_of_dir_storage(target, full), "/nonexistent", ())
    assert_incomplete(outcomes, "the object-store prefix of the failed save")
    assert {k: v for k, v in root._files.data.items() if k.startswith("step10/")} == {
        k: v for k, v in before.items() if k.startswith("step10/")
    }
    got = rel_helpers.load_part(MemoryStorage("step10", _files=root._files), earlier)
    assert all(torch.equal(got[k], v) for k, v in earlier.items())


def loaders_of_dir_storage(storage, like):
    return {
        "load": lambda: rel_helpers.load_part(storage, like),
        "unshard": lambda: Checkpointer().unshard(storage),
        "get_metadata": lambda: Checkpointer().get_metadata(storage),
        "lazy_load": lambda: rel_helpers.lazy_all(storage),
    }


# --------------------------------------------------------------------------------------
# latest_checkpoint
# --------------------------------------------------------------------------------------


def test_latest_checkpoint_skips_incomplete_ones(ckpt):
    run = ckpt.run_dir
    for step in ("step2", "step9", "step20", "step100"):
        shutil.copytree(ckpt.top, os.path.join(run, step))
    os.remove(os.path.join(run, "step100", "optim", "metadata.json"))  # killed while saving optim/
    os.remove(os.path.join(run, "step20", "model", "metadata.json"))  # killed while saving model/
    shutil.rmtree(os.path.join(run, "step20", "optim"))
    os.makedirs(os.path.join(run, "step300"))  # just created
    assert checkpointer.latest_checkpoint(run) == os.path.join(run, "step10")  # numeric, not "step9" > "step10"
    os.remove(os.path.join(run, "step10", "model", "metadata.json"))
    assert checkpointer.latest_checkpoint(run) == os.path.join(run, "step9")
    # A flat Checkpointer directory counts as a checkpoint too.
    Checkpointer().save(os.path.join(run, "step50"), rel_helpers.flat_full())
    assert checkpointer.latest_checkpoint(run) == os.path.join(run, "step50")
    assert checkpointer.latest_checkpoint(os.path.join(run, "step300")) is None


def test_latest_checkpoint_goes_by_the_step_number(ckpt):
    """A name with a step and other numbers is ranked by its step, wherever the step sits."""
    run = ckpt.run_dir
    for name in ("step1000_epoch3", "epoch2-step900", "step950-rank8"):
        shutil.copytree(ckpt.top, os.path.join(run, name))
    shutil.rmtree(ckpt.top)
    assert checkpointer.latest_checkpoint(run) == os.path.join(run, "step1000_epoch3")
    shutil.rmtree(os.path.join(run, "step1000_epoch3"))
    assert checkpointer.latest_checkpoint(run) == os.path.join(run, "step950-rank8")


def test_latest_checkpoint_without_step_in_the_names_goes_by_the_last_number(ckpt):
    """Names without ``step`` are ranked by their last number, not their first (a mutant that
    took the first one, picking run2-200 here, passed every test)."""
    run = ckpt.run_dir
    for name in ("run1-300", "run2-200"):
        shutil.copytree(ckpt.top, os.path.join(run, name))
    shutil.rmtree(ckpt.top)
    assert checkpointer.latest_checkpoint(run) == os.path.join(run, "run1-300")


def test_a_refused_top_level_save_writes_neither_part(ckpt):
    """model/ without its metadata (and no lock) beside a complete optim/: a save without
    save_overwrite is refused before model/ is written, so no new model lands beside the old
    optimizer state."""
    os.remove(os.path.join(ckpt.top, "model", "metadata.json"))
    model, optim = job_state()
    with pytest.raises(FileExistsError, match="optim"):
        checkpointer.save_model_and_optim_state(ckpt.top, model, optim)
    assert not os.path.exists(os.path.join(ckpt.top, "model", "metadata.json")), "the refused save wrote model/"
