"""Hugging Face safetensors: the one safetensors reader of the tools (``lazy_load``, ``convert``).

:class:`HFSource` reads, on any storage backend:

- a directory with ``model.safetensors.index.json`` (its ``weight_map`` names the shards; the
  index is the authority on which keys there are);
- a single safetensors file, recognised by its first bytes whatever its name;
- a directory holding ``model.safetensors``, else every other ``.safetensors`` file in it
  (rank files of this library excepted), in name order.

The recipe:

1. the index (if any) is read and validated (:func:`read_hf_index`: plain file names only);
2. every shard's header is read and validated by this library's parser; a key in two shards,
   or listed in the index but not in its shard, is refused;
3. each tensor is located, :meth:`HFSource.locate`: its file and the byte range of its data
   (a :class:`StoredTensor`), so a range reader can read just part of it;
4. reads (:meth:`HFSource.fetch`, or a :class:`~checkpointer.tools.sources.LazyTensor`'s
   ``read(box)``) fetch only the box's bytes, a few strided runs however many rows.

Symlinks that leave a local directory (the Hugging Face cache links ``snapshots/<rev>/*`` to
``blobs/``) are followed; names in the index were checked plain first.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..engine.checks import HeaderCache, read_small_file
from ..engine.reads import ReadJob, execute_reads
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..format.dtypes import dtype_from_code
from ..format.layout import check_filename, is_rank_filename
from ..format.metadata_parse import reject_duplicate_keys
from ..format.safetensors_header import MAX_HEADER_BYTES, PREFIX_BYTES, HeaderEntry
from ..planning.load_plan import whole_file_plan
from ..planning.pieces import Piece
from ..storage.base import Storage
from ..storage.local import LocalStorage
from .export import INDEX_NAME
from .sources import Box, Entry, LazyTensor, TensorSource, Where, read_box

__all__ = [
    "HFSource",
    "StoredTensor",
    "read_hf_index",
    "resolve",
    "check_shard",
    "has_file",
    "looks_like_safetensors",
    "INDEX_NAME",
    "SINGLE_NAME",
    "MAX_INDEX_BYTES",
]

SINGLE_NAME = "model.safetensors"
MAX_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: ``[start, end)`` of ``file`` in ``storage``, row-major,
    ``dtype`` (a safetensors code) and ``shape`` as the header says."""

    key: str
    storage: Storage
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    data_start: int = 0
    """Where the file's data area begins: its header is bytes ``[0, data_start)``."""

    @property
    def url(self) -> str:
        """The file's URL."""
        return self.storage.join(self.file)


class HFSource(TensorSource):
    """The tensors of Hugging Face safetensors (see the module docstring), read one at a time.

    Example::

        src = open_source("hf_out/")          # an HFSource
        for key, shape, dtype in src.entries():
            t = src.fetch(key)
        src.locate(key).start                 # where its bytes begin in src.locate(key).file
    """

    format = "hf"
    looks_for = f"{INDEX_NAME}, {SINGLE_NAME} or other .safetensors files (Hugging Face)"

    @classmethod
    def supports(cls, where: Where) -> bool:
        if where.name is not None:
            return looks_like_safetensors(where.storage, where.name)
        storage = where.storage
        if has_file(storage, INDEX_NAME) or has_file(storage, SINGLE_NAME):
            return True
        return bool(_listed_safetensors(storage))

    def __init__(self, where: Where, *, wanted: Callable[[str], bool] | None = None, **_options: object):
        """Read the index and the headers of ``where``'s files; with ``wanted``, an index's shards
        that hold no key it accepts are not opened (their keys are in :attr:`all_keys` only)."""
        self.aliases: dict[str, str] = {}
        self.skipped: list[str] = []
        storage = where.storage
        self.url = where.shown
        index: dict[str, list[str]] | None = None
        if where.name is not None:
            files = [where.name]
        elif has_file(storage, INDEX_NAME):
            index = read_hf_index(*resolve(storage, INDEX_NAME), where=storage.join(INDEX_NAME))
            files = list(index)
        elif has_file(storage, SINGLE_NAME):
            files = [SINGLE_NAME]
        else:
            files = _listed_safetensors(storage)
            if not files:
                raise CorruptCheckpointError(f"{storage.url}: no {INDEX_NAME} and no .safetensors file")
        what = "safetensors file" if index is None else f"shard listed in {INDEX_NAME}"
        self.all_keys: list[str] | None = None
        if index is not None:
            self.all_keys = [k for keys in index.values() for k in keys]
            if wanted is not None:
                files = [name for name in files if any(wanted(k) for k in index[name])]
        self._headers: dict[str, HeaderCache] = {}
        self._stored: dict[str, StoredTensor] = {}
        for name in files:
            file_storage, file_name = resolve(storage, name)
            if index is not None:
                check_shard(file_storage, file_name, storage.join(name))
            headers = self._headers.setdefault(file_storage.url, HeaderCache(file_storage, what=what))
            header = headers.get(file_name)
            entries = header.entries
            wanted = index[name] if index is not None else list(entries)
            missing = [k for k in wanted if k not in entries]
            if missing:
                raise CorruptCheckpointError(
                    f"{storage.join(name)}: tensors {missing[:5]} are listed in the index but not in the file"
                )
            for key in sorted(wanted, key=lambda k: entries[k].start):
                if key in self._stored:
                    raise CorruptCheckpointError(f"{storage.join(name)}: tensor {key!r} is also in {self._stored[key].url}")
                self._stored[key] = _stored(key, file_storage, file_name, entries[key], header.data_start)

    def keys(self) -> list[str]:
        """Every key the checkpoint holds: the index's (shards not opened included), else the files'."""
        return list(self._stored) if self.all_keys is None else list(self.all_keys)

    @property
    def files(self) -> list[str]:
        """The URL of every file read, in order."""
        return list(dict.fromkeys(s.url for s in self._stored.values()))

    def locate(self, key: str) -> StoredTensor:
        """Where ``key``'s bytes are (see :class:`StoredTensor`)."""
        return self._stored[key]

    def entries(self) -> list[Entry]:
        return [(key, s.shape, s.dtype) for key, s in self._stored.items()]

    def fetch(self, key: str) -> torch.Tensor:
        return self.read(key, None)

    def read(self, key: str, box: Box | None) -> torch.Tensor:
        """A fresh tensor holding ``box`` of ``key`` (all of it for ``None``): only its bytes are read."""
        stored = self._stored[key]

        def read_piece(piece: Piece, flat: torch.Tensor) -> None:
            plan = whole_file_plan(key, stored.dtype, stored.shape, stored.file, piece)
            headers = self._headers[stored.storage.url]
            execute_reads(headers.storage, [ReadJob(plan, flat, {stored.file: _numel(stored)})], headers=headers)

        return read_box(stored.shape, dtype_from_code(stored.dtype), box, read_piece)

    def tensors(self) -> Iterator[LazyTensor]:
        for key, stored in self._stored.items():

            def read(box: Box | None, key: str = key) -> torch.Tensor:
                return self.read(key, box)

            yield LazyTensor(key, stored.shape, dtype_from_code(stored.dtype), read)


def _stored(key: str, storage: Storage, name: str, entry: HeaderEntry, data_start: int) -> StoredTensor:
    return StoredTensor(key, storage, name, entry.dtype, tuple(entry.shape), entry.start, entry.end, data_start)


def _numel(stored: StoredTensor) -> int:
    return math.prod(stored.shape)


def check_shard(storage: Storage, name: str, shown: str, index_name: str = INDEX_NAME) -> None:
    """Refuse a shard listed in ``index_name`` that is missing (``shown``: its name for messages)."""
    try:
        exists = storage.exists(name)
    except OSError as ex:
        raise CorruptCheckpointError(f"{shown}: cannot check the shard ({ex})") from ex
    if not exists:
        raise CorruptCheckpointError(f"{shown}: shard listed in {index_name} is missing")


_NUMBERED_SHARD = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors")


def _listed_safetensors(storage: Storage) -> list[str]:
    """The ``.safetensors`` files of a directory without an index. Shards numbered ``-i-of-n``
    must all be there: an export or a download cut short leaves some, and reading those alone
    would drop the others' tensors silently."""
    try:
        names = storage.list()
    except (OSError, NotImplementedError):  # http(s) cannot list
        return []
    files = sorted(n for n in names if n.endswith(".safetensors") and not is_rank_filename(n))
    series: dict[tuple[str, str, int], set[int]] = {}
    for name in files:
        numbered = _NUMBERED_SHARD.fullmatch(name)
        if numbered:
            stem, number, total = numbered.groups()
            series.setdefault((stem, total, len(number)), set()).add(int(number))
    for (stem, total, width), numbers in series.items():
        absent = [i for i in range(1, min(int(total), 100_000) + 1) if i not in numbers]
        if absent:
            raise IncompleteCheckpointError(
                f"{storage.join(f'{stem}-{absent[0]:0{width}d}-of-{total}.safetensors')} is missing "
                f"({len(absent)} of the {int(total)} shards, and no {INDEX_NAME}): an export or a download cut short?"
            )
    return files


def read_hf_index(storage: Storage, index_name: str, *, where: str | None = None) -> dict[str, list[str]]:
    """Validate a Hugging Face index (``model.safetensors.index.json`` or
    ``pytorch_model.bin.index.json``): ``{filename: [keys]}``, files in name order."""
    where = where or storage.join(index_name)
    data = read_small_file(storage, index_name, limit=MAX_INDEX_BYTES, what="index")
    try:
        raw = json.loads(data, object_pairs_hook=reject_duplicate_keys)
    except (ValueError, RecursionError, UnicodeDecodeError) as ex:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({ex})") from ex
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptCheckpointError(f"{where}: expected an object with a \"weight_map\" of key -> file name")
    files: dict[str, list[str]] = {}
    for key, filename in weight_map.items():
        try:
            check_filename(filename)
        except CorruptCheckpointError as ex:
            raise CorruptCheckpointError(
                f"{where}: weight_map maps {key!r} to {filename!r}, which is not a plain file name inside the directory"
            ) from ex
        files.setdefault(filename, []).append(key)
    return dict(sorted(files.items()))


def has_file(storage: Storage, name: str) -> bool:
    """Whether the directory ``storage`` holds ``name`` (a local symlink counts; so does a local
    name that is not a regular file, for reading it to refuse it by name)."""
    if isinstance(storage, LocalStorage):
        return os.path.exists(os.path.join(storage.root, name))
    return storage.exists(name)


def resolve(storage: Storage, name: str) -> tuple[Storage, str]:
    """Where to read ``name`` of a local directory from, following a symlink that leaves it
    (the Hugging Face cache's ``blobs/``); other storages as they are."""
    if not isinstance(storage, LocalStorage):
        return storage, name
    root = os.path.realpath(storage.root)
    real = os.path.realpath(os.path.join(storage.root, name))
    if os.path.dirname(real) == root:
        return storage, name
    return LocalStorage(os.path.dirname(real)), os.path.basename(real)


def looks_like_safetensors(storage: Storage, name: str) -> bool:
    """Whether the file ``name`` starts with a plausible safetensors header (length, then ``{``)."""
    size = storage.size(name)
    head = storage.read(name, 0, min(size, 16))
    if len(head) < PREFIX_BYTES + 1:
        return False
    (n,) = struct.unpack("<Q", head[:PREFIX_BYTES])
    return 2 <= n <= min(MAX_HEADER_BYTES, size - PREFIX_BYTES) and head[PREFIX_BYTES : PREFIX_BYTES + 1] == b"{"
