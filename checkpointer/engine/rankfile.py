"""Reading and writing one rank's safetensors file: headers, and bytes straight to and from tensor memory."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from ..buffers import memoryview_of
from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize
from ..format.safetensors_header import PREFIX_BYTES, SafetensorsHeader, build_header, header_length, parse_header
from ..planning.plan import TensorLoadPlan
from ..sharding import LocalTensor
from ..storage.base import ReadRequest, Storage

__all__ = ["write_rank_file", "HeaderCache", "execute_reads", "io_threads"]

_SPECULATIVE_HEADER = 1 << 16
_SPLIT_BYTES = 32 << 20


def io_threads() -> int:
    return int(os.environ.get("CHECKPOINTER_IO_THREADS", "4"))


def write_rank_file(storage: Storage, name: str, tensors: Sequence[tuple[str, LocalTensor]]) -> int:
    """Write the local pieces as one safetensors file, streaming from tensor memory. Returns bytes written."""
    header, _ = build_header([(key, lt.dtype, lt.numel) for key, lt in tensors])
    total = len(header)
    with storage.open_writer(name) as writer:
        writer.write([memoryview(header)])
        batch: list[memoryview] = []
        keep: list[torch.Tensor] = []
        for _, lt in tensors:
            data = lt.data
            if data.device.type != "cpu" or not data.is_contiguous():
                data = data.detach().to("cpu", copy=False).contiguous()
            keep.append(data)
            view = memoryview_of(data)
            batch.append(view)
            total += len(view)
            if len(batch) >= 256:
                writer.write(batch)
                batch, keep = [], []
        if batch:
            writer.write(batch)
        writer.commit()
    return total


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


def _byte_requests(
    plan: TensorLoadPlan, dest: memoryview, headers: HeaderCache, expected_numel: dict[str, int]
) -> dict[str, list[ReadRequest]]:
    size = itemsize(plan.dtype)
    out: dict[str, list[ReadRequest]] = {}
    for item in plan.items:
        entry = headers.get(item.file).entries.get(plan.key)
        where = headers.storage.join(item.file)
        if entry is None:
            raise CorruptCheckpointError(f"{where}: tensor {plan.key!r} is in metadata.json but not in the file")
        if entry.dtype != plan.dtype or entry.numel != expected_numel[item.file]:
            raise CorruptCheckpointError(
                f"{where}: tensor {plan.key!r} is {entry.dtype} x {entry.numel} in the file but "
                f"{plan.dtype} x {expected_numel[item.file]} in metadata.json"
            )
        start = entry.start + item.src_offset * size
        buf = dest[item.dst_offset * size : (item.dst_offset + item.numel) * size]
        out.setdefault(item.file, []).append((start, buf))
    return out


def execute_reads(
    storage: Storage,
    jobs: Sequence[tuple[TensorLoadPlan, torch.Tensor, dict[str, int]]],
    *,
    headers: HeaderCache | None = None,
    num_threads: int | None = None,
) -> None:
    """Run load plans. Each job is (plan, flat contiguous CPU destination, piece numel per file).

    Reads for one file are sorted by offset (adjacent ones become one ``preadv``) and split
    into chunks spread over a small thread pool.
    """
    headers = headers or HeaderCache(storage)
    per_file: dict[str, list[ReadRequest]] = {}
    keep = []
    for plan, dest, numel_per_file in jobs:
        keep.append(dest)
        view = memoryview_of(dest)
        for name, reqs in _byte_requests(plan, view, headers, numel_per_file).items():
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
    threads = min(num_threads or io_threads(), len(tasks))
    if threads <= 1:
        for name, reqs in tasks:
            _read(storage, name, reqs)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="checkpointer-read") as pool:
        for future in [pool.submit(_read, storage, name, reqs) for name, reqs in tasks]:
            future.result()


def _read(storage: Storage, name: str, reqs: list[ReadRequest]) -> None:
    try:
        storage.read_into(name, reqs)
    except FileNotFoundError as ex:
        raise CorruptCheckpointError(f"{storage.join(name)}: rank file listed in metadata.json is missing") from ex
    except EOFError as ex:
        raise CorruptCheckpointError(f"{storage.join(name)}: file is truncated ({ex})") from ex
