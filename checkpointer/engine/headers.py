"""The safetensors headers of a checkpoint's rank files, and the checks made against them
before anything is allocated or read."""

from __future__ import annotations

import threading
from typing import Callable, Mapping, TypeVar

from ..errors import CorruptCheckpointError
from ..format.layout import FILE_ID_KEY, METADATA_FILENAME
from ..format.metadata import TensorStorageMetadata
from ..format.safetensors_header import PREFIX_BYTES, SafetensorsHeader, header_length, parse_header
from ..storage.base import FileChangedError, Storage

__all__ = ["HeaderCache", "piece_start", "check_files_hold", "read_small_file", "read_with"]

T = TypeVar("T")

_SPECULATIVE_HEADER = 1 << 16


class HeaderCache:
    """Each rank file's safetensors header, read once per load (two small reads at most).

    With ``file_ids`` (``metadata.json``'s), a file whose header names another id is refused:
    it was written by another save than the metadata describes. ``storage`` is the given one
    :meth:`~checkpointer.storage.base.Storage.pinned` for this load: reads through it reach the
    file whose header was checked (a local file replaced meanwhile is an error, not other bytes).
    """

    def __init__(self, storage: Storage, file_ids: Mapping[str, str] | None = None, *,
                 what: str = f"rank file listed in {METADATA_FILENAME}"):
        self._given = storage
        self.storage = storage.pinned()
        self.file_ids = file_ids or {}
        self.what = what  # what a file is, for the error when one is missing
        self._headers: dict[str, SafetensorsHeader] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> SafetensorsHeader:
        with self._lock:
            cached = self._headers.get(name)
        if cached is not None:
            return cached
        where = self.storage.join(name)
        size = _file_size(self.storage, name, self.what)
        prefix = read_with(self.storage, name, lambda: self.storage.read(name, 0, min(size, _SPECULATIVE_HEADER)), self.what)
        n = header_length(prefix, where=where, file_size=size)
        if PREFIX_BYTES + n <= len(prefix):
            header_json = prefix[PREFIX_BYTES : PREFIX_BYTES + n]
        else:
            rest = read_with(self.storage, name, lambda: self.storage.read(name, len(prefix), PREFIX_BYTES + n), self.what)
            header_json = prefix[PREFIX_BYTES:] + rest
        header = parse_header(header_json, where=where, file_size=size)
        expected = self.file_ids.get(name)
        if expected is not None:
            found = (header.user_metadata or {}).get(FILE_ID_KEY)
            if found != expected:
                raise CorruptCheckpointError(
                    f"{where}: written by another save than {self.storage.join(METADATA_FILENAME)} describes "
                    f"(file id {found!r}, expected {expected!r}): did two saves write this directory at once?"
                )
        with self._lock:
            self._headers[name] = header
        return header

    def close(self) -> None:
        """Close the files this load keeps open (done anyway when the cache is dropped)."""
        if self.storage is not self._given:
            self.storage.close()


def _file_size(storage: Storage, name: str, what: str) -> int:
    """The size of a file the checkpoint needs; a missing or special file is corrupt data."""
    where = storage.join(name)
    try:
        return storage.size(name)
    except FileNotFoundError as ex:
        raise CorruptCheckpointError(f"{where}: {what} is missing") from ex
    except FileChangedError as ex:
        raise CorruptCheckpointError(f"{where}: changed while the checkpoint was read ({ex})") from ex
    except (PermissionError, IsADirectoryError, NotADirectoryError, ValueError) as ex:
        raise CorruptCheckpointError(f"{where}: not a readable file inside the checkpoint ({ex})") from ex
    except OSError as ex:
        if not storage.is_local():
            raise
        raise CorruptCheckpointError(f"{where}: not a regular file ({ex})") from ex


def read_small_file(storage: Storage, name: str, *, limit: int, what: str) -> bytes:
    """All of a file read whole (an index, a JSON document): bytes ``[0, size)`` of its size as
    stat'ed, refused above ``limit`` bytes. One that grows while it is read (or is a FIFO, or a
    device) is never read past that size, and one that changes size is refused.
    """
    where = storage.join(name)
    size = _file_size(storage, name, what)
    if size > limit:
        raise CorruptCheckpointError(f"{where}: {what} of {size} bytes is over the limit of {limit} bytes")
    data = read_with(storage, name, lambda: storage.read(name, 0, size), what)
    if len(data) != size:
        raise CorruptCheckpointError(f"{where}: read {len(data)} bytes of {size}: the file changed while it was read")
    return data


def piece_start(headers: HeaderCache, file: str, key: str, dtype: str, numel: int) -> int:
    """Byte offset of ``key``'s piece in ``file``, after checking the header agrees with the metadata."""
    entry = headers.get(file).entries.get(key)
    if entry is None:
        raise CorruptCheckpointError(f"{headers.storage.join(file)}: tensor {key!r} is in metadata.json but not in the file")
    if entry.dtype != dtype or entry.numel != numel:
        raise CorruptCheckpointError(
            f"{headers.storage.join(file)}: tensor {key!r} is {entry.dtype} x {entry.numel} in the file "
            f"but {dtype} x {numel} in metadata.json"
        )
    return entry.start


def check_files_hold(headers: HeaderCache, key: str, meta: TensorStorageMetadata) -> None:
    """Check, before allocating ``meta.shape``, that the rank files hold that many elements.

    Each file's piece of ``key`` must match its safetensors header (whose byte ranges were
    checked against the file's size when it was parsed), and the pieces together must hold
    at least the tensor's element count; so a buffer of the tensor's shape is never larger
    than the bytes on disk. Reads only headers (cached); a hole or an overlap between pieces
    is left to the load plan.
    """
    held = 0
    for name, spec in meta.shard_spec_per_file.items():
        piece_start(headers, name, key, meta.dtype, spec.local_numel)
        held += spec.local_numel
    if held < meta.numel:
        files = ", ".join(headers.storage.join(name) for name in meta.shard_spec_per_file) or "no file"
        raise CorruptCheckpointError(
            f"tensor {key!r}: metadata.json gives it {meta.numel} elements but its files ({files}) hold {held}"
        )


def read_with(storage: Storage, name: str, read: Callable[[], T], what: str = f"rank file listed in {METADATA_FILENAME}") -> T:
    """``read()``, its errors as a load reports them: a file that is missing, cut short, replaced
    or not a readable file inside the checkpoint is corrupt; any other ``OSError`` names the file."""
    where = storage.join(name)
    try:
        return read()
    except FileNotFoundError as ex:
        raise CorruptCheckpointError(f"{where}: {what} is missing") from ex
    except (EOFError, FileChangedError) as ex:
        raise CorruptCheckpointError(f"{where}: changed while the checkpoint was read, or damaged ({ex})") from ex
    except (PermissionError, IsADirectoryError, NotADirectoryError) as ex:
        if not storage.is_local():
            raise
        raise CorruptCheckpointError(f"{where}: not a readable file inside the checkpoint ({ex})") from ex
    except OSError as ex:
        if where in str(ex) or name in str(ex):
            raise
        message = f"{where}: {ex.strerror or ex}"
        raise (OSError(ex.errno, message) if ex.errno else OSError(message)) from ex
