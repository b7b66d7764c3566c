"""Descriptors a local reader holds open, and where an open descriptor leads.

:class:`OpenFiles` is the bookkeeping of a pinned :class:`~checkpointer.storage.local.LocalStorage`
view: the files it opened, by name, at most :data:`PINNED_FILES` open at once, and the identity
(device, inode, size, modification time) of the file first opened under each name, which a
file opened again under that name must have.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from .base import FileChangedError

__all__ = ["PINNED_FILES", "OpenFile", "OpenFiles", "inside", "where_opened"]

PINNED_FILES = 64
"""Files a pinned view keeps open at most (the least recently used is closed first)."""


def inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def where_opened(fd: int, real: str) -> str:
    """The path the kernel gives for an open descriptor (``/proc/self/fd``). Without procfs:
    ``real``, the path it was opened by, if that names the same file now."""
    try:
        where = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        where = ""
    if where.startswith(os.sep):
        return where
    opened, now = os.fstat(fd), os.stat(real, follow_symlinks=False)
    if (opened.st_dev, opened.st_ino) != (now.st_dev, now.st_ino) or os.path.realpath(real) != real:
        raise PermissionError(f"{real} changed while it was opened")
    return real


@dataclass
class OpenFile:
    """A file a reader holds open: its descriptor, its ``fstat`` when opened, the path it was opened by."""

    fd: int
    st: os.stat_result
    path: str
    users: int = 0
    dropped: bool = False


class OpenFiles:
    """The files of a pinned view, by name: at most ``limit`` kept open (a file in use stays open
    until its reads end), and the identity of every file first opened under each name."""

    def __init__(self, limit: int = PINNED_FILES):
        self._lock = threading.Lock()
        self._open: OrderedDict[str, OpenFile] = OrderedDict()
        self._first: dict[str, tuple[int, int, int, int]] = {}
        self._limit = limit
        self._closed = False

    def acquire(self, name: str, opener: Callable[[str], OpenFile]) -> OpenFile:
        """The open file for ``name`` (``opener`` opens it when none is), for the caller to
        :meth:`release`. A file opened again must be the one first opened under ``name``."""
        with self._lock:
            entry = self._open.get(name)
            if entry is not None:
                self._open.move_to_end(name)
                entry.users += 1
                return entry
        fresh = opener(name)
        path, st = fresh.path, fresh.st
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if self._first.setdefault(name, identity) != identity:
                entry = None
            elif name in self._open:  # another thread opened it meanwhile
                entry = self._open[name]
            else:
                entry, fresh = fresh, None
                if self._closed:
                    entry.dropped = True  # closed by its release: nothing is kept once the view is closed
                else:
                    self._open[name] = entry
                    self._evict()
            if entry is not None:
                entry.users += 1
        if fresh is not None:
            os.close(fresh.fd)
        if entry is None:
            raise FileChangedError(f"{path}: not the file first opened under this name (replaced or rewritten while it was read)")
        return entry

    def release(self, entry: OpenFile) -> None:
        with self._lock:
            entry.users -= 1
            close = entry.dropped and entry.users == 0
        if close:
            os.close(entry.fd)

    def _evict(self) -> None:
        """Under the lock: drop the least recently used past the limit (closed once unused)."""
        while len(self._open) > self._limit:
            _, old = self._open.popitem(last=False)
            old.dropped = True
            if old.users == 0:
                os.close(old.fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._limit = 0
            self._evict()


