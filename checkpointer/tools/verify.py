"""Check one checkpoint directory end to end, reading every byte; returns the problems found.

The checks, each problem reported as one line naming the file and the tensor:

1. ``metadata.json`` exists and parses (shapes, dtypes, file names, offsets within each tensor).
2. Every file it lists exists and has a valid safetensors header that fits the file; no rank
   file is there that it does not list.
3. Each file is a valid safetensors file: its tensors fill the data area back to back, with no
   stray bytes, and it holds exactly the tensors metadata.json places in it.
4. Each piece's header entry agrees with metadata.json: dtype, element count, flat shape.
5. Every element of every tensor is in exactly one piece: no gaps, no overlaps. Checked only
   where every piece passed step 4, so that a piece's ranges are expanded only once its file
   is known to hold them (a hostile shape costs nothing).
6. Every byte of every piece is read; where the checkpoint has checksums, each chunk's
   CRC32C must match.

A Hugging Face safetensors checkpoint (an export, say) has no checksums:
:func:`verify_hf_checkpoint` checks its headers and index and reads every tensor's bytes.
"""

from __future__ import annotations

import io
import math

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..checksums import ALGORITHM, crc32c
from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize
from ..format.layout import CHECKSUMS_KEY, METADATA_FILENAME, is_rank_filename
from ..format.metadata import StorageMetadata, TensorStorageMetadata
from ..format.safetensors_header import SafetensorsHeader
from ..planning.overlap import Range
from ..planning.load_plan import stored_cover_exactly, stored_ranges
from ..storage import open_storage
from ..storage.base import Storage
from ..engine.load import read_metadata
from ..engine.checks import HeaderCache
from ..engine.reader import CheckpointReader
from ..engine.rankfile import io_threads

__all__ = ["verify_checkpoint", "verify_hf_checkpoint"]

_READ_BYTES = 16 << 20  # read size where a piece has no checksums
_BATCH_BYTES = 32 << 20  # adjacent chunks read together up to this size
_MAX_LINES_PER_TENSOR = 3


@dataclass(frozen=True)
class _Chunk:
    file: str
    key: str
    index: int
    start: int  # absolute byte offsets in the file
    end: int
    expected: int | None  # CRC32C, when the checkpoint has one


def _one_line(ex: BaseException) -> str:
    return " ".join(str(ex).split()) or type(ex).__name__


def verify_checkpoint(
    storage: str | Storage,
    *,
    make_progress: Callable[[int, int], Any] | None = None,
    num_threads: int | None = None,
) -> list[str]:
    """Every problem of the checkpoint directory ``storage``, one line each; empty when sound.

    Args:
        storage: the checkpoint directory (holding ``metadata.json``), path, URL or Storage.
        make_progress: ``make_progress(total_bytes, total_chunks)`` returns an object with
            ``advance(nbytes, chunks)`` and ``close()`` (a progress bar).
        num_threads: parallel reads (default ``CHECKPOINTER_IO_THREADS`` or 4).
    """
    storage = open_storage(storage)
    try:
        metadata = read_metadata(storage, no_dist=True)
    except (CorruptCheckpointError, OSError) as ex:
        return [_one_line(ex)]
    problems: list[str] = []
    use_checksums = metadata.checksum_algorithm in (None, ALGORITHM)
    if not use_checksums:
        problems.append(
            f"{storage.join(METADATA_FILENAME)}: unknown checksum algorithm {metadata.checksum_algorithm!r} "
            f"(expected {ALGORITHM!r}); checksums not checked"
        )
    cache = CheckpointReader(storage, metadata).headers
    headers = _read_headers(storage, metadata, problems, cache)
    chunks: list[_Chunk] = []
    in_files: dict[str, dict[str, tuple[int, ...]]] = {}  # format 2: each file's own checksums
    if metadata.checksums_in_files and metadata.checksum_chunk_bytes and use_checksums:
        for name in headers:
            try:
                in_files[name] = cache.checksums(name, metadata.checksum_chunk_bytes)
            except (CorruptCheckpointError, OSError) as ex:
                problems.append(_one_line(ex))
    for key, meta in metadata.tensors.items():
        problems.extend(_check_tensor(storage, metadata, key, meta, headers, chunks, use_checksums, in_files))
    problems.extend(_read_everything(storage, chunks, make_progress, num_threads))
    return problems


def verify_hf_checkpoint(path: str) -> list[str] | None:
    """Every problem of the Hugging Face safetensors checkpoint in the directory ``path`` (its
    shards, with or without their index): its headers and index are sound and every tensor's
    bytes are read, in blocks of rows of at most ``_READ_BYTES`` (a row more where one row is
    larger). Its files hold no checksums, so a flipped byte passes.
    ``None`` where ``path`` is no such directory (a single file, a rank file among them, is not
    taken, as ``inspect`` does not take it)."""
    from .detect import detect
    from .hf import HFSource

    try:
        source_class, where = detect(path)
    except (CorruptCheckpointError, OSError):
        return None
    if source_class is not HFSource or where.name is not None:
        return None
    try:
        source = HFSource(where)
        entries = source.entries()
    except (CorruptCheckpointError, OSError) as ex:
        return [_one_line(ex)]
    problems = []
    for key, shape, dtype in entries:
        rows = shape[0] if shape else 1
        row_bytes = math.prod(shape[1:]) * itemsize(dtype)
        step = max(1, _READ_BYTES // max(1, row_bytes))
        try:
            if not shape:
                source.read(key, None)
            for row in range(0, rows if shape else 0, step):
                n = min(step, rows - row)
                source.read(key, ((n, *shape[1:]), (row, *[0] * (len(shape) - 1))))
        except (CorruptCheckpointError, OSError) as ex:
            problems.append(_one_line(ex))
    return problems


def _read_headers(
    storage: Storage, metadata: StorageMetadata, problems: list[str], cache: HeaderCache
) -> dict[str, SafetensorsHeader]:
    """Steps 2 and 3: the header of every listed file that has a sound one."""
    listed = metadata.files()
    good: dict[str, SafetensorsHeader] = {}
    placed: dict[str, set[str]] = {name: set() for name in listed}
    for key, meta in metadata.tensors.items():
        for name in meta.shard_spec_per_file:
            placed[name].add(key)
    for name in listed:
        where = storage.join(name)
        try:
            header = cache.get(name)
            size = storage.size(name)
        except (CorruptCheckpointError, OSError) as ex:
            problems.append(_one_line(ex))
            continue
        good[name] = header
        pos = header.data_start
        for start, end, key in sorted((e.start, e.end, k) for k, e in header.entries.items()):
            if start > pos:
                problems.append(f"{where}: bytes [{pos}, {start}) before tensor {key!r} belong to no tensor")
            pos = max(pos, end)
        if pos < size:
            problems.append(f"{where}: bytes [{pos}, {size}) after the last tensor belong to no tensor")
        for key in sorted(set(header.entries) - placed[name] - {CHECKSUMS_KEY}):
            problems.append(f"{where}: holds tensor {key!r}, which metadata.json does not place in this file")
    try:
        names = storage.list()
    except io.UnsupportedOperation:
        names = []  # read-only storage (http): stray files cannot be looked for
    for name in names:
        if is_rank_filename(name) and name not in placed:
            problems.append(f"{storage.join(name)}: rank file is not listed in metadata.json")
    return good


def _check_tensor(
    storage: Storage,
    metadata: StorageMetadata,
    key: str,
    meta: TensorStorageMetadata,
    headers: dict[str, SafetensorsHeader],
    chunks: list[_Chunk],
    use_checksums: bool,
    in_files: dict[str, dict[str, tuple[int, ...]]] | None = None,
) -> list[str]:
    """Steps 4 and 5 for one tensor; queues the reads of step 6."""
    problems: list[str] = []
    size = itemsize(meta.dtype)
    chunk_bytes = metadata.checksum_chunk_bytes
    all_held = True  # every piece's file holds as many elements as metadata.json says
    for name, spec in meta.shard_spec_per_file.items():
        header = headers.get(name)
        if header is None:  # its problem is reported already
            all_held = False
            continue
        where = storage.join(name)
        entry = header.entries.get(key)
        numel = spec.local_numel
        if entry is None:
            problems.append(f"{where}: tensor {key!r} is in metadata.json but not in the file")
            all_held = False
            continue
        if entry.numel != numel:
            all_held = False
        if entry.dtype != meta.dtype or entry.numel != numel:
            problems.append(
                f"{where}: tensor {key!r} is {entry.dtype} x {entry.numel} in the file "
                f"but {meta.dtype} x {numel} in metadata.json"
            )
            continue
        if len(entry.shape) != 1:
            problems.append(f"{where}: tensor {key!r} is stored with shape {list(entry.shape)}, not flat [{numel}]")
        nbytes = numel * size
        crcs = spec.checksums if use_checksums else None
        if in_files is not None and name in in_files:
            crcs = in_files[name].get(key)
        if crcs is not None:
            want = -(-nbytes // chunk_bytes) if chunk_bytes else None
            if want is None:
                problems.append(f"{where}: tensor {key!r} has checksums but metadata.json has no checksum_chunk_bytes")
                crcs = None
            elif len(crcs) != want:
                problems.append(f"{where}: tensor {key!r} has {len(crcs)} checksums, expected {want} for {nbytes} bytes")
                crcs = None
        step = chunk_bytes if crcs is not None and chunk_bytes else _READ_BYTES
        for i, lo in enumerate(range(0, nbytes, step)):
            hi = min(lo + step, nbytes)
            chunks.append(_Chunk(name, key, i, entry.start + lo, entry.start + hi, crcs[i] if crcs is not None else None))
    if all_held and not stored_cover_exactly(meta, replicas=False):  # else a line says why already
        try:
            ranges = stored_ranges(key, meta)
        except CorruptCheckpointError as ex:
            problems.append(str(ex))
        else:
            problems.extend(_coverage_problems(key, meta.numel, list(zip(meta.shard_spec_per_file, ranges))))
    return problems


def _coverage_problems(key: str, numel: int, pieces: Sequence[tuple[str, Sequence[Range]]]) -> list[str]:
    """Step 5: elements in no piece, or in more than one."""
    found: list[str] = []
    pos, owner = 0, ""
    for start, end, name in sorted((s, e, name) for name, ranges in pieces for s, e in ranges if e > s):
        if start < pos:
            found.append(f"tensor {key!r}: elements [{start}, {min(end, pos)}) are in more than one piece ({owner} and {name})")
        elif start > pos:
            found.append(f"tensor {key!r}: elements [{pos}, {start}) of {numel} are in no file")
        if end > pos:
            pos, owner = end, name
    if pos < numel:
        found.append(f"tensor {key!r}: elements [{pos}, {numel}) of {numel} are in no file")
    if len(found) > _MAX_LINES_PER_TENSOR:
        more = len(found) - _MAX_LINES_PER_TENSOR
        found = found[:_MAX_LINES_PER_TENSOR] + [f"tensor {key!r}: {more} more gaps or overlaps"]
    return found


def _batches(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    """Chunks that follow each other in one file, grouped into reads of at most ``_BATCH_BYTES``."""
    out: list[list[_Chunk]] = []
    for c in sorted(chunks, key=lambda c: (c.file, c.start)):
        last = out[-1] if out else None
        if (
            last is not None
            and last[-1].file == c.file
            and last[-1].end == c.start
            and c.end - last[0].start <= _BATCH_BYTES
        ):
            last.append(c)
        else:
            out.append([c])
    return out


def _read_everything(
    storage: Storage, chunks: list[_Chunk], make_progress: Callable[[int, int], Any] | None, num_threads: int | None
) -> list[str]:
    """Step 6."""
    batches = _batches(chunks)
    bar = make_progress(sum(c.end - c.start for c in chunks), len(chunks)) if make_progress else None
    local = threading.local()

    def check(batch: list[_Chunk]) -> list[str]:
        a, b = batch[0].start, batch[-1].end
        buf = getattr(local, "buf", None)
        if buf is None or len(buf) < b - a:
            buf = local.buf = bytearray(max(b - a, min(_BATCH_BYTES, 1 << 20)))
        view = memoryview(buf)[: b - a]
        where = storage.join(batch[0].file)
        try:
            storage.read_into(batch[0].file, [(a, view)])
        except (OSError, EOFError) as ex:
            keys = sorted({c.key for c in batch})
            return [f"{where}: cannot read bytes [{a}, {b}) (tensors {', '.join(map(repr, keys[:3]))}): {_one_line(ex)}"]
        found = []
        for c in batch:
            if c.expected is not None and crc32c(view[c.start - a : c.end - a]) != c.expected:
                found.append(
                    f"{where}: checksum mismatch in tensor {c.key!r}, chunk {c.index} (file bytes [{c.start}, {c.end}))"
                )
        if bar is not None:
            bar.advance(b - a, len(batch))
        return found

    threads = max(1, min(num_threads or io_threads(), len(batches)))
    try:
        if threads == 1:
            results = [check(batch) for batch in batches]
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="checkpointer-verify") as pool:
                results = list(pool.map(check, batches))
    finally:
        if bar is not None:
            bar.close()
    return [line for found in results for line in found]
