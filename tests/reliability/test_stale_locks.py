"""A crashed save's lock does not block the next save of that directory; a live one still does.

The lock is judged stale when its process, on this host, is gone, or when its heartbeat is
older than ``CHECKPOINTER_LOCK_LEASE_S``; of saves that find one stale lock, one takes it over.
A model + optimizer step whose ``model/`` committed and whose ``optim/`` did not (a save that died
between the parts) is taken over the same way, and refused while its save lives.
Locally and on S3 (moto, behind a proxy that makes conditional creates atomic). The real crash
(a save killed with SIGKILL, then saved again) is in ``test_crash_safety.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from storage_fixtures import loopback_env, moto_endpoint  # noqa: F401  (fixtures)
from storage_servers import S3_BUCKET, FaultProxy

import checkpointer
from checkpointer import Checkpointer
from checkpointer.engine import save as save_module
from checkpointer.format.layout import LOCK_FILENAME
from checkpointer.storage import open_storage, save_lock


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _last_beat(directory: str) -> int:
    """The holder's last heartbeat: its beat file's time, or the lock's own before the first beat."""
    lock = json.loads(open(os.path.join(directory, LOCK_FILENAME), "rb").read())
    try:
        with open(os.path.join(directory, f"{LOCK_FILENAME}.beat-{lock['token']}"), "rb") as f:
            return json.loads(f.read())["beat_ms"]
    except FileNotFoundError:
        return lock["beat_ms"]


def _lock(host: str, pid: int, beat_ms: int, pid_space: str | None = None) -> bytes:
    """A lock as a process of ``host`` writes it, in this boot and PID namespace unless ``pid_space`` says."""
    space = save_lock._PID_SPACE if pid_space is None else pid_space
    return json.dumps({"host": host, "pid": pid, "pid_space": space, "token": "f" * 32, "beat_ms": beat_ms}).encode()


def _now_ms() -> int:
    return int(time.time() * 1000)


STATE = {"w": torch.arange(6.0)}


def _saved(url: str) -> bool:
    out = {"w": torch.zeros(6)}
    Checkpointer().load(url, out)
    return torch.equal(out["w"], STATE["w"])


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path, monkeypatch):
    """A fresh checkpoint URL, local or on S3 (behind a proxy with atomic conditional creates)."""
    if request.param == "local":
        return str(tmp_path / "ckpt")
    proxy = FaultProxy(request.getfixturevalue("moto_endpoint"), conditional=True)
    request.addfinalizer(proxy.close)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    return f"s3://{S3_BUCKET}/stale-{os.urandom(6).hex()}/ckpt"


def test_stale_locks_are_taken_over_and_live_ones_refuse(where, monkeypatch):
    storage = open_storage(where)
    storage.prepare()
    here = socket.gethostname()
    monkeypatch.setenv("CHECKPOINTER_LOCK_LEASE_S", "60")

    # A live lock: this host, a living process (this one), a fresh heartbeat.
    storage.write(LOCK_FILENAME, _lock(here, os.getpid(), _now_ms()))
    with pytest.raises(FileExistsError, match=rf"held by pid {os.getpid()} on {here}"):
        Checkpointer().save(where, STATE)
    # Another host, a fresh heartbeat: its process cannot be asked, so it is live.
    storage.write(LOCK_FILENAME, _lock("some-other-host", 1, _now_ms()))
    with pytest.raises(FileExistsError, match="in progress, or one crashed there"):
        Checkpointer().save(where, STATE)
    # A lock that says nothing of its holder is never judged stale.
    storage.write(LOCK_FILENAME, b"{}")
    with pytest.raises(FileExistsError, match="remove it, or pass save_overwrite=True"):
        Checkpointer().save(where, STATE)
    assert not storage.exists("metadata.json")

    # A dead pid, but in another PID namespace (a container with this host name) or an older
    # lock without one: its pid says nothing here, and its heartbeat is fresh: live.
    for space in ("another-boot/4026531836", ""):
        storage.write(LOCK_FILENAME, _lock(here, _dead_pid(), _now_ms(), pid_space=space))
        with pytest.raises(FileExistsError, match="in progress, or one crashed there"):
            Checkpointer().save(where, STATE)

    # The process that wrote it is gone (this host): taken over at once, whatever its heartbeat.
    storage.write(LOCK_FILENAME, _lock(here, _dead_pid(), _now_ms()))
    Checkpointer().save(where, STATE)
    assert _saved(where)
    assert storage.list() == ["metadata.json", "rank_0.safetensors"]  # no lock, no takeover marker

    # Another host, its heartbeat older than the lease: stale (an older version's "time" field too).
    for old in (_lock("some-other-host", 1, _now_ms() - 61_000), json.dumps({"time": time.time() - 61}).encode()):
        storage.delete("metadata.json")
        storage.write(LOCK_FILENAME, old)
        Checkpointer().save(where, STATE)
        assert _saved(where) and storage.list() == ["metadata.json", "rank_0.safetensors"]


def test_a_late_beat_of_a_lock_taken_over_does_not_take_it_back(where, monkeypatch):
    """Holder A goes silent past the lease (its beat's write stuck on a slow store, say) and B
    takes its lock over; A's beat then lands. B still holds the lock, and A finds at its commit
    that it does not: the beat went to A's own heartbeat file, not over B's lock (found by a review)."""
    monkeypatch.setenv("CHECKPOINTER_LOCK_LEASE_S", "1")
    storage = open_storage(where)
    storage.prepare()
    a = save_lock.acquire(storage, False)
    save_lock._HEARTBEAT.release(save_lock._lock_key(storage, a))  # A falls silent
    monkeypatch.setattr(save_lock, "_PID_SPACE", "another-host-s-pids")  # A's pid cannot be asked
    time.sleep(1.2)
    taken: list[bytes] = []
    real_write = type(storage).write

    def write(self, name, data):  # A's beat is slow to land: B takes the lock over meanwhile
        if not taken:
            taken.append(b"")
            taken[0] = save_lock.acquire(storage, False)  # the lease passed
        return real_write(self, name, data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(storage), "write", write)
        save_lock._refresh((storage, a))  # A's beat
    b = taken[0]
    save_lock.check_lock_is_ours(storage, b)
    with pytest.raises(FileExistsError, match="took over its lock"):
        save_lock.check_lock_is_ours(storage, a)
    save_lock.release_lock(storage, a)  # A gives up: B's lock stays
    assert storage.exists(LOCK_FILENAME)
    save_lock.release_lock(storage, b)
    assert storage.list() == [] or all(".taken-" in n for n in storage.list())


def test_a_lock_beating_in_its_own_file_is_live(where, monkeypatch):
    """A lock's own time is when it was taken; its holder beats in a file beside it. A lock taken
    long ago whose beat is fresh is live, and one whose beat is old too is stale."""
    monkeypatch.setenv("CHECKPOINTER_LOCK_LEASE_S", "60")
    storage = open_storage(where)
    storage.prepare()
    storage.write(LOCK_FILENAME, _lock("some-other-host", 1, _now_ms() - 3_600_000))
    beat = f"{LOCK_FILENAME}.beat-{'f' * 32}"
    storage.write(beat, json.dumps({"beat_ms": _now_ms()}).encode())
    with pytest.raises(FileExistsError, match=r"in progress, or one crashed there.*last heartbeat [0-9]s ago"):
        Checkpointer().save(where, STATE)
    storage.write(beat, json.dumps({"beat_ms": _now_ms() - 61_000}).encode())
    Checkpointer().save(where, STATE)
    assert _saved(where) and storage.list() == ["metadata.json", "rank_0.safetensors"]  # its beat went at the commit


def test_one_of_two_saves_takes_over_a_stale_lock(where):
    """Both find the same dead process's lock at once: one saves, the other is refused."""
    storage = open_storage(where)
    storage.prepare()
    storage.write(LOCK_FILENAME, _lock(socket.gethostname(), _dead_pid(), _now_ms()))
    gate = threading.Barrier(2)
    real_read = type(storage).read
    waited: set[str] = set()

    def read(self, name, start=0, end=None):  # both read the stale lock before either takes it
        data = real_read(self, name, start, end)
        me = threading.current_thread().name
        if name == LOCK_FILENAME and me.startswith("job") and me not in waited:
            waited.add(me)
            try:
                gate.wait(10)
            except threading.BrokenBarrierError:
                pass
        return data

    results: dict[str, object] = {}

    def job(name: str) -> None:
        try:
            Checkpointer().save(where, STATE)
            results[name] = "saved"
        except Exception as ex:  # noqa: BLE001 - the outcome is the test's
            results[name] = ex

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(storage), "read", read)
        threads = [threading.Thread(target=job, args=(f"job{i}",), name=f"job{i}") for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    outcomes = sorted(type(r).__name__ if isinstance(r, Exception) else r for r in results.values())
    assert outcomes == ["FileExistsError", "saved"], results
    assert _saved(where)


def test_a_long_save_keeps_its_lock_alive(tmp_path, monkeypatch):
    """The holder's heartbeat refreshes the lock while it writes: a save that starts meanwhile,
    with a short lease, finds it live and is refused; the first save commits."""
    monkeypatch.setenv("CHECKPOINTER_LOCK_LEASE_S", "4")
    path = str(tmp_path / "ckpt")
    real = save_module.write_rank_file
    seen: list[object] = []

    def write_then_try_another(*args, **kwargs):
        first = _last_beat(path)
        deadline = time.monotonic() + 30
        while _last_beat(path) == first and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            Checkpointer().save(path, STATE)
        except FileExistsError as ex:
            seen.append(ex)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "write_rank_file", write_then_try_another)
    Checkpointer().save(path, STATE)
    monkeypatch.undo()
    assert len(seen) == 1 and "in progress" in str(seen[0]), seen
    assert _saved(path) and sorted(os.listdir(path)) == ["metadata.json", "rank_0.safetensors"]


def test_a_shorter_lease_is_kept_from_the_first_save_under_it(tmp_path, monkeypatch):
    """The heartbeat thread, kept from a save under the default lease (it waits a quarter of
    120 s), refreshes the lock of a save under a lease of 2 s within a quarter of that: it
    refreshed it only after about 30 s, so another save could take a live lock over."""
    Checkpointer().save(str(tmp_path / "first"), STATE)
    monkeypatch.setenv("CHECKPOINTER_LOCK_LEASE_S", "2")
    path = str(tmp_path / "second")
    real = save_module.write_rank_file
    waited: list[float] = []

    def write_after_a_beat(*args, **kwargs):
        first, start = _last_beat(path), time.monotonic()
        while _last_beat(path) == first and time.monotonic() < start + 10:
            time.sleep(0.02)
        waited.append(time.monotonic() - start)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "write_rank_file", write_after_a_beat)
    Checkpointer().save(path, STATE)
    assert len(waited) == 1 and waited[0] < 1.5, waited


def test_a_bad_lease_setting_refuses_the_save_before_its_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKPOINTER_LOCK_LEASE_S", "1 s")
    with pytest.raises(ValueError, match="CHECKPOINTER_LOCK_LEASE_S"):
        Checkpointer().save(str(tmp_path / "ckpt"), STATE)
    assert not (tmp_path / "ckpt" / LOCK_FILENAME).exists()


def _another_rank_fails_once(monkeypatch, name: str, when=lambda *args: True):
    """``dist.<name>`` raises once, where ``when(*args)`` holds, as when another rank failed there."""
    from checkpointer import dist
    from checkpointer.errors import RankFailedError

    real, failed = getattr(dist, name), []

    def fake(*args, **kwargs):
        if not failed and when(*args):
            failed.append(name)
            raise RankFailedError("save failed on rank 1: injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, name, fake)
    return failed


@pytest.mark.parametrize("where", ["planning", "writing"])
def test_a_save_another_rank_failed_leaves_no_lock(tmp_path, monkeypatch, where):
    """Rank 0 took the lock; another rank failed while planning (the agreement raises) or died
    while writing (the gather of statuses raises): the lock goes, so the job's retry is not refused
    as a save in progress (the heartbeat kept the leaked lock fresh for the life of the process)."""
    path = str(tmp_path / "ckpt")
    lock = os.path.join(path, LOCK_FILENAME)
    if where == "planning":
        failed = _another_rank_fails_once(monkeypatch, "agree", lambda error, what: what == "save" and os.path.exists(lock))
    else:
        failed = _another_rank_fails_once(monkeypatch, "gather_bytes")
    with pytest.raises(checkpointer.CheckpointError, match="injected"):
        Checkpointer().save(path, STATE)
    assert failed and not os.path.exists(lock)
    Checkpointer().save(path, STATE)
    assert _saved(path)


def _overtaken_while_writing(rank, world_size, path):
    """Rank 0: while this save writes, another job takes its lock over (``save_overwrite=True``).
    Returns the save's error and (rank 0) whether the other job still holds the lock."""
    from unittest import mock

    from dist_helpers import catch

    taken = []
    real = save_module.write_rank_file

    def write_rank_file(*args, **kwargs):
        if rank == 0 and not taken:
            taken.append(save_lock.acquire(open_storage(path), True))
        return real(*args, **kwargs)

    with mock.patch.object(save_module, "write_rank_file", write_rank_file):
        error = catch(Checkpointer().save, path, {"w": torch.arange(10.0), "r": torch.ones(3)})
    torch.distributed.barrier()  # every rank's failure handled
    if rank != 0:
        return error, None
    try:
        save_lock.check_lock_is_ours(open_storage(path), taken[0])
        return error, True
    except FileExistsError:
        return error, False
    finally:
        save_lock.release_lock(open_storage(path), taken[0])


def test_a_failed_save_leaves_the_lock_another_save_took_over(run_distributed, tmp_path):
    """Every rank of the overtaken save fails, and none removes the other job's lock (rank 1, which
    holds no lock, once removed whatever lock the directory had), so that job can still commit."""
    results = run_distributed(_overtaken_while_writing, 2, str(tmp_path / "ckpt"), timeout=120)
    for rank, (error, _) in enumerate(results):
        assert error is not None and "took over its lock" in error["msg"], f"rank {rank}: {error}"
    assert results[0][1], "the other job's lock was removed by the failed save"


def test_a_cached_plan_retires_the_old_checkpoint_only_once_every_rank_planned(tmp_path, monkeypatch):
    """With its plan cached, a save_overwrite=True whose other rank cannot describe its values
    (no cached plan there, so the full plan reports its error) leaves the old checkpoint whole:
    rank 0 had removed its metadata.json before the ranks agreed."""
    from checkpointer import dist

    path = str(tmp_path / "ckpt")
    ckpt = Checkpointer()
    ckpt.save(path, STATE)
    ckpt.save(path, STATE, save_overwrite=True)  # the plan is cached and reused from here on
    from checkpointer.errors import RankFailedError

    real = dist.all_equal_and_least
    monkeypatch.setattr(dist, "all_equal_and_least", lambda value, pick: (False, real(value, pick)[1]))
    refused = RankFailedError("save failed on rank 1: cannot save 'w': injected")  # what the full plan's exchange brings
    monkeypatch.setattr(save_module, "_plan_from_layouts", lambda described, aliases, error, url: (None, refused))
    monkeypatch.setattr(save_module, "_exchange_and_plan", lambda described, aliases, error, fingerprint: (None, error))
    with pytest.raises(checkpointer.CheckpointError, match="injected"):
        ckpt.save(path, {"w": torch.zeros(6)}, save_overwrite=True)
    assert _saved(path) and not os.path.exists(os.path.join(path, LOCK_FILENAME))


def test_a_failure_retiring_the_old_checkpoint_releases_the_lock(tmp_path, monkeypatch):
    from checkpointer.storage.local import LocalStorage

    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, STATE)
    real, failed = LocalStorage.delete, []

    def delete(self, name):
        if name == "metadata.json" and not failed:
            failed.append(name)
            raise OSError(5, "injected I/O error")
        return real(self, name)

    monkeypatch.setattr(LocalStorage, "delete", delete)
    with pytest.raises(OSError, match="injected"):
        Checkpointer().save(path, STATE, save_overwrite=True)
    assert failed and not os.path.exists(os.path.join(path, LOCK_FILENAME))
    Checkpointer().save(path, STATE, save_overwrite=True)
    assert _saved(path)


def test_a_commit_removes_what_dead_saves_left_of_rank_files(tmp_path):
    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, STATE)
    from checkpointer.storage.local import LocalStorage

    dead = LocalStorage(path).open_writer("rank_1.safetensors")  # a rank that died writing: its temp file stays
    dead.write([memoryview(b"x" * 100)])
    os.close(dead.fd)
    dead.fd = None
    from checkpointer.format.layout import part_prefix

    parts = part_prefix("rank_2.safetensors")  # a parallel upload's parts (GCS), one joined partly
    for suffix in ("1", "2", "c0"):
        (tmp_path / "ckpt" / f"{parts}{suffix}").write_bytes(b"p" * 10)
    (tmp_path / "ckpt" / "notes.txt").write_bytes(b"the user's")
    (tmp_path / "ckpt" / ".notes.txt.part-0123456789ab-1").write_bytes(b"not a rank file's")
    Checkpointer().save(path, STATE, save_overwrite=True)
    assert sorted(os.listdir(path)) == [".notes.txt.part-0123456789ab-1", "metadata.json", "notes.txt", "rank_0.safetensors"]


def test_a_refused_save_of_several_targets_leaves_no_lock_behind(tmp_path):
    """A cached plan's save of model + optimizer, refused because ``optim/`` holds a checkpoint,
    takes no lock that outlives it: the next save into ``model/`` is not refused as in progress."""
    model, optim = {"a": torch.arange(4.0)}, {"b": torch.arange(3.0)}
    ckpt = Checkpointer()
    ckpt.save_many([(str(tmp_path / "s1" / "model"), model), (str(tmp_path / "s1" / "optim"), optim)])
    Checkpointer().save(str(tmp_path / "s2" / "optim"), optim)
    with pytest.raises(FileExistsError, match="optim"):  # the plans are cached: the locks are taken first
        ckpt.save_many([(str(tmp_path / "s2" / "model"), model), (str(tmp_path / "s2" / "optim"), optim)])
    assert not (tmp_path / "s2" / "model" / LOCK_FILENAME).exists()
    Checkpointer().save(str(tmp_path / "s2" / "model"), model)
    out = {"a": torch.zeros(4)}
    Checkpointer().load(str(tmp_path / "s2" / "model"), out)
    assert torch.equal(out["a"], model["a"])


def test_a_save_overtaken_while_silent_leaves_the_committed_files_alone(tmp_path):
    """Save A stops with its rank file written but not yet named (a process stopped past the
    lease); meanwhile another save takes its lock over and commits the directory. When A goes
    on, its file does not replace the committed one: A fails, and the checkpoint stays B's."""
    from checkpointer.storage.local import LocalWriter

    where, elsewhere = str(tmp_path / "ckpt"), str(tmp_path / "b")
    theirs = {"w": torch.arange(6.0) * 10}
    Checkpointer().save(elsewhere, theirs)
    stopped, go_on = threading.Event(), threading.Event()
    real_write = LocalWriter.write

    def write(self, buffers):  # A's last write, its checksums: then A stops
        if threading.current_thread().name == "save-a":
            stopped.set()
            go_on.wait(30)
        return real_write(self, buffers)

    outcome: dict[str, object] = {}

    def save_a() -> None:
        try:
            Checkpointer().save(where, STATE)
            outcome["a"] = "saved"
        except Exception as ex:  # noqa: BLE001 - the outcome is the test's
            outcome["a"] = ex

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalWriter, "write", write)
        a = threading.Thread(target=save_a, name="save-a")
        a.start()
        assert stopped.wait(30)
        for name in ("rank_0.safetensors", "metadata.json"):  # B's commit, as it leaves the directory
            with open(os.path.join(elsewhere, name), "rb") as src, open(os.path.join(where, name), "wb") as dst:
                dst.write(src.read())
        go_on.set()
        a.join(30)
    assert isinstance(outcome["a"], Exception) and "another save committed here" in str(outcome["a"]), outcome
    out = {"w": torch.zeros(6)}
    Checkpointer().load(where, out)
    assert torch.equal(out["w"], theirs["w"])
    assert sorted(os.listdir(where)) == ["metadata.json", "rank_0.safetensors"]


def test_a_step_a_dead_save_left_half_committed_is_taken_over_and_a_live_ones_is_not(where):
    torch.manual_seed(0)
    old = torch.nn.Linear(4, 3)
    top = f"{where}/step5"
    checkpointer.save_model_and_optim_state(top, old, torch.optim.AdamW(old.parameters()))
    optim_part = open_storage(f"{top}/optim")
    optim_part.delete("metadata.json")  # as if the save were still writing optim/, or died there
    optim_part.write(LOCK_FILENAME, _lock(socket.gethostname(), os.getpid(), _now_ms()))  # live: this process
    new = torch.nn.Linear(4, 3)
    with pytest.raises(FileExistsError, match="is in progress"):
        checkpointer.save_model_and_optim_state(top, new, torch.optim.AdamW(new.parameters()))
    assert open_storage(f"{top}/model").exists("metadata.json"), "a refused save retired model/"
    assert checkpointer.latest_checkpoint(where) is None

    optim_part.write(LOCK_FILENAME, _lock(socket.gethostname(), _dead_pid(), _now_ms()))  # its process is gone
    checkpointer.save_model_and_optim_state(top, new, torch.optim.AdamW(new.parameters()))
    assert checkpointer.latest_checkpoint(where) == top
    loaded = torch.nn.Linear(4, 3)
    checkpointer.load_model_and_optim_state(top, loaded)
    assert torch.equal(loaded.weight, new.weight) and not torch.equal(loaded.weight, old.weight)


def test_a_committed_model_beside_an_optim_no_save_wrote_is_not_taken_over(tmp_path):
    """model/ committed and optim/ empty (a model saved alone, or optim/ deleted by hand): nothing
    shows a save that died there, so a save without save_overwrite is refused and changes nothing."""
    top = str(tmp_path / "step5")
    model = torch.nn.Linear(4, 3)
    checkpointer.save_model_and_optim_state(top, model, torch.optim.AdamW(model.parameters()))
    optim_dir = os.path.join(top, "optim")
    for name in os.listdir(optim_dir):
        os.remove(os.path.join(optim_dir, name))
    with pytest.raises(FileExistsError, match="model"):
        checkpointer.save_model_and_optim_state(top, model, torch.optim.AdamW(model.parameters()))
    assert os.path.exists(os.path.join(top, "model", "metadata.json"))


def test_a_dead_saves_uncommitted_train_state_goes_under_its_lock(where):
    """A step whose only remains are a save's uncommitted ``train/``: a save without train state
    removes them once it holds ``train/``'s lock (the step would otherwise read as incomplete),
    and refuses, removing nothing, while a live save holds it."""
    top = f"{where}/step5"
    model = torch.nn.Linear(4, 3)
    checkpointer.save_model_and_optim_state(top, model, torch.optim.AdamW(model.parameters()), train_state={"step": 5})
    for part in ("model", "optim", "train"):
        open_storage(f"{top}/{part}").delete("metadata.json")
    train_part = open_storage(f"{top}/train")
    left = sorted(train_part.list())
    train_part.write(LOCK_FILENAME, _lock(socket.gethostname(), os.getpid(), _now_ms()))  # live: this process
    with pytest.raises(FileExistsError, match="is in progress"):
        checkpointer.save_model_and_optim_state(top, model, torch.optim.AdamW(model.parameters()))
    assert sorted(train_part.list()) == sorted(left + [LOCK_FILENAME]), "a refused save removed train/'s files"

    train_part.write(LOCK_FILENAME, _lock(socket.gethostname(), _dead_pid(), _now_ms()))  # its process is gone
    checkpointer.save_model_and_optim_state(top, model, torch.optim.AdamW(model.parameters()))
    assert train_part.list() == []
    assert checkpointer.latest_checkpoint(where) == top
