"""This library's checkpoints as a tensor source: whole tensors read one at a time (checksums
checked) for an export or a conversion (:class:`CheckpointTensors`), and boxes of them for
``lazy_load`` (:class:`OursSource`, the format ``open_source`` picks for a directory holding
``metadata.json``, or ``model/metadata.json`` as ``save_model_and_optim_state`` and OLMo-core
write it)."""

from __future__ import annotations

import os
import queue
import threading
import math
from typing import Iterator, Sequence

import torch

from ..errors import CorruptCheckpointError
from ..buffers import memoryview_of
from ..format.dtypes import dtype_from_code, itemsize
from ..format.metadata import StorageMetadata
from ..planning.load_plan import TensorLoadPlan, build_load_plan
from ..format.layout import METADATA_FILENAME
from ..storage.base import Storage
from ..storage.local import LocalStorage
from ..engine.checks import check_files_hold, piece_files, verify_chunk_bytes
from ..engine.load import read_metadata
from ..engine.locate import PARTS, model_checkpoint
from ..engine.reader import CheckpointReader, new_tensor
from ..engine.reads import ReadJob, check_chunk, execute_reads, verify_reads
from .sources import Box, Entry, LazyTensor, TensorSource, Where, box_piece

__all__ = ["CheckpointTensors", "OursSource", "Staging"]

_STREAM_BLOCK = 4 << 20


class Staging:
    """One reusable host buffer: fresh memory for every tensor costs a page fault per 4 KiB."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the buffer, valid until the next call."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(0, dtype=torch.uint8)  # let the old one go first
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes].view(dtype).view(tuple(shape))


class CheckpointTensors:
    """Whole tensors of one checkpoint directory, read one at a time (checksums checked).

    With ``reuse_memory``, each tensor :meth:`fetch` returns lives in one buffer that the next
    call overwrites: for callers that are done with a tensor before asking for the next.
    """

    def __init__(
        self,
        storage: Storage,
        metadata: StorageMetadata,
        *,
        verify: bool = True,
        num_threads: int | None = None,
        reuse_memory: bool = False,
    ):
        self.storage = storage
        self.metadata = metadata
        self.reader = CheckpointReader(storage, metadata, num_threads=num_threads)
        self.headers = self.reader.headers
        self.verify = verify
        self.verify_chunk = verify_chunk_bytes(storage, metadata, verify)
        self.num_threads = num_threads
        self._staging = Staging() if reuse_memory else None

    def entries(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [(key, tuple(meta.shape), meta.dtype) for key, meta in self.metadata.tensors.items()]

    def fetch(self, key: str) -> torch.Tensor:
        allocate = self._staging.take if self._staging else new_tensor
        return self.reader.full(key, verify=self.verify, allocate=allocate)

    def fetch_streaming(self, key: str) -> tuple[torch.Tensor, Iterator[int]]:
        """Like :meth:`fetch`, reading in blocks on a thread: returns the tensor at once and an
        iterator of how many of its bytes are ready, so the caller writes while the rest is read.
        Checksums are checked before the iterator ends (it raises on a mismatch)."""
        key = (self.metadata.aliases or {}).get(key, key)
        meta = self.metadata.tensors[key]
        dtype = dtype_from_code(meta.dtype)
        check_files_hold(self.headers, key, meta)
        full = self._staging.take(meta.shape, dtype) if self._staging else torch.empty(meta.shape, dtype=dtype)
        if not meta.numel:
            return full, iter(())
        flat, size, specs = full.view(-1), itemsize(meta.dtype), meta.shard_spec_per_file
        numels, crcs = piece_files(self.headers, self.metadata, key, list(specs))  # format 2: in the files
        step = max(1, _STREAM_BLOCK // size)
        ready: queue.Queue[int | BaseException | None] = queue.Queue()

        whole = build_load_plan(key, meta, [(0, meta.numel)])
        checks = _streamed_checks(self.storage, whole, numels, crcs, size, self.verify_chunk) if self.verify_chunk else []
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
                    job = ReadJob(whole, flat, numels, crcs)
                    verify_reads(self.storage, [job], headers=self.headers, chunk_bytes=self.verify_chunk)
                ready.put(None)
            except BaseException as ex:  # noqa: BLE001 - raised by the consumer
                ready.put(ex)

        def progress() -> Iterator[int]:
            worker = threading.Thread(target=produce, name="checkpointer-export-read", daemon=True)
            worker.start()
            try:
                while (item := ready.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                worker.join()

        return full, progress()


def _streamed_checks(
    storage: Storage, plan: TensorLoadPlan, numels: dict[str, int], crcs: dict, size: int, chunk: int
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


class OursSource(TensorSource):
    """A checkpoint directory of this library (or the ``model/`` part of a model and optimizer save)."""

    format = "checkpointer"
    looks_for = f"{METADATA_FILENAME} or model/{METADATA_FILENAME} (checkpointer)"

    @classmethod
    def supports(cls, where: Where) -> bool:
        if where.name is not None:
            return False
        storage = where.storage
        if storage.exists(METADATA_FILENAME) or any(storage.part(p).exists(METADATA_FILENAME) for p in PARTS):
            return True
        model = storage.part("model")  # there, but leading out of the checkpoint: reading it says so
        return isinstance(model, LocalStorage) and os.path.isfile(os.path.join(model.root, METADATA_FILENAME))

    def __init__(self, where: Where, **_options: object):
        storage = where.storage
        root = storage if storage.exists(METADATA_FILENAME) else model_checkpoint(storage)
        self.url = root.url
        self.metadata = read_metadata(root, no_dist=True)
        self.source = CheckpointTensors(root, self.metadata)
        self.aliases = dict(self.metadata.aliases or {})
        self.skipped: list[str] = []

    def entries(self) -> list[Entry]:
        return self.source.entries()

    def fetch(self, key: str) -> torch.Tensor:
        return self.source.fetch(key)

    def tensors(self) -> Iterator[LazyTensor]:
        """Boxes are read from the rank files' bytes (headers checked before allocating)."""
        reader = self.source.reader
        by_target = self.tied_names()
        for key, meta in self.metadata.tensors.items():

            def read(box: Box | None, key: str = key, shape: tuple[int, ...] = tuple(meta.shape)) -> torch.Tensor:
                return reader.piece(key, box_piece(shape, box))

            for name in [key, *by_target.get(key, [])]:
                yield LazyTensor(name, tuple(meta.shape), dtype_from_code(meta.dtype), read)
