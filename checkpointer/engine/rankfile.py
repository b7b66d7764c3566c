"""Reading and writing one rank's safetensors file: headers, and bytes straight to and from tensor memory."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from ..buffers import memoryview_of
from ..checksums import CHUNK_BYTES, chunk_crcs, crc32c, crc32c_extend
from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize
from ..format.safetensors_header import PREFIX_BYTES, SafetensorsHeader, build_header, header_length, parse_header
from ..planning.plan import TensorLoadPlan
from ..sharding import LocalTensor
from ..storage.base import ReadRequest, Storage

__all__ = ["write_rank_file", "HeaderCache", "ReadJob", "execute_reads", "io_threads", "piece_start", "read_file_ranges", "verify_reads"]

_SPECULATIVE_HEADER = 1 << 16
_SPLIT_BYTES = 32 << 20
_WRITE_BLOCK = 2 << 20  # divides CHUNK_BYTES


def io_threads() -> int:
    return int(os.environ.get("CHECKPOINTER_IO_THREADS", "4"))


def write_rank_file(
    storage: Storage, name: str, tensors: Sequence[tuple[str, LocalTensor]], *, checksums: bool = True
) -> dict[str, list[int]]:
    """Write the local pieces as one safetensors file, streaming from tensor memory.

    Returns each key's CRC32C per :data:`~checkpointer.checksums.CHUNK_BYTES` of its piece.
    Each block is checksummed right after it is written, while it is still in the CPU cache:
    on a machine whose memory bandwidth is the limit, that costs almost nothing extra.

    Pieces already in contiguous CPU memory (and the header) stay alive and unchanged until
    the writer commits, so they go to :meth:`~checkpointer.storage.base.Writer.write_stable`:
    an object-store writer sends them from tensor memory, with no copy. A piece staged from
    another device or layout is a temporary, written with ``write`` (the writer copies what
    it keeps past the call).
    """
    header, _ = build_header([(key, lt.dtype, lt.numel) for key, lt in tensors])
    result: dict[str, list[int]] = {}
    with storage.open_writer(name) as writer:
        pending: list[memoryview] = [memoryview(header)]
        pending_bytes = len(header)
        for key, lt in tensors:
            data = lt.data
            stable = data.device.type == "cpu" and data.is_contiguous()
            if not stable:
                data = data.detach().to("cpu").contiguous()
            view = memoryview_of(data)
            if stable and len(view) < _WRITE_BLOCK:
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
            result[key] = _write_hashed(writer.write_stable if stable else writer.write, view, checksums)
        if pending:
            writer.write_stable(pending)
        writer.commit()
    return result


def _write_hashed(write: Callable[[Sequence[memoryview]], None], view: memoryview, checksums: bool) -> list[int]:
    crcs = []
    for chunk_start in range(0, len(view), CHUNK_BYTES):
        chunk = view[chunk_start : chunk_start + CHUNK_BYTES]
        crc = 0
        for block_start in range(0, len(chunk), _WRITE_BLOCK):
            block = chunk[block_start : block_start + _WRITE_BLOCK]
            write([block])
            if checksums:
                crc = crc32c_extend(crc, block)
        crcs.append(crc)
    return crcs if checksums else []


class HeaderCache:
    """Each rank file's safetensors header, read once per load (two small reads at most)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._headers: dict[str, SafetensorsHeader] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> SafetensorsHeader:
        with self._lock:
            cached = self._headers.get(name)
        if cached is not None:
            return cached
        where = self.storage.join(name)
        try:
            size = self.storage.size(name)
        except FileNotFoundError as ex:
            raise CorruptCheckpointError(f"{where}: rank file listed in metadata.json is missing") from ex
        except (PermissionError, IsADirectoryError, NotADirectoryError, ValueError) as ex:
            raise CorruptCheckpointError(f"{where}: not a readable file inside the checkpoint ({ex})") from ex
        except OSError as ex:
            if not self.storage.is_local():
                raise
            raise CorruptCheckpointError(f"{where}: not a regular file ({ex})") from ex
        prefix = self.storage.read(name, 0, min(size, _SPECULATIVE_HEADER))
        n = header_length(prefix, where=where, file_size=size)
        if PREFIX_BYTES + n <= len(prefix):
            header_json = prefix[PREFIX_BYTES : PREFIX_BYTES + n]
        else:
            header_json = prefix[PREFIX_BYTES:] + self.storage.read(name, len(prefix), PREFIX_BYTES + n)
        header = parse_header(header_json, where=where, file_size=size)
        with self._lock:
            self._headers[name] = header
        return header


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
    into chunks spread over a small thread pool. With ``verify_chunk_bytes``, every
    checksummed chunk the reads touched is checked afterwards.
    """
    headers = headers or HeaderCache(storage)
    per_file: dict[str, list[ReadRequest]] = {}
    for job in jobs:
        for name, reqs in _byte_requests(job, memoryview_of(job.dest), headers).items():
            per_file.setdefault(name, []).extend(reqs)
    tasks: list[tuple[str, list[ReadRequest]]] = []
    for name, reqs in per_file.items():
        reqs.sort(key=lambda r: r[0])
        chunk: list[ReadRequest] = []
        chunk_bytes = 0
        for req in reqs:
            chunk.append(req)
            chunk_bytes += len(req[1])
            if chunk_bytes >= _SPLIT_BYTES:
                tasks.append((name, chunk))
                chunk, chunk_bytes = [], 0
        if chunk:
            tasks.append((name, chunk))
    _run(num_threads, [(_read, storage, name, reqs) for name, reqs in tasks])
    if verify_chunk_bytes:
        verify_reads(storage, jobs, headers=headers, chunk_bytes=verify_chunk_bytes, num_threads=num_threads)


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
                    tasks.append((_check, storage, where, dest[d + lo - a : d + hi - a], crcs[c]))
                elif where not in reread:
                    reread.add(where)
                    start = piece_start(headers, item.file, job.plan.key, job.plan.dtype, job.numel_per_file[item.file])
                    tasks.append((_check_stored, storage, where, start + lo, start + hi, crcs[c]))
    return tasks


def _check(storage: Storage, where: tuple[str, str, int], view: memoryview, expected: int) -> None:
    if crc32c(view) != expected:
        name, key, c = where
        raise CorruptCheckpointError(f"{storage.join(name)}: checksum mismatch in tensor {key!r}, chunk {c}")


def _check_stored(storage: Storage, where: tuple[str, str, int], start: int, end: int, expected: int) -> None:
    _check(storage, where, memoryview(storage.read(where[0], start, end)), expected)


def read_file_ranges(storage: Storage, name: str, reqs: list[ReadRequest]) -> None:
    """Fill each buffer from ``name`` (sorted by offset; adjacent ones coalesce)."""
    _read(storage, name, sorted(reqs, key=lambda r: r[0]))


def _read(storage: Storage, name: str, reqs: list[ReadRequest]) -> None:
    try:
        storage.read_into(name, reqs)
    except FileNotFoundError as ex:
        raise CorruptCheckpointError(f"{storage.join(name)}: rank file listed in metadata.json is missing") from ex
    except EOFError as ex:
        raise CorruptCheckpointError(f"{storage.join(name)}: file is truncated ({ex})") from ex
