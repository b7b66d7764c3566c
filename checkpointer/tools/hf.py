"""Reading Hugging Face safetensors: one ``.safetensors`` file, or a directory of shards with
``model.safetensors.index.json`` (or a single ``model.safetensors``), on any storage backend.

Headers are parsed and validated by this library's own parser; each tensor's bytes are read
straight into its memory with one ranged read.
"""

from __future__ import annotations

import torch

from ..buffers import memoryview_of
from .export import INDEX_NAME
from .lazy_sources import read_hf_index
from ..engine.checks import HeaderCache
from ..errors import CorruptCheckpointError
from ..format.dtypes import dtype_from_code
from ..format.layout import is_rank_filename
from ..storage import open_storage
from ..storage.base import Storage
from ..storage.urls import split_path

__all__ = ["HFTensors", "is_hf"]

def is_hf(url: str, names: set[str]) -> bool:
    """Whether ``url`` (a file, or a directory holding ``names``) looks like Hugging Face safetensors."""
    if str(url).endswith(".safetensors"):
        return True
    return INDEX_NAME in names or any(n.endswith(".safetensors") and not is_rank_filename(n) for n in names)


class HFTensors:
    """The tensors of a Hugging Face safetensors file or directory, read one at a time.

    Example::

        src = HFTensors("hf_out/")
        for key, shape, dtype in src.entries():
            t = src.fetch(key)
    """

    @property
    def aliases(self) -> dict[str, str]:
        """Safetensors files name tied tensors once: there are no aliases to report."""
        return {}

    def __init__(self, url: str | Storage):
        if isinstance(url, str) and url.endswith(".safetensors"):
            parent, name = split_path(url)  # a URL's name is decoded
            self.storage = open_storage(parent)
            files = [name]
            self._index = None
        else:
            self.storage = open_storage(url)
            files = self._files()
        self.url = self.storage.url
        what = "safetensors file" if self._index is None else f"shard listed in {INDEX_NAME}"
        self._headers = HeaderCache(self.storage, what=what)
        self._where: dict[str, str] = {}
        order: list[tuple[str, int, str]] = []
        for name in files:
            header = self._headers.get(name)
            for key, entry in header.entries.items():
                if key in self._where:
                    raise CorruptCheckpointError(f"{self.storage.join(name)}: tensor {key!r} is also in {self._where[key]}")
                self._where[key] = name
                order.append((name, entry.start, key))
        if self._index is not None:
            for key, name in self._index.items():
                if self._where.get(key) != name:
                    raise CorruptCheckpointError(f"{self.storage.join(INDEX_NAME)}: tensor {key!r} is not in {name}")
        self._order = [key for _, _, key in sorted(order, key=lambda o: (files.index(o[0]), o[1]))]

    def _files(self) -> list[str]:
        self._index: dict[str, str] | None = None
        if self.storage.exists(INDEX_NAME):
            files = read_hf_index(self.storage, INDEX_NAME)
            self._index = {key: name for name, keys in files.items() for key in keys}
            return list(files)
        names = [n for n in self.storage.list() if n.endswith(".safetensors") and not is_rank_filename(n)]
        if "model.safetensors" in names:
            return ["model.safetensors"]
        if not names:
            raise CorruptCheckpointError(f"{self.storage.url}: no {INDEX_NAME} and no .safetensors file")
        return sorted(names)

    def entries(self) -> list[tuple[str, tuple[int, ...], str]]:
        out = []
        for key in self._order:
            entry = self._headers.get(self._where[key]).entries[key]
            out.append((key, entry.shape, entry.dtype))
        return out

    def fetch(self, key: str) -> torch.Tensor:
        name = self._where[key]
        entry = self._headers.get(name).entries[key]
        out = torch.empty(entry.shape, dtype=dtype_from_code(entry.dtype))
        if out.numel():
            try:
                self.storage.read_into(name, [(entry.start, memoryview_of(out.view(-1)))])
            except (FileNotFoundError, EOFError) as ex:  # other OSErrors are I/O failures, not damage
                raise CorruptCheckpointError(f"{self.storage.join(name)}: cannot read tensor {key!r}: {ex}") from ex
        return out
