"""What a load checks against a checkpoint's rank files: their safetensors headers (read once, before
anything is allocated), the pieces they hold, and the CRC32C checksums of the bytes read."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np

from ..buffers import memoryview_of
from ..checksums import ALGORITHM, crc32c, crc32c_extend
from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize
from ..format.layout import CHECKSUMS_KEY, FILE_ID_KEY, METADATA_FILENAME
from ..format.metadata import TensorStorageMetadata
from ..format.specs import ShardSpecs
from ..format.safetensors_header import PREFIX_BYTES, SafetensorsHeader, header_length, parse_header
from ..storage.base import FileChangedError, ReadRequest, Storage

__all__ = [
    "HeaderCache", "piece_start", "check_files_hold", "read_small_file", "read_with", "check_chunk", "HashedRun",
    "verified_requests", "read_hashed", "verify_tasks", "FileChecksums", "piece_files", "verify_chunk_bytes",
    "ArrivingChunks",
]

T = TypeVar("T")

_SPECULATIVE_HEADER = 1 << 16
_HASH_BLOCK = 1 << 20  # hashed right after it is read, from the CPU cache
_SPLIT_BYTES = 32 << 20  # a run of whole chunks read and hashed by one thread


class HeaderCache:
    """Each rank file's safetensors header, read once per load (two small reads at most).

    With ``file_ids`` (``metadata.json``'s), a file whose header names another id is refused:
    it was written by another save than the metadata describes. ``storage`` is the given one
    :meth:`~checkpointer.storage.base.Storage.pinned` for this load: reads through it reach the
    file whose header was checked (a local file replaced meanwhile is an error, not other bytes).
    """

    def __init__(self, storage: Storage, file_ids: Mapping[str, str] | None = None, *,
                 what: str = f"rank file listed in {METADATA_FILENAME}", header_bytes: Mapping[str, int] | None = None):
        """``header_bytes``: each file's header size where known (``8 + length``), read in one
        exact read instead of a speculative 64 KiB prefix."""
        self._given = storage
        self.header_bytes = header_bytes or {}
        self.storage = storage.pinned()
        self.file_ids = file_ids or {}
        self.what = what  # what a file is, for the error when one is missing
        self._headers: dict[str, SafetensorsHeader] = {}
        self._checksums: dict[str, dict[str, tuple[int, ...]]] = {}
        self._lock = threading.Lock()

    def checksums(self, name: str, chunk_bytes: int) -> dict[str, tuple[int, ...]]:
        """Format 2: the checksums rank file ``name`` holds (its ``CHECKSUMS_KEY`` tensor), per key;
        read once. A file without them, or with too few or too many, is corrupt."""
        with self._lock:
            cached = self._checksums.get(name)
        if cached is not None:
            return cached
        header = self.get(name)
        where = self.storage.join(name)
        entry = header.entries.get(CHECKSUMS_KEY)
        if entry is None or entry.dtype != "U8":
            raise CorruptCheckpointError(f"{where}: holds no checksums ({CHECKSUMS_KEY!r}), which metadata.json promises")
        counts = {
            key: -(-(e.end - e.start) // chunk_bytes) for key, e in header.entries.items() if key != CHECKSUMS_KEY
        }
        if entry.end - entry.start != 4 * sum(counts.values()):
            raise CorruptCheckpointError(
                f"{where}: {entry.end - entry.start} bytes of checksums for {sum(counts.values())} chunks of 4 bytes"
            )
        data = read_with(self.storage, name, lambda: self.storage.read(name, entry.start, entry.end))
        if len(data) != entry.end - entry.start:
            raise CorruptCheckpointError(f"{where}: the checksums are cut short")
        values = np.frombuffer(data, dtype="<u4").tolist()
        out: dict[str, tuple[int, ...]] = {}
        at = 0
        for key in sorted(counts):
            out[key] = tuple(values[at : at + counts[key]])
            at += counts[key]
        with self._lock:
            self._checksums[name] = out
        return out

    def get(self, name: str) -> SafetensorsHeader:
        with self._lock:
            cached = self._headers.get(name)
        if cached is not None:
            return cached
        where = self.storage.join(name)
        size = _file_size(self.storage, name, self.what)
        first = self.header_bytes.get(name, _SPECULATIVE_HEADER)
        prefix = read_with(self.storage, name, lambda: self.storage.read(name, 0, min(size, first)), self.what)
        n = header_length(prefix, where=where, file_size=size)
        if PREFIX_BYTES + n <= len(prefix):
            header_json = prefix[PREFIX_BYTES : PREFIX_BYTES + n]
        else:
            rest = read_with(self.storage, name, lambda: self.storage.read(name, len(prefix), PREFIX_BYTES + n), self.what)
            header_json = prefix[PREFIX_BYTES:] + rest
        header = parse_header(header_json, where=where, file_size=size)
        expected = self.file_ids.get(name)
        if expected is not None:
            found = (header.user_metadata or {}).get(FILE_ID_KEY)
            if found != expected:
                raise CorruptCheckpointError(
                    f"{where}: written by another save than {self.storage.join(METADATA_FILENAME)} describes "
                    f"(file id {found!r}, expected {expected!r}): did two saves write this directory at once, or "
                    "do the ranks load different directories (rank 0 reads metadata.json for every rank)?"
                )
        with self._lock:
            self._headers[name] = header
        return header

    def close(self) -> None:
        """Close the files this load keeps open (done anyway when the cache is dropped)."""
        if self.storage is not self._given:
            self.storage.close()


class FileChecksums(Mapping):
    """Format 2: the checksums of one tensor's pieces, per file, read from the files on first use
    (``ReadJob.checksums_per_file`` of a checkpoint whose files hold them)."""

    def __init__(self, headers: HeaderCache, key: str, files: Sequence[str], chunk_bytes: int):
        self.headers, self.key, self.files, self.chunk_bytes = headers, key, list(files), chunk_bytes

    def __getitem__(self, name: str) -> tuple[int, ...]:
        if name not in self.files:
            raise KeyError(name)
        crcs = self.headers.checksums(name, self.chunk_bytes).get(self.key)
        if crcs is None:
            raise CorruptCheckpointError(f"{self.headers.storage.join(name)}: no checksums of tensor {self.key!r}")
        return crcs

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def piece_files(headers: HeaderCache, metadata: Any, key: str, files: Sequence[str]) -> tuple[dict[str, int], Mapping]:
    """For ``files`` of stored tensor ``key``: each one's element count of its piece, and its
    checksums of it, from ``metadata.json`` (format 1) or, lazily, from the files (format 2)."""
    specs = metadata.tensors[key].shard_spec_per_file
    if isinstance(specs, ShardSpecs):  # no spec object per file
        numels = {f: specs.local_numel(f) for f in files}
        stored: Callable[[str], Any] = specs.checksums_of
    else:
        numels = {f: specs[f].local_numel for f in files}
        stored = lambda f: specs[f].checksums  # noqa: E731
    if getattr(metadata, "checksums_in_files", None) and metadata.checksum_chunk_bytes:
        return numels, FileChecksums(headers, key, list(files), metadata.checksum_chunk_bytes)
    return numels, {f: stored(f) for f in files}


def verify_chunk_bytes(storage: Storage, metadata: Any, verify: bool) -> int | None:
    """The bytes each stored checksum covers, for reads that check them (``verify``), else None.
    Checksums of an algorithm this version cannot compute are refused, not skipped."""
    if not verify:
        return None
    algorithm = getattr(metadata, "checksum_algorithm", None)
    if algorithm not in (None, ALGORITHM):
        raise CorruptCheckpointError(
            f"{storage.join(METADATA_FILENAME)}: checksums of algorithm {algorithm!r}, which this version "
            f"cannot check (it computes {ALGORITHM!r})"
        )
    return metadata.checksum_chunk_bytes


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
    data = read_with(storage, name, lambda: storage.read(name, 0, size), what)
    if len(data) != size:
        raise CorruptCheckpointError(f"{where}: read {len(data)} bytes of {size}: the file changed while it was read")
    return data


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


def read_with(storage: Storage, name: str, read: Callable[[], T], what: str = f"rank file listed in {METADATA_FILENAME}") -> T:
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


@dataclass
class HashedRun:
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


def verified_requests(
    storage: Storage, job: Any, dest: memoryview, headers: HeaderCache, chunk: int
) -> tuple[dict[str, list[ReadRequest]], list[tuple], list[HashedRun]]:
    """Split a job's reads at checksum chunks: ``(plain reads, checks from storage, hashed runs)``.

    Chunks the read covers whole are read and hashed in runs; the covered part of a chunk it
    touches only in part is a plain read, and that chunk is checked from storage once."""
    plan = job.plan
    size = itemsize(plan.dtype)
    plain: dict[str, list[ReadRequest]] = {}
    tasks: list[tuple] = []
    runs: list[HashedRun] = []
    rechecked: set[tuple[str, int]] = set()
    for item in plan.items:
        if item.sizes:
            continue  # checked as its staging blocks are read
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
            where, expected = (item.file, plan.key, c), _nth(storage, item.file, plan.key, crcs, c)
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
                    run.expected.append((c, expected))
                else:
                    runs.append(HashedRun(item.file, plan.key, start + lo, d + lo, d + hi, [(c, expected)], dest))
                continue
            seg_lo, seg_hi = max(lo, a), min(hi, b)
            plain.setdefault(item.file, []).append((start + seg_lo, dest[d + seg_lo : d + seg_hi]))
            if (item.file, c) not in rechecked:
                rechecked.add((item.file, c))
                tasks.append((_check_stored, storage, where, start + lo, start + hi, expected))
    return plain, tasks, runs


def read_hashed(
    storage: Storage, name: str, key: str, start: int, view: memoryview, chunk: int, expected: list[tuple[int, int]]
) -> None:
    """Whole checksum chunks read in blocks small enough to stay in the CPU cache, each block
    hashed right after it is read, while it is still there."""
    for i, (c, crc) in enumerate(expected):
        lo, hi = i * chunk, min((i + 1) * chunk, len(view))
        running = _RunningCrc()
        read_with(storage, name, partial(storage.read_blocks, name, start + lo, view[lo:hi], _HASH_BLOCK, running.extend))
        if running.value != crc:
            raise CorruptCheckpointError(f"{storage.join(name)}: checksum mismatch in tensor {key!r}, chunk {c}")


class _RunningCrc:
    def __init__(self) -> None:
        self.value = 0

    def extend(self, part: memoryview) -> None:
        self.value = crc32c_extend(self.value, part)


def verify_tasks(
    storage: Storage, jobs: Sequence[Any], headers: HeaderCache, chunk: int, strided: bool = True
) -> list[tuple]:
    """Checks for every checksummed chunk the reads touched: hashed from the destination when
    one read covered it whole, re-read from storage otherwise (only at piece boundaries)."""
    tasks: list[tuple] = []
    reread: set[tuple[str, str, int]] = set()
    for job in jobs:
        size = itemsize(job.plan.dtype)
        dest = memoryview_of(job.dest)
        for item in job.plan.items:
            crcs = (job.checksums_per_file or {}).get(item.file)
            if crcs is None or (item.sizes and not strided):
                continue
            piece_bytes = job.numel_per_file[item.file] * size
            a, b = item.src_offset * size, item.src_end * size
            d = item.dst_offset * size
            for c in range(a // chunk, -(-b // chunk)):
                lo, hi = c * chunk, min((c + 1) * chunk, piece_bytes)
                where, expected = (item.file, job.plan.key, c), _nth(storage, item.file, job.plan.key, crcs, c)
                if a <= lo and hi <= b and not item.sizes:
                    tasks.append((check_chunk, storage, where, dest[d + lo - a : d + hi - a], expected))
                elif where not in reread:
                    reread.add(where)
                    start = piece_start(headers, item.file, job.plan.key, job.plan.dtype, job.numel_per_file[item.file])
                    tasks.append((_check_stored, storage, where, start + lo, start + hi, expected))
    return tasks


def check_chunk(storage: Storage, where: tuple[str, str, int], view: memoryview, expected: int) -> None:
    """Raise if the CRC32C of ``view`` is not ``expected``; ``where`` is (file, key, chunk index)."""
    if crc32c(view) != expected:
        name, key, c = where
        raise CorruptCheckpointError(f"{storage.join(name)}: checksum mismatch in tensor {key!r}, chunk {c}")


def _check_stored(storage: Storage, where: tuple[str, str, int], start: int, end: int, expected: int) -> None:
    data = read_with(storage, where[0], lambda: storage.read(where[0], start, end))
    check_chunk(storage, where, memoryview(data), expected)


class ArrivingChunks:
    """Checksummed chunks checked from a piece's bytes as they arrive, in order (a two-stage load's
    units): a chunk whose bytes all came, one after the other, is hashed from them as they come;
    one that came in part, or out of order, is re-read from storage once (:meth:`rereads`)."""

    def __init__(self, headers: HeaderCache, metadata: Any, chunk: int):
        self.headers, self.metadata, self.chunk = headers, metadata, chunk
        self.pieces: dict[tuple[str, str], tuple[int, int, Sequence[int] | None]] = {}  # numel, itemsize, CRCs
        self.open: dict[tuple[str, str], tuple[int, int, int]] = {}  # (chunk, next byte, CRC so far)
        self.partial: set[tuple[str, str, int]] = set()

    def _piece(self, file: str, key: str) -> tuple[int, int, Sequence[int] | None]:
        found = self.pieces.get((file, key))
        if found is None:
            numels, crcs = piece_files(self.headers, self.metadata, key, [file])
            found = self.pieces[(file, key)] = (numels[file], itemsize(self.metadata.tensors[key].dtype), crcs.get(file))
        return found

    def take(self, file: str, key: str, at: int, data: memoryview) -> None:
        """Bytes ``[at, at + len(data))`` of ``key``'s piece in ``file`` arrived."""
        numel, size, crcs = self._piece(file, key)
        if crcs is None:
            return
        pos, end, chunk = at, at + len(data), self.chunk
        while pos < end:
            c = pos // chunk
            c_end, stop = min((c + 1) * chunk, numel * size), min(end, (c + 1) * chunk)
            state = self.open.pop((file, key), None)
            if state is not None and state[:2] == (c, pos):
                crc = crc32c_extend(state[2], data[pos - at : stop - at])
            else:
                if state is not None:
                    self.partial.add((file, key, state[0]))
                if pos != c * chunk:
                    self.partial.add((file, key, c))
                    pos = stop
                    continue
                crc = crc32c(data[pos - at : stop - at])
            if stop < c_end:
                self.open[(file, key)] = (c, stop, crc)
            elif crc != _nth(self.headers.storage, file, key, crcs, c):
                raise CorruptCheckpointError(f"{self.headers.storage.join(file)}: checksum mismatch in tensor {key!r}, chunk {c}")
            pos = stop

    def rereads(self) -> list[tuple]:
        """Checks from storage (``(fn, *args)``) of the chunks that arrived in part, each once."""
        tasks: list[tuple] = []
        for file, key, c in sorted(self.partial | {(f, k, c) for (f, k), (c, _, _) in self.open.items()}):
            numel, size, crcs = self._piece(file, key)
            expected = _nth(self.headers.storage, file, key, crcs, c)  # type: ignore[arg-type]
            start = piece_start(self.headers, file, key, self.metadata.tensors[key].dtype, numel)
            lo, hi = c * self.chunk, min((c + 1) * self.chunk, numel * size)
            tasks.append((_check_stored, self.headers.storage, (file, key, c), start + lo, start + hi, expected))
        return tasks


def _nth(storage: Storage, file: str, key: str, crcs: Sequence[int], c: int) -> int:
    if c >= len(crcs):
        raise CorruptCheckpointError(f"{storage.join(file)}: tensor {key!r} has too few checksums")
    return crcs[c]
