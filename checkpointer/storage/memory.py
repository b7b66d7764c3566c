"""An in-memory backend for tests: the files live in a dict owned by the instance.

``MemoryStorage()`` starts empty; :meth:`MemoryStorage.child` shares its parent's dict, so a
checkpoint written through one view is read through another. Nothing is kept at class or
module level: two ``MemoryStorage()`` never see each other's files.
"""

from __future__ import annotations

import threading
from typing import Sequence

from .base import ReadRequest, Storage, Writer, check_name

__all__ = ["MemoryStorage", "MemoryWriter"]


class _Files:
    """The shared state of one memory tree: full names (``a/b/c``) to contents."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()


class MemoryStorage(Storage):
    """Files in memory, rooted at ``prefix`` inside a tree that :meth:`child` views share."""

    def __init__(self, prefix: str = "", *, _files: _Files | None = None):
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_name(self.prefix)
        self._files = _files if _files is not None else _Files()
        self.url = f"memory://{self.prefix}"

    def _key(self, name: str) -> str:
        name = check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> MemoryStorage:
        return MemoryStorage(self._key(name), _files=self._files)

    def _get(self, name: str) -> bytes:
        key = self._key(name)
        with self._files.lock:
            data = self._files.data.get(key)
        if data is None:
            raise FileNotFoundError(self.join(name))
        return data

    def size(self, name: str) -> int:
        return len(self._get(name))

    def exists(self, name: str) -> bool:
        key = self._key(name)
        with self._files.lock:
            return key in self._files.data

    def list(self) -> list[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        with self._files.lock:
            keys = [k for k in self._files.data if k.startswith(root)]
        return sorted({k[len(root) :].split("/", 1)[0] for k in keys})

    def delete(self, name: str) -> None:
        key = self._key(name)
        with self._files.lock:
            self._files.data.pop(key, None)

    def delete_tree(self, name: str) -> None:
        key = self._key(name)
        with self._files.lock:
            for k in [k for k in self._files.data if k.startswith(f"{key}/")]:
                del self._files.data[k]

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        data = self._get(name)
        return data[start:end]

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        data = memoryview(self._get(name))
        for offset, buf in requests:
            flat = memoryview(buf).cast("B")
            if offset + len(flat) > len(data):
                raise OSError(
                    f"short read of {self.join(name)} at {offset}: "
                    f"{max(0, len(data) - offset)} of {len(flat)} bytes"
                )
            flat[:] = data[offset : offset + len(flat)]

    def write(self, name: str, data: bytes) -> None:
        key = self._key(name)
        with self._files.lock:
            self._files.data[key] = bytes(data)

    def open_writer(self, name: str) -> MemoryWriter:
        return MemoryWriter(self, self._key(name))


class MemoryWriter(Writer):
    """Collects copies of the written buffers; commit stores them under the name, whole."""

    def __init__(self, storage: MemoryStorage, key: str):
        self._files = storage._files
        self._key = key
        self._url = storage.join(key[len(storage.prefix) + 1 :] if storage.prefix else key)
        self._parts: list[bytes] | None = []

    def write(self, buffers: Sequence[memoryview]) -> None:
        if self._parts is None:
            raise ValueError(f"writer for {self._url} is closed")
        self._parts.extend(bytes(memoryview(b).cast("B")) for b in buffers if len(b))

    def commit(self) -> None:
        if self._parts is None:
            raise ValueError(f"writer for {self._url} is closed")
        data = b"".join(self._parts)
        self._parts = None
        with self._files.lock:
            self._files.data[self._key] = data

    def abort(self) -> None:
        self._parts = None
