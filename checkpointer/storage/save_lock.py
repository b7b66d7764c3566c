"""A checkpoint directory's save lock: one save at a time writes there (see
:mod:`~checkpointer.engine.commit` for when a save takes and releases it).

The lock file, ``.checkpointer-save.lock``, is JSON: ``host``, ``pid``, a random
``token`` (whose lock it is: compared with the file's length, so a file that grew is no one's)
and ``beat_ms``, when it was taken. The holding process's heartbeat thread writes the time
again every quarter of ``CHECKPOINTER_LOCK_LEASE_S`` (:func:`~checkpointer.settings.lock_lease_s`)
until the lock is released, into a file of its own, ``.checkpointer-save.lock.beat-<token>``:
never into the lock, which only the save taking it writes, so a late beat cannot take back a
lock another save took over. A lock is stale when its process is known dead (it was taken on
this host, in this boot and PID namespace, and no process has its pid) or when its last beat is
older than the lease (hosts' clocks must agree to well within it). A save that finds a stale
lock, without ``save_overwrite``:

a. creates ``.checkpointer-save.lock.taken-<digest of the stale lock's bytes>`` exclusively
   (a local ``O_EXCL`` create, S3's ``If-None-Match: *``, GCS's ``ifGenerationMatch=0``): of
   saves that found the same stale lock, exactly one creates it; the others are refused, unless
   the marker's own save died before step c (the marker holds its lock, judged stale as a lock
   is): then its marker is claimed the same way, by a marker of the marker's bytes;
b. reads the lock and its beat again: if either changed (its holder was alive after all), the
   save is refused;
c. writes its own lock over the stale one.

A holder that was alive but silent for a lease finds at its commit (:func:`check_lock_is_ours`)
that the lock is no longer its own, and does not commit; so two live saves never both commit. A live lock (fresh
heartbeat, or a living process on this host) refuses the save with ``FileExistsError`` naming
its holder. The markers, and the beats of locks taken over, go at the commit
(:func:`~checkpointer.engine.commit.commit_metadata`).
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

from .. import settings
from ..format.layout import LOCK_BEAT_PREFIX, LOCK_FILENAME, LOCK_TAKEOVER_PREFIX
from .base import Storage
from .parallel import Periodic

__all__ = ["acquire", "release_lock", "check_lock_is_ours", "stale_reason", "beat_name"]

_LOCK_READ = 4096  # a lock file is read no further than this (ours are about 150 bytes)
log = logging.getLogger(__name__)


def acquire(storage: Storage, save_overwrite: bool) -> bytes:
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




def _new_lock() -> bytes:
    """This process's lock: the token makes it ours alone (a conditional create retried after a
    lost answer recognises its own file by it); ``beat_ms``, its first beat, takes the same
    length for centuries, so ownership compares lengths too."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "pid_space": _PID_SPACE,
                       "token": uuid.uuid4().hex, "beat_ms": int(time.time() * 1000)}).encode()


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


def beat_name(lock: bytes) -> str | None:
    """The name of the heartbeat file of the lock ``lock``; None where its token is not ours to
    name a file by (a lock file is anyone's to write)."""
    token = _fields(lock).get("token")
    if not (isinstance(token, str) and len(token) == 32 and all(c in "0123456789abcdef" for c in token)):
        return None
    return f"{LOCK_BEAT_PREFIX}{token}"


def _read_beat(storage: Storage, lock: bytes) -> bytes | None:
    """The heartbeat file of the lock ``lock``, None where it has none (yet)."""
    name = beat_name(lock)
    try:
        return None if name is None else storage.read(name, 0, _LOCK_READ)
    except FileNotFoundError:
        return None


def _last_beat_ms(data: bytes, beat: bytes | None) -> float | None:
    """The time of the last heartbeat of the lock ``data``: its own, or a later one from its
    heartbeat file ``beat``."""
    fields = _fields(data)
    times = [fields.get("beat_ms", 1000 * fields["time"] if isinstance(fields.get("time"), (int, float)) else None),
             _fields(beat).get("beat_ms")]
    times = [t for t in times if isinstance(t, (int, float)) and not isinstance(t, bool)]
    return max(times) if times else None


def stale_reason(data: bytes, *, now: float | None = None, beat: bytes | None = None) -> str | None:
    """Why the lock ``data`` is stale (its process is gone, or its last heartbeat, its own or
    the heartbeat file's ``beat``, older than the lease), or None while it may be held: a lock
    this cannot read is never judged stale."""
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
    last = _last_beat_ms(data, beat)
    if last is not None:
        age, lease = (time.time() if now is None else now) - last / 1000, settings.lock_lease_s()
        if age > lease:
            return f"its last heartbeat was {age:.0f}s ago, more than {settings.LOCK_LEASE_S_ENV}={lease:g}s"
    return None


def _holder(data: bytes | None, beat: bytes | None) -> str:
    fields = _fields(data)
    if data is None or not {"host", "pid"} <= fields.keys():
        return ""
    last = _last_beat_ms(data, beat)
    ago = f", its last heartbeat {time.time() - last / 1000:.0f}s ago" if last is not None else ""
    return f" (held by pid {fields['pid']} on {fields['host']}{ago})"


def _take_over_stale(storage: Storage, lock: bytes) -> None:
    """The lock exists and this save has no ``save_overwrite``: take it over if it is stale
    (steps a-c of the module docstring), else ``FileExistsError``."""
    held, beat = _read_lock_and_beat(storage)
    if held is None:  # released meanwhile: one more try, as at first
        try:
            return storage.create_exclusive(LOCK_FILENAME, lock)
        except FileExistsError:
            pass
    reason = None if held is None else stale_reason(held, beat=beat)
    if held is None or reason is None:
        raise FileExistsError(
            f"another save into {storage.url} is in progress, or one crashed there: {storage.join(LOCK_FILENAME)} "
            f"exists{_holder(held, beat)}. A crashed save's lock is taken over once its process is known gone or "
            f"{settings.LOCK_LEASE_S_ENV}={settings.lock_lease_s():g}s pass without its heartbeat "
            "(remove it, or pass save_overwrite=True)"
        )
    assert held is not None
    _claim(storage, held, reason, lock)
    again, beat_again = _read_lock_and_beat(storage)
    if (again is not None and again != held) or beat_again != beat:
        raise FileExistsError(f"{storage.join(LOCK_FILENAME)} changed while this save took it over: its holder lives")
    storage.write(LOCK_FILENAME, lock)
    log.warning("took over the lock of a crashed save into %s: %s", storage.url, reason)


def _claim(storage: Storage, held: bytes, reason: str, lock: bytes) -> None:
    """Step a: create the marker of the stale lock ``held`` exclusively, or, where a save that
    made it has died since (its marker, holding its lock, is stale), the marker of that marker."""
    claimed, seen = held, set()
    while True:
        marker = f"{LOCK_TAKEOVER_PREFIX}{hashlib.sha256(claimed).hexdigest()[:32]}"
        try:
            return storage.create_exclusive(marker, lock)
        except FileExistsError:
            pass
        try:
            taker = storage.read(marker, 0, _LOCK_READ)
        except FileNotFoundError:
            taker = None  # a commit removed it: the lock is no longer the stale one
        if taker is None or marker in seen or stale_reason(taker, beat=_read_beat(storage, taker)) is None:
            raise FileExistsError(
                f"another save is taking over the stale lock {storage.join(LOCK_FILENAME)} ({reason}): "
                "this one is not saved (pass save_overwrite=True to save regardless)"
            )
        seen.add(marker)
        claimed = taker


def _read_lock_and_beat(storage: Storage) -> tuple[bytes | None, bytes | None]:
    try:
        held = storage.read(LOCK_FILENAME, 0, _LOCK_READ)
    except FileNotFoundError:
        return None, None
    return held, _read_beat(storage, held)


def _refresh(held: tuple[Storage, bytes]) -> None:
    """One beat: the time into the lock's own heartbeat file (never into the lock)."""
    storage, lock = held
    name = beat_name(lock)
    assert name is not None, "our own lock names its heartbeat file"
    try:
        storage.write(name, json.dumps({"beat_ms": int(time.time() * 1000)}).encode())
    except OSError as ex:  # the next beat tries again; a lease missed makes the commit refuse
        log.warning("could not refresh the save lock of %s: %s", storage.url, ex)


# Every lock this process holds has its heartbeat file written every quarter of the lease, on one kept
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


def check_lock_is_ours(storage: Storage, lock: bytes | None) -> None:
    """Before committing: a save that took this directory's lock over (``save_overwrite=True``)
    while this one wrote may have replaced some of its rank files, so this one must not commit."""
    if lock is not None and not _is_ours(_read_lock(storage, lock), lock):
        raise FileExistsError(
            f"another save into {storage.url} took over its lock ({storage.join(LOCK_FILENAME)}) while this "
            "one was writing (two jobs saving there with save_overwrite=True?): this save is not committed"
        )


def release_lock(storage: Storage, lock: bytes | None) -> None:
    """Remove the lock this save wrote (``lock``), leaving one another save has taken over. A
    save that wrote none (``None``: every rank but 0) leaves the directory's lock as it is."""
    if lock is None:
        return
    _HEARTBEAT.release(_lock_key(storage, lock))
    try:
        if _is_ours(_read_lock(storage, lock), lock):
            storage.delete(LOCK_FILENAME)
        beat = beat_name(lock)
        if beat is not None:
            storage.delete(beat)
    except OSError:
        pass  # the checkpoint stands; a leftover lock only makes the next save here ask for save_overwrite
