"""Reading pieces of rank files straight into their destinations, with checksums checked."""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import product
from typing import Sequence

import numpy as np
import torch

from ..buffers import StagingBlocks, memoryview_of
from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize
from ..planning.boxes import span_boxes
from ..planning.load_plan import ReadItem, TensorLoadPlan
from ..planning.runs import RUNS_PER_SLICE, overlapping, run_blocks, run_starts
from ..storage.base import ReadRequest, Storage
from ..storage.parallel import shared_pool
from ..storage.scatter import MAX_GAP, RUNS_PER_CALL
from .checks import HashedRun, HeaderCache, check_chunk, piece_start, read_hashed, read_with, verified_requests, verify_tasks
from .rankfile import io_threads

__all__ = [
    "ReadJob", "execute_reads", "execute_reads_from", "check_chunk", "read_file_ranges", "verify_reads", "run_checks",
    "scatter_span", "STRIDED_BLOCK",
]

_SPLIT_BYTES = 32 << 20
_BYTES_PER_THREAD = 8 << 20
STRIDED_BLOCK = 8 << 20
"""Bytes of a stored piece read at once for a strided copy (a tensor-parallel box)."""
_FEW_RUNS = 64
_RUN_BYTES = 256 << 10
_MAP_BYTES = 256 << 10
"""The smallest span of a stored piece copied from mapped pages (a mapping is four system calls:
size, page-cache count, map, unmap). For 32 spans of 2 MiB, a quarter of each 4 KiB row wanted,
4 processes of 4 threads, 2 cores: 12 ms of CPU a process mapped, 17 staged, 26 by scattered reads."""


@dataclass(frozen=True)
class ReadJob:
    """Fill ``dest`` (flat, contiguous, CPU) by ``plan``; ``numel_per_file`` checks the file headers."""

    plan: TensorLoadPlan
    dest: torch.Tensor
    numel_per_file: dict[str, int]
    checksums_per_file: dict[str, tuple[int, ...] | None] | None = None


def _byte_requests(job: ReadJob, dest: memoryview, headers: HeaderCache, *, runs: bool) -> dict[str, list[ReadRequest]]:
    """Reads straight into the destination: contiguous items, and (with ``runs``) the strided
    items whose runs are few or long (:func:`_by_runs`)."""
    plan = job.plan
    size = itemsize(plan.dtype)
    out: dict[str, list[ReadRequest]] = {}
    scattered = headers.storage.reads_runs()
    cached: dict[str, int] = {}  # file -> byte offset of the piece: the header is checked once
    for item in plan.items:
        if item.sizes and not (runs and _by_runs(item, size, scattered)):
            continue  # read by _strided_tasks: scattered runs, or through a staging block
        entry_start = cached.get(item.file)
        if entry_start is None:
            entry_start = cached[item.file] = piece_start(headers, item.file, plan.key, plan.dtype, job.numel_per_file[item.file])
        reqs = out.setdefault(item.file, [])
        if item.sizes:
            reqs += _run_requests(item, entry_start, dest, size)
            continue
        start = entry_start + item.src_offset * size
        buf = dest[item.dst_offset * size : (item.dst_offset + item.numel) * size]
        reqs.append((start, buf))
    return out


def _by_runs(item: ReadItem, size: int, scattered: bool) -> bool:
    """Whether a strided item is read as one request per run, straight into its destination: its
    runs are contiguous on both sides and long (at least :data:`_RUN_BYTES` each, so reads are
    large), or few where the storage has no scattered reads (one ``preadv`` takes short runs
    whatever their number, and a run apart from the next is a system call of its own)."""
    if item.src_strides[-1] != 1 or item.dst_strides[-1] != 1:
        return False
    few = item.numel // item.sizes[-1] <= _FEW_RUNS and not scattered
    return few or item.sizes[-1] * size >= _RUN_BYTES


def _run_requests(item: ReadItem, piece_byte: int, dest: memoryview, size: int) -> list[ReadRequest]:
    run = item.sizes[-1] * size
    out = []
    for index in product(*map(range, item.sizes[:-1])):
        src = item.src_offset + sum(i * s for i, s in zip(index, item.src_strides))
        dst = (item.dst_offset + sum(i * s for i, s in zip(index, item.dst_strides))) * size
        out.append((piece_byte + src * size, dest[dst : dst + run]))
    return out


def execute_reads(
    storage: Storage,
    jobs: Sequence[ReadJob],
    *,
    headers: HeaderCache,
    num_threads: int | None = None,
    verify_chunk_bytes: int | None = None,
    map_pages: bool = False,
) -> None:
    """Run load plans, straight into their destinations.

    Reads for one file are sorted by offset (adjacent ones become one ``preadv``) and split
    into chunks of about ``_SPLIT_BYTES`` (a larger read too) spread over a small thread pool. With ``verify_chunk_bytes``, every
    checksummed chunk the reads touch is checked: on local storage, runs of whole chunks (up to
    32 MiB) go to one thread each, which reads them 1 MiB at a time and hashes each block right
    after reading it, from the CPU cache (hashing each 16 MiB chunk after one read of the run, from
    memory, added about 48 % to a warm 1 GiB load here; this, about 36 %); elsewhere, and for chunks the reads cover only in part, after
    all the reads. ``map_pages``: long strided spans of local files may be copied from their
    mapped pages (see :func:`_strided_tasks`); only for files a save wrote, never changed in place.
    """
    execute_reads_from(
        [(headers, jobs)],
        num_threads=num_threads,
        verify_chunk_bytes=verify_chunk_bytes,
        map_pages=map_pages,
    )


def execute_reads_from(
    sources: Sequence[tuple[HeaderCache, Sequence[ReadJob]]],
    *,
    num_threads: int | None = None,
    verify_chunk_bytes: int | None = None,
    map_pages: bool = False,
) -> None:
    """:func:`execute_reads` for the jobs of several checkpoints at once (each with the header
    cache of its storage), in one thread pool: a model's and its optimizer's reads overlap."""
    tasks: list[tuple] = []
    checked_after: list[tuple[HeaderCache, Sequence[ReadJob]]] = []
    buffers = StagingBlocks(STRIDED_BLOCK)
    for headers, jobs in sources:
        tasks += _strided_tasks(headers, jobs, verify_chunk_bytes, buffers, map_pages)
        tasks += _read_tasks(headers, jobs, verify_chunk_bytes)
        if verify_chunk_bytes and not headers.storage.is_local():
            checked_after.append((headers, jobs))
    payload = sum(job.dest.numel() * job.dest.element_size() for _, jobs in sources for job in jobs)
    _run(num_threads, tasks, payload)
    for headers, jobs in checked_after:
        verify_reads(
            headers.storage, jobs, headers=headers, chunk_bytes=verify_chunk_bytes, num_threads=num_threads, strided=False
        )


def _read_tasks(headers: HeaderCache, jobs: Sequence[ReadJob], verify_chunk_bytes: int | None) -> list[tuple]:
    """The thread-pool tasks of one storage's jobs: checks from storage, hashed runs, plain reads."""
    storage = headers.storage
    fused = bool(verify_chunk_bytes) and storage.is_local()
    per_file: dict[str, list[ReadRequest]] = {}
    checks: list[tuple] = []
    runs: list[HashedRun] = []
    for job in jobs:
        dest = memoryview_of(job.dest)
        if fused and job.checksums_per_file:
            requests, job_checks, job_runs = verified_requests(storage, job, dest, headers, verify_chunk_bytes)
            checks += job_checks
            runs += job_runs
        else:
            requests = _byte_requests(job, dest, headers, runs=not verify_chunk_bytes)
        for name, reqs in requests.items():
            per_file.setdefault(name, []).extend(reqs)
    tasks: list[tuple] = []
    for name, reqs in per_file.items():
        reqs.sort(key=lambda r: r[0])
        chunk: list[ReadRequest] = []
        chunk_bytes = 0
        for req in (part for req in reqs for part in _split_request(req)):
            chunk.append(req)
            chunk_bytes += len(req[1])
            if chunk_bytes >= _SPLIT_BYTES:
                tasks.append((_read, storage, name, chunk))
                chunk, chunk_bytes = [], 0
        if chunk:
            tasks.append((_read, storage, name, chunk))
    runs.sort(key=lambda run: (run.file, run.start))  # in file order, as the plain reads: the disk reads ahead
    hashed = [(read_hashed, storage, r.file, r.key, r.start, r.view, verify_chunk_bytes, r.expected) for r in runs]
    return checks + hashed + tasks


def _strided_tasks(
    headers: HeaderCache, jobs: Sequence[ReadJob], verify_chunk_bytes: int | None, buffers: StagingBlocks, map_pages: bool
) -> list[tuple]:
    """The tasks of the strided items. Items of one stored piece whose spans overlap (column blocks
    of the same rows) share their reads (:func:`overlapping`); a lone item of long runs, or any
    whose one scattered read skips gaps, takes scattered reads where the storage has them
    (:func:`_by_scattered_runs`). Other spans are read in blocks of at most :data:`STRIDED_BLOCK`
    bytes (whole checksum chunks when verifying, each hashed once read), copied out as at most
    ``2 * ndim - 1`` strided boxes per item. Unverified, with ``map_pages``, a local file's span of
    :data:`_MAP_BYTES` or more is copied from its mapped pages, in blocks of about
    :data:`STRIDED_BLOCK` (cut between runs where read by runs), each read as above unless all its
    pages are cached."""
    tasks: list[tuple] = []
    storage = headers.storage
    scattered = storage.reads_runs()
    maps = map_pages and not verify_chunk_bytes and storage.maps_files()
    for job in jobs:
        plan = job.plan
        size = itemsize(plan.dtype)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if item.sizes and (verify_chunk_bytes or not _by_runs(item, size, scattered)):
                per_file.setdefault(item.file, []).append(item)
        for name, items in per_file.items():
            numel = job.numel_per_file[name]
            start = piece_start(headers, name, plan.key, plan.dtype, numel)
            crcs = (job.checksums_per_file or {}).get(name) if verify_chunk_bytes else None
            chunk = verify_chunk_bytes // size if crcs is not None else 1  # type: ignore[operator]
            step = chunk * max(1, STRIDED_BLOCK // (chunk * size))  # whole chunks a block
            by_runs = {id(i) for i in items if not verify_chunk_bytes and scattered and _by_scattered_runs(i, size)}
            apart = {id(i) for i in items if id(i) in by_runs and _gaps_skipped(i, size)}  # alone, they read only their runs
            groups = overlapping([i for i in items if id(i) not in apart], chunk)
            for lo, hi, group in groups + [(i.src_offset, i.src_end, (i,)) for i in items if id(i) in apart]:
                hi = min(hi, numel)
                mapped = maps and (hi - lo) * size >= _MAP_BYTES
                if len(group) == 1 and id(group[0]) in by_runs:
                    item = group[0]
                    runs = item.numel // item.sizes[-1]
                    if mapped:  # blocks of the stored span, cut between runs: uncached, a block is read by runs
                        bounds = run_blocks(item, max(1, STRIDED_BLOCK // size))
                    else:
                        bounds = range(0, runs, max(1, STRIDED_BLOCK // (item.sizes[-1] * size)))
                    for r, r_end in zip(bounds, [*bounds[1:], runs]):
                        tasks.append((_read_runs, storage, name, start, size, item, job.dest, int(r), int(r_end), mapped))
                    continue
                for a in range(lo, hi, step):
                    b = min(hi, a + step)
                    checks = []
                    if crcs is not None:
                        for c in range(a // chunk, -(-b // chunk)):
                            if c >= len(crcs):
                                raise CorruptCheckpointError(f"{storage.join(name)}: tensor {plan.key!r} has too few checksums")
                            checks.append((c, c * chunk - a, min(b, (c + 1) * chunk) - a, crcs[c]))
                    tasks.append((_read_strided, storage, name, plan.key, start, size, group, job.dest, a, b, checks, buffers, mapped))
    return tasks


def _by_scattered_runs(item: ReadItem, size: int) -> bool:
    """Whether a strided item of runs contiguous on both sides takes scattered reads: long runs, or gaps skipped
    in one call. Short runs and gaps cost a ``preadv`` segment each, more than a read of their span (:data:`_MAP_BYTES`)."""
    if item.src_strides[-1] != 1 or item.dst_strides[-1] != 1:
        return False
    one_call = item.numel // item.sizes[-1] <= RUNS_PER_CALL
    return item.sizes[-1] * size * RUNS_PER_CALL >= STRIDED_BLOCK or (one_call and _gaps_skipped(item, size))


def _gaps_skipped(item: ReadItem, size: int) -> bool:
    """Whether scattered reads of the item skip some bytes between its runs: a gap between
    neighbours along any dimension (rows, or the blocks of rows of an outer dimension) longer than
    :data:`~checkpointer.storage.scatter.MAX_GAP`, where a read of its span would take them all."""
    extent = item.sizes[-1]  # elements from the first of a sub-box to one past its last
    for n, s in zip(item.sizes[-2::-1], item.src_strides[-2::-1]):
        if n > 1 and (s - extent) * size > MAX_GAP:
            return True
        extent += (n - 1) * s
    return False


def _read_runs(
    storage: Storage, name: str, piece_start_byte: int, size: int, item: ReadItem, dest: torch.Tensor, lo: int, hi: int,
    mapped: bool = False,
) -> None:
    """Runs ``[lo, hi)`` of a strided item whose runs are contiguous on both sides, read straight
    into the destination by the storage's scattered reads (exactly their bytes, no staging), the
    offsets of :data:`RUNS_PER_SLICE` runs at a time; with ``mapped``, copied from the file's mapped
    pages instead where it can (:func:`_copied_mapped`)."""
    if mapped:
        first = int(run_starts(item, lo, lo + 1, dest=False)[0][0])
        end = int(run_starts(item, hi - 1, hi, dest=False)[0][0]) + item.sizes[-1]
        if _copied_mapped(storage, name, piece_start_byte + first * size, (item,), dest, first, end):
            return
    for a in range(lo, hi, RUNS_PER_SLICE):
        src, dst = run_starts(item, a, min(hi, a + RUNS_PER_SLICE))
        offsets = piece_start_byte + src * size
        addresses = (dest.data_ptr() + dst * size).astype(np.uint64)
        read_with(storage, name, lambda: storage.read_runs(name, offsets, addresses, item.sizes[-1] * size))


def _copied_mapped(
    storage: Storage, name: str, start_byte: int, items: Sequence[ReadItem], dest: torch.Tensor, lo: int, hi: int
) -> bool:
    """Copy the items' elements among stored elements ``[lo, hi)`` (from byte ``start_byte`` of the
    file) into ``dest`` straight from the file's mapped pages: the gaps between their runs are
    neither read nor copied. False where the storage cannot map them now (not all in the page cache)."""
    size = dest.element_size()

    def copy() -> bool:
        with storage.mapped(name, start_byte, (hi - lo) * size) as view:
            if view is None:
                return False
            span = torch.frombuffer(view, dtype=dest.dtype)
            for item in items:
                scatter_span(item, span, lo, dest)
            return True

    return read_with(storage, name, copy)


def _read_strided(
    storage: Storage,
    name: str,
    key: str,
    piece_start_byte: int,
    size: int,
    items: Sequence[ReadItem],
    dest: torch.Tensor,
    lo: int,
    hi: int,
    checks: list[tuple[int, int, int, int]],
    buffers: StagingBlocks,
    mapped: bool = False,
) -> None:
    """Read elements ``[lo, hi)`` of the stored piece into a staging block, check the checksum
    chunks it holds whole, and copy the items' elements among them into ``dest``; with
    ``mapped``, copy them from the file's mapped pages instead where it can (:func:`_copied_mapped`)."""
    if mapped and _copied_mapped(storage, name, piece_start_byte + lo * size, items, dest, lo, hi):
        return
    nbytes = (hi - lo) * size
    buf = buffers.take(nbytes)
    try:
        block = buf[:nbytes]
        read_with(storage, name, lambda: storage.read_into(name, [(piece_start_byte + lo * size, memoryview_of(block))]))
        for c, a, b, expected in checks:
            check_chunk(storage, (name, key, c), memoryview_of(block[a * size : b * size]), expected)
        for item in items:
            scatter_span(item, block.view(dest.dtype), lo, dest)
    finally:
        buffers.give(buf)


def scatter_span(item: ReadItem, span: torch.Tensor, lo: int, dest: torch.Tensor) -> int:
    """Copy the elements of a strided ``item`` whose stored offsets lie in ``[lo, lo + len(span))``
    from ``span`` (those stored elements, flat) into ``dest`` (the flat destination piece).
    Returns how many elements it copied."""
    copied = 0
    base = dest.storage_offset()
    for origin, sizes in span_boxes(item.sizes, item.src_strides, lo - item.src_offset, lo + span.numel() - item.src_offset):
        src = item.src_offset - lo + sum(o * s for o, s in zip(origin, item.src_strides))
        dst = item.dst_offset + sum(o * s for o, s in zip(origin, item.dst_strides))
        target = dest.as_strided(sizes, item.dst_strides, base + dst)
        target.copy_(span.as_strided(sizes, item.src_strides, span.storage_offset() + src))
        copied += target.numel()
    return copied


def _split_request(req: ReadRequest) -> list[ReadRequest]:
    """A large read as reads of at most ``_SPLIT_BYTES``, which the threads share."""
    start, buf = req
    if len(buf) <= _SPLIT_BYTES:
        return [req]
    return [(start + i, buf[i : i + _SPLIT_BYTES]) for i in range(0, len(buf), _SPLIT_BYTES)]


def verify_reads(
    storage: Storage,
    jobs: Sequence[ReadJob],
    *,
    headers: HeaderCache,
    chunk_bytes: int,
    num_threads: int | None = None,
    strided: bool = True,
) -> None:
    """Check the checksums of every chunk the jobs' reads touched (after the reads filled them).
    A strided item's chunks are read again from storage (``strided=False``: they were checked
    as they were read)."""
    run_checks(verify_tasks(storage, jobs, headers, chunk_bytes, strided), num_threads)


def run_checks(tasks: list[tuple], num_threads: int | None = None) -> None:
    """Run checks (``(fn, *args)``, each raising on a mismatch) on the I/O threads."""
    _run(num_threads, tasks)


def _run(num_threads: int | None, tasks: list[tuple], payload: int | None = None) -> None:
    """Run ``tasks`` (``(fn, *args)``) on at most ``num_threads`` threads, this one among them:
    each takes the next task until none is left, so a load hands its pool a few long turns, not a
    wake-up per task (a tiny load's reads are done before the pool's threads start their first).
    ``payload``: the bytes the tasks read; a thread per :data:`_BYTES_PER_THREAD` of it at most
    (many small tasks are mostly Python, and threads sharing the GIL only slow them down)."""
    most = num_threads or io_threads()
    threads = min(most, len(tasks))
    if payload is not None:
        threads = min(threads, max(1, -(-payload // _BYTES_PER_THREAD)))
    if threads <= 1:
        with torch.no_grad():
            for fn, *args in tasks:
                fn(*args)
        return
    pending = collections.deque(tasks)
    errors: list[BaseException] = []

    def drain() -> None:
        with torch.no_grad():  # on every thread (grad mode is per thread): in-place copies into the callers' tensors
            while not errors:
                try:
                    fn, *args = pending.popleft()
                except IndexError:
                    return
                try:
                    fn(*args)
                except Exception as ex:  # raised once every thread has stopped
                    errors.append(ex)

    pool = shared_pool(most)  # starts at most ``threads - 1`` of its threads for these tasks
    own = ThreadPoolExecutor(threads - 1, thread_name_prefix="checkpointer-io") if pool is None else None
    helpers: list[Future] = []
    try:
        for _ in range(threads - 1):
            helpers.append((pool or own).submit(drain))  # type: ignore[union-attr]
        drain()
    finally:  # interrupted too: no task writes into the callers' memory once this returns
        pending.clear()
        _stopped(helpers)
        if own is not None:
            own.shutdown()
    if errors:
        raise errors[0]


def _stopped(helpers: list[Future]) -> None:
    """Wait until no helper runs a task; one still queued behind other work in the shared pool is
    dropped (``wait`` would wait for a cancelled future until a pool thread reaches it). An
    interrupt while waiting is raised after the wait: a helper may be writing into the callers'
    memory (a raw ``preadv`` into a tensor its caller would free)."""
    started = [helper for helper in helpers if not helper.cancel()]
    interrupted: BaseException | None = None
    while True:
        try:
            wait(started)
            break
        except BaseException as ex:  # noqa: BLE001 - raised below, once the helpers have stopped
            interrupted = interrupted or ex
    if interrupted is not None:
        raise interrupted
    for helper in started:
        helper.result()  # what escaped a helper's drain (not an Exception)


def read_file_ranges(storage: Storage, name: str, reqs: list[ReadRequest]) -> None:
    """Fill each buffer from ``name`` (sorted by offset; adjacent ones coalesce)."""
    _read(storage, name, sorted(reqs, key=lambda r: r[0]))


def _read(storage: Storage, name: str, reqs: list[ReadRequest]) -> None:
    read_with(storage, name, lambda: storage.read_into(name, reqs))
