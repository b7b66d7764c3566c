"""This library's checkpoints as a tensor source: whole tensors read one at a time (checksums
checked) for an export or a conversion (:class:`CheckpointTensors`), and boxes of them for
``lazy_load`` (:class:`OursSource`, the format ``open_source`` picks for a directory holding
``metadata.json``, or ``model/metadata.json`` as ``save_model_and_optim_state`` and OLMo-core
write it)."""

from __future__ import annotations

import os
import math
from typing import Iterator, Sequence

import torch

from ..format.dtypes import dtype_from_code
from ..format.metadata import StorageMetadata
from ..format.layout import METADATA_FILENAME
from ..storage.base import Storage
from ..storage.local import LocalStorage
from ..engine.load import read_metadata
from ..engine.locate import PARTS, model_checkpoint
from ..engine.reader import CheckpointReader, new_tensor
from .sources import Box, Entry, LazyTensor, TensorSource, Where, box_piece

__all__ = ["CheckpointTensors", "OursSource", "Staging"]


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
        self.verify = verify
        self._staging = Staging() if reuse_memory else None

    def entries(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [(key, tuple(meta.shape), meta.dtype) for key, meta in self.metadata.tensors.items()]

    def fetch(self, key: str) -> torch.Tensor:
        allocate = self._staging.take if self._staging else new_tensor
        return self.reader.full(key, verify=self.verify, allocate=allocate)

    def fetch_streaming(self, key: str) -> tuple[torch.Tensor, Iterator[int]]:
        """Like :meth:`fetch`, reading in blocks on a thread (see :meth:`CheckpointReader.stream`)."""
        allocate = self._staging.take if self._staging else new_tensor
        return self.reader.stream(key, verify=self.verify, allocate=allocate)


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
