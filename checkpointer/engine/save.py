"""Saving a flat state dict: plan once across ranks, each rank writes its pieces, rank 0 commits last.

The recipe:

1. Every rank describes its values (:func:`~checkpointer.sharding.describe`); values that
   share memory with an earlier key (tied parameters) become aliases, saved once.
2. Rank 0 checks the directory (``FileExistsError`` unless ``save_overwrite``; with it, the
   old ``metadata.json`` is removed first so the old checkpoint reads as incomplete).
3. Every rank builds the same plan (each distinct piece gets one writer; the other holders of
   a piece keep a copy): from layouts every rank shares (DTensors over all ranks, plain
   tensors: :mod:`~checkpointer.planning.layouts`), confirmed by one all-reduce; else from every
   rank's pieces, all-gathered (as columns: the structure, which ranks of one model share,
   travels only when it differs from rank 0's). A cached plan skips this: one all-reduce
   confirms every rank's pieces are those of one earlier save, planned together (with
   ``save_overwrite``, one more agreement follows rank 0's retiring the old checkpoint).
4. Every rank writes ``rank_{r}.safetensors`` (temp name, fsync, rename), with a new id in its
   header, checksumming each piece as it goes; meanwhile it hashes its copies of pieces that
   another rank writes (:mod:`~checkpointer.engine.commit`).
5. Rank 0 gathers every rank's outcome and checksums, and refuses to commit
   (:class:`~checkpointer.errors.ReplicaMismatchError`) if a copy differs from the written
   piece; otherwise it removes stale rank files and writes ``metadata.json`` (listing every
   file's id and checksum) atomically. All ranks agree on the outcome.

A failure anywhere reaches every rank at the next agreement.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .. import dist
from ..errors import CheckpointError, RankError
from ..checksums import ALGORITHM, CHUNK_BYTES
from ..format.layout import FORMAT_VERSION, METADATA_FILENAME, new_file_id, rank_filename
from ..format.metadata import StorageMetadata
from ..planning.layouts import describe_layouts, plan_from_layouts
from ..planning.pieces import parse_pieces, pieces_payload
from ..planning.plan import PieceDesc, RankPieces, SavePlan, Structure, build_save_plan
from ..sharding import LocalTensor, describe_state_dict
from ..storage.base import Storage
from .commit import (
    check_directory, commit_metadata, refuse_existing_everywhere, refuse_if_committed, release_lock,
    agree_or_release, retire, take_locks,
)
from .rankfile import Copies, check_copies, start_hashing, write_rank_file

__all__ = [
    "save_state_dict", "plan_save", "write_and_commit", "PlannedSave", "SavePlanCache",
    "DescribedState", "describe_for_save", "reuse_cached_plans", "plan_in_full", "plan_ahead", "save_state_dicts",
]

_CACHE_ENTRIES = 8

COMPACT_METADATA = True
"""The form of new checkpoints: format 2 (shard rules; checksums in the rank files; one file id).
``False`` writes format 1 (every piece listed, with its checksums and each file's id), which
OLMo-core 0.1.0 reads; ``checkpointer convert --to olmo`` turns either into that form."""


@dataclass
class SavePlanCache:
    """The last save plan of one :class:`~checkpointer.Checkpointer`, reused while the structure holds."""

    fingerprint: str
    keys: tuple[str, ...]
    metadata: StorageMetadata
    plan_id: int
    """The same on every rank for one plan: this rank's pieces recurring is not enough, the
    other ranks' entries must come from the same save (pieces may move between ranks)."""
    copies: dict[str, int] = field(default_factory=dict)
    """The keys whose piece this rank holds while another rank writes it: key -> that rank."""


def _desc_json(described: Mapping[str, LocalTensor], aliases: Mapping[str, str]) -> bytes:
    items = []
    for key, lt in described.items():
        p = lt.piece
        items.append([key, list(lt.shape), lt.dtype, lt.is_sharded, p.flat, p.local_shape, p.global_offset])
    return json.dumps({"items": items, "aliases": aliases}, separators=(",", ":")).encode()


def _columns(described: Mapping[str, LocalTensor]) -> RankPieces:
    return RankPieces.from_descs(
        [PieceDesc(key, lt.shape, lt.dtype, lt.is_sharded, lt.piece) for key, lt in described.items()]
    )


def _plan(
    storage: Storage, described, aliases, local_error, save_overwrite, fingerprint: str, take_lock: bool = True
) -> tuple[tuple[str, ...], StorageMetadata, bytes | None, int, dict[str, int], str | None]:
    """Steps 2-3 without a cached plan. Returns this rank's keys, the metadata, (rank 0) the lock,
    the plan's id (the same on every rank), this rank's copies of pieces others write (key ->
    writer) and the save's file id when planning picked it.

    Every rank makes the same plan: from layouts every rank shares, confirmed by one all-reduce,
    else from every rank's pieces, all-gathered (far fewer bytes and far less work than rank 0
    sending the metadata it planned, as JSON, to be parsed)."""
    rank = dist.get_rank()
    error: BaseException | None = local_error
    if rank == 0 and error is None:
        _, error = dist.attempt(lambda: check_directory(storage, save_overwrite, retire_old=False))
    planned, error = _plan_from_layouts(described, aliases, error, storage.url)
    if planned is None:
        planned, error = _exchange_and_plan(described, aliases, error, fingerprint)
    plan, plan_id, save_id = planned or (None, -1, None)
    lock = None
    if error is None and rank == 0 and take_lock:
        # Planned: only now retire an old checkpoint here, before any rank writes a file.
        lock, error = dist.attempt(lambda: check_directory(storage, save_overwrite, retire_old=True))
    agree_or_release(error, [(storage, lock)])
    assert plan is not None
    copies = plan.copies_for(rank, {key: lt.piece for key, lt in described.items()})
    return plan.keys_for(rank), plan.metadata, lock, plan_id, copies, save_id


def _plan_from_layouts(
    described, aliases, error, url: str
) -> tuple[tuple[SavePlan | None, int, str] | None, BaseException | None]:
    """Every rank's pieces computed from layouts the same on every rank
    (:mod:`~checkpointer.planning.layouts`), confirmed by one all-reduce, which also picks the
    save's file id and checks that every rank saves to ``url``; ``(None, error)``: the pieces
    must be exchanged (which reports ``error``)."""
    form = f"{COMPACT_METADATA}"
    mine = None
    if error is None:
        items = [(key, lt.shape, lt.dtype, lt.is_sharded, lt.layout) for key, lt in described.items()]
        own = {key: lt.piece for key, lt in described.items()}
        mine, error = dist.attempt(lambda: describe_layouts(
            items, own, aliases, world=dist.get_world_size(), rank=dist.get_rank(), form=form))
    digest = mine.digest if mine is not None and error is None else -1
    (same, same_place), save_id = dist.all_equal_each_and_least([digest, _digest(url)], secrets.randbits(62))
    if not same_place:  # the same on every rank: every rank raises, before any lock or file
        raise CheckpointError(f"cannot save: the ranks passed different directories (this rank's: {url})")
    if not same or digest < 0:
        return None, error
    assert mine is not None
    planned, error = dist.attempt(lambda: _refusing(lambda: plan_from_layouts(
        mine.entries, mine.classes, dist.get_world_size(), aliases=dict(aliases), compact=COMPACT_METADATA)))
    plan_id = _digest(f"layouts {digest}")
    return (planned, plan_id, f"{save_id:016x}"), error  # planned None: error, agreed on next


def _exchange_and_plan(described, aliases, error, fingerprint) -> tuple[tuple[SavePlan, int, None] | None, BaseException | None]:
    """Every rank gets every rank's pieces (all-gathered) and makes the same plan from them; a
    rank's error reaches every rank here. Returns ``((plan, plan id, None) or None, error)``."""
    rank = dist.get_rank()
    columns = _columns(described) if error is None else None
    rank0_digest = dist.broadcast_bytes(
        (columns.structure.digest if columns is not None else "").encode() if rank == 0 else None, src=0
    ).decode()
    mine = (
        dist.error_payload(error)  # type: ignore[arg-type]
        if columns is None
        else pieces_payload(
            columns, aliases, with_structure=rank == 0 or columns.structure.digest != rank0_digest,
            fingerprint=fingerprint,
        )
    )
    gathered = dist.all_gather_bytes(mine)
    failed = [r for r, payload in enumerate(gathered) if payload[:1] != b"P"]
    if failed:
        if error is not None:
            raise error
        raise dist.remote_error([RankError.from_json(gathered[r]) for r in failed], "save")
    assert columns is not None
    planned, error = dist.attempt(lambda: _refusing(lambda: _plan_from(gathered, columns)))
    return (planned[0], planned[1], None) if planned is not None else None, error


def _digest(text: str) -> int:
    """``text`` as a number the ranks compare in an all-reduce."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _refusing(fn):
    """``fn()``, its refusals (the same on every rank: the same inputs) as one error."""
    try:
        return fn()
    except (ValueError, CheckpointError) as ex:
        raise CheckpointError(f"cannot save: {ex}") from None


def _plan_from(gathered: list[bytes], mine: RankPieces) -> tuple[SavePlan, int]:
    """The save plan from every rank's payload (this rank's structure is known already), and its
    id: a digest of every rank's fingerprint in rank order, the same on every rank."""
    columns: list[RankPieces] = []
    aliases: dict[str, str] = {}
    known: dict[str, Structure] = {mine.structure.digest: mine.structure}
    plan_id = hashlib.sha256()
    for payload in gathered:
        rank_columns, rank_aliases, fingerprint = parse_pieces(payload, known)
        columns.append(rank_columns)
        aliases.update(rank_aliases)
        plan_id.update(fingerprint.encode() + b"\n")
    plan = build_save_plan(columns, aliases=aliases, compact=COMPACT_METADATA)
    return plan, int.from_bytes(plan_id.digest()[:7], "little")


@dataclass
class PlannedSave:
    """A save after planning: what this rank writes, and the metadata rank 0 will commit."""

    storage: Storage
    described: dict[str, LocalTensor]
    keys: tuple[str, ...]
    metadata: StorageMetadata
    fingerprint: str
    lock: bytes | None = None  # rank 0: the lock file this save wrote
    copies: dict[str, int] = field(default_factory=dict)  # key -> the rank writing the piece this one holds too
    save_id: str | None = None  # format 2: the id of every file of this save, when planning agreed on one

    def local_pieces(self) -> list[tuple[str, LocalTensor]]:
        return [(key, self.described[key]) for key in self.keys]


@dataclass
class DescribedState:
    """One state dict described for a save (step 1), with the key of its plan cache entry."""

    described: dict[str, LocalTensor]
    aliases: dict[str, str]
    error: BaseException | None  # this rank's, reported to every rank by the full plan
    fingerprint: str


def describe_for_save(state_dict: Mapping[str, Any]) -> DescribedState:
    result, error = dist.attempt(lambda: describe_state_dict(state_dict))  # its error: in the plan exchange
    described, aliases = result or ({}, {})
    form = f"{dist.get_world_size()},{COMPACT_METADATA}".encode()
    fingerprint = hashlib.sha256(_desc_json(described, aliases) + form).hexdigest()
    return DescribedState(described, aliases, error, fingerprint)


def reuse_cached_plans(
    targets: list[tuple[Storage, DescribedState]], *, cache: dict[str, SavePlanCache], save_overwrite: bool
) -> list[PlannedSave] | None:
    """Every target's plan from ``cache``, confirmed by one all-reduce: None unless every rank
    has a cached plan for each target, each from the same save as the other ranks' entries.
    Rank 0 first takes each target's lock; a refusal sends every rank to the full plan, which
    reports it. With ``save_overwrite``, old checkpoints are retired once the plans are
    confirmed, and one more agreement reports that."""
    hits = [cache.get(d.fingerprint) if d.error is None else None for _, d in targets]
    locks: list[bytes | None] = [None] * len(targets)
    ok = all(hit is not None for hit in hits)
    if ok and dist.get_rank() == 0:
        # take_locks releases the locks it took when a later target refuses. An old checkpoint is
        # retired only once every rank's plan is confirmed: a rank may have failed to describe its values.
        taken, failed = dist.attempt(lambda: take_locks([s for s, _ in targets], save_overwrite, keep_old=True))
        ok = failed is None  # the full path reports it
        locks = taken or locks
    # Every rank's entries must come from one plan: each rank's own pieces can recur while
    # another rank's did not (they moved between ranks), or recur from another save.
    plan_id = _plans_id(hits, [storage for storage, _ in targets]) if ok else -1
    same, save_id = dist.all_equal_and_least(plan_id, secrets.randbits(62))  # the save's file id comes along
    if same and plan_id >= 0:
        if save_overwrite:
            error = None
            if dist.get_rank() == 0:
                _, error = dist.attempt(lambda: [retire(storage, True) for storage, _ in targets])
            agree_or_release(error, [(storage, lock) for (storage, _), lock in zip(targets, locks)])
        return [
            PlannedSave(storage, d.described, hit.keys, hit.metadata, d.fingerprint, lock, hit.copies, f"{save_id:016x}")
            for (storage, d), hit, lock in zip(targets, hits, locks)
            if hit is not None
        ]
    for (storage, _), lock in zip(targets, locks):
        if lock is not None:
            release_lock(storage, lock)
    return None


def _plans_id(hits: list[SavePlanCache | None], storages: list[Storage]) -> int:
    """Cached plans and their targets (ranks saving elsewhere differ) as one number to compare, -1 if one is missing."""
    if any(hit is None for hit in hits):
        return -1
    return _digest(",".join(str(hit.plan_id) for hit in hits) + "".join(f"\n{storage.url}" for storage in storages))  # type: ignore[union-attr]


def plan_ahead(
    targets: list[tuple[Storage, DescribedState]], *, save_overwrite: bool, cache: dict[str, SavePlanCache]
) -> None:
    """Every rank: each target planned into ``cache`` and agreed (values a rank cannot save, ranks
    that disagree), no directory locked or changed, unless every rank holds the same cached plans:
    before ``save_overwrite``'s claim retires an old model + optimizer step."""
    hits = [cache.get(d.fingerprint) if d.error is None else None for _, d in targets]
    plan_id = _plans_id(hits, [storage for storage, _ in targets])
    same, _ = dist.all_equal_and_least(plan_id, 0)
    if same and plan_id >= 0:
        return
    for storage, d in targets:
        plan_in_full(storage, d, save_overwrite=save_overwrite, cache=cache, take_lock=False)


def plan_save(
    storage: Storage,
    state_dict: Mapping[str, Any],
    *,
    save_overwrite: bool = False,
    cache: dict[str, SavePlanCache] | None = None,
) -> PlannedSave:
    """Steps 1-3 on every rank: describe, check the directory, plan (or reuse a cached plan)."""
    d = describe_for_save(state_dict)
    if cache is not None:
        reused = reuse_cached_plans([(storage, d)], cache=cache, save_overwrite=save_overwrite)
        if reused is not None:
            return reused[0]
    return plan_in_full(storage, d, save_overwrite=save_overwrite, cache=cache)


def plan_in_full(
    storage: Storage, d: DescribedState, *, save_overwrite: bool, cache: dict[str, SavePlanCache] | None,
    take_lock: bool = True,
) -> PlannedSave:
    """Steps 2-3 without the cache (every rank's pieces exchanged); the plan goes into ``cache``.
    Without ``take_lock``, the directory is neither locked nor changed."""
    keys, metadata, lock, plan_id, copies, save_id = _plan(
        storage, d.described, d.aliases, d.error, save_overwrite, d.fingerprint, take_lock
    )
    if cache is not None:
        while len(cache) >= _CACHE_ENTRIES:
            cache.pop(next(iter(cache)))
        cache[d.fingerprint] = SavePlanCache(d.fingerprint, keys, metadata, plan_id, copies)
    return PlannedSave(storage, d.described, keys, metadata, d.fingerprint, lock, copies, save_id)


def write_and_commit(
    planned: PlannedSave,
    *,
    pieces: list[tuple[str, LocalTensor]] | None = None,
    copies: Copies | None = None,
    group: Any = None,
) -> list[str]:
    """Steps 4-5: write this rank's file (from ``pieces``, default the live tensors), then commit.

    ``copies``: the checksums of this rank's copies of pieces others write, hashed already
    (async saves hash them before staging ends); by default they are hashed from the live
    tensors while the file is written. ``group`` is the process group for the closing
    collectives (async saves use their own).
    """
    storage, metadata, rank = planned.storage, planned.metadata, dist.get_rank()
    files: list[str] = []
    crcs: dict[str, list[int]] = {}
    file_id = None
    hashing = None
    compact = (metadata.format_version or 0) >= FORMAT_VERSION
    # Format 2: one id for every file of this save (the least of the ranks' random picks), so
    # metadata.json names it once; and each file holds its own checksums.
    save_id = None
    if compact:
        save_id = planned.save_id or f"{dist.all_reduce_min(secrets.randbits(62), group=group):016x}"

    def write() -> None:
        nonlocal crcs, file_id, hashing
        if copies is None:
            hashing = start_hashing(planned.copies, planned.described)
        if rank != 0:
            storage.prepare()
        local = planned.local_pieces() if pieces is None else pieces
        if local:
            name = rank_filename(rank)
            file_id = save_id or new_file_id()
            crcs = write_rank_file(storage, name, local, file_id=file_id, checksums_in_file=compact,
                                   before_commit=lambda: refuse_if_committed(storage))
            files.append(storage.join(name))

    _, error = dist.attempt(write)
    if hashing is not None:
        hashed, hash_error = dist.attempt(hashing.result)  # waited for even after a failed write: no thread outlives the save
        copies, error = hashed, error or hash_error
    status = {"ok": error is None, "crcs": crcs, "id": file_id, "copies": copies or []}
    gathered = dist.gather_bytes(json.dumps(status, separators=(",", ":")).encode(), dst=0, group=group)

    commit_error: BaseException | None = None
    if gathered is not None:
        statuses = [json.loads(b) for b in gathered]
        if all(s["ok"] for s in statuses):

            def commit() -> None:
                check_copies(statuses)
                if compact:
                    committed = metadata.model_copy(update={
                        "checksum_algorithm": ALGORITHM, "checksum_chunk_bytes": CHUNK_BYTES,
                        "checksums_in_files": True, "file_id": save_id,
                    })
                else:
                    crcs_per_file = {rank_filename(r): s["crcs"] for r, s in enumerate(statuses)}
                    committed = metadata.with_checksums(crcs_per_file, algorithm=ALGORITHM, chunk_bytes=CHUNK_BYTES)
                    ids = {rank_filename(r): s["id"] for r, s in enumerate(statuses) if s["id"]}
                    committed = committed.with_file_ids(ids)
                commit_metadata(storage, committed, planned.lock)
                files.append(storage.join(METADATA_FILENAME))

            _, commit_error = dist.attempt(commit)
            if commit_error is not None:
                release_lock(storage, planned.lock)
        else:
            release_lock(storage, planned.lock)
    dist.agree(error or commit_error, "save", group=group)
    return files


def save_state_dict(
    storage: Storage, state_dict: Mapping[str, Any], *, save_overwrite: bool = False,
    cache: dict[str, SavePlanCache] | None = None,
) -> tuple[StorageMetadata, list[str]]:
    """Save on every rank. Returns the metadata and the files this rank created."""
    return save_state_dicts([(storage, state_dict)], save_overwrite=save_overwrite, cache=cache)[0]


@contextlib.contextmanager
def _released_unless_committed(planned: list[PlannedSave], start: int) -> Iterator[None]:
    """On a failure in the block, release the locks of ``planned[start:]``; the failure goes on."""
    done = False
    try:
        yield
        done = True
    finally:
        if not done:
            for p in planned[start:]:
                release_lock(p.storage, p.lock)


def save_state_dicts(
    targets: list[tuple[Storage, Mapping[str, Any] | DescribedState]], *, save_overwrite: bool = False,
    cache: dict[str, SavePlanCache] | None = None,
) -> list[tuple[StorageMetadata, list[str]]]:
    """Several state dicts (or their :func:`describe_for_save`) as one save, on every rank: all
    planned and locked before any rank writes, then each written and committed in order (the
    last commit is the save's), as :meth:`~checkpointer.engine.async_save.AsyncSaver.save` does."""
    described = [(storage, sd if isinstance(sd, DescribedState) else describe_for_save(sd)) for storage, sd in targets]
    planned = None
    if cache is not None:
        planned = reuse_cached_plans(described, cache=cache, save_overwrite=save_overwrite)
    if planned is None:
        planned = []
        if not save_overwrite and len(targets) > 1:  # before any target's lock: a refused save locks none
            refuse_existing_everywhere([storage for storage, _ in targets])
        with _released_unless_committed(planned, 0):
            for storage, d in described:
                planned.append(plan_in_full(storage, d, save_overwrite=save_overwrite, cache=cache))
    out: list[tuple[StorageMetadata, list[str]]] = []
    for index, p in enumerate(planned):
        with _released_unless_committed(planned, index):  # a failure: this target's lock and the later ones' go
            out.append((p.metadata, write_and_commit(p)))
    return out
