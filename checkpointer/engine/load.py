"""Loading a flat state dict in place: each rank reads only the bytes of its own pieces.

1. Rank 0 reads ``metadata.json`` and shares it (one broadcast, for a model's and its
   optimizer's checkpoints together).
2. Each rank checks its keys, shapes and dtypes against it and plans, per tensor, which
   byte ranges of which file land where in its local memory. A plan that does not cover
   every local element is an error, so a completed load has filled every element. All
   ranks agree that planning succeeded before any tensor is written.
3. Reads go straight into the destination tensors (``preadv`` locally, ranged requests
   remotely); only CUDA or non-contiguous destinations pass through a host buffer.
4. All ranks agree: an error on one rank makes every rank raise.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import dist
from ..errors import CheckpointError, CheckpointMismatchError
from ..format.dtypes import dtype_from_code
from ..format.layout import METADATA_FILENAME
from ..format.metadata import StorageMetadata, TensorStorageMetadata
from ..format.metadata_parse import parse_metadata
from ..planning.load_plan import TensorLoadPlan, build_load_plan
from ..planning.pieces import Piece
from ..sharding import LocalTensor, describe_state_dict
from ..storage.base import Storage
from .locate import metadata_bytes
from .checks import HeaderCache, piece_files, verify_chunk_bytes
from .reader import CheckpointReader
from .reads import ReadJob, execute_reads, execute_reads_from

__all__ = [
    "unshard_state_dict",
    "read_full_onto",
    "read_metadata",
    "read_metadatas",
    "load_state_dict",
    "load_state_dicts",
    "plan_local_loads",
    "fill_in_place",
    "fill_in_place_from",
    "copy_into",
    "LocalLoad",
    "MAX_METADATA_BYTES",
]

MAX_METADATA_BYTES = 4 << 30
"""The default limit on ``metadata.json``; ``CHECKPOINTER_MAX_METADATA_MIB`` changes it. Above
what this library writes for a 70B model's optimizer over 8,192 ranks (about 1.1 GiB)."""
_STAGE_BYTES = 256 << 20
"""The most host memory a load stages destinations it cannot read into through (two batches)."""
_MIN_STAGE_BYTES = 32 << 20
_READ_STAGING = 32 << 20  # what strided reads may hold besides (a block per reading thread)


def read_metadata(storage: Storage, *, no_dist: bool = False) -> StorageMetadata:
    return read_metadatas([storage], no_dist=no_dist)[0]


def read_metadatas(storages: Sequence[Storage], *, no_dist: bool = False) -> list[StorageMetadata]:
    """The metadata of several checkpoints: rank 0 reads every ``metadata.json`` and shares them
    in one broadcast (each framed by its 8-byte length)."""

    def produce() -> bytes:
        return b"".join(len(data).to_bytes(8, "little") + data for data in map(metadata_bytes, storages))

    shared = memoryview(dist.share_from(0, produce, "reading metadata", no_dist=no_dist))
    out, at = [], 0
    for storage in storages:
        size = int.from_bytes(shared[at : at + 8], "little")
        out.append(parse_metadata(shared[at + 8 : at + 8 + size], where=storage.join(METADATA_FILENAME)))
        at += 8 + size
    return out


def _meta_for(metadata: StorageMetadata, key: str, storage: Storage) -> TensorStorageMetadata:
    meta = metadata.tensors.get(key)
    if meta is None and metadata.aliases and key in metadata.aliases:
        meta = metadata.tensors[metadata.aliases[key]]
    if meta is None:
        raise CheckpointMismatchError(f"key {key!r} is not in the checkpoint at {storage.url}")
    return meta


def _dtype_mismatch(key: str, storage: Storage, saved: str, wanted: str) -> str:
    """What a load never does silently (cast), and how to do it on purpose."""
    saved_torch, wanted_torch = _torch_dtype(saved), _torch_dtype(wanted)
    saved_dtype, wanted_dtype = str(saved_torch or saved), str(wanted_torch or wanted)
    head = (
        f"dtype mismatch for {key!r} in the checkpoint at {storage.url}: the checkpoint has {saved} "
        f"({saved_dtype}), the state dict has {wanted} ({wanted_dtype}). A load never casts: "
    )
    if all(d is not None and d.is_floating_point for d in (saved_torch, wanted_torch)):
        return head + (
            f"load into {saved_dtype} tensors and convert after (e.g. model.to({saved_dtype}) before loading, "
            f"model.to({wanted_dtype}) after), or read full tensors with unshard_model_state / "
            f"Checkpointer().unshard and call .to({wanted_dtype}) on them"
        )
    # Module.to(dtype) casts only floating-point tensors: no advice to call it here.
    return head + (
        f"put a {saved_dtype} tensor under {key!r} in the state dict you load into and convert it after "
        f"with .to({wanted_dtype}), or read it with unshard_model_state / Checkpointer().unshard"
    )


def _torch_dtype(code: str) -> torch.dtype | None:
    try:
        return dtype_from_code(code)
    except (CheckpointError, KeyError, ValueError):
        return None


@dataclass(frozen=True)
class LocalLoad:
    key: str
    local: LocalTensor
    plan: TensorLoadPlan
    numel_per_file: dict[str, int]
    checksums_per_file: Mapping[str, tuple[int, ...] | None]

    meta: TensorStorageMetadata | None = None

    def job(self, dest: torch.Tensor) -> ReadJob:
        return ReadJob(self.plan, dest, self.numel_per_file, self.checksums_per_file)

    def blocks(self, nbytes: int) -> list[tuple[torch.Tensor, LocalLoad]]:
        """This load as loads of blocks of its destination of at most ``nbytes`` each, ``(the
        destination's block, its load)``: whole rows (dim 0); a row larger than ``nbytes`` of a
        box, in slabs of dim 1 (one that is larger still, alone); of flattened ranges, a row a
        block. Itself, whole, where its destination is that small or its piece is not laid out
        by those rows."""
        data = self.local.data
        rows = data.shape[0] if data.dim() else 1
        per_row = self.local.numel // max(1, rows)
        fit = nbytes // max(1, per_row * data.element_size())  # rows to a block; 0: a row is larger
        piece = self.local.piece
        if fit == 0 and data.dim() >= 2 and piece.local_shape == tuple(data.shape) and self.meta is not None:
            return self._slabs(nbytes)
        step = max(1, fit)
        splits = self.meta is not None and step < rows and data.numel() == self.local.numel and (
            piece.flat is not None or piece.local_shape == tuple(data.shape)
        )
        if not splits:
            return [(data, self)]
        out = []
        positions = list(accumulate((e - s for s, e in piece.flat), initial=0)) if piece.flat is not None else []
        for first in range(0, rows, step):
            end = min(rows, first + step)
            part = _piece_rows(piece, first, end, per_row, positions)
            out.append((data[first:end], self._planned(part)))
        return out

    def _slabs(self, nbytes: int) -> list[tuple[torch.Tensor, LocalLoad]]:
        """Each row of a box destination in slabs of dim 1 of at most ``nbytes`` (one larger alone)."""
        data, offset = self.local.data, self.local.piece.global_offset
        assert offset is not None
        step = max(1, nbytes // max(1, math.prod(data.shape[2:]) * data.element_size()))
        out = []
        for row in range(data.shape[0]):
            for first in range(0, data.shape[1], step):
                end = min(data.shape[1], first + step)
                origin = (offset[0] + row, offset[1] + first, *offset[2:])
                part = Piece(local_shape=(1, end - first, *data.shape[2:]), global_offset=origin)
                out.append((data[row : row + 1, first:end], self._planned(part)))
        return out

    def _planned(self, piece: Piece) -> LocalLoad:
        return replace(self, plan=build_load_plan(self.plan.key, self.meta, piece))  # type: ignore[arg-type]


def _piece_rows(piece: Piece, first: int, end: int, per_row: int, positions: Sequence[int]) -> Piece:
    """The part of ``piece`` that rows ``[first, end)`` of its local tensor hold (``positions``:
    where each flattened range starts in the local tensor, then its size: found by bisection, so
    cutting a piece of many ranges into blocks stays linear)."""
    if piece.flat is None:
        assert piece.local_shape is not None and piece.global_offset is not None
        shape = (end - first, *piece.local_shape[1:])
        return Piece(local_shape=shape, global_offset=(piece.global_offset[0] + first, *piece.global_offset[1:]))
    lo, hi, ranges = first * per_row, end * per_row, []
    for i in range(max(0, bisect_right(positions, lo) - 1), min(len(piece.flat), bisect_left(positions, hi))):
        (start, stop), pos = piece.flat[i], positions[i]
        a, b = max(lo, pos), min(hi, pos + stop - start)
        if a < b:
            ranges.append((start + a - pos, start + b - pos))
    return Piece(flat=tuple(ranges))


def plan_local_loads(reader: CheckpointReader, state_dict: Mapping[str, Any]) -> list[LocalLoad]:
    """Check every key against the reader's metadata and plan its reads (keys sharing memory
    load once). The reader's header cache gives the checksums of a format-2 checkpoint, read
    from its files when the reads need them."""
    storage, metadata, headers = reader.storage, reader.metadata, reader.headers
    described, _ = describe_state_dict(state_dict, action="load")
    out = []
    for key, lt in described.items():
        meta = _meta_for(metadata, key, storage)
        if tuple(meta.shape) != lt.shape:
            raise CheckpointMismatchError(
                f"shape mismatch for {key!r} in the checkpoint at {storage.url}: the checkpoint has "
                f"{list(meta.shape)}, the state dict has {list(lt.shape)} (global shapes)"
            )
        if meta.dtype != lt.dtype:
            raise CheckpointMismatchError(_dtype_mismatch(key, storage, meta.dtype, lt.dtype))
        saved_key = key if key in metadata.tensors else metadata.aliases[key]  # type: ignore[index]
        plan = build_load_plan(saved_key, meta, lt.piece)
        # Only the files read: a tensor of a large job has thousands, most not this rank's.
        numels, crcs = piece_files(headers, metadata, saved_key, plan.files)
        out.append(LocalLoad(key, lt, plan, numels, crcs, meta))
    return out


def load_state_dict(
    storage: Storage,
    state_dict: Mapping[str, Any],
    *,
    no_dist: bool = False,
    metadata: StorageMetadata | None = None,
    num_threads: int | None = None,
    verify: bool = False,
) -> None:
    load_state_dicts(
        [storage], lambda _: [state_dict], metadatas=[metadata], no_dist=no_dist, num_threads=num_threads, verify=verify
    )


def load_state_dicts(
    storages: Sequence[Storage],
    state_dicts: Callable[[list[CheckpointReader]], Sequence[Mapping[str, Any]]],
    *,
    metadatas: Sequence[StorageMetadata | None] | None = None,
    finish: Callable[[], None] | None = None,
    no_dist: bool = False,
    num_threads: int | None = None,
    verify: bool = False,
) -> None:
    """Load several checkpoints (a model's and its optimizer's) in place as one load.

    ``state_dicts(readers)`` gives the state dict to fill from each storage, given a reader of
    each (its metadata, and its header cache, which the whole load shares); it may allocate,
    or raise a mismatch. The metadata not given is shared in one broadcast; every rank plans
    everything and all ranks agree that planning succeeded before any tensor is written; then
    all reads share one thread pool, ``finish()`` runs, and all ranks agree again.
    """
    given = list(metadatas or [None] * len(storages))
    missing = [i for i, m in enumerate(given) if m is None]
    for i, meta in zip(missing, read_metadatas([storages[i] for i in missing], no_dist=no_dist) if missing else []):
        given[i] = meta
    readers = [CheckpointReader(storage, meta) for storage, meta in zip(storages, given)]  # type: ignore[arg-type]
    parts: list[tuple[HeaderCache, list[LocalLoad]]] = []
    chunks: list[int | None] = []
    with dist.phase("load", no_dist=no_dist), torch.no_grad():
        for reader, state_dict in zip(readers, state_dicts(readers), strict=True):
            chunks.append(verify_chunk_bytes(reader.storage, reader.metadata, verify))
            parts.append((reader.headers, plan_local_loads(reader, state_dict)))
    with dist.phase("load", no_dist=no_dist), torch.no_grad():
        by_chunk: dict[int | None, list[tuple[HeaderCache, list[LocalLoad]]]] = {}
        for part, chunk in zip(parts, chunks):
            by_chunk.setdefault(chunk, []).append(part)
        for chunk, group in by_chunk.items():
            fill_in_place_from(group, num_threads=num_threads, verify_chunk_bytes=chunk)
        if finish is not None:
            finish()


def fill_in_place(
    reader: CheckpointReader, loads: list[LocalLoad], *, num_threads: int | None = None, verify_chunk_bytes: int | None = None
) -> None:
    fill_in_place_from([(reader.headers, loads)], num_threads=num_threads, verify_chunk_bytes=verify_chunk_bytes)


def fill_in_place_from(
    parts: Sequence[tuple[HeaderCache, list[LocalLoad]]],
    *,
    num_threads: int | None = None,
    verify_chunk_bytes: int | None = None,
) -> None:
    """Fill the loads of several checkpoints (each with its storage's header cache): every
    destination that can be read into directly in one pool of reads, then the others."""
    options = dict(num_threads=num_threads, verify_chunk_bytes=verify_chunk_bytes, map_pages=True)  # rank files a save wrote
    direct: list[tuple[HeaderCache, list[ReadJob]]] = []
    staged: list[tuple[HeaderCache, list[LocalLoad]]] = []
    for headers, loads in parts:
        jobs, later = [], []
        for load in loads:
            if load.local.numel == 0:
                continue
            data = load.local.data
            if data.device.type == "cpu" and data.is_contiguous():
                jobs.append(load.job(data.view(-1)))
            else:
                later.append(load)
        direct.append((headers, jobs))
        staged.append((headers, later))
    execute_reads_from(direct, **options)
    # Staging stays within the memory a load may add: 10% of the rank's bytes + 64 MiB.
    rank_bytes = sum(load.local.numel * load.local.data.element_size() for _, loads in parts for load in loads)
    stage = min(_STAGE_BYTES, max(_MIN_STAGE_BYTES, rank_bytes // 10 + (64 << 20) - _READ_STAGING))
    for headers, later in staged:
        _fill_through_host(headers.storage, later, dict(options, headers=headers), stage)


def _fill_through_host(storage: Storage, staged: list[LocalLoad], options: dict[str, Any], stage_bytes: int) -> None:
    """Read destinations that cannot be read into (on a GPU, or strided) through two reused host
    buffers, in batches of whole rows of at most half of ``stage_bytes`` (a larger row alone).
    Copies to a GPU run on its current stream from pinned memory while the next batch is read
    into the other buffer; a buffer is read into again only once its copies are done."""
    half = max(1, stage_bytes // 2)
    buffers: list[torch.Tensor | None] = [None, None]  # reused: the allocator's churn would add to RSS
    copying: list[list[torch.cuda.Event]] = [[], []]
    turn = 0
    batch: list[tuple[LocalLoad, torch.Tensor, int]] = []  # (load, its destination rows, offset in the buffer)
    batch_bytes = 0

    def flush() -> None:
        nonlocal turn, batch, batch_bytes
        for event in copying[turn]:
            event.synchronize()
        pinned = any(dest.is_cuda for _, dest, _ in batch)
        buf = buffers[turn]
        if buf is None or buf.numel() < batch_bytes or (pinned and not buf.is_pinned()):
            buffers[turn] = buf = None
            buf = buffers[turn] = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=pinned)
        hosts = [buf[at : at + dest.numel() * dest.element_size()].view(dest.dtype) for _, dest, at in batch]
        execute_reads(storage, [ld.job(host) for (ld, _, _), host in zip(batch, hosts)], **options)
        for (ld, dest, _), host in zip(batch, hosts):
            copy_into(ld.key, dest, host, non_blocking=dest.is_cuda)
        copying[turn] = [_copies_done(device) for device in {dest.device for _, dest, _ in batch if dest.is_cuda}]
        turn, batch, batch_bytes = 1 - turn, [], 0

    for load in staged:
        for dest, part in load.blocks(half):
            nbytes = -(-dest.numel() * dest.element_size() // 64) * 64  # each part aligned for its dtype
            if batch and batch_bytes + nbytes > half:
                flush()
            batch.append((part, dest, batch_bytes))
            batch_bytes += nbytes
    if batch:
        flush()
    for events in copying:
        for event in events:
            event.synchronize()


def _copies_done(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def copy_into(key: str, dest: torch.Tensor, flat: torch.Tensor, *, non_blocking: bool = False) -> None:
    """Copy ``key``'s loaded elements (``flat``, in row-major order) into its tensor ``dest``, which
    could not be read into directly; a tensor that cannot take them (an expanded view, whose
    elements share memory) is an error naming the key. ``non_blocking``: a copy from pinned
    memory to a GPU may still run when this returns (``flat`` stays reserved until it is done)."""
    try:
        dest.copy_(flat.view(dest.shape), non_blocking=non_blocking)
    except RuntimeError as ex:
        raise CheckpointError(f"cannot load {key!r} into its tensor: {ex}") from ex


# ---------------------------------------------------------------------------------------
# Full tensors from a checkpoint, on one rank or all, never through a sharded model
# ---------------------------------------------------------------------------------------




def unshard_state_dict(
    storage: Storage,
    *,
    device: torch.device | str | None = None,
    rank0_only: bool = False,
    no_dist: bool = False,
    num_threads: int | None = None,
    verify: bool = False,
) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    if rank0_only and no_dist and rank != 0:
        raise ValueError(f"unshard with rank0_only=True and no_dist=True is undefined on rank {rank}")
    if rank0_only and rank != 0:
        return {}
    metadata = read_metadata(storage, no_dist=no_dist or rank0_only)
    device = torch.device(device) if device is not None else torch.device("cpu")
    with dist.phase("unshard", no_dist=no_dist or rank0_only):
        if device.type == "cpu":
            reader = CheckpointReader(storage, metadata, num_threads=num_threads)
            out = reader.full_tensors(list(metadata.tensors), verify=verify)
        else:
            out = read_full_onto(device, storage, metadata, num_threads=num_threads, verify=verify)
    for alias, target in (metadata.aliases or {}).items():
        out[alias] = out[target]
    return out


def read_full_onto(
    device: torch.device,
    storage: Storage,
    metadata: StorageMetadata,
    *,
    num_threads: int | None = None,
    verify: bool = False,
) -> dict[str, torch.Tensor]:
    """Every full tensor, allocated on ``device`` and filled as a load fills its tensors: through
    host buffers of bounded size, never the whole checkpoint in host memory at once."""
    reader = CheckpointReader(storage, metadata, num_threads=num_threads)
    chunk = verify_chunk_bytes(storage, metadata, verify)
    for key, meta in metadata.tensors.items():
        reader.check_whole(key, meta)
    out = {
        key: torch.empty(meta.shape, dtype=dtype_from_code(meta.dtype), device=device)
        for key, meta in metadata.tensors.items()
    }
    with torch.no_grad():
        fill_in_place(reader, plan_local_loads(reader, out), num_threads=num_threads, verify_chunk_bytes=chunk)
    return out
