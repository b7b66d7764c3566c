"""storage/save_lock.py on local files, in one process: whose lock a file is (its token and its
length: a file that grew is no one's), and a takeover of a stale lock refused when the lock's
heartbeat file changed between the takeover's marker and its write (the holder lives). The
whole protocol, across processes and stores, is in ``reliability/test_stale_locks.py``."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from checkpointer.format.layout import LOCK_FILENAME, LOCK_TAKEOVER_PREFIX
from checkpointer.storage import save_lock
from checkpointer.storage.local import LocalStorage


def test_a_lock_file_that_grew_is_not_ours(tmp_path):
    storage = LocalStorage(str(tmp_path))
    lock = save_lock.acquire(storage, save_overwrite=False)
    save_lock.check_lock_is_ours(storage, lock)  # as written: ours
    storage.write(LOCK_FILENAME, lock + b"\n")  # the same JSON, the same token, one byte longer
    with pytest.raises(FileExistsError, match="took over its lock"):
        save_lock.check_lock_is_ours(storage, lock)
    save_lock.release_lock(storage, lock)
    assert storage.read(LOCK_FILENAME) == lock + b"\n"  # not ours: left where it is


class BeatDuringTakeover(LocalStorage):
    """Local files; the holder of the stale lock beats again right after the takeover's marker is made."""

    def create_exclusive(self, name: str, data: bytes) -> None:
        super().create_exclusive(name, data)
        if name.startswith(LOCK_TAKEOVER_PREFIX):
            super().write(save_lock.beat_name(STALE), json.dumps({"beat_ms": int(time.time() * 1000)}).encode())


STALE = json.dumps({"host": "elsewhere", "pid": 1, "token": "a" * 32, "beat_ms": 1000}).encode()


def test_a_takeover_is_refused_when_the_stale_locks_heartbeat_moves_meanwhile(tmp_path):
    storage = BeatDuringTakeover(str(tmp_path))
    storage.write(LOCK_FILENAME, STALE)  # its last beat in 1970: stale
    with pytest.raises(FileExistsError, match="changed while this save took it over"):
        save_lock.acquire(storage, save_overwrite=False)
    assert storage.read(LOCK_FILENAME) == STALE  # still the holder's
    assert sorted(os.listdir(tmp_path))[0] == LOCK_FILENAME


def test_of_two_saves_taking_over_one_stale_lock_the_second_to_make_its_marker_is_refused(tmp_path):
    """The marker of step a is created exclusively: a save that finds it made (another save is at
    step b or c with the same stale lock) is refused, and the lock is not written."""
    storage = LocalStorage(str(tmp_path))
    storage.write(LOCK_FILENAME, STALE)
    marker = f"{LOCK_TAKEOVER_PREFIX}{hashlib.sha256(STALE).hexdigest()[:32]}"
    storage.write(marker, b"the other save's lock")
    with pytest.raises(FileExistsError, match="another save is taking over the stale lock"):
        save_lock.acquire(storage, save_overwrite=False)
    assert storage.read(LOCK_FILENAME) == STALE and storage.read(marker) == b"the other save's lock"


def _marker_of(data: bytes) -> str:
    return f"{LOCK_TAKEOVER_PREFIX}{hashlib.sha256(data).hexdigest()[:32]}"


def _lock_of(token: str, beat_ms: int) -> bytes:
    return json.dumps({"host": "elsewhere", "pid": 1, "token": token * 32, "beat_ms": beat_ms}).encode()


def test_a_marker_whose_save_died_before_writing_its_lock_is_claimed_in_turn(tmp_path):
    """A save that made its marker and died before its lock (two in a row here) would otherwise
    leave the directory refusing every save: a stale marker is claimed by a marker of its bytes."""
    storage = LocalStorage(str(tmp_path))
    storage.write(LOCK_FILENAME, STALE)
    dead, dead_again = _lock_of("b", 2000), _lock_of("c", 3000)
    storage.write(_marker_of(STALE), dead)
    storage.write(_marker_of(dead), dead_again)
    lock = save_lock.acquire(storage, save_overwrite=False)
    try:
        assert storage.read(LOCK_FILENAME) == lock != STALE
        assert storage.read(_marker_of(dead_again)) == lock
    finally:
        save_lock.release_lock(storage, lock)


def test_a_marker_whose_save_lives_still_refuses(tmp_path):
    storage = LocalStorage(str(tmp_path))
    storage.write(LOCK_FILENAME, STALE)
    live = _lock_of("d", 1000)
    storage.write(_marker_of(STALE), live)
    storage.write(save_lock.beat_name(live), json.dumps({"beat_ms": int(time.time() * 1000)}).encode())
    with pytest.raises(FileExistsError, match="another save is taking over the stale lock"):
        save_lock.acquire(storage, save_overwrite=False)
    assert storage.read(LOCK_FILENAME) == STALE and not storage.exists(_marker_of(live))
