"""One opened checkpoint directory: its storage, its metadata and its rank files' headers.

Every reader of this library's checkpoints goes through a :class:`CheckpointReader`: a load
plans and fills pieces with it, ``unshard`` and the export read full tensors, ``lazy_load``
reads boxes, the optimizer load reads its small tensors. Each header is read once per reader,
every read goes straight into its destination (strided boxes through bounded staging blocks),
an export streams whole tensors block by block while it writes them,
and nothing is allocated before the files are known to hold what ``metadata.json`` claims.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, Mapping, Sequence

import torch

from ..buffers import memoryview_of
from ..errors import CorruptCheckpointError
from ..format.dtypes import dtype_from_code, itemsize
from ..format.metadata import StorageMetadata, TensorStorageMetadata
from ..planning.overlap import SourceIndex
from ..planning.pieces import Piece
from ..planning.load_plan import TensorLoadPlan, build_load_plan, stored_cover_exactly, stored_ranges
from ..planning.pieces import whole
from ..storage.base import Storage
from .checks import HeaderCache, check_files_hold, piece_files, verify_chunk_bytes
from .reads import ReadJob, check_chunk, execute_reads, verify_reads

__all__ = ["CheckpointReader", "HEADER_BYTES_FIELD", "header_bytes_of"]

HEADER_BYTES_FIELD = "header_bytes"
"""An extra field of metadata built in memory, never written: ``{file: header size}`` of files
whose headers were read already (a Hugging Face checkpoint described by rank 0), so that each
rank reads a header in one exact read."""


def header_bytes_of(metadata: StorageMetadata) -> dict[str, int] | None:
    """The :data:`HEADER_BYTES_FIELD` of ``metadata`` when it is well formed, else None (a hint:
    a wrong size costs one more read, never a wrong header)."""
    hint = (metadata.model_extra or {}).get(HEADER_BYTES_FIELD)
    if isinstance(hint, dict) and all(isinstance(k, str) and type(v) is int and v >= 8 for k, v in hint.items()):
        return hint
    return None

Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""Memory for a whole tensor of a shape and dtype (a new tensor, or a reused buffer)."""


_STREAM_BLOCK = 4 << 20


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class CheckpointReader:
    """Reads from one checkpoint directory, whose ``metadata.json`` was read already.

    Example::

        reader = CheckpointReader(storage, read_metadata(storage, no_dist=True))
        full = reader.full("layers.0.w")                 # a whole tensor
        part = reader.piece("layers.0.w", Piece(local_shape=(8, 4), global_offset=(0, 4)))
    """

    def __init__(self, storage: Storage, metadata: StorageMetadata, *, num_threads: int | None = None):
        self.storage = storage
        self.metadata = metadata
        self.headers = HeaderCache(storage, metadata.file_ids, header_bytes=header_bytes_of(metadata))
        self.num_threads = num_threads

    def meta(self, key: str) -> tuple[str, TensorStorageMetadata]:
        """The saved key (a tied key resolves to the one it shares memory with) and its metadata."""
        saved = (self.metadata.aliases or {}).get(key, key)
        return saved, self.metadata.tensors[saved]

    def plan(self, key: str, piece: Piece) -> TensorLoadPlan:
        saved, meta = self.meta(key)
        return build_load_plan(saved, meta, piece)

    def job(self, plan: TensorLoadPlan, dest: torch.Tensor) -> ReadJob:
        """A read of ``plan`` into ``dest`` (flat, contiguous, on the CPU), with the file sizes and
        checksums of just the files it reads."""
        numels, crcs = piece_files(self.headers, self.metadata, plan.key, plan.files)
        return ReadJob(plan, dest, numels, crcs)

    def read(self, jobs: Sequence[ReadJob], *, verify: bool = False) -> None:
        """Fill the jobs' destinations; with ``verify``, every checksum chunk they touch is checked."""
        execute_reads(
            self.storage,
            jobs,
            headers=self.headers,
            num_threads=self.num_threads,
            verify_chunk_bytes=self._chunk(verify),
            map_pages=True,  # rank files a save wrote
        )

    def piece(self, key: str, piece: Piece, *, verify: bool = False) -> torch.Tensor:
        """A new tensor holding ``piece`` of ``key`` (a box keeps its shape; flattened ranges are 1-D)."""
        saved, meta = self.meta(key)
        check_files_hold(self.headers, saved, meta)  # before allocating what metadata.json claims
        shape = piece.local_shape if piece.flat is None else (piece.numel,) if meta.shape else ()
        dest = torch.empty(shape, dtype=dtype_from_code(meta.dtype))  # type: ignore[arg-type]
        if dest.numel():
            self.read([self.job(build_load_plan(saved, meta, piece), dest.view(-1))], verify=verify)
        return dest

    def full(self, key: str, *, verify: bool = False, allocate: Allocate = new_tensor) -> torch.Tensor:
        """The whole tensor ``key``, in memory from ``allocate(shape, dtype)`` (a reused buffer, say)."""
        return self.full_tensors([key], verify=verify, allocate=allocate)[key]

    def full_tensors(
        self, keys: Sequence[str], *, verify: bool = False, allocate: Allocate = new_tensor
    ) -> dict[str, torch.Tensor]:
        """Whole tensors of ``keys``, read by this process alone (no collectives), in one pool.

        Every piece is checked against its file's header before ``allocate(shape, dtype)`` is
        called, so a hostile ``metadata.json`` cannot make this allocate more than the files hold.
        """
        result: dict[str, torch.Tensor] = {}
        jobs = []
        for key in keys:
            saved, meta = self.meta(key)
            self.check_whole(saved, meta)
            dest = result[key] = allocate(tuple(meta.shape), dtype_from_code(meta.dtype))
            if meta.numel:
                jobs.append(self.job(build_load_plan(saved, meta, whole(meta.shape)), dest.view(-1)))
        with torch.no_grad():
            self.read(jobs, verify=verify)
        return result

    def stream(
        self, key: str, *, verify: bool = False, allocate: Allocate = new_tensor
    ) -> tuple[torch.Tensor, Iterator[int]]:
        """The whole tensor ``key``, read in blocks of 4 MiB on a thread: returns the tensor at
        once and an iterator of how many of its bytes are ready, so that the caller writes them
        out while the rest is read (an export). With ``verify``, every checksum is checked before
        the iterator ends, which raises on a mismatch; a chunk as soon as its block is read where
        each file's piece is one run of the tensor."""
        key, meta = self.meta(key)
        dtype = dtype_from_code(meta.dtype)
        check_files_hold(self.headers, key, meta)
        full = allocate(tuple(meta.shape), dtype)
        if not meta.numel:
            return full, iter(())
        flat, size, chunk = full.view(-1), itemsize(meta.dtype), self._chunk(verify)
        numels, crcs = piece_files(self.headers, self.metadata, key, list(meta.shard_spec_per_file))
        step = max(1, _STREAM_BLOCK // size)
        ready: queue.Queue[int | BaseException | None] = queue.Queue()
        whole_plan = build_load_plan(key, meta, [(0, meta.numel)])
        checks = _streamed_checks(self.storage, whole_plan, numels, crcs, size, chunk) if chunk else []
        view = memoryview_of(flat)

        def produce() -> None:
            try:
                checked = 0
                for start in range(0, meta.numel, step):
                    end = min(start + step, meta.numel)
                    job = ReadJob(build_load_plan(key, meta, [(start, end)]), flat[start:end], numels, crcs)
                    execute_reads(self.storage, [job], headers=self.headers, num_threads=self.num_threads, map_pages=True)
                    ready.put(end * size)
                    # Chunks that this block completed, hashed while they are recent in the cache.
                    while checks and checked < len(checks) and checks[checked][0] <= end * size:
                        hi, lo, expected, where = checks[checked]
                        check_chunk(self.storage, where, view[lo:hi], expected)
                        checked += 1
                if checks is None:
                    job = ReadJob(whole_plan, flat, numels, crcs)
                    verify_reads(self.storage, [job], headers=self.headers, chunk_bytes=chunk)  # type: ignore[arg-type]
                ready.put(None)
            except BaseException as ex:  # noqa: BLE001 - raised by the consumer
                ready.put(ex)

        def progress() -> Iterator[int]:
            worker = threading.Thread(target=produce, name="checkpointer-stream-read", daemon=True)
            worker.start()
            try:
                while (item := ready.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                worker.join()

        return full, progress()

    def check_whole(self, key: str, meta: TensorStorageMetadata) -> None:
        """Before a full ``key`` is allocated: the files hold its pieces, and the pieces cover it.

        The headers come first: a piece is only expanded into ranges (when its boxes cannot be
        proven to tile the tensor) once its file is known to hold that many elements, so a
        hostile shape in ``metadata.json`` costs nothing before it is refused.
        """
        check_files_hold(self.headers, key, meta)
        if stored_cover_exactly(meta):
            return
        files = list(meta.shard_spec_per_file)
        index = SourceIndex(stored_ranges(key, meta))
        if index.conflict is not None:
            a, b = sorted(index.conflict)
            raise CorruptCheckpointError(f"tensor {key!r}: the pieces in {files[a]} and {files[b]} overlap")
        if index.covered() != meta.numel:
            raise CorruptCheckpointError(f"tensor {key!r}: the files hold {index.covered()} of its {meta.numel} elements")

    def _chunk(self, verify: bool) -> int | None:
        return verify_chunk_bytes(self.storage, self.metadata, verify)


def _streamed_checks(
    storage: Storage, plan: TensorLoadPlan, numels: dict[str, int], crcs: Mapping, size: int, chunk: int
) -> list[tuple[int, int, int, tuple[str, str, int]]] | None:
    """The checksummed chunks of a whole-tensor read as ``(end, start, crc, where)`` in bytes of
    the destination, by end; ``None`` when some file's piece is not one run of the destination
    (box shards split along a later dimension): those are checked after the reads."""
    per_file: dict[str, list] = {}
    for item in plan.items:
        per_file.setdefault(item.file, []).append(item)
    checks = []
    for name, items in per_file.items():
        expected = crcs.get(name)
        if expected is None:
            continue
        if len(items) != 1 or items[0].sizes or items[0].src_offset != 0 or items[0].numel != numels[name]:
            return None
        piece_bytes, d = numels[name] * size, items[0].dst_offset * size
        count = -(-piece_bytes // chunk)
        if len(expected) < count:
            raise CorruptCheckpointError(f"{storage.join(name)}: tensor {plan.key!r} has too few checksums")
        for c in range(count):
            lo, hi = c * chunk, min((c + 1) * chunk, piece_bytes)
            checks.append((d + hi, d + lo, expected[c], (name, plan.key, c)))
    checks.sort()
    return checks
