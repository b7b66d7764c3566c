"""Torch pickles (``.pt``, ``.pth``, ``.bin``) as a tensor source: what ``lazy_load`` reads of them.

:class:`TorchSource` reads one ``torch.save`` file (recognised by its first bytes: a zip
archive or a pickle, whatever its name), a directory holding ``pytorch_model.bin``, or one
sharded by ``pytorch_model.bin.index.json`` (validated as the safetensors index is). A file is
loaded whole with ``torch.load`` (``mmap=True`` maps a local one instead) when the iteration
reaches it, and boxes are cut from memory; ``restrict`` (the default) loads with
``weights_only=True``, so nothing but tensors and builtins is unpickled.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import warnings
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..storage.base import Storage
from ..storage.local import LocalStorage
from .hf import check_shard, has_file, read_hf_index, resolve
from .sources import Box, Entry, LazyTensor, TensorSource, Where, cut_box

__all__ = ["TorchSource", "MAX_NESTING", "BIN_INDEX_NAME", "BIN_SINGLE_NAME"]

BIN_INDEX_NAME = "pytorch_model.bin.index.json"
BIN_SINGLE_NAME = "pytorch_model.bin"
MAX_NESTING = 100
"""How deeply the mappings of a torch pickle may nest (``{"model": {"layers": ...}}``)."""


def looks_like_torch_file(head: bytes) -> bool:
    """A zip archive (``torch.save``'s format) or a pickle (its legacy one)."""
    return head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


class TorchSource(TensorSource):
    """The tensors of torch pickles, each file loaded when the iteration reaches it."""

    format = "torch"
    looks_for = f"{BIN_INDEX_NAME} or {BIN_SINGLE_NAME} (torch pickles)"

    @classmethod
    def supports(cls, where: Where) -> bool:
        if where.name is not None:
            size = where.storage.size(where.name)
            return looks_like_torch_file(where.storage.read(where.name, 0, min(size, 16)))
        return has_file(where.storage, BIN_INDEX_NAME) or has_file(where.storage, BIN_SINGLE_NAME)

    def __init__(self, where: Where, *, mmap: bool = False, restrict: bool = True, **_options: object):
        self.aliases: dict[str, str] = {}
        self.skipped: list[str] = []
        self.url = where.shown
        self.mmap, self.restrict = mmap, restrict
        storage = where.storage
        self._files: list[tuple[Storage, str, str, Sequence[str] | None]]
        if where.name is not None:
            self._files = [(storage, where.name, where.shown, None)]
        elif has_file(storage, BIN_INDEX_NAME):
            index = read_hf_index(*resolve(storage, BIN_INDEX_NAME), where=storage.join(BIN_INDEX_NAME))
            self._files = []
            for name, keys in index.items():
                file_storage, file_name = resolve(storage, name)
                self._files.append((file_storage, file_name, storage.join(name), keys))
        else:
            file_storage, file_name = resolve(storage, BIN_SINGLE_NAME)
            self._files = [(file_storage, file_name, storage.join(BIN_SINGLE_NAME), None)]
        if self._files[0][3] is None:  # a file alone is loaded now: a damaged one fails the call
            self._loaded: dict[str, torch.Tensor] | None = self._load(*self._files[0])
        else:
            self._loaded = None
        self._all: dict[str, torch.Tensor] | None = None

    def _load(self, storage: Storage, name: str, shown: str, keys: Sequence[str] | None) -> dict[str, torch.Tensor]:
        if keys is not None:
            check_shard(storage, name, shown, BIN_INDEX_NAME)
        obj = _torch_load(storage, name, shown, mmap=self.mmap, restrict=self.restrict)
        if not isinstance(obj, Mapping):
            raise CorruptCheckpointError(f"{shown}: holds a {type(obj).__name__}, not a state dict")
        flat: dict[str, torch.Tensor] = {}
        skipped: list[str] = []
        _flatten(obj, "", flat, shown, skipped)
        del obj
        if skipped:
            what = "1 entry is not a tensor and is" if len(skipped) == 1 else f"{len(skipped)} entries are not tensors and are"
            warnings.warn(f"{shown}: {what} skipped: {skipped[:10]}", stacklevel=2)
        if keys is not None:
            missing = [k for k in keys if k not in flat]
            if missing:
                raise CorruptCheckpointError(f"{shown}: tensors {missing[:5]} are listed in the index but not in the file")
            flat = {k: flat[k] for k in keys}
        return flat

    def tensors(self) -> Iterator[LazyTensor]:
        """One file at a time; each tensor is let go as the caller drops what it was given."""
        for i, file in enumerate(self._files):
            flat = self._loaded if i == 0 and self._loaded is not None else self._load(*file)
            self._loaded = None
            for key in list(flat):
                tensor = flat.pop(key)

                def read(box: Box | None, tensor: torch.Tensor = tensor) -> torch.Tensor:
                    return cut_box(tensor, box)

                yield LazyTensor(key, tuple(tensor.shape), tensor.dtype, read)
                del tensor, read

    def _everything(self) -> dict[str, torch.Tensor]:
        if self._all is None:
            self._all = {t.key: t.read(None) for t in self.tensors()}
        return self._all

    def entries(self) -> list[Entry]:
        """Every tensor (all files loaded, and kept)."""
        from ..format.dtypes import code_from_dtype

        return [(key, tuple(t.shape), code_from_dtype(t.dtype)) for key, t in self._everything().items()]

    def fetch(self, key: str) -> torch.Tensor:
        return self._everything()[key]


def _torch_load(storage: Storage, name: str, where: str, *, mmap: bool, restrict: bool) -> Any:
    if isinstance(storage, LocalStorage):
        source: Any = os.path.join(storage.root, name)
    else:
        source = io.BytesIO(storage.read(name))  # a pickle is read whole anyway; no mmap remotely
        mmap = False
    _refuse_compressed_records(source, where)
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


def _refuse_compressed_records(source: Any, where: str) -> None:
    """``torch.save`` stores every record of its zip archive as it is; ``torch.load`` inflates
    compressed ones too, so a file of a few hundred KB could ask for a thousand times that in
    memory. A record that is compressed, or claims more bytes than the file has, is refused."""
    try:
        size = os.path.getsize(source) if isinstance(source, str) else len(source.getbuffer())
        with zipfile.ZipFile(source) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError):
        return  # not a zip archive (the legacy format), or a damaged one: torch.load says which
    finally:
        if not isinstance(source, str):
            source.seek(0)
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED or record.file_size > size:
            raise CorruptCheckpointError(
                f"{where}: record {record.filename[:200]!r} is compressed or larger than the file "
                f"({record.file_size} bytes); torch.save writes neither"
            )


def _is_bad_archive(ex: OSError) -> bool:
    """torch's zip reader says EINVAL, naming no file, when the archive's directory is cut off."""
    return ex.errno == errno.EINVAL and ex.filename is None


def _flatten(
    obj: Mapping[Any, Any], prefix: str, out: dict[str, torch.Tensor], where: str, skipped: list[str], depth: int = 1
) -> None:
    """``obj``'s tensors into ``out`` by dotted key; the keys of other values into ``skipped``."""
    if depth > MAX_NESTING:  # a hostile file (or a mapping holding itself) would exhaust the stack
        raise CorruptCheckpointError(f"{where}: state dict nests mappings more than {MAX_NESTING} deep")
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            if key in out:  # {"a.b": x, "a": {"b": y}}: one would silently replace the other
                raise CorruptCheckpointError(f"{where}: two tensors flatten to the key {key!r}")
            out[key] = v.detach()
        elif isinstance(v, Mapping):
            _flatten(v, f"{key}.", out, where, skipped, depth + 1)
        else:
            skipped.append(key)
