"""Helpers of the lazy-loading tests: a storage that counts what it reads, and writers of each format."""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from safetensors.torch import save_file

from checkpointer.storage.base import ReadRequest
from checkpointer.storage.local import LocalStorage


class CountingStorage(LocalStorage):
    """A local directory that records its reads: ``reads`` (whole-range ``read``: headers,
    metadata) and ``data_reads`` (``read_into``, ``read_runs`` and ``mapped``: tensor bytes),
    each ``(name, offset, nbytes)``; a mapped block counts whole."""

    def __init__(self, root: str):
        super().__init__(root)
        self.reads: list[tuple[str, int, int]] = []
        self.data_reads: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def child(self, name: str) -> CountingStorage:
        return CountingStorage(os.path.join(self.root, name))

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        data = super().read(name, start, end)
        with self._lock:
            self.reads.append((name, start, len(data)))
        return data

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        super().read_into(name, requests)
        with self._lock:
            self.data_reads.extend((name, off, len(buf)) for off, buf in requests)

    def read_runs(self, name, file_offsets, addresses, length) -> None:
        super().read_runs(name, file_offsets, addresses, length)
        with self._lock:  # one entry per call: the bytes that reached the destination
            self.data_reads.append((name, int(file_offsets[0]), len(file_offsets) * length))

    @contextmanager
    def mapped(self, name: str, start: int, nbytes: int) -> Iterator[memoryview | None]:
        with super().mapped(name, start, nbytes) as view:
            if view is not None:
                with self._lock:
                    self.data_reads.append((name, start, nbytes))
            yield view

    def data_bytes(self) -> int:
        return sum(n for _, _, n in self.data_reads)

    def all_bytes(self) -> int:
        return self.data_bytes() + sum(n for _, _, n in self.reads)


def reference_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Uneven shapes and several dtypes: every TP size below splits something unevenly."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(11, 6, generator=g),
        "proj.weight": torch.randn(7, 13, generator=g).to(torch.bfloat16),
        "proj.bias": torch.randn(7, generator=g),
        "tiny": torch.randn(2, 9, generator=g),
        "ids": torch.randint(-1000, 1000, (5, 3, 4), generator=g),
        "mask": torch.rand(6, 4, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def write_hf_index(directory: str, state: dict[str, torch.Tensor], files: int = 3, *, binary: bool = False) -> None:
    """A Hugging Face directory: ``files`` shards and their index."""
    os.makedirs(directory, exist_ok=True)
    keys = list(state)
    weight_map: dict[str, str] = {}
    for i in range(files):
        part = {k: state[k].contiguous() for k in keys[i::files]}
        ext = "bin" if binary else "safetensors"
        prefix = "pytorch_model" if binary else "model"
        name = f"{prefix}-{i + 1:05d}-of-{files:05d}.{ext}"
        if binary:
            torch.save(part, os.path.join(directory, name))
        else:
            save_file(part, os.path.join(directory, name))
        weight_map.update({k: name for k in part})
    index = "pytorch_model.bin.index.json" if binary else "model.safetensors.index.json"
    with open(os.path.join(directory, index), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def expected_slice(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """``torch.chunk(full, tp_size, dim)[tp_rank]``, empty past the last chunk."""
    if dim is None or tp_size == 1:
        return full
    chunks = torch.chunk(full, tp_size, dim)
    if tp_rank < len(chunks):
        return chunks[tp_rank]
    return full.narrow(dim, full.shape[dim], 0)


def slice_span_bytes(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> int:
    """Bytes from the first to one past the last stored element of a matrix's slice: what a read
    of it takes, the slice's own bytes for rows and its span for columns (short runs with short
    gaps are read as their span, as a ``preadv`` of the runs reads the gaps too)."""
    part = expected_slice(full, dim, tp_rank, tp_size)
    if dim is None or dim == 0 or part.numel() == 0 or full.dim() == 1:
        return part.numel() * full.element_size()
    rows, cols = full.shape
    return ((rows - 1) * cols + part.shape[1]) * full.element_size()
