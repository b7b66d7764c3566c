"""The checkpoint formats :func:`~checkpointer.tools.lazy.lazy_load` reads, one tensor at a time.

Each format gives a sequence of :class:`LazyTensor`: a key, a shape, a dtype and a
``read(box)`` that returns a fresh tensor holding just that box of the full tensor
(``None``: all of it). Safetensors-based formats read only the box's bytes (see
:func:`read_box` for slices along a trailing dimension), through the
:class:`~checkpointer.storage.base.Storage` interface, so local files and remote URLs
behave alike; a torch pickle (``.pt``/``.bin``) is loaded whole (or memory-mapped) and cut.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..format.dtypes import dtype_from_code
from ..format.layout import check_filename
from ..format.metadata import StorageMetadata, reject_duplicate_keys
from ..planning.pieces import Piece
from ..planning.load_plan import whole_file_plan
from ..planning.pieces import whole
from ..storage.base import ReadRequest, Storage, Writer
from ..storage.local import LocalStorage
from ..engine.checks import HeaderCache, read_small_file
from ..engine.reader import CheckpointReader
from ..engine.reads import ReadJob, execute_reads

__all__ = [
    "Box",
    "LazyTensor",
    "read_box",
    "checkpoint_tensors",
    "safetensors_tensors",
    "hf_index_tensors",
    "torch_file_tensors",
    "GatheredReads",
    "MAX_INDEX_BYTES",
    "MAX_NESTING",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(local_shape, global_offset)`` of the part of a tensor to read."""

MAX_INDEX_BYTES = 256 << 20
MAX_NESTING = 100
"""How deeply the mappings of a torch pickle may nest (``{"model": {"layers": ...}}``)."""
_GAP_BYTES = 1 << 20
_SPAN_BYTES = 64 << 20


@dataclass(frozen=True)
class LazyTensor:
    """One tensor of a checkpoint, not read yet."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[Box | None], torch.Tensor]


def box_piece(shape: Sequence[int], box: Box | None) -> Piece:
    """``box`` of a tensor of ``shape`` as a piece to read (all of it for ``None``)."""
    if box is None:
        return whole(shape)
    local, offset = box
    return Piece(local_shape=tuple(local), global_offset=tuple(offset))


def read_box(
    shape: Sequence[int], dtype: torch.dtype, box: Box | None, read_piece: Callable[[Piece, torch.Tensor], None]
) -> torch.Tensor:
    """A fresh tensor holding ``box`` of a stored tensor (all of it for ``None``).

    ``read_piece(piece, flat)`` fills ``flat`` with the elements of ``piece`` in its row-major
    order: a box stays a box, read as a few strided copies however many rows it has."""
    piece = box_piece(shape, box)
    dest = torch.empty(tuple(shape) if box is None else tuple(box[0]), dtype=dtype)
    if dest.numel():
        read_piece(piece, dest.view(-1))
    return dest


# ---------------------------------------------------------------------------------------
# This library's checkpoint directory
# ---------------------------------------------------------------------------------------


def checkpoint_tensors(storage: Storage, metadata: StorageMetadata) -> Iterator[LazyTensor]:
    """The tensors of a checkpoint directory (tied keys after the key they share memory with)."""
    reader = CheckpointReader(storage, metadata)
    aliases: dict[str, list[str]] = {}
    for alias, target in (metadata.aliases or {}).items():
        aliases.setdefault(target, []).append(alias)
    for key, meta in metadata.tensors.items():

        def read(box: Box | None, key: str = key, shape: tuple[int, ...] = tuple(meta.shape)) -> torch.Tensor:
            return reader.piece(key, box_piece(shape, box))  # the files' headers checked before allocating

        for name in [key, *aliases.get(key, [])]:
            yield LazyTensor(name, tuple(meta.shape), dtype_from_code(meta.dtype), read)


# ---------------------------------------------------------------------------------------
# Safetensors files, alone or as the shards of a Hugging Face directory
# ---------------------------------------------------------------------------------------


def safetensors_tensors(storage: Storage, name: str, keys: Sequence[str] | None = None) -> Iterator[LazyTensor]:
    """The tensors of one safetensors file, in file order (only ``keys``, when given).

    The header is read and validated now; the tensors as the iterator advances.
    """
    where = storage.join(name)
    headers = HeaderCache(storage, what="safetensors file")
    entries = headers.get(name).entries
    if keys is not None:
        missing = [k for k in keys if k not in entries]
        if missing:
            raise CorruptCheckpointError(f"{where}: tensors {missing[:5]} are listed in the index but not in the file")
        wanted = set(keys)
        entries = {k: e for k, e in entries.items() if k in wanted}
    return _safetensors_entries(headers, name, sorted(entries.items(), key=lambda kv: kv[1].start))


def _safetensors_entries(headers: HeaderCache, name: str, entries: list[tuple[str, Any]]) -> Iterator[LazyTensor]:
    for key, entry in entries:

        def read_piece(piece: Piece, flat: torch.Tensor, key: str = key, entry: Any = entry) -> None:
            plan = whole_file_plan(key, entry.dtype, entry.shape, name, piece)
            execute_reads(headers.storage, [ReadJob(plan, flat, {name: entry.numel})], headers=headers)

        def read(box: Box | None, entry: Any = entry, read_piece: Any = read_piece) -> torch.Tensor:
            return read_box(entry.shape, dtype_from_code(entry.dtype), box, read_piece)

        yield LazyTensor(key, entry.shape, dtype_from_code(entry.dtype), read)


def hf_index_tensors(
    storage: Storage,
    index_name: str,
    per_file: Callable[[Storage, str, Sequence[str]], Iterator[LazyTensor]],
    resolve: Callable[[Storage, str], tuple[Storage, str]],
) -> Iterator[LazyTensor]:
    """The tensors of a Hugging Face directory sharded by ``index_name``, one file after another.

    The index is read and validated now; each shard's header when the iterator reaches it.
    """
    index_storage, index_file = resolve(storage, index_name)
    return _hf_files(storage, index_name, read_hf_index(index_storage, index_file), per_file, resolve)


def _hf_files(
    storage: Storage,
    index_name: str,
    files: dict[str, list[str]],
    per_file: Callable[[Storage, str, Sequence[str]], Iterator[LazyTensor]],
    resolve: Callable[[Storage, str], tuple[Storage, str]],
) -> Iterator[LazyTensor]:
    for filename, keys in files.items():
        file_storage, file_name = resolve(storage, filename)
        try:
            exists = file_storage.exists(file_name)
        except OSError as ex:
            raise CorruptCheckpointError(f"{storage.join(filename)}: cannot check the shard ({ex})") from ex
        if not exists:
            raise CorruptCheckpointError(f"{storage.join(filename)}: shard listed in {index_name} is missing")
        yield from per_file(file_storage, file_name, keys)


def read_hf_index(storage: Storage, index_name: str) -> dict[str, list[str]]:
    """Validate ``model.safetensors.index.json``: ``{filename: [keys]}``, files in name order."""
    import json

    where = storage.join(index_name)
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


# ---------------------------------------------------------------------------------------
# Torch pickles (.pt / .bin)
# ---------------------------------------------------------------------------------------


def torch_file_tensors(
    storage: Storage, name: str, keys: Sequence[str] | None = None, *, mmap: bool, restrict: bool
) -> Iterator[LazyTensor]:
    """The tensors of a ``torch.save`` file: loaded whole now (``mmap``: mapped), cut when read.

    Nested mappings (up to :data:`MAX_NESTING` deep) are flattened with ``.`` (``{"model": {"w": t}}`` gives ``model.w``);
    values that are neither tensors nor mappings are skipped.
    """
    where = storage.join(name)
    obj = _torch_load(storage, name, where, mmap=mmap, restrict=restrict)
    if not isinstance(obj, Mapping):
        raise CorruptCheckpointError(f"{where}: holds a {type(obj).__name__}, not a state dict")
    flat: dict[str, torch.Tensor] = {}
    _flatten(obj, "", flat, where)
    del obj
    if keys is not None:
        missing = [k for k in keys if k not in flat]
        if missing:
            raise CorruptCheckpointError(f"{where}: tensors {missing[:5]} are listed in the index but not in the file")
        flat = {k: flat[k] for k in keys}
    return _torch_entries(flat)


def _torch_entries(flat: dict[str, torch.Tensor]) -> Iterator[LazyTensor]:
    for key in list(flat):
        tensor = flat.pop(key)  # the file's memory goes as the caller drops what it was given

        def read(box: Box | None, tensor: torch.Tensor = tensor) -> torch.Tensor:
            if box is None:
                return tensor
            part = tensor
            for dim, (size, offset) in enumerate(zip(*box)):
                if size != tensor.shape[dim]:
                    part = part.narrow(dim, offset, size)
            return part.clone(memory_format=torch.contiguous_format) if part.numel() < tensor.numel() else part

        yield LazyTensor(key, tuple(tensor.shape), tensor.dtype, read)
        del tensor, read


def _torch_load(storage: Storage, name: str, where: str, *, mmap: bool, restrict: bool) -> Any:
    if isinstance(storage, LocalStorage):
        source: Any = os.path.join(storage.root, name)
    else:
        source = io.BytesIO(storage.read(name))  # a pickle is read whole anyway; no mmap remotely
        mmap = False
    try:
        if restrict:
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
        # restrict=False is the caller's explicit choice to trust this file (API.md, lazy_load).
        return torch.load(source, map_location="cpu", weights_only=False, mmap=mmap)
    except OSError as ex:
        if not _is_bad_archive(ex):
            raise
        raise CorruptCheckpointError(f"{where}: not a readable torch checkpoint (a damaged or truncated zip archive)") from ex
    except MemoryError:
        raise
    except Exception as ex:  # noqa: BLE001 - any failure to unpickle is a bad file
        first_line = str(ex).strip().splitlines()[0] if str(ex).strip() else ""
        refused = restrict and isinstance(ex, pickle.UnpicklingError)
        hint = " (weights_only=True refuses pickled objects other than tensors and builtins)" if refused else ""
        raise CorruptCheckpointError(
            f"{where}: cannot load the torch checkpoint{hint}: {type(ex).__name__}: {first_line[:300]}"
        ) from ex


def _is_bad_archive(ex: OSError) -> bool:
    """torch's zip reader says EINVAL, naming no file, when the archive's directory is cut off."""
    return ex.errno == errno.EINVAL and ex.filename is None


def _flatten(obj: Mapping[Any, Any], prefix: str, out: dict[str, torch.Tensor], where: str, depth: int = 1) -> None:
    if depth > MAX_NESTING:  # a hostile file (or a mapping holding itself) would exhaust the stack
        raise CorruptCheckpointError(f"{where}: state dict nests mappings more than {MAX_NESTING} deep")
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            if key in out:  # {"a.b": x, "a": {"b": y}}: one would silently replace the other
                raise CorruptCheckpointError(f"{where}: two tensors flatten to the key {key!r}")
            out[key] = v.detach()
        elif isinstance(v, Mapping):
            _flatten(v, f"{key}.", out, where, depth + 1)


# ---------------------------------------------------------------------------------------
# Remote reads: many small ranges become few ranged requests
# ---------------------------------------------------------------------------------------


class GatheredReads(Storage):
    """A view of ``inner`` whose :meth:`read_into` fetches requests less than 1 MiB apart as one
    range (through a staging buffer of at most 64 MiB): a slice along a trailing dimension is
    a range per row, and an object store charges per request."""

    def __init__(self, inner: Storage, *, gap: int = _GAP_BYTES, span: int = _SPAN_BYTES):
        self.inner, self.gap, self.span = inner, gap, span
        self.url = inner.url

    def child(self, name: str) -> Storage:
        return GatheredReads(self.inner.child(name), gap=self.gap, span=self.span)

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def list(self) -> list[str]:
        return self.inner.list()

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        return self.inner.read(name, start, end)

    def write(self, name: str, data: bytes) -> None:
        self.inner.write(name, data)

    def open_writer(self, name: str) -> Writer:
        return self.inner.open_writer(name)

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        groups: list[list[ReadRequest]] = []
        end = -1
        for off, buf in sorted((r for r in requests if len(r[1])), key=lambda r: r[0]):
            if groups and end <= off <= end + self.gap and off + len(buf) - groups[-1][0][0] <= self.span:
                groups[-1].append((off, buf))
            else:
                groups.append([(off, buf)])
            end = off + len(buf)
        direct = [g[0] for g in groups if len(g) == 1]
        if direct:
            self.inner.read_into(name, direct)
        batch: list[tuple[list[ReadRequest], bytearray]] = []
        staged = 0
        for group in [g for g in groups if len(g) > 1] + [None]:  # type: ignore[list-item]
            if group is not None:
                first = group[0][0]
                stage = bytearray(group[-1][0] + len(group[-1][1]) - first)
                batch.append((group, stage))
                staged += len(stage)
            if batch and (group is None or staged >= self.span):
                self.inner.read_into(name, [(g[0][0], memoryview(s)) for g, s in batch])
                for g, s in batch:
                    view = memoryview(s)
                    for off, buf in g:
                        rel = off - g[0][0]
                        buf.cast("B")[:] = view[rel : rel + len(buf)]
                batch, staged = [], 0
