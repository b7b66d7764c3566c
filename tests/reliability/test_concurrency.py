"""Two jobs saving to one directory at once: one wins, the other gets FileExistsError, and the
directory never holds an interleaved mix of both.

Each job is a separate single-process "job" (a forked process, no process group in common),
started together from a gate; they save different data (and different keys) to one path.
"""

from __future__ import annotations

import os
import time
from unittest import mock

import pytest
import rel_helpers
import torch

import checkpointer
from checkpointer import Checkpointer, CheckpointError


def job_state(job: int) -> dict[str, torch.Tensor]:
    """Different values for each job, and a key only that job has."""
    state = {k: (v + 10 * (job + 1)).to(v.dtype) for k, v in rel_helpers.flat_full().items()}
    state[f"only_in_job{job}"] = torch.full((64, 33), float(job))
    return state


def _save_job(path: str, job: int, slow: float) -> str:
    """Save job ``job``'s state; with ``slow``, every write of this job takes that long."""
    from checkpointer.storage import local

    real, real_stable = local.LocalWriter.write, local.LocalWriter.write_stable

    def write(self, buffers):
        time.sleep(slow)
        return real(self, buffers)

    def write_stable(self, buffers):
        time.sleep(slow)
        return real_stable(self, buffers)

    with mock.patch.object(local.LocalWriter, "write", write), mock.patch.object(local.LocalWriter, "write_stable", write_stable):
        Checkpointer().save(path, job_state(job))
    return "saved"


def _save_model_job(top: str, job: int, slow: float) -> str:
    from dist_helpers import build_model, build_optim, train

    from checkpointer.storage import local

    model = build_model(1, seed=job)
    optim = build_optim(model, "adamw")
    train(model, optim, range(job + 1))
    real, real_stable = local.LocalWriter.write, local.LocalWriter.write_stable

    def write(self, buffers):
        time.sleep(slow)
        return real(self, buffers)

    def write_stable(self, buffers):
        time.sleep(slow)
        return real_stable(self, buffers)

    with mock.patch.object(local.LocalWriter, "write", write), mock.patch.object(local.LocalWriter, "write_stable", write_stable):
        checkpointer.save_model_and_optim_state(top, model, optim)
    return "saved"


def race(fn, path: str, slow: tuple[float, float], delay: float) -> list[rel_helpers.ForkResult]:
    """Start two jobs from one gate (the second ``delay`` seconds later); both results."""
    gate_a, gate_b = rel_helpers.new_gate(), rel_helpers.new_gate()
    a = rel_helpers.start_forked(fn, path, 0, slow[0], gate=gate_a)
    b = rel_helpers.start_forked(fn, path, 1, slow[1], gate=gate_b)
    time.sleep(0.3)  # both children are waiting at their gates
    gate_a.set()
    if delay:
        time.sleep(delay)
    gate_b.set()
    return [rel_helpers.finish_forked(*a, timeout=120), rel_helpers.finish_forked(*b, timeout=120)]


def winner_of(results: list[rel_helpers.ForkResult]) -> int:
    __tracebackhide__ = True
    ok = [i for i, r in enumerate(results) if r.value == "saved"]
    refused = [i for i, r in enumerate(results) if r.error_type == "FileExistsError"]
    assert len(ok) == 1 and len(refused) == 1, f"expected one winner and one FileExistsError: {results}"
    assert all(r.exitcode == 0 for r in results), results
    return ok[0]


ROUNDS = [
    ("together", (0.0, 0.0), 0.0),
    ("together_again", (0.0, 0.0), 0.0),
    ("second_arrives_mid_write", (0.2, 0.0), 0.25),
    ("first_is_slow", (0.2, 0.2), 0.0),
    ("second_arrives_after", (0.0, 0.0), 3.0),
]


@pytest.mark.parametrize("name,slow,delay", ROUNDS, ids=[r[0] for r in ROUNDS])
def test_two_jobs_saving_to_one_directory(tmp_path, name, slow, delay):
    path = str(tmp_path / "ckpt")
    results = race(_save_job, path, slow, delay)
    winner = winner_of(results)
    expected = job_state(winner)
    assert Checkpointer().get_metadata(path).tensors.keys() == expected.keys(), "metadata of the loser is in there"
    got = rel_helpers.load_part(path, expected, verify=True)  # checksums: no byte of the loser
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert Checkpointer().unshard(path).keys() == expected.keys()
    leftovers = [n for n in os.listdir(path) if n.startswith(".")]
    assert not leftovers, f"left behind: {leftovers}"


def test_two_jobs_saving_model_and_optimizer_to_one_directory(tmp_path):
    """save_model_and_optim_state writes two directories: the winner of model/ must win optim/ too."""
    from dist_helpers import build_model, model_full_state

    top = str(tmp_path / "step1")
    results = race(_save_model_job, top, (0.05, 0.05), 0.0)
    winner = winner_of(results)
    want = build_model(1, seed=winner)
    from dist_helpers import build_optim, train

    train(want, build_optim(want, "adamw"), range(winner + 1))
    expected = model_full_state(want)
    got = rel_helpers.load_model_top(top)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    steps = {
        int(s["step"].item()) for s in checkpointer.unshard_optim_state(top)["state"].values() if "step" in s
    }
    assert steps == {winner + 1}, f"optimizer state of another job: steps {steps}"


def _save_after_this_rank_file(monkeypatch, then) -> None:
    """Make the next save call ``then()`` right after it has written its rank file, before it commits."""
    from checkpointer.engine import save as save_module

    real = save_module.write_rank_file
    calls = []

    def write_then(*args, **kwargs):
        out = real(*args, **kwargs)
        if not calls:
            calls.append(1)
            then()
        return out

    monkeypatch.setattr(save_module, "write_rank_file", write_then)


def test_with_save_overwrite_a_save_whose_lock_was_taken_over_does_not_commit(tmp_path, monkeypatch):
    """Job 0 has written its file when job 1 (save_overwrite=True) takes the lock, saves and
    commits. Job 0 must not then commit its metadata.json over job 1's files: it gets
    FileExistsError, and job 1's checkpoint stands whole."""
    path = str(tmp_path / "ckpt")
    _save_after_this_rank_file(monkeypatch, lambda: Checkpointer().save(path, job_state(1), save_overwrite=True))
    with pytest.raises(FileExistsError, match="took over its lock"):
        Checkpointer().save(path, job_state(0), save_overwrite=True)
    expected = job_state(1)
    assert Checkpointer().get_metadata(path).tensors.keys() == expected.keys()
    got = rel_helpers.load_part(path, expected, verify=True)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert not [n for n in os.listdir(path) if n.startswith(".")]


def test_a_save_leaves_the_lock_another_save_holds(tmp_path, monkeypatch):
    """The lock is another save's when this one comes to commit (that save is still writing):
    this one neither commits nor removes that lock."""
    from checkpointer.format.layout import LOCK_FILENAME

    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, job_state(0))
    theirs = b'{"token": "another job"}'

    def take_over() -> None:
        with open(os.path.join(path, LOCK_FILENAME), "wb") as f:
            f.write(theirs)

    _save_after_this_rank_file(monkeypatch, take_over)
    with pytest.raises(FileExistsError, match="took over its lock"):
        Checkpointer().save(path, job_state(1), save_overwrite=True)
    with open(os.path.join(path, LOCK_FILENAME), "rb") as f:
        assert f.read() == theirs
    assert not os.path.exists(os.path.join(path, "metadata.json"))  # retired before any file was written


def test_a_lock_that_grew_past_ours_is_not_ours_and_is_not_read_whole(tmp_path, monkeypatch):
    """The lock file now holds this save's bytes and then 1 MiB more: it is not this save's lock
    (only a prefix matches), and telling so reads no further than one byte past ours."""
    from checkpointer.format.layout import LOCK_FILENAME
    from checkpointer.storage.local import LocalStorage

    path = str(tmp_path / "ckpt")
    lock_path = os.path.join(path, LOCK_FILENAME)
    ours_size = []
    lock_reads = []
    real_read = LocalStorage.read

    def recording_read(self, name, start=0, end=None):
        data = real_read(self, name, start, end)
        if name == LOCK_FILENAME:
            lock_reads.append(len(data))
        return data

    def grow() -> None:
        with open(lock_path, "r+b") as f:
            ours_size.append(len(f.read()))
            f.write(b" " * (1 << 20))

    monkeypatch.setattr(LocalStorage, "read", recording_read)
    _save_after_this_rank_file(monkeypatch, grow)
    with pytest.raises(FileExistsError, match="took over its lock"):
        Checkpointer().save(path, job_state(0))
    assert os.path.getsize(lock_path) == ours_size[0] + (1 << 20)  # left alone: not ours
    assert lock_reads and max(lock_reads) == ours_size[0] + 1
    assert not os.path.exists(os.path.join(path, "metadata.json"))


def same_layout_state(job: int) -> dict[str, torch.Tensor]:
    """The same keys, shapes and dtypes for every job; only the values differ."""
    return {k: (v + 10 * (job + 1)).to(v.dtype) for k, v in rel_helpers.flat_full().items()}


def test_a_save_overtaken_before_its_rank_file_is_named_leaves_the_winner_whole(tmp_path, monkeypatch):
    """Two saves with save_overwrite=True: job 1 saves and commits while job 0 is still writing.
    Job 0's rank file, written, does not then take its name over job 1's (it finds
    ``metadata.json`` there first): job 0 fails, and job 1's checkpoint loads whole."""
    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, same_layout_state(2))
    winner = same_layout_state(1)

    from checkpointer.engine import save as save_module

    real = save_module.write_rank_file
    calls = []

    def write_after_the_winner(*args, **kwargs):
        if not calls:
            calls.append(1)
            Checkpointer().save(path, winner, save_overwrite=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "write_rank_file", write_after_the_winner)
    with pytest.raises(CheckpointError, match="another save committed here while this one was writing"):
        Checkpointer().save(path, same_layout_state(0), save_overwrite=True)
    monkeypatch.undo()
    for verify in (False, True):
        loaded = rel_helpers.load_part(path, winner, verify=verify)
        assert all(torch.equal(loaded[k], v) for k, v in winner.items()), f"verify={verify}"


def test_a_rank_file_of_another_save_is_refused_on_every_load(tmp_path):
    """A rank file that landed from another save of the same layout (a rename racing the check
    above): only the file id tells them apart, and every load, with or without verify,
    ``unshard`` and ``checkpointer verify`` refuse the directory rather than read its bytes."""
    from checkpointer import CorruptCheckpointError
    from checkpointer.cli import main as cli_main

    path, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    winner = same_layout_state(1)
    Checkpointer().save(path, winner)
    Checkpointer().save(other, same_layout_state(0))
    with open(os.path.join(other, "rank_0.safetensors"), "rb") as src, open(os.path.join(path, "rank_0.safetensors"), "wb") as dst:
        dst.write(src.read())
    for verify in (False, True):
        with pytest.raises(CorruptCheckpointError, match=r"rank_0\.safetensors: written by another save"):
            rel_helpers.load_part(path, winner, verify=verify)
    with pytest.raises(CorruptCheckpointError, match="written by another save"):
        Checkpointer().unshard(path)
    assert cli_main(["verify", path]) != 0