"""Two-stage load: every piece several ranks need is read from storage once and shared.

The recipe (after Megatron-core's two-stage strategy):

1. Each rank plans its local reads as the default strategy does.
2. All ranks exchange what they need: ``(file, key, element interval)`` lists (one all-gather).
3. Every rank computes the same schedule (:func:`~checkpointer.planning.readers.assign_readers`):
   units of elements each needed by one set of ranks, each with one reader among them.
4. Units, cut to at most a batch each, go in batches of bounded size (two reused buffers),
   tensor by tensor, in the order of where they start in the tensor. While batch ``k`` is
   shared (one broadcast when every rank needs a unit, point-to-point sends otherwise), a
   thread reads batch ``k + 1``.
5. Each rank copies the units it needs into its tensors; a unit that falls whole in one
   contiguous run of a destination was read, sent or received there, and is not copied again.
   A destination that cannot be read into (on a GPU, or strided) is staged in blocks of rows,
   each in host memory from its first unit to its last: units of such a tensor are cut to a
   block, and to the rows of about two blocks of the full tensor, and go by where they start in
   it, so a few blocks are open at once whatever the stored pieces (many narrow column pieces
   too, boxes or flattened ranges).
   With ``verify``, each rank checks the checksums of the bytes it receives as they come (a
   chunk it receives only in part is re-read once). A rank whose read failed still takes part
   in every exchange, then all ranks raise at the closing agreement, naming it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from bisect import bisect_left, bisect_right
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any, Callable, Mapping

import torch

from .. import dist
from ..buffers import StagingBlocks, memoryview_of, overlapping_memory
from ..errors import CheckpointError
from ..format.dtypes import itemsize
from ..format.metadata import StorageMetadata
from ..planning.load_plan import ReadItem
from ..planning.readers import Need, ReadUnit, assign_readers
from ..storage.base import Storage
from .load import LocalLoad, copy_into, plan_local_loads
from .checks import ArrivingChunks, HeaderCache, piece_start, verify_chunk_bytes
from .reader import CheckpointReader
from .reads import read_file_ranges, run_checks, scatter_span

__all__ = ["LoadStats", "load_two_stage", "prepare_two_stage"]

log = logging.getLogger(__name__)
_BATCH_BYTES = 24 << 20
"""A batch of units holds at most this many bytes (or one unit); two are in memory, one read
while the other is shared."""
_STAGED_BYTES = 4 << 20
"""A destination filled through host memory (on a GPU, or strided) is staged in blocks of its rows
of about this size, and the units of a tensor some rank stages are cut this small: a few blocks
are in host memory at once, not the whole tensor."""


@dataclass
class LoadStats:
    """Where a load's time went, per phase, and how many bytes moved."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes_read: int = 0
    bytes_received: int = 0
    bytes_staged: int = 0  # of those, the bytes that went through a batch buffer and were copied again

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in self.seconds.items())
        return f"{phases}; read {self.bytes_read} B, received {self.bytes_received} B, staged {self.bytes_staged} B"


class _Laps:
    """``lap(phase)`` adds the time since the last lap (or :meth:`restart`) to ``phase``."""

    def __init__(self, stats: LoadStats):
        self.stats, self.clock = stats, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.stats.seconds[phase] += now - self.clock
        self.clock = now

    def restart(self) -> None:
        self.clock = time.perf_counter()


@dataclass
class _Staged:
    """Rows of a destination read through host memory (on a device, or not contiguous): its
    buffer is made when its first unit arrives, and copied into place and let go when its last
    one has. ``load`` plans just these rows."""

    load: LocalLoad
    missing: int  # elements not received yet
    rows: torch.Tensor  # the destination's rows this block fills
    blocks: StagingBlocks
    held: torch.Tensor | None = None  # bytes from ``blocks`` while the block is open

    def buffer(self) -> torch.Tensor:
        nbytes = self.rows.numel() * self.rows.element_size()
        if self.held is None:
            self.held = self.blocks.take(nbytes)
        return self.held[:nbytes].view(self.rows.dtype)

    def release(self) -> None:
        if self.held is not None:
            self.blocks.give(self.held)
            self.held = None


@dataclass
class _Dest:
    item: ReadItem  # elements of one stored piece, to one destination
    dest: torch.Tensor | _Staged  # flat destination, or one filled through host memory


def load_two_stage(
    storage: Storage,
    state_dict: Mapping[str, Any],
    metadata: StorageMetadata,
    *,
    verify: bool = False,
    stats: LoadStats | None = None,
) -> LoadStats:
    """The whole recipe for one checkpoint."""
    return prepare_two_stage(CheckpointReader(storage, metadata), state_dict, verify=verify, stats=stats)()


def prepare_two_stage(
    reader: CheckpointReader,
    state_dict: Mapping[str, Any],
    *,
    verify: bool = False,
    stats: LoadStats | None = None,
) -> Callable[[], LoadStats]:
    """Steps 1-3 of the recipe, on every rank (a planning error on any rank raises on every
    rank, before anything is written); returns steps 4-5, which fill ``state_dict``. Several
    checkpoints loaded as one (a model's and its optimizer's) are all prepared first."""
    storage, metadata = reader.storage, reader.metadata
    stats = stats or LoadStats()
    lap = _Laps(stats)
    error: BaseException | None = None
    needs: list[Need] = []
    dests: dict[tuple[str, str], list[_Dest]] = defaultdict(list)
    staged: list[_Staged] = []
    chunk: int | None = None
    staged_keys: set[str] = set()
    memory: dict[str, torch.Tensor] = {}  # each key's destination
    blocks = StagingBlocks()

    def plan() -> None:
        nonlocal chunk
        chunk = verify_chunk_bytes(storage, metadata, verify)
        for load in plan_local_loads(reader, state_dict):
            if load.local.numel == 0:
                continue
            data = memory[load.plan.key] = load.local.data
            if data.device.type == "cpu" and data.is_contiguous():
                parts: list[tuple[LocalLoad, torch.Tensor | _Staged]] = [(load, data.view(-1))]
            else:
                staged_keys.add(load.plan.key)
                parts = []
                for rows, part in load.blocks(_STAGED_BYTES):
                    staged.append(_Staged(part, part.plan.numel, rows, blocks))
                    parts.append((part, staged[-1]))
            for part, dest in parts:
                for item in part.plan.items:
                    needs.append(Need(item.file, part.plan.key, item.src_offset, item.src_end))
                    dests[(item.file, part.plan.key)].append(_Dest(item, dest))

    _, error = dist.attempt(plan)  # reported to every rank with the needs
    lap("planning")
    mine = json.dumps({"ok": error is None, "needs": [[n.file, n.key, n.start, n.end] for n in needs],
                       "staged": sorted(staged_keys)})
    gathered = [json.loads(b) for b in dist.all_gather_bytes(mine.encode())]
    lap("metadata exchange")
    if not all(g["ok"] for g in gathered):
        dist.agree(error, "two-stage load")
    needs_per_rank = [[Need(*n) for n in g["needs"]] for g in gathered]
    sizes = {key: itemsize(meta.dtype) for key, meta in metadata.tensors.items()}
    fine = {key for g in gathered for key in g["staged"]}
    # By key, then by where each unit starts in the full tensor: all files move through a tensor's
    # rows together, so a staged block's units follow each other and few blocks are open at once.
    where = _GlobalIndex(metadata)
    units = sorted(
        _split(assign_readers(needs_per_rank, sizes), sizes, fine, where), key=lambda u: (u.key, where(u), u.file, u.start)
    )
    headers = reader.headers
    rank = dist.get_rank()

    def check_headers() -> None:  # the pieces this rank reads are in its files, as metadata.json says
        for file, key in {(u.file, u.key) for u in units if u.reader == rank}:
            meta = metadata.tensors[key]
            piece_start(headers, file, key, meta.dtype, meta.shard_spec_per_file[file].local_numel)

    dist.agree(dist.attempt(check_headers)[1], "two-stage load")
    lap("planning")
    index = {where: _DestIndex(ds) for where, ds in dests.items()}
    return lambda: _run(headers, metadata, units, sizes, index, staged, chunk, stats, overlapping_memory(memory))


def _run(
    headers: HeaderCache, metadata: StorageMetadata, units: list[ReadUnit], sizes: dict[str, int],
    dests: dict[tuple[str, str], _DestIndex], staged: list[_Staged], chunk: int | None, stats: LoadStats, shared: set[str],
) -> LoadStats:
    """Steps 4-5 of the recipe: read, share and copy the units this rank needs."""
    rank = dist.get_rank()
    error: BaseException | None = None
    failed_read: BaseException | None = None  # then the bytes this rank sent are not the file's
    lap = _Laps(stats)
    mine = [u for u in units if rank in u.ranks]
    plain = {where: d for where, d in dests.items() if where[1] not in shared}  # the others overlap: copied in order
    direct = {u: v for u in mine if (v := _direct(u, plain.get((u.file, u.key), _NO_DESTS), sizes[u.key])) is not None}
    batches = _batches(mine, sizes)
    tags = {u: i for i, u in enumerate(units)}
    arriving = ArrivingChunks(headers, metadata, chunk) if chunk else None
    copied = [[u for u in batch if u not in direct] for batch in batches]  # through the arenas
    placed = [_placed(part, sizes) for part in copied]
    # batch k in arena k % 2, made once at the largest size it takes: one grown later would leave
    # the smaller one in the allocator's heap, three batches' memory at the peak
    arena_bytes = [max((starts[-1] + nbytes[-1] for starts, nbytes in placed[j::2] if nbytes), default=0) for j in (0, 1)]
    arenas: list[torch.Tensor | None] = [None, None]

    def read_batch(k: int) -> tuple[dict[ReadUnit, torch.Tensor], BaseException | None]:
        batch, (starts, nbytes) = batches[k], placed[k]
        arena = arenas[k % 2]
        if arena is None:
            arena = arenas[k % 2] = torch.empty(arena_bytes[k % 2], dtype=torch.uint8)
        bufs = {u: direct[u] for u in batch if u in direct} | {u: arena[at : at + n] for u, at, n in zip(copied[k], starts, nbytes)}

        def read() -> None:
            per_file: dict[str, list] = defaultdict(list)
            for u in batch:
                if u.reader == rank:
                    size = sizes[u.key]
                    meta = metadata.tensors[u.key]
                    start = piece_start(headers, u.file, u.key, meta.dtype, meta.shard_spec_per_file[u.file].local_numel)
                    per_file[u.file].append((start + u.start * size, memoryview_of(bufs[u])))
            for name, reqs in per_file.items():
                read_file_ranges(headers.storage, name, reqs)  # the files whose headers were checked

        return bufs, dist.attempt(read)[1]  # raised after the exchanges

    with ThreadPoolExecutor(1, thread_name_prefix="checkpointer-two-stage") as reader:
        pending = reader.submit(read_batch, 0) if batches else None
        for i, batch in enumerate(batches):
            t = time.perf_counter()
            bufs, read_error = pending.result()  # type: ignore[union-attr]
            stats.seconds["reads"] += time.perf_counter() - t
            failed_read = failed_read or read_error
            pending = reader.submit(read_batch, i + 1) if i + 1 < len(batches) else None
            lap.restart()
            for u in batch:
                dist.share_tensor(bufs[u], u.reader, u.ranks, tag=tags[u])
                if u.reader == rank:
                    stats.bytes_read += bufs[u].numel()
                else:
                    stats.bytes_received += bufs[u].numel()
            lap("broadcasts")
            def scatter() -> None:
                for u in batch:
                    if arriving is not None:
                        arriving.take(u.file, u.key, u.start * sizes[u.key], memoryview_of(bufs[u]))
                    if u not in direct:
                        stats.bytes_staged += bufs[u].numel()
                        for done in _scatter_unit(u, bufs[u], dests.get((u.file, u.key), _NO_DESTS), sizes[u.key]):
                            _finish(done)

            error = error or dist.attempt(scatter)[1]  # raised after the exchanges
            lap("copies")
    dist.agree(failed_read, "two-stage load")  # every rank names the failed read, not what it left in the buffers
    if arriving is not None and error is None:
        _, error = dist.attempt(lambda: run_checks(arriving.rereads()))
        lap("verify")
    unfilled = list(dict.fromkeys(s.load.key for s in staged if s.missing))
    if unfilled and error is None:
        error = CheckpointError(f"two-stage load left {unfilled[:5]} unfilled ({len(unfilled)} tensors)")
    dist.agree(error, "two-stage load")
    log.debug("two-stage load on rank %d: %s", rank, stats)
    return stats


def _placed(batch: list[ReadUnit], sizes: dict[str, int]) -> tuple[list[int], list[int]]:
    """Where each unit of a batch starts in its arena, and its bytes."""
    nbytes = [(u.end - u.start) * sizes[u.key] for u in batch]
    return [0, *accumulate(map(_aligned, nbytes[:-1]))], nbytes


def _aligned(nbytes: int) -> int:
    """The bytes a unit takes in an arena: the next unit starts aligned for any dtype."""
    return -(-nbytes // 64) * 64


def _split(units: list[ReadUnit], sizes: dict[str, int], fine: set[str], where: _GlobalIndex) -> list[ReadUnit]:
    """Units of at most a batch each (a large replicated tensor is read a batch at a time), and
    for the ``fine`` keys, which some rank stages, of at most a staged block, spanning the rows
    of about two blocks of the full tensor (a unit of a narrow column piece spans many rows)."""
    out: list[ReadUnit] = []
    steps: dict[tuple[str, str], tuple[int, bool]] = {}  # elements a unit, whether cut by where it spans
    for u in units:
        found = steps.get((u.file, u.key))
        if found is None:
            meta = where.metadata.tensors[u.key]
            spec = meta.shard_spec_per_file[u.file]
            step = max(1, (_STAGED_BYTES if u.key in fine else _BATCH_BYTES) // sizes[u.key])
            if u.key in fine and spec.flattened_offsets is None and spec.local_shape and len(meta.shape) > 1:
                rows = max(1, 2 * _STAGED_BYTES // (math.prod(meta.shape[1:]) * sizes[u.key]))
                step = max(1, min(step, rows * math.prod(spec.local_shape[1:])))
            found = steps[(u.file, u.key)] = (step, u.key in fine and spec.flattened_offsets is not None)
        step, by_span = found
        if not by_span:
            out.extend(replace(u, start=lo, end=min(lo + step, u.end)) for lo in range(u.start, u.end, step))
            continue
        span = max(1, 2 * _STAGED_BYTES // sizes[u.key])  # elements of the full tensor a unit may span
        lo = u.start
        while lo < u.end:
            hi = min(u.end, lo + step, max(lo + 1, where.local_at(u, where.at(u.key, u.file, lo) + span)))
            out.append(replace(u, start=lo, end=hi))
            lo = hi
    return out


class _GlobalIndex:
    """Where a unit's first element is in the row-major full tensor (a piece's flattened ranges
    indexed once, then found by bisection)."""

    def __init__(self, metadata: StorageMetadata):
        self.metadata = metadata
        self.ranges: dict[tuple[str, str], tuple[list[int], list[int], bool]] = {}

    def _ranges(self, key: str, file: str) -> tuple[list[int], list[int], bool]:
        """Where each flattened range starts in the piece, and in the full tensor; whether in order."""
        found = self.ranges.get((key, file))
        if found is None:
            flat = self.metadata.tensors[key].shard_spec_per_file[file].flattened_offsets
            firsts = [lo for lo, _ in flat]
            found = self.ranges[(key, file)] = (
                list(accumulate((hi - lo for lo, hi in flat), initial=0)), firsts, all(a < b for a, b in zip(firsts, firsts[1:]))
            )
        return found

    def local_at(self, unit: ReadUnit, index: int) -> int:
        """Of a piece of flattened ranges in order, the position of the first element at or past
        full-tensor ``index``; of one whose ranges are out of order, the piece's end."""
        positions, firsts, ordered = self._ranges(unit.key, unit.file)
        if not ordered:
            return positions[-1]
        i = bisect_right(firsts, index) - 1
        return 0 if i < 0 else min(positions[i + 1], positions[i] + index - firsts[i])

    def __call__(self, unit: ReadUnit) -> int:
        return self.at(unit.key, unit.file, unit.start)

    def at(self, key: str, file: str, start: int) -> int:
        """Where element ``start`` of ``file``'s piece of ``key`` is in the full tensor."""
        meta = self.metadata.tensors[key]
        spec = meta.shard_spec_per_file[file]
        if spec.flattened_offsets is not None:
            positions, firsts, _ = self._ranges(key, file)
            i = bisect_right(positions, start) - 1
            return firsts[i] + start - positions[i] if i < len(firsts) else meta.numel
        assert spec.local_shape is not None and spec.global_offset is not None
        index, stride = 0, 1
        for n, offset, full in zip(reversed(spec.local_shape), reversed(spec.global_offset), reversed(meta.shape)):
            start, i = divmod(start, n) if n else (start, 0)
            index += (offset + i) * stride
            stride *= full
        return index


def _batches(units: list[ReadUnit], sizes: dict[str, int]) -> list[list[ReadUnit]]:
    out: list[list[ReadUnit]] = []
    current: list[ReadUnit] = []
    nbytes = 0
    for u in units:
        n = _aligned((u.end - u.start) * sizes[u.key])
        if current and nbytes + n > _BATCH_BYTES:
            out.append(current)
            current, nbytes = [], 0
        current.append(u)
        nbytes += n
    if current:
        out.append(current)
    return out


class _DestIndex:
    """The destinations of one stored piece, by where their items start in it: a unit meets
    those found by bisection, not every block of the tensor."""

    def __init__(self, dests: list[_Dest]):
        self.dests = sorted(dests, key=lambda d: d.item.src_offset)
        self.starts = [d.item.src_offset for d in self.dests]
        self.longest = max((d.item.src_end - d.item.src_offset for d in self.dests), default=0)

    def meeting(self, start: int, end: int) -> list[_Dest]:
        return self.dests[bisect_left(self.starts, start - self.longest + 1) : bisect_left(self.starts, end)]


_NO_DESTS = _DestIndex([])


def _direct(unit: ReadUnit, dests: _DestIndex, size: int) -> torch.Tensor | None:
    """The bytes of a destination a unit fills whole (it meets one contiguous item); else None."""
    meeting = [d for d in dests.meeting(unit.start, unit.end) if max(unit.start, d.item.src_offset) < min(unit.end, d.item.src_end)]
    item, flat = (meeting[0].item, meeting[0].dest) if len(meeting) == 1 else (None, None)
    if item is None or item.sizes or isinstance(flat, _Staged) or not item.src_offset <= unit.start < unit.end <= item.src_end:
        return None
    at = (item.dst_offset + unit.start - item.src_offset) * size
    return flat.view(torch.uint8)[at : at + (unit.end - unit.start) * size]


def _scatter_unit(unit: ReadUnit, buf: torch.Tensor, dests: _DestIndex, size: int) -> list[_Staged]:
    """Copy the parts of a unit this rank needs into its destinations; returns the staged
    destinations this unit completed."""
    done = []
    for d in dests.meeting(unit.start, unit.end):
        item = d.item
        lo, hi = max(unit.start, item.src_offset), min(unit.end, item.src_end)
        if hi <= lo:
            continue
        flat = d.dest.buffer() if isinstance(d.dest, _Staged) else d.dest
        part = buf[(lo - unit.start) * size : (hi - unit.start) * size]
        if item.sizes:
            copied = scatter_span(item, part.view(flat.dtype), lo, flat)
        else:
            target = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
            dst = (item.dst_offset + lo - item.src_offset) * size
            target[dst : dst + (hi - lo) * size].copy_(part)
            copied = hi - lo
        if isinstance(d.dest, _Staged):
            d.dest.missing -= copied
            if d.dest.missing == 0:
                done.append(d.dest)
    return done


def _finish(staged: _Staged) -> None:
    """Copy a completed staged block into place and let its buffer go."""
    try:
        copy_into(staged.load.key, staged.rows, staged.buffer())
    finally:
        staged.release()
