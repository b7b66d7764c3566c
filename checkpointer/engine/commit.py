"""The commit protocol of a save: the directory's lock, the checks, and publication, in one place.

Which rank calls what, in order (after Orbax's ``path/atomicity.py``):

1. Every rank, before planning: :func:`claim_parts` (a model + optimizer save) or, for an async
   save without ``save_overwrite``, :func:`refuse_existing_everywhere`: a directory that holds a
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

Replicas agree before the commit (step 4): a piece several ranks hold (a plain tensor every
rank saves, DDP's parameters, a ``Replicate`` placement, each shard under HSDP) is written once,
by one of them. Each other holder hashes its copy (:func:`start_hashing`; CRC32C per
:data:`~checkpointer.checksums.CHUNK_BYTES`, as the writer computes them while writing): a
synchronous save on a thread while the rank writes its file, an async save before the call
returns, while the state is the one it staged. The checksums reach rank 0 in the commit's
gather of every rank's status (no collective of their own), and :func:`check_copies` refuses
the commit with :class:`~checkpointer.errors.ReplicaMismatchError`, naming the tensors and
ranks, where a copy differs. ``CHECKPOINTER_VERIFY_REPLICAS=0`` turns the check off.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from .. import dist, settings
from ..checksums import CHUNK_BYTES
from ..errors import ReplicaMismatchError
from ..format.layout import LOCK_FILENAME, METADATA_FILENAME, is_rank_filename
from ..format.metadata import StorageMetadata
from ..sharding import LocalTensor
from ..storage.base import Storage
from .rankfile import hash_pieces, io_threads



def claim_parts(
    model: Storage, optim: Storage, save_overwrite: bool, *, train: Storage | None = None, keep_train: bool = False
) -> None:
    """Every rank, before any part of a model + optimizer save is planned. Without
    ``save_overwrite``, every rank raises ``FileExistsError`` when ``model/``, ``optim/`` or
    ``train/`` holds a checkpoint, so a refused save writes none. With it, rank 0 first makes the
    old ``optim/`` incomplete: the optimizer is committed last, so a save that dies between the
    parts leaves the directory incomplete, never the new model beside the old optimizer state.
    Then, when the new save has no training state (``keep_train`` False), the old ``train/`` is
    removed (its ``metadata.json`` first), so that it is not read as the new checkpoint's."""

    def check() -> bytes:
        if not save_overwrite:
            refuse_existing([model, optim] + ([train] if train is not None else []))
            return b""
        if optim.exists(METADATA_FILENAME):
            optim.delete(METADATA_FILENAME)
        if train is not None and not keep_train:
            remove_checkpoint_files(train)
        return b""

    dist.share_from(0, check, "save")


def remove_checkpoint_files(storage: Storage) -> None:
    """Delete a flat checkpoint directory's files, ``metadata.json`` first (it reads as
    incomplete from then on); a directory that does not exist is left alone."""
    names = storage.list()
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


def check_directory(storage: Storage, save_overwrite: bool, *, retire_old: bool) -> bytes | None:
    """Refuse to save over a checkpoint unless asked. With ``retire_old``, take the save lock
    and make an old checkpoint incomplete, before any rank writes; returns the lock's bytes."""
    storage.prepare()
    if storage.exists(METADATA_FILENAME) and not save_overwrite:
        raise FileExistsError(_exists_message(storage))
    if not retire_old:
        return None
    # The token makes the lock file ours alone: a conditional create retried after a lost
    # answer recognises its own file by its bytes.
    lock = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                       "token": uuid.uuid4().hex}).encode()
    try:
        storage.create_exclusive(LOCK_FILENAME, lock)
    except FileExistsError:
        if not save_overwrite:
            raise FileExistsError(
                f"another save into {storage.url} is in progress, or one crashed there: "
                f"{storage.join(LOCK_FILENAME)} exists (remove it, or pass save_overwrite=True)"
            ) from None
        storage.write(LOCK_FILENAME, lock)
    if storage.exists(METADATA_FILENAME):
        if not save_overwrite:
            # A save that held the lock committed between the first check and ours.
            release_lock(storage, lock)
            raise FileExistsError(
                f"{storage.join(METADATA_FILENAME)} exists: a checkpoint was saved there while this save "
                "was planning (pass save_overwrite=True to replace it)"
            )
        storage.delete(METADATA_FILENAME)
    return lock


def take_locks(storages: list[Storage], save_overwrite: bool) -> list[bytes | None]:
    """Rank 0, before any rank writes: take every target's lock, retiring old checkpoints (see
    :func:`check_directory`). Without ``save_overwrite``, nothing is locked when any target holds
    a checkpoint. A failure releases the locks taken."""
    if not save_overwrite:
        refuse_existing(storages)
    locks: list[bytes | None] = []
    try:
        for storage in storages:
            locks.append(check_directory(storage, save_overwrite, retire_old=True))
    finally:
        if len(locks) < len(storages):  # a failure: the locks taken go
            for storage, lock in zip(storages, locks):
                release_lock(storage, lock)
    return locks


def release_locks(held: list[tuple[Storage, bytes | None]]) -> None:
    """Rank 0: release the locks of saves that will not be written (nothing was)."""
    for storage, lock in held:
        if lock is not None:
            release_lock(storage, lock)


def commit_metadata(storage: Storage, metadata: StorageMetadata, lock: bytes | None) -> None:
    """Rank 0, once every rank file is durable: drop stale rank files, then publish metadata.json."""
    _check_lock_is_ours(storage, lock)
    wanted = set(metadata.files())
    for name in storage.list():
        if is_rank_filename(name) and name not in wanted:
            storage.delete(name)
    storage.write(METADATA_FILENAME, metadata.to_json_bytes())
    release_lock(storage, lock)


def _read_lock(storage: Storage, ours: bytes) -> bytes | None:
    """The lock file's bytes, enough of them to tell whether it is ``ours`` (a larger file is
    read no further than one byte past the length of ours)."""
    try:
        return storage.read(LOCK_FILENAME, 0, len(ours) + 1)
    except FileNotFoundError:
        return None


def _check_lock_is_ours(storage: Storage, lock: bytes | None) -> None:
    """Before committing: a save that took this directory's lock over (``save_overwrite=True``)
    while this one wrote may have replaced some of its rank files, so this one must not commit."""
    if lock is not None and _read_lock(storage, lock) != lock:
        raise FileExistsError(
            f"another save into {storage.url} took over its lock ({storage.join(LOCK_FILENAME)}) while this "
            "one was writing (two jobs saving there with save_overwrite=True?): this save is not committed"
        )


def release_lock(storage: Storage, lock: bytes | None) -> None:
    """Remove the lock this save wrote (``lock``), leaving one another save has taken over."""
    try:
        if lock is None or _read_lock(storage, lock) == lock:
            storage.delete(LOCK_FILENAME)
    except OSError:
        pass  # the checkpoint stands; a leftover lock only makes the next save here ask for save_overwrite


# ---------------------------------------------------------------------------------------
# Replicas agree before a commit
# ---------------------------------------------------------------------------------------



VERIFY_ENV = settings.VERIFY_REPLICAS_ENV
_SHOWN = 5  # tensors described in the error; the rest are counted
_INLINE_BYTES = 4 << 20  # copies smaller than this in all are hashed by the caller (well under 1 ms)

Copies = list[list[Any]]
"""This rank's copies as its commit status carries them: ``[key, writer, crcs]`` each."""


def enabled() -> bool:
    """Whether saves compare replicas (default on; ``CHECKPOINTER_VERIFY_REPLICAS=0`` is off)."""
    return settings.verify_replicas()


def start_hashing(copies: Mapping[str, int], described: Mapping[str, LocalTensor]) -> Future[Copies]:
    """Hash this rank's ``copies`` (key -> the rank writing that piece) on a thread (the hashing
    releases the GIL), the chunks of large ones on up to ``CHECKPOINTER_IO_THREADS`` threads; the
    future's result goes into the commit's status. Nothing to hash, or the check turned off: an
    empty result at once."""
    if not copies or not enabled():
        done: Future[Copies] = Future()
        done.set_result([])
        return done
    keys = sorted(copies)
    tensors = [described[key].data for key in keys]

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    threads = max(1, min(io_threads(), os.cpu_count() or 1, nbytes // (4 * CHUNK_BYTES)))

    def run() -> Copies:
        return [[key, copies[key], crcs] for key, crcs in zip(keys, hash_pieces(tensors, threads=threads))]

    if nbytes < _INLINE_BYTES:
        done = Future()
        done.set_result(run())  # a few small tensors (an optimizer's steps): sooner than a thread starts
        return done
    pool = ThreadPoolExecutor(1, thread_name_prefix="checkpointer-replica-hash")
    try:
        return pool.submit(run)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


def check_copies(statuses: Sequence[Mapping[str, Any]]) -> None:
    """Rank 0, before committing: raise :class:`ReplicaMismatchError` if a copy in any rank's
    status (``copies``) differs from the checksums its writer reported (``crcs``)."""
    differing: set[tuple[str, int]] = set()
    for status in statuses:
        for key, writer, crcs in status.get("copies", ()):
            if crcs != statuses[writer]["crcs"].get(key):
                differing.add((key, writer))
    if not differing:
        return
    # Every holder of each differing piece, grouped by what it holds; the writer's group first.
    groups: dict[tuple[str, int], dict[tuple[int, ...], list[int]]] = {
        (key, writer): {tuple(statuses[writer]["crcs"].get(key) or ()): [writer]} for key, writer in differing
    }
    for rank, status in enumerate(statuses):
        for key, writer, crcs in status.get("copies", ()):
            if (key, writer) in differing:
                groups[key, writer].setdefault(tuple(crcs), []).append(rank)
    shown = sorted(differing)[:_SHOWN]
    details = "; ".join(_describe(key, writer, groups[key, writer]) for key, writer in shown)
    more = f"; and {len(differing) - len(shown)} more" if len(differing) > len(shown) else ""
    raise ReplicaMismatchError(
        f"replicas disagree, so this save is not committed: {details}{more}. A copy was corrupted in "
        "memory, or a value that differs per rank was saved under one key (give each rank's value a key "
        f"of its own). {VERIFY_ENV}=0 turns this check off."
    )


def _describe(key: str, writer: int, groups: dict[tuple[int, ...], list[int]]) -> str:
    values = list(groups.items())  # the writer's group first (inserted first)
    who = [_ranks(sorted(ranks)) for _, ranks in values]
    who[0] += f" (rank {writer}'s copy was written)"
    a, b = values[0][0], values[1][0]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (
        f"tensor {key!r} differs between {' / '.join(who)}, first in the {CHUNK_BYTES >> 20} MiB chunk "
        f"at byte {first * CHUNK_BYTES} of the piece"
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
