"""Local files: reads with ``preadv`` straight into the caller's buffers, atomic publication by rename."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
import uuid
from typing import Any, Callable, Sequence

from . import scatter
from .base import ReadRequest, Storage, Writer, check_name
from .direct import DirectStream, direct_io_enabled

__all__ = ["LocalStorage", "LocalWriter", "fsync_dir"]

_IOV_MAX = 1024
_WRITEBACK_BYTES = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux's ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``: start writing dirty
    pages to disk without waiting. Python has no binding; ``None`` where libc lacks it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: a failure shows up at fsync

    return start_writeback


_start_writeback = _load_sync_file_range()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root

    def is_local(self) -> bool:
        return True

    def _path(self, name: str) -> str:
        path = os.path.join(self.root, check_name(name))
        real = os.path.realpath(path)
        real_root = os.path.realpath(self.root)
        if real != real_root and not real.startswith(real_root + os.sep):
            raise PermissionError(f"{path} resolves to {real}, outside {self.root}")
        return path

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(os.path.join(self.root, check_name(name)))

    def prepare(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def size(self, name: str) -> int:
        return self._regular(self._path(name)).st_size

    @staticmethod
    def _regular(path: str) -> os.stat_result:
        """Stat a path that must be a regular file: a FIFO would block a reader, a directory fail it."""
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{path} is not a regular file") if stat.S_ISDIR(st.st_mode) else OSError(
                f"{path} is not a regular file"
            )
        return st

    def exists(self, name: str) -> bool:
        try:
            return os.path.exists(self._path(name))
        except PermissionError:
            return False  # a symlink leading out of the root: nothing of this checkpoint is there

    def list(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        path = self._path(name)
        self._regular(path)
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(-1 if end is None else max(0, end - start))

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        path = self._path(name)
        fd = os.open(path, os.O_RDONLY)
        try:
            i = 0
            while i < len(requests):
                # Requests that follow each other in the file go out as one preadv.
                offset, first = requests[i]
                bufs, end, j = [first], offset + first.nbytes, i + 1
                while j < len(requests) and requests[j][0] == end and len(bufs) < _IOV_MAX:
                    bufs.append(requests[j][1])
                    end += requests[j][1].nbytes
                    j += 1
                _preadv_exact(fd, bufs, offset, path)
                i = j
        finally:
            os.close(fd)

    def reads_runs(self) -> bool:
        return scatter.available()

    def read_runs(self, name: str, file_offsets: Any, addresses: Any, length: int) -> None:
        path = self._path(name)
        fd = os.open(path, os.O_RDONLY)
        try:
            scatter.preadv_runs(fd, file_offsets, addresses, length, path)
        finally:
            os.close(fd)

    def read_blocks(
        self, name: str, start: int, buf: memoryview, block: int, after: Callable[[memoryview], None]
    ) -> None:
        path = self._path(name)
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = memoryview(buf).cast("B")
            for b in range(0, buf.nbytes, block):
                part = buf[b : b + block]
                _preadv_exact(fd, [part], start + b, path)
                after(part)
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes) -> None:
        with self.open_writer(name) as writer:
            writer.write([memoryview(data)])
            writer.commit()

    def create_exclusive(self, name: str, data: bytes) -> None:
        path = self._path(name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.root)

    def open_writer(self, name: str) -> LocalWriter:
        return LocalWriter(self._path(name))


def _preadv_exact(fd: int, bufs: list[memoryview], offset: int, path: str) -> None:
    bufs = [b.cast("B") for b in bufs if len(b)]
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n == 0:
            raise OSError(f"{path} ends before byte {offset}: the file is truncated")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


class LocalWriter(Writer):
    """Writes to a hidden temp file beside the target; commit fsyncs and renames it into place.

    Where ``O_DIRECT`` is available (and ``CHECKPOINTER_DIRECT_IO`` is not ``0``), bytes go
    through a :class:`~checkpointer.storage.direct.DirectStream`, bypassing the page cache.
    Otherwise they are written buffered and, every :data:`_WRITEBACK_BYTES`, the kernel is asked
    to start writing them to disk, so the disk works while later bytes are copied in and the
    final ``fsync`` has little left to do (about 1.5x faster than write-then-fsync here).
    """

    def __init__(self, path: str, *, direct: bool | None = None):
        self.path = path
        directory, base = os.path.split(path)
        self.directory = directory
        self.tmp = os.path.join(directory, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.done = False
        self.written = 0
        self.flushed = 0
        use_direct = direct_io_enabled() if direct is None else direct
        self.stream: DirectStream | None = DirectStream(self.fd, self.tmp) if use_direct else None

    def write(self, buffers: Sequence[memoryview]) -> None:
        assert self.fd is not None, "writer is closed"
        if self.stream is not None:
            self.stream.write(buffers)
            return
        bufs = [b.cast("B") for b in buffers if len(b)]
        while bufs:
            n = os.writev(self.fd, bufs[:_IOV_MAX])
            self.written += n
            while bufs and n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            if n:
                bufs[0] = bufs[0][n:]
        if _start_writeback is not None and self.written - self.flushed >= _WRITEBACK_BYTES:
            _start_writeback(self.fd, self.flushed, self.written - self.flushed)
            self.flushed = self.written

    def write_stable(self, buffers: Sequence[memoryview]) -> None:
        assert self.fd is not None, "writer is closed"
        if self.stream is not None:
            self.stream.write_stable(buffers)
        else:
            self.write(buffers)

    def source_alignment(self) -> int | None:
        return self.stream.align if self.stream is not None and not self.stream.refused else None

    def commit(self) -> None:
        assert self.fd is not None, "writer is closed"
        if self.stream is not None:
            self.stream.finish()
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.rename(self.tmp, self.path)
        self.done = True
        fsync_dir(self.directory)

    def abort(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.done:
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass
