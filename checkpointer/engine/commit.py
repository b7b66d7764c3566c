"""The commit protocol of a save: the directory's lock, the checks, and publication, in one place.

Which rank calls what, in order (after Orbax's ``path/atomicity.py``):

1. Rank 0, before anything is locked, its error raised on every rank: :func:`claim_step` (a
   model + optimizer save, sync or async; it also takes over a step a dead save left half
   committed; with ``save_overwrite`` only once every part's plan is agreed, as it retires the
   old step) or :func:`refuse_existing_everywhere` (an async save of several directories without
   ``save_overwrite``): a directory that holds a checkpoint refuses the save on every rank
   before anything is locked or written.
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

The save lock (create, heartbeat, takeover of a crashed save's, release) is :mod:`~checkpointer.storage.save_lock`.

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

import logging

from .. import dist, settings
from ..errors import CheckpointError
from ..format.layout import (
    LOCK_BEAT_PREFIX, LOCK_FILENAME, LOCK_TAKEOVER_PREFIX, METADATA_FILENAME, is_rank_filename, is_rank_temp_file, is_save_file,
)
from ..format.metadata import StorageMetadata
from ..storage.base import Storage
from ..storage.save_lock import acquire, beat_name, check_lock_is_ours, release_lock


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
            held.append((part, acquire(part, False)))
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
    lock = acquire(storage, save_overwrite)
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
    check_lock_is_ours(storage, lock)
    wanted = set(metadata.files())
    for name in storage.list():
        if (is_rank_filename(name) and name not in wanted) or name.startswith(LOCK_TAKEOVER_PREFIX) or is_rank_temp_file(name):
            storage.delete(name)
        elif name.startswith(LOCK_BEAT_PREFIX) and (lock is None or name != beat_name(lock)):
            storage.delete(name)
    storage.write(METADATA_FILENAME, metadata.to_json_bytes())
    release_lock(storage, lock)


log = logging.getLogger(__name__)
