"""The storage interface; :func:`~checkpointer.storage.open_storage` picks the backend for a URL.

A :class:`Storage` is rooted at one directory-like location (a checkpoint directory). Names
are relative and ``/``-separated; a backend refuses a name that would leave its root. All
methods may be called from several threads at once. Errors are builtin: a missing object
is ``FileNotFoundError``, other I/O failures are ``OSError`` naming the URL. A read-only
backend (http) raises ``io.UnsupportedOperation`` from ``list``, ``write``, ``delete``,
``delete_tree`` and ``open_writer``, so loading never relies on ``list``. ``url`` and :meth:`Storage.join` are
for messages and never contain credentials.

Who calls what: during a save every rank opens a :class:`Writer` for its own file and
commits it; rank 0 alone writes ``metadata.json`` with :meth:`Storage.write` last. During a
load, any rank calls :meth:`Storage.read` and :meth:`Storage.read_into` on any file.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Sequence

__all__ = ["Storage", "Writer", "ReadRequest", "FileChangedError", "check_name", "check_url", "path_arg"]

ReadRequest = tuple[int, memoryview]
"""``(byte offset, buffer)``: fill the whole buffer with the bytes starting at the offset."""


class FileChangedError(OSError):
    """A file is not what its reader was given: it ends before bytes its size promised, or it is
    no longer the file first opened under its name (another was renamed over it)."""


def check_name(name: str) -> str:
    """Refuse names that are absolute or climb out of the root."""
    if not name or name.startswith("/") or "\\" in name or "\x00" in name:
        raise ValueError(f"invalid storage name {name!r}")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid storage name {name!r}")
    return name


def is_valid_name(name: str) -> bool:
    """Whether :func:`check_name` takes ``name`` (a listing may hold others, written by other tools)."""
    try:
        check_name(name)
    except ValueError:
        return False
    return True


_MANGLED_URL = re.compile(r"(s3|gs|gcs|file|https?):/+(?!/)", re.IGNORECASE)
"""``s3:/bucket/key``: a URL that went through ``pathlib.Path`` (or ``os.path.normpath``),
which folds ``//`` into ``/``. As a local path it would be a directory named ``s3:``."""


def check_url(url: str) -> str:
    """Refuse a URL whose ``//`` was folded into ``/`` (``Path("s3://b/k")`` is ``s3:/b/k``).

    Raises:
        ValueError: naming the URL and the one it probably was.
    """
    match = _MANGLED_URL.match(url)
    if match and not url.startswith(f"{match.group(1)}://"):
        scheme = match.group(1)
        fixed = f"{scheme}://{'/' if scheme.lower() == 'file' else ''}{url[match.end():]}"
        raise ValueError(
            f"{url!r} is not a valid URL: {scheme}: needs two slashes ({fixed!r}). Was it held as a "
            "pathlib.Path, which folds '//' into '/'? Keep URLs as str. (A local directory whose name "
            f"starts with '{scheme}:' can be given as ./{url})"
        )
    return url


def path_arg(value: object, what: str = "checkpoint directory") -> str:
    """A path or URL argument as ``str``; ``None`` or another type is a ``TypeError`` saying so,
    a URL mangled by ``pathlib`` a ``ValueError`` (:func:`check_url`).

    ``None`` is what ``latest_checkpoint(run_dir)`` returns when ``run_dir`` holds no complete
    checkpoint: passed on to a load, it would otherwise read a directory named ``None``.
    """
    if value is None:
        hint = (
            " (latest_checkpoint(run_dir) returned None? It does when run_dir holds no complete "
            "checkpoint: check for None before loading)"
            if what == "checkpoint directory"
            else ""
        )
        raise TypeError(f"the {what} is None, not a path or URL{hint}")
    if isinstance(value, Storage):
        return value.url
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"the {what} must be a path or URL (str or os.PathLike), not {type(value).__name__}: {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"the {what} must be a str path or URL, not {type(path).__name__}: {path!r}")
    return check_url(path)


class Writer(ABC):
    """A file being written; it appears under its name only when :meth:`commit` returns."""

    @abstractmethod
    def write(self, buffers: Sequence[memoryview]) -> None:
        """Append the buffers, in order; the caller may reuse them once this returns."""

    def write_stable(self, buffers: Sequence[memoryview]) -> None:
        """Append the buffers, which the caller leaves alive and unchanged until :meth:`commit`
        or :meth:`abort` returns (the pieces of a save), so that a writer may send them later
        from where they are instead of copying them. By default the same as :meth:`write`."""
        self.write(buffers)

    def source_alignment(self) -> int | None:
        """For a writer that sends :meth:`write_stable` buffers from where they are only when
        their address and their offset in the file agree modulo some number of bytes (local
        ``O_DIRECT`` writes), that number: a caller may order and pad the file to arrange it.
        None when any address will do (the default)."""
        return None

    def expect_bytes(self, total: int, uncopied: int) -> None:
        """Before the first write: the file will hold ``total`` bytes, of which ``uncopied``
        reach :meth:`write_stable` placed as :meth:`source_alignment` asks, so that they can go
        from where they are. A writer may choose how it writes from that (and its
        :meth:`source_alignment` may then change); by default it does not."""

    @abstractmethod
    def commit(self) -> None:
        """Make the file durable and visible under its name, whole."""

    @abstractmethod
    def abort(self) -> None:
        """Discard what was written; the name is left as it was. Safe to call twice, and a no-op after commit."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort()  # a no-op after commit; otherwise nothing half-written stays behind


class Storage(ABC):
    """Bytes under one root location."""

    url: str

    def join(self, name: str) -> str:
        """The URL of ``name`` (for messages)."""
        return posixpath.join(self.url.rstrip("/"), name)

    @abstractmethod
    def child(self, name: str) -> Storage:
        """A storage rooted at the sub-directory ``name``."""

    def part(self, name: str) -> Storage:
        """The sub-directory ``name`` as a part of the checkpoint here (``model/``, ``optim/``):
        :meth:`child`, except that through it a backend with links (local files) reads nothing
        outside this storage's root, as it reads nothing outside its own."""
        return self.child(name)

    def pinned(self) -> Storage:
        """This storage for one reader (a load): a backend that can keeps each file it opens
        open, so that every read of a file reaches the file first opened under its name, or
        fails (:class:`FileChangedError`). Released by :meth:`close` or when no longer referenced.
        By default the storage itself."""
        return self

    def close(self) -> None:
        """Release what :meth:`pinned` holds; a no-op for others."""

    @abstractmethod
    def size(self, name: str) -> int:
        """Size in bytes; ``FileNotFoundError`` when missing."""

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def list(self) -> list[str]:
        """Names of the files and sub-directories directly under the root.

        A missing directory or prefix gives ``[]``; a missing bucket is ``FileNotFoundError``.
        """

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove a file; missing is fine."""

    def delete_tree(self, name: str) -> None:
        """Remove the sub-directory ``name`` and everything under it (a local link named ``name``
        is removed, not followed); missing is fine. Not atomic: a caller that needs a half-removed
        tree to read a certain way deletes the files that decide it first."""
        raise io.UnsupportedOperation(f"{self.join(name)}: this storage cannot delete")

    @abstractmethod
    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file (to its end when ``end`` is None)."""

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        """Fill each buffer with the bytes at its offset; a short file is ``EOFError``-free ``OSError``."""
        for offset, buf in requests:
            buf = memoryview(buf).cast("B")
            data = self.read(name, offset, offset + buf.nbytes)
            if len(data) != buf.nbytes:
                raise OSError(f"short read of {self.join(name)} at {offset}: {len(data)} of {buf.nbytes} bytes")
            buf[:] = data

    def reads_runs(self) -> bool:
        """Whether :meth:`read_runs` is offered (a local file system); otherwise the caller reads
        the span holding the runs into a staging buffer of its own."""
        return False

    def read_runs(self, name: str, file_offsets: Any, addresses: Any, length: int) -> None:
        """Read ``length`` bytes at each of ``file_offsets`` (an increasing ``int64`` array) into
        memory at each of ``addresses`` (``uint64``, memory the caller keeps alive), in few calls."""
        raise io.UnsupportedOperation(f"{self.url}: no scattered reads")

    def maps_files(self) -> bool:
        """Whether :meth:`mapped` is offered (a local file system)."""
        return False

    def mapped(self, name: str, start: int, nbytes: int) -> ContextManager[memoryview | None]:
        """Bytes ``[start, start + nbytes)`` of a file as its pages mapped into memory, to read
        while the context lasts and to keep no view of after it; ``None`` where they cannot be
        mapped safely now (the caller reads them); ``EOFError`` where the file is shorter."""
        raise io.UnsupportedOperation(f"{self.url}: no mapped files")

    def read_blocks(
        self, name: str, start: int, buf: memoryview, block: int, after: Callable[[memoryview], None]
    ) -> None:
        """Fill ``buf`` with the bytes from ``start`` on, ``block`` bytes at a time, calling
        ``after`` on each block as soon as it is read (while it is still in the CPU cache)."""
        buf = memoryview(buf).cast("B")
        for b in range(0, buf.nbytes, block):
            part = buf[b : b + block]
            self.read_into(name, [(start + b, part)])
            after(part)

    @abstractmethod
    def write(self, name: str, data: bytes) -> None:
        """Write a whole small file atomically (replacing any file of that name)."""

    def create_exclusive(self, name: str, data: bytes) -> None:
        """Create a small file only if no file of that name exists, else ``FileExistsError``.

        Backends override this with an atomic primitive; this default checks, then writes.
        """
        if self.exists(name):
            raise FileExistsError(self.join(name))
        self.write(name, data)

    @abstractmethod
    def open_writer(self, name: str) -> Writer:
        """Start writing a file that appears, whole, at commit."""

    def prepare(self) -> None:
        """Create the root if the backend needs it (local directories)."""

    def is_local(self) -> bool:
        return False

    def place(self) -> str:
        """Where this storage is, to tell whether two are the same place: its URL here; a local
        directory's real path, links resolved."""
        return self.url.rstrip("/")
