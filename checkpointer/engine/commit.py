"""The commit protocol of a save: the directory's lock, the checks, and publication, in one place.

Which rank calls what, in order (after Orbax's ``path/atomicity.py``):

1. Every rank, before planning: :func:`claim_parts` (a model + optimizer save, sync or async;
   it also takes over a step a dead save left half committed) or :func:`refuse_existing_everywhere`
   (an async save of several directories without ``save_overwrite``): a directory that holds a
   checkpoint refuses the save on every rank before anything is locked or written.
2. Rank 0, once the plan is agreed and before any rank writes: :func:`check_directory` with
   ``retire_old`` (or :func:`take_locks` for several targets) creates ``.lock`` exclusively
   (``save_overwrite`` takes over a crashed save's) and removes an old ``metadata.json``, so
   the old checkpoint reads as incomplete from then on. All ranks agree on the outcome.
3. Every rank writes its rank file under a temporary name, fsyncs it and renames it.
4. Rank 0, once every rank reported success and the replicas agree: :func:`commit_metadata`
   checks the lock is still its own (another job may have taken it over), removes stale rank
   files, writes ``metadata.json`` atomically (the commit point) and releases the lock.
5. On any failure rank 0 :func:`release_lock` s (a lock another save took over is left alone);
   a directory without ``metadata.json`` is an incomplete checkpoint to every reader.

The lock, and taking over a crashed save's. The lock file is JSON: ``host``, ``pid``, a random
``token`` (whose lock it is: compared with the file's length, so a file that grew is no one's)
and ``beat_ms``, refreshed by a heartbeat thread of the holding process every quarter of
``CHECKPOINTER_LOCK_LEASE_S`` (:func:`~checkpointer.settings.lock_lease_s`) until the lock is
released. A lock is stale when its process is known dead (it was taken on this host, in this
boot and PID namespace, and no process has its pid) or when its heartbeat is older than the
lease (hosts' clocks must agree to well within it). A save that finds a stale lock, without
``save_overwrite``:

a. creates ``.checkpointer-save.lock.taken-<digest of the stale lock's bytes>`` exclusively
   (a local ``O_EXCL`` create, S3's ``If-None-Match: *``, GCS's ``ifGenerationMatch=0``): of
   saves that found the same stale lock, exactly one creates it; the others are refused;
b. reads the lock again: if it changed (its holder was alive after all), the save is refused;
c. writes its own lock over the stale one, and goes on as in step 2.

A holder that was alive but silent for a lease finds at its commit (step 4) that the lock is no
longer its own, and does not commit; so two live saves never both commit. A live lock (fresh
heartbeat, or a living process on this host) refuses the save with ``FileExistsError`` naming
its holder. The markers go at the commit.

Replicas agree before the commit (step 4): a piece several ranks hold (a plain tensor every
rank saves, DDP's parameters, a ``Replicate`` placement, each shard under HSDP) is written once,
by one of them. Each other holder hashes its copy (:func:`~checkpointer.engine.rankfile.start_hashing`; CRC32C per
:data:`~checkpointer.checksums.CHUNK_BYTES`, as the writer computes them while writing): a
synchronous save on a thread while the rank writes its file, an async save before the call
returns, while the state is the one it staged. The checksums reach rank 0 in the commit's
gather of every rank's status (no collective of their own), and :func:`~checkpointer.engine.rankfile.check_copies` refuses
the commit with :class:`~checkpointer.errors.ReplicaMismatchError`, naming the tensors and
ranks, where a copy differs. ``CHECKPOINTER_VERIFY_REPLICAS=0`` turns the check off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from .. import dist, settings
from ..errors import CheckpointError
from ..format.layout import (
    LOCK_FILENAME, LOCK_TAKEOVER_PREFIX, METADATA_FILENAME, is_rank_filename, is_rank_temp_file, is_save_file,
)
from ..format.metadata import StorageMetadata
from ..storage.base import Storage
from ..storage.parallel import Periodic


def claim_parts(
    model: Storage, optim: Storage, save_overwrite: bool, *, train: Storage | None = None, keep_train: bool = False
) -> None:
    """Every rank, before any part of a model + optimizer save is planned: :func:`claim_step` on
    rank 0, its refusal raised on every rank, so a refused save writes nothing."""
    dist.share_from(0, lambda: claim_step(model, optim, save_overwrite, train=train, keep_train=keep_train) or b"", "save")


def claim_step(
    model: Storage, optim: Storage, save_overwrite: bool, *, train: Storage | None = None, keep_train: bool = False
) -> None:
    """Rank 0, before a model + optimizer save takes its locks (an async save makes this check
    inside a collective it makes anyway).

    Without ``save_overwrite``: ``FileExistsError`` when ``optim/`` (committed last: the step's
    commit point) holds a checkpoint. A step whose ``model/`` or ``train/`` committed but whose
    ``optim/`` did not, beside a dead save's files in ``optim/``, is what a save that died between
    the parts leaves: it is taken over once no part holds a live lock (``FileExistsError`` naming
    the holder otherwise), its committed parts retired while this holds their locks.

    With ``save_overwrite``, the old ``optim/`` is made incomplete first: a save that dies between
    the parts leaves the directory incomplete, never the new model beside the old optimizer state.

    A save without training state (``keep_train`` False) removes an old ``train/``, committed or
    a dead save's leftovers, so that it is never read as the new checkpoint's."""
    parts = [model, optim] + ([train] if train is not None else [])
    drop_train = train is not None and not keep_train
    if save_overwrite:
        if optim.exists(METADATA_FILENAME):
            optim.delete(METADATA_FILENAME)
        if drop_train:
            remove_checkpoint_files(train)
        return
    refuse_existing([optim])
    left = [part for part in parts if part.exists(METADATA_FILENAME)]
    if left and not any(is_save_file(name) for name in optim.list()):  # no save died writing optim/
        raise FileExistsError(_exists_message(left[0]))
    stale = [train] if drop_train and train not in left and train.list() else []
    if not left and not stale:
        return
    held: list[tuple[Storage, bytes | None]] = []
    try:  # retired under their locks: a live save's lock refuses this one (FileExistsError)
        for part in [optim, *left, *stale] if left else stale:
            held.append((part, _acquire(part, False)))
        refuse_existing([optim])  # again: a live save may have committed meanwhile
        for part in left:
            part.delete(METADATA_FILENAME)
        if drop_train:
            # Takeover markers too: no commit of this save will clear train/ (it would read as incomplete).
            remove_checkpoint_files(train, keep=(LOCK_FILENAME,))
    finally:
        release_locks(held)
    if left:
        log.warning("taking over %s: an earlier save committed %s and died before the rest",
                    optim.url.rsplit("/", 1)[0], ", ".join(p.url.rsplit("/", 1)[-1] + "/" for p in left))


def remove_checkpoint_files(storage: Storage, *, keep: tuple[str, ...] = ()) -> None:
    """Delete a flat checkpoint directory's files but those named in ``keep``, ``metadata.json``
    first (it reads as incomplete from then on); a directory that does not exist is left alone."""
    names = [name for name in storage.list() if name not in keep]
    for name in sorted(names, key=lambda n: n != METADATA_FILENAME):
        storage.delete(name)


def refuse_existing_everywhere(storages: list[Storage]) -> None:
    """Every rank: :func:`refuse_existing` checked by rank 0, its refusal raised on every rank."""

    def check() -> bytes:
        refuse_existing(storages)
        return b""

    dist.share_from(0, check, "async save")


def refuse_existing(storages: list[Storage]) -> None:
    """``FileExistsError`` if any of ``storages`` holds a checkpoint (a save without ``save_overwrite``)."""
    for storage in storages:
        if storage.exists(METADATA_FILENAME):
            raise FileExistsError(_exists_message(storage))


def _exists_message(storage: Storage) -> str:
    return (
        f"{storage.join(METADATA_FILENAME)} exists: a checkpoint is already saved there "
        "(pass save_overwrite=True to replace it)"
    )


def check_directory(storage: Storage, save_overwrite: bool, *, retire_old: bool, keep_old: bool = False) -> bytes | None:
    """Refuse to save over a checkpoint unless asked. With ``retire_old``, take the save lock
    and make an old checkpoint incomplete (not with ``keep_old``: :func:`retire` does it later),
    before any rank writes; returns the lock's bytes. A failure releases the lock."""
    storage.prepare()
    if storage.exists(METADATA_FILENAME) and not save_overwrite:
        raise FileExistsError(_exists_message(storage))
    if not retire_old:
        return None
    lock = _acquire(storage, save_overwrite)
    retired = False
    try:
        if not keep_old or not save_overwrite:
            retire(storage, save_overwrite)
        retired = True
    finally:
        if not retired:
            release_lock(storage, lock)
    return lock


def retire(storage: Storage, save_overwrite: bool) -> None:
    """Rank 0, holding the lock: remove an old checkpoint's ``metadata.json`` (``save_overwrite``),
    or refuse one that a save committed while this one was planning."""
    if storage.exists(METADATA_FILENAME):
        if not save_overwrite:
            raise FileExistsError(
                f"{storage.join(METADATA_FILENAME)} exists: a checkpoint was saved there while this save "
                "was planning (pass save_overwrite=True to replace it)"
            )
        storage.delete(METADATA_FILENAME)


def _acquire(storage: Storage, save_overwrite: bool) -> bytes:
    """Create the lock exclusively; one that exists is replaced (``save_overwrite``) or taken over
    when stale (``FileExistsError`` otherwise). Returns its bytes; the heartbeat keeps it fresh."""
    settings.lock_lease_s()  # a bad setting is an error here, before the lock is taken
    lock = _new_lock()
    _hold(storage, lock)  # first: nothing between taking the lock and returning it can fail
    taken = False
    try:
        try:
            storage.create_exclusive(LOCK_FILENAME, lock)
        except FileExistsError:
            if save_overwrite:
                storage.write(LOCK_FILENAME, lock)
            else:
                _take_over_stale(storage, lock)
        taken = True
    finally:
        if not taken:
            _HEARTBEAT.release(_lock_key(storage, lock))
    return lock


def take_locks(storages: list[Storage], save_overwrite: bool, *, keep_old: bool = False) -> list[bytes | None]:
    """Rank 0, before any rank writes: take every target's lock, retiring old checkpoints (see
    :func:`check_directory`). Without ``save_overwrite``, nothing is locked when any target holds
    a checkpoint. A failure releases the locks taken."""
    if not save_overwrite:
        refuse_existing(storages)
    locks: list[bytes | None] = []
    try:
        for storage in storages:
            locks.append(check_directory(storage, save_overwrite, retire_old=True, keep_old=keep_old))
    finally:
        if len(locks) < len(storages):  # a failure: the locks taken go
            for storage, lock in zip(storages, locks):
                release_lock(storage, lock)
    return locks


def refuse_if_committed(storage: Storage) -> None:
    """A rank, its file written, before the file takes its name: ``metadata.json`` there means another
    save took this one's lock over (this process was silent past the lease) and committed."""
    if storage.exists(METADATA_FILENAME):
        raise CheckpointError(f"{storage.url}: another save committed here while this one was writing (it took over "
                              f"this save's lock, silent past {settings.LOCK_LEASE_S_ENV}); this rank's file was not put in place")


def lock_everywhere(storages: list[Storage], save_overwrite: bool) -> list[bytes | None]:
    """Every rank: rank 0 takes every target's lock (:func:`take_locks`), and one agreement
    brings its error to every rank. Returns the locks (rank 0's; None on the others)."""
    locks: list[bytes | None] = [None] * len(storages)
    error = None
    if dist.get_rank() == 0:
        taken, error = dist.attempt(lambda: take_locks(storages, save_overwrite))
        locks = taken or locks
    agree_or_release(error, list(zip(storages, locks)))
    return locks


def agree_or_release(error: BaseException | None, held: list[tuple[Storage, bytes | None]]) -> None:
    """Every rank: ``dist.agree`` on a save's planning; where any rank failed, rank 0's locks
    ``held`` go before the error is raised (the save will not be written)."""
    agreed = False
    try:
        dist.agree(error, "save")
        agreed = True
    finally:
        if not agreed:
            release_locks(held)


def release_locks(held: list[tuple[Storage, bytes | None]]) -> None:
    """Rank 0: release the locks of saves that will not be written (nothing was)."""
    for storage, lock in held:
        if lock is not None:
            release_lock(storage, lock)


def commit_metadata(storage: Storage, metadata: StorageMetadata, lock: bytes | None) -> None:
    """Rank 0, once every rank file is durable: drop stale rank files (and the temp files of dead
    saves' ranks), then publish metadata.json."""
    _check_lock_is_ours(storage, lock)
    wanted = set(metadata.files())
    for name in storage.list():
        if (is_rank_filename(name) and name not in wanted) or name.startswith(LOCK_TAKEOVER_PREFIX) or is_rank_temp_file(name):
            storage.delete(name)
    storage.write(METADATA_FILENAME, metadata.to_json_bytes())
    release_lock(storage, lock)


_LOCK_READ = 4096  # a lock file is read no further than this (ours are about 150 bytes)
log = logging.getLogger(__name__)


def _new_lock() -> bytes:
    """This process's lock: the token makes it ours alone (a conditional create retried after a
    lost answer recognises its own file by it); ``beat_ms`` is the heartbeat, refreshed in place
    (:func:`_with_beat`: the same length for centuries, so ownership compares lengths too)."""
    return _with_beat(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "pid_space": _PID_SPACE,
                                  "token": uuid.uuid4().hex, "beat_ms": 0}).encode())


def _pid_space() -> str:
    """This boot's id and this process's PID namespace: where a pid names one process. Containers
    may share a host name but not both of these; "" where they cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


_PID_SPACE = _pid_space()


def _with_beat(lock: bytes) -> bytes:
    fields = json.loads(lock)
    fields["beat_ms"] = int(time.time() * 1000)
    return json.dumps(fields).encode()


def _fields(data: bytes | None) -> dict[str, Any]:
    try:
        fields = json.loads(data or b"")
    except ValueError:
        return {}
    return fields if isinstance(fields, dict) else {}


def _is_ours(data: bytes | None, lock: bytes) -> bool:
    return data is not None and len(data) == len(lock) and _fields(data).get("token") == _fields(lock).get("token")


def _read_lock(storage: Storage, ours: bytes) -> bytes | None:
    """The lock file's bytes, enough of them to tell whether it is ``ours`` (a larger file is
    read no further than one byte past the length of ours)."""
    try:
        return storage.read(LOCK_FILENAME, 0, len(ours) + 1)
    except FileNotFoundError:
        return None


def stale_reason(data: bytes, *, now: float | None = None) -> str | None:
    """Why the lock ``data`` is stale (its process is gone, or its heartbeat older than the
    lease), or None while it may be held: a lock this cannot read is never judged stale."""
    fields = _fields(data)
    host, pid = fields.get("host"), fields.get("pid")
    same_pids = bool(_PID_SPACE) and fields.get("pid_space") == _PID_SPACE  # not merely the same host name
    if same_pids and host == socket.gethostname() and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its process (pid {pid} on this host) is gone"
        except OSError:
            pass  # it exists, as another user's process
    beat = fields.get("beat_ms", 1000 * fields["time"] if isinstance(fields.get("time"), (int, float)) else None)
    if isinstance(beat, (int, float)) and not isinstance(beat, bool):
        age, lease = (time.time() if now is None else now) - beat / 1000, settings.lock_lease_s()
        if age > lease:
            return f"its last heartbeat was {age:.0f}s ago, more than {settings.LOCK_LEASE_S_ENV}={lease:g}s"
    return None


def _holder(data: bytes | None) -> str:
    fields = _fields(data)
    if not {"host", "pid"} <= fields.keys():
        return ""
    beat = fields.get("beat_ms")
    ago = f", its last heartbeat {time.time() - beat / 1000:.0f}s ago" if isinstance(beat, (int, float)) else ""
    return f" (held by pid {fields['pid']} on {fields['host']}{ago})"


def _take_over_stale(storage: Storage, lock: bytes) -> None:
    """The lock exists and this save has no ``save_overwrite``: take it over if it is stale
    (steps a-c of the module docstring), else ``FileExistsError``."""
    try:
        held: bytes | None = storage.read(LOCK_FILENAME, 0, _LOCK_READ)
    except FileNotFoundError:
        held = None
    if held is None:  # released meanwhile: one more try, as at first
        try:
            return storage.create_exclusive(LOCK_FILENAME, lock)
        except FileExistsError:
            pass
    reason = None if held is None else stale_reason(held)
    if held is None or reason is None:
        raise FileExistsError(
            f"another save into {storage.url} is in progress, or one crashed there: {storage.join(LOCK_FILENAME)} "
            f"exists{_holder(held)}. A crashed save's lock is taken over once its process is known gone or "
            f"{settings.LOCK_LEASE_S_ENV}={settings.lock_lease_s():g}s pass without its heartbeat "
            "(remove it, or pass save_overwrite=True)"
        )
    assert held is not None
    marker = f"{LOCK_TAKEOVER_PREFIX}{hashlib.sha256(held).hexdigest()[:32]}"
    try:
        storage.create_exclusive(marker, lock)
    except FileExistsError:
        raise FileExistsError(
            f"another save is taking over the stale lock {storage.join(LOCK_FILENAME)} ({reason}): "
            "this one is not saved (pass save_overwrite=True to save regardless)"
        ) from None
    try:
        again: bytes | None = storage.read(LOCK_FILENAME, 0, _LOCK_READ)
    except FileNotFoundError:
        again = None
    if again is not None and again != held:
        raise FileExistsError(f"{storage.join(LOCK_FILENAME)} changed while this save took it over: its holder lives")
    storage.write(LOCK_FILENAME, lock)
    log.warning("took over the lock of a crashed save into %s: %s", storage.url, reason)


def _refresh(held: tuple[Storage, bytes]) -> None:
    storage, lock = held
    try:
        if _is_ours(_read_lock(storage, lock), lock):
            storage.write(LOCK_FILENAME, _with_beat(lock))
    except OSError as ex:  # the next beat tries again; a lease missed makes the commit refuse
        log.warning("could not refresh the save lock of %s: %s", storage.url, ex)


# Every lock this process holds has its beat_ms refreshed every quarter of the lease, on one kept
# daemon thread (a save while the interpreter exits needs no new thread).
_HEARTBEAT = Periodic(_refresh, lambda: settings.lock_lease_s() / 4, "checkpointer-lock-heartbeat")


def _hold(storage: Storage, lock: bytes) -> None:
    try:
        _HEARTBEAT.hold(_lock_key(storage, lock), (storage, lock))
    except RuntimeError as ex:  # no thread can run: a save longer than the lease may be taken over
        log.warning("no heartbeat for the save lock of %s (%s): a save longer than %s=%gs may be taken over",
                    storage.url, ex, settings.LOCK_LEASE_S_ENV, settings.lock_lease_s())


def _lock_key(storage: Storage, lock: bytes) -> tuple[str, str]:
    return storage.url, _fields(lock).get("token", "")


def _check_lock_is_ours(storage: Storage, lock: bytes | None) -> None:
    """Before committing: a save that took this directory's lock over (``save_overwrite=True``)
    while this one wrote may have replaced some of its rank files, so this one must not commit."""
    if lock is not None and not _is_ours(_read_lock(storage, lock), lock):
        raise FileExistsError(
            f"another save into {storage.url} took over its lock ({storage.join(LOCK_FILENAME)}) while this "
            "one was writing (two jobs saving there with save_overwrite=True?): this save is not committed"
        )


def release_lock(storage: Storage, lock: bytes | None) -> None:
    """Remove the lock this save wrote (``lock``), leaving one another save has taken over."""
    if lock is not None:
        _HEARTBEAT.release(_lock_key(storage, lock))
    try:
        if lock is None or _is_ours(_read_lock(storage, lock), lock):
            storage.delete(LOCK_FILENAME)
    except OSError:
        pass  # the checkpoint stands; a leftover lock only makes the next save here ask for save_overwrite
