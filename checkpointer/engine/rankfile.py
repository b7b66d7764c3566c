"""Reading and writing one rank's safetensors file: headers, and bytes straight to and from tensor memory."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from functools import partial
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence, TypeVar

import torch

from ..buffers import memoryview_of
from ..checksums import CHUNK_BYTES, chunk_crcs, crc32c, crc32c_extend
from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize
from ..format.layout import FILE_ID_KEY, METADATA_FILENAME
from ..format.metadata import TensorStorageMetadata
from ..format.safetensors_header import PREFIX_BYTES, SafetensorsHeader, build_header, header_length, parse_header
from ..planning.plan import TensorLoadPlan
from ..sharding import LocalTensor
from ..storage.base import FileChangedError, ReadRequest, Storage, Writer
from ..storage.direct import MIN_FROM_SOURCE
from .file_order import order_for_alignment

__all__ = [
    "write_rank_file",
    "staging_bytes",
    "HeaderCache",
    "ReadJob",
    "execute_reads",
    "execute_reads_from",
    "io_threads",
    "piece_start",
    "check_files_hold",
    "check_chunk",
    "read_file_ranges",
    "read_small_file",
    "verify_reads",
]

_SPECULATIVE_HEADER = 1 << 16
_SPLIT_BYTES = 32 << 20
_WRITE_BLOCK = 2 << 20  # divides CHUNK_BYTES
_FROM_MEMORY_BLOCK = 64 << 20  # a multiple of CHUNK_BYTES, and 4x MIN_FROM_SOURCE
_HASH_BLOCK = 1 << 20  # hashed right after it is read, from the CPU cache

T = TypeVar("T")


def io_threads() -> int:
    return int(os.environ.get("CHECKPOINTER_IO_THREADS", "4"))


def write_rank_file(
    storage: Storage,
    name: str,
    tensors: Sequence[tuple[str, LocalTensor]],
    *,
    checksums: bool = True,
    file_id: str | None = None,
) -> dict[str, list[int]]:
    """Write the local pieces as one safetensors file, streaming from tensor memory.

    Returns each key's CRC32C per :data:`~checkpointer.checksums.CHUNK_BYTES` of its piece.
    Each block is checksummed right after it is written, while it is still in the CPU cache:
    on a machine whose memory bandwidth is the limit, that costs almost nothing extra.
    ``file_id`` goes into the header's ``__metadata__``, for ``metadata.json`` to list.

    Pieces already in contiguous CPU memory (and the header) stay alive and unchanged until
    the writer commits, so they go to :meth:`~checkpointer.storage.base.Writer.write_stable`:
    an object-store writer sends them from tensor memory, with no copy. A piece staged from
    another device or layout is a temporary, written with ``write`` (the writer copies what
    it keeps past the call). A local ``O_DIRECT`` writer sends them uncopied where their
    addresses agree with their file offsets: for it, the file is ordered and its header padded
    so that most bytes do (:func:`order_for_alignment`), and blocks end on aligned offsets.
    """
    result: dict[str, list[int]] = {}
    with storage.open_writer(name) as writer:
        align = writer.source_alignment()
        data_start = None
        if align is not None:
            tensors, data_start = order_for_alignment(tensors, align, MIN_FROM_SOURCE)
        header, offsets = build_header(
            [(key, lt.dtype, lt.numel) for key, lt in tensors],
            user_metadata={FILE_ID_KEY: file_id} if file_id else None,
            data_start=data_start,
        )
        # A writer that copies: each block is hashed while the copy is in the CPU cache. One
        # that writes from tensor memory: blocks of several of its writes.
        block = _FROM_MEMORY_BLOCK if align is not None else _WRITE_BLOCK
        min_block = MIN_FROM_SOURCE if align is not None else 0  # a shorter block would be copied
        pending: list[memoryview] = [memoryview(header)]
        pending_bytes = len(header)
        staging = _Staging()
        for (key, lt), offset in zip(tensors, offsets):
            data = lt.data
            if data.device.type != "cpu" or not data.is_contiguous():
                if pending:
                    writer.write_stable(pending)
                    pending, pending_bytes = [], 0
                # The staging buffer is reused: plain ``write``, which copies what it keeps.
                result[key] = _write_staged(writer, data.detach(), staging, checksums)
                continue
            view = memoryview_of(data)
            if len(view) < _WRITE_BLOCK:
                # Small pieces go out together; each is hashed now, while it is hot.
                result[key] = chunk_crcs(view) if checksums else []
                pending.append(view)
                pending_bytes += len(view)
                if pending_bytes >= _WRITE_BLOCK:
                    writer.write_stable(pending)
                    pending, pending_bytes = [], 0
                continue
            if pending:
                writer.write_stable(pending)
                pending, pending_bytes = [], 0
            result[key] = _write_hashed(writer.write_stable, view, checksums, block, offset, min_block)
        if pending:
            writer.write_stable(pending)
        writer.commit()
    return result


def staging_bytes() -> int:
    """Host memory a save may use to copy tensors that cannot be written from where they are
    (on a GPU, or not contiguous): ``CHECKPOINTER_STAGING_MIB``, default 256."""
    return max(1, int(float(os.environ.get("CHECKPOINTER_STAGING_MIB", "256")) * (1 << 20)))


class _Staging:
    """One reusable host buffer of at most :func:`staging_bytes` (pinned when copying from CUDA)."""

    def __init__(self) -> None:
        self.budget = staging_bytes()
        self._buf: torch.Tensor | None = None

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < nbytes or (pinned and not buf.is_pinned()):
            self._buf = None
            size = max(nbytes, min(self.budget, 64 << 20))
            buf = self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return buf[:nbytes]


def _write_staged(writer: Writer, data: torch.Tensor, staging: _Staging, checksums: bool) -> list[int]:
    """Write a tensor through the staging buffer, a block of whole rows (dim 0) at a time.

    A block is at most the staging budget, or one row where a row is larger than that."""
    pinned = data.device.type == "cuda"
    if data.dim() == 0:
        data = data.reshape(1)
    if data.is_contiguous():
        data = data.reshape(-1)  # a view: blocks of elements
    rows = data.shape[0]
    row_bytes = max(1, data[:1].numel() * data.element_size())
    step = max(1, staging.budget // row_bytes)
    crcs: list[int] = []
    crc, in_chunk = 0, 0
    for start in range(0, rows, step):
        part = data[start : start + step]
        nbytes = part.numel() * part.element_size()
        host = staging.take(nbytes, pinned).view(part.dtype).view(part.shape)
        host.copy_(part)
        view = memoryview_of(host)
        pos = 0
        while pos < len(view):
            # Checksums restart every CHUNK_BYTES of the tensor, wherever the block boundaries fall.
            take = min(len(view) - pos, CHUNK_BYTES - in_chunk, _WRITE_BLOCK)
            block = view[pos : pos + take]
            writer.write([block])
            if checksums:
                crc = crc32c_extend(crc, block)
            pos += take
            in_chunk += take
            if in_chunk == CHUNK_BYTES:
                crcs.append(crc)
                crc, in_chunk = 0, 0
    if in_chunk:
        crcs.append(crc)
    return crcs if checksums else []


def _write_hashed(
    write: Callable[[Sequence[memoryview]], None],
    view: memoryview,
    checksums: bool,
    block_bytes: int,
    file_offset: int,
    min_block: int = 0,
) -> list[int]:
    """Write ``view`` (which starts at ``file_offset``) in blocks that end on multiples of
    ``block_bytes`` in the file, none shorter than ``min_block`` but the whole view, hashing
    each :data:`CHUNK_BYTES` of it."""
    crcs: list[int] = []
    crc, pos = 0, 0
    while pos < len(view):
        end = pos + block_bytes - (file_offset + pos) % block_bytes
        if end - pos < min_block:
            end += block_bytes
        if len(view) - end < min_block:
            end = len(view)
        end = min(len(view), end)
        write([view[pos:end]])
        while checksums and pos < end:
            cut = min(end, (pos // CHUNK_BYTES + 1) * CHUNK_BYTES)
            crc = crc32c_extend(crc, view[pos:cut])
            if cut % CHUNK_BYTES == 0 or cut == len(view):
                crcs.append(crc)
                crc = 0
            pos = cut
        pos = end
    return crcs


class HeaderCache:
    """Each rank file's safetensors header, read once per load (two small reads at most).

    With ``file_ids`` (``metadata.json``'s), a file whose header names another id is refused:
    it was written by another save than the metadata describes. ``storage`` is the given one
    :meth:`~checkpointer.storage.base.Storage.pinned` for this load: reads through it reach the
    file whose header was checked (a local file replaced meanwhile is an error, not other bytes).
    """

    def __init__(self, storage: Storage, file_ids: Mapping[str, str] | None = None, *,
                 what: str = f"rank file listed in {METADATA_FILENAME}"):
        self._given = storage
        self.storage = storage.pinned()
        self.file_ids = file_ids or {}
        self.what = what  # what a file is, for the error when one is missing
        self._headers: dict[str, SafetensorsHeader] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> SafetensorsHeader:
        with self._lock:
            cached = self._headers.get(name)
        if cached is not None:
            return cached
        where = self.storage.join(name)
        size = _file_size(self.storage, name, self.what)
        prefix = _read_with(self.storage, name, lambda: self.storage.read(name, 0, min(size, _SPECULATIVE_HEADER)), self.what)
        n = header_length(prefix, where=where, file_size=size)
        if PREFIX_BYTES + n <= len(prefix):
            header_json = prefix[PREFIX_BYTES : PREFIX_BYTES + n]
        else:
            rest = _read_with(self.storage, name, lambda: self.storage.read(name, len(prefix), PREFIX_BYTES + n), self.what)
            header_json = prefix[PREFIX_BYTES:] + rest
        header = parse_header(header_json, where=where, file_size=size)
        expected = self.file_ids.get(name)
        if expected is not None:
            found = (header.user_metadata or {}).get(FILE_ID_KEY)
            if found != expected:
                raise CorruptCheckpointError(
                    f"{where}: written by another save than {self.storage.join(METADATA_FILENAME)} describes "
                    f"(file id {found!r}, expected {expected!r}): did two saves write this directory at once?"
                )
        with self._lock:
            self._headers[name] = header
        return header

    def close(self) -> None:
        """Close the files this load keeps open (done anyway when the cache is dropped)."""
        if self.storage is not self._given:
            self.storage.close()


def _file_size(storage: Storage, name: str, what: str) -> int:
    """The size of a file the checkpoint needs; a missing or special file is corrupt data."""
    where = storage.join(name)
    try:
        return storage.size(name)
    except FileNotFoundError as ex:
        raise CorruptCheckpointError(f"{where}: {what} is missing") from ex
    except FileChangedError as ex:
        raise CorruptCheckpointError(f"{where}: changed while the checkpoint was read ({ex})") from ex
    except (PermissionError, IsADirectoryError, NotADirectoryError, ValueError) as ex:
        raise CorruptCheckpointError(f"{where}: not a readable file inside the checkpoint ({ex})") from ex
    except OSError as ex:
        if not storage.is_local():
            raise
        raise CorruptCheckpointError(f"{where}: not a regular file ({ex})") from ex


def read_small_file(storage: Storage, name: str, *, limit: int, what: str) -> bytes:
    """All of a file read whole (an index, a JSON document): bytes ``[0, size)`` of its size as
    stat'ed, refused above ``limit`` bytes. One that grows while it is read (or is a FIFO, or a
    device) is never read past that size, and one that changes size is refused.
    """
    where = storage.join(name)
    size = _file_size(storage, name, what)
    if size > limit:
        raise CorruptCheckpointError(f"{where}: {what} of {size} bytes is over the limit of {limit} bytes")
    data = _read_with(storage, name, lambda: storage.read(name, 0, size), what)
    if len(data) != size:
        raise CorruptCheckpointError(f"{where}: read {len(data)} bytes of {size}: the file changed while it was read")
    return data


@dataclass(frozen=True)
class ReadJob:
    """Fill ``dest`` (flat, contiguous, CPU) by ``plan``; ``numel_per_file`` checks the file headers."""

    plan: TensorLoadPlan
    dest: torch.Tensor
    numel_per_file: dict[str, int]
    checksums_per_file: dict[str, tuple[int, ...] | None] | None = None


def piece_start(headers: HeaderCache, file: str, key: str, dtype: str, numel: int) -> int:
    """Byte offset of ``key``'s piece in ``file``, after checking the header agrees with the metadata."""
    entry = headers.get(file).entries.get(key)
    if entry is None:
        raise CorruptCheckpointError(f"{headers.storage.join(file)}: tensor {key!r} is in metadata.json but not in the file")
    if entry.dtype != dtype or entry.numel != numel:
        raise CorruptCheckpointError(
            f"{headers.storage.join(file)}: tensor {key!r} is {entry.dtype} x {entry.numel} in the file "
            f"but {dtype} x {numel} in metadata.json"
        )
    return entry.start


def check_files_hold(headers: HeaderCache, key: str, meta: TensorStorageMetadata) -> None:
    """Check, before allocating ``meta.shape``, that the rank files hold that many elements.

    Each file's piece of ``key`` must match its safetensors header (whose byte ranges were
    checked against the file's size when it was parsed), and the pieces together must hold
    at least the tensor's element count; so a buffer of the tensor's shape is never larger
    than the bytes on disk. Reads only headers (cached); a hole or an overlap between pieces
    is left to the load plan.
    """
    held = 0
    for name, spec in meta.shard_spec_per_file.items():
        piece_start(headers, name, key, meta.dtype, spec.local_numel)
        held += spec.local_numel
    if held < meta.numel:
        files = ", ".join(headers.storage.join(name) for name in meta.shard_spec_per_file) or "no file"
        raise CorruptCheckpointError(
            f"tensor {key!r}: metadata.json gives it {meta.numel} elements but its files ({files}) hold {held}"
        )


def _byte_requests(job: ReadJob, dest: memoryview, headers: HeaderCache) -> dict[str, list[ReadRequest]]:
    plan = job.plan
    size = itemsize(plan.dtype)
    out: dict[str, list[ReadRequest]] = {}
    for item in plan.items:
        entry_start = piece_start(headers, item.file, plan.key, plan.dtype, job.numel_per_file[item.file])
        start = entry_start + item.src_offset * size
        buf = dest[item.dst_offset * size : (item.dst_offset + item.numel) * size]
        out.setdefault(item.file, []).append((start, buf))
    return out


def execute_reads(
    storage: Storage,
    jobs: Sequence[ReadJob],
    *,
    headers: HeaderCache | None = None,
    num_threads: int | None = None,
    verify_chunk_bytes: int | None = None,
) -> None:
    """Run load plans, straight into their destinations.

    Reads for one file are sorted by offset (adjacent ones become one ``preadv``) and split
    into chunks of about ``_SPLIT_BYTES`` (a larger read too) spread over a small thread pool. With ``verify_chunk_bytes``, every
    checksummed chunk the reads touch is checked: on local storage, runs of whole chunks (up to
    32 MiB) go to one thread each, which reads them 1 MiB at a time and hashes each block right
    after reading it, from the CPU cache (hashing each 16 MiB chunk after one read of the run, from
    memory, added about 48 % to a warm 1 GiB load here; this, about 36 %); elsewhere, and for chunks the reads cover only in part, after
    all the reads.
    """
    execute_reads_from([(headers or HeaderCache(storage), jobs)], num_threads=num_threads, verify_chunk_bytes=verify_chunk_bytes)


def execute_reads_from(
    sources: Sequence[tuple[HeaderCache, Sequence[ReadJob]]],
    *,
    num_threads: int | None = None,
    verify_chunk_bytes: int | None = None,
) -> None:
    """:func:`execute_reads` for the jobs of several checkpoints at once (each with the header
    cache of its storage), in one thread pool: a model's and its optimizer's reads overlap."""
    tasks: list[tuple] = []
    checked_after: list[tuple[HeaderCache, Sequence[ReadJob]]] = []
    for headers, jobs in sources:
        tasks += _read_tasks(headers, jobs, verify_chunk_bytes)
        if verify_chunk_bytes and not headers.storage.is_local():
            checked_after.append((headers, jobs))
    _run(num_threads, tasks)
    for headers, jobs in checked_after:
        verify_reads(headers.storage, jobs, headers=headers, chunk_bytes=verify_chunk_bytes, num_threads=num_threads)


def _read_tasks(headers: HeaderCache, jobs: Sequence[ReadJob], verify_chunk_bytes: int | None) -> list[tuple]:
    """The thread-pool tasks of one storage's jobs: checks from storage, hashed runs, plain reads."""
    storage = headers.storage
    fused = bool(verify_chunk_bytes) and storage.is_local()
    per_file: dict[str, list[ReadRequest]] = {}
    checks: list[tuple] = []
    runs: list[_HashedRun] = []
    for job in jobs:
        dest = memoryview_of(job.dest)
        if fused and job.checksums_per_file:
            requests, job_checks, job_runs = _verified_requests(storage, job, dest, headers, verify_chunk_bytes)
            checks += job_checks
            runs += job_runs
        else:
            requests = _byte_requests(job, dest, headers)
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
    hashed = [(_read_hashed, storage, r.file, r.key, r.start, r.view, verify_chunk_bytes, r.expected) for r in runs]
    return checks + hashed + tasks


def _split_request(req: ReadRequest) -> list[ReadRequest]:
    """A large read as reads of at most ``_SPLIT_BYTES``, which the threads share."""
    start, buf = req
    if len(buf) <= _SPLIT_BYTES:
        return [req]
    return [(start + i, buf[i : i + _SPLIT_BYTES]) for i in range(0, len(buf), _SPLIT_BYTES)]


@dataclass
class _HashedRun:
    """Whole checksum chunks next to each other in one file and one destination: one read."""

    file: str
    key: str
    start: int  # file offset of the first chunk
    dest_lo: int
    dest_hi: int
    expected: list[tuple[int, int]]  # (chunk number, CRC32C) of each chunk in turn
    dest: memoryview

    @property
    def view(self) -> memoryview:
        return self.dest[self.dest_lo : self.dest_hi]


def _verified_requests(
    storage: Storage, job: ReadJob, dest: memoryview, headers: HeaderCache, chunk: int
) -> tuple[dict[str, list[ReadRequest]], list[tuple], list[_HashedRun]]:
    """Split a job's reads at checksum chunks: ``(plain reads, checks from storage, hashed runs)``.

    Chunks the read covers whole are read and hashed in runs; the covered part of a chunk it
    touches only in part is a plain read, and that chunk is checked from storage once."""
    plan = job.plan
    size = itemsize(plan.dtype)
    plain: dict[str, list[ReadRequest]] = {}
    tasks: list[tuple] = []
    runs: list[_HashedRun] = []
    rechecked: set[tuple[str, int]] = set()
    for item in plan.items:
        numel = job.numel_per_file[item.file]
        start = piece_start(headers, item.file, plan.key, plan.dtype, numel)
        a, b = item.src_offset * size, (item.src_offset + item.numel) * size
        d = item.dst_offset * size - a  # dest index of piece byte 0
        crcs = job.checksums_per_file.get(item.file) if job.checksums_per_file else None
        if crcs is None:
            plain.setdefault(item.file, []).append((start + a, dest[d + a : d + b]))
            continue
        piece_bytes = numel * size
        for c in range(a // chunk, -(-b // chunk)):
            lo, hi = c * chunk, min((c + 1) * chunk, piece_bytes)
            where = (item.file, plan.key, c)
            if c >= len(crcs):
                raise CorruptCheckpointError(f"{storage.join(item.file)}: tensor {plan.key!r} has too few checksums")
            if a <= lo and hi <= b:
                run = runs[-1] if runs else None
                if (
                    run is not None
                    and run.file == item.file
                    and run.dest_hi == d + lo
                    and run.start + (run.dest_hi - run.dest_lo) == start + lo
                    and run.dest_hi - run.dest_lo < _SPLIT_BYTES
                ):
                    run.dest_hi = d + hi  # the previous run of whole chunks goes on: one read for both
                    run.expected.append((c, crcs[c]))
                else:
                    runs.append(_HashedRun(item.file, plan.key, start + lo, d + lo, d + hi, [(c, crcs[c])], dest))
                continue
            seg_lo, seg_hi = max(lo, a), min(hi, b)
            plain.setdefault(item.file, []).append((start + seg_lo, dest[d + seg_lo : d + seg_hi]))
            if (item.file, c) not in rechecked:
                rechecked.add((item.file, c))
                tasks.append((_check_stored, storage, where, start + lo, start + hi, crcs[c]))
    return plain, tasks, runs


def _read_hashed(
    storage: Storage, name: str, key: str, start: int, view: memoryview, chunk: int, expected: list[tuple[int, int]]
) -> None:
    """Whole checksum chunks read in blocks small enough to stay in the CPU cache, each block
    hashed right after it is read, while it is still there."""
    for i, (c, crc) in enumerate(expected):
        lo, hi = i * chunk, min((i + 1) * chunk, len(view))
        running = _RunningCrc()
        _read_with(storage, name, partial(storage.read_blocks, name, start + lo, view[lo:hi], _HASH_BLOCK, running.extend))
        if running.value != crc:
            raise CorruptCheckpointError(f"{storage.join(name)}: checksum mismatch in tensor {key!r}, chunk {c}")


class _RunningCrc:
    def __init__(self) -> None:
        self.value = 0

    def extend(self, part: memoryview) -> None:
        self.value = crc32c_extend(self.value, part)


def verify_reads(
    storage: Storage, jobs: Sequence[ReadJob], *, headers: HeaderCache, chunk_bytes: int, num_threads: int | None = None
) -> None:
    """Check the checksums of every chunk the jobs' reads touched (after the reads filled them)."""
    _run(num_threads, _verify_tasks(storage, jobs, headers, chunk_bytes))


def _run(num_threads: int | None, tasks: list[tuple]) -> None:
    threads = min(num_threads or io_threads(), len(tasks))
    if threads <= 1:
        for fn, *args in tasks:
            fn(*args)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="checkpointer-io") as pool:
        for future in [pool.submit(fn, *args) for fn, *args in tasks]:
            future.result()


def _verify_tasks(storage: Storage, jobs: Sequence[ReadJob], headers: HeaderCache, chunk: int) -> list[tuple]:
    """Checks for every checksummed chunk the reads touched: hashed from the destination when
    one read covered it whole, re-read from storage otherwise (only at piece boundaries)."""
    tasks: list[tuple] = []
    reread: set[tuple[str, str, int]] = set()
    for job in jobs:
        size = itemsize(job.plan.dtype)
        dest = memoryview_of(job.dest)
        for item in job.plan.items:
            crcs = (job.checksums_per_file or {}).get(item.file)
            if crcs is None:
                continue
            piece_bytes = job.numel_per_file[item.file] * size
            a, b = item.src_offset * size, (item.src_offset + item.numel) * size
            d = item.dst_offset * size
            for c in range(a // chunk, -(-b // chunk)):
                lo, hi = c * chunk, min((c + 1) * chunk, piece_bytes)
                where = (item.file, job.plan.key, c)
                if c >= len(crcs):
                    raise CorruptCheckpointError(f"{storage.join(item.file)}: tensor {job.plan.key!r} has too few checksums")
                if a <= lo and hi <= b:
                    tasks.append((check_chunk, storage, where, dest[d + lo - a : d + hi - a], crcs[c]))
                elif where not in reread:
                    reread.add(where)
                    start = piece_start(headers, item.file, job.plan.key, job.plan.dtype, job.numel_per_file[item.file])
                    tasks.append((_check_stored, storage, where, start + lo, start + hi, crcs[c]))
    return tasks


def check_chunk(storage: Storage, where: tuple[str, str, int], view: memoryview, expected: int) -> None:
    """Raise if the CRC32C of ``view`` is not ``expected``; ``where`` is (file, key, chunk index)."""
    if crc32c(view) != expected:
        name, key, c = where
        raise CorruptCheckpointError(f"{storage.join(name)}: checksum mismatch in tensor {key!r}, chunk {c}")


def _check_stored(storage: Storage, where: tuple[str, str, int], start: int, end: int, expected: int) -> None:
    data = _read_with(storage, where[0], lambda: storage.read(where[0], start, end))
    check_chunk(storage, where, memoryview(data), expected)


def read_file_ranges(storage: Storage, name: str, reqs: list[ReadRequest]) -> None:
    """Fill each buffer from ``name`` (sorted by offset; adjacent ones coalesce)."""
    _read(storage, name, sorted(reqs, key=lambda r: r[0]))


def _read(storage: Storage, name: str, reqs: list[ReadRequest]) -> None:
    _read_with(storage, name, lambda: storage.read_into(name, reqs))


def _read_with(storage: Storage, name: str, read: Callable[[], T], what: str = f"rank file listed in {METADATA_FILENAME}") -> T:
    """``read()``, its errors as a load reports them: a file that is missing, cut short, replaced
    or not a readable file inside the checkpoint is corrupt; any other ``OSError`` names the file."""
    where = storage.join(name)
    try:
        return read()
    except FileNotFoundError as ex:
        raise CorruptCheckpointError(f"{where}: {what} is missing") from ex
    except (EOFError, FileChangedError) as ex:
        raise CorruptCheckpointError(f"{where}: changed while the checkpoint was read, or damaged ({ex})") from ex
    except (PermissionError, IsADirectoryError, NotADirectoryError) as ex:
        if not storage.is_local():
            raise
        raise CorruptCheckpointError(f"{where}: not a readable file inside the checkpoint ({ex})") from ex
    except OSError as ex:
        if where in str(ex) or name in str(ex):
            raise
        message = f"{where}: {ex.strerror or ex}"
        raise (OSError(ex.errno, message) if ex.errno else OSError(message)) from ex
