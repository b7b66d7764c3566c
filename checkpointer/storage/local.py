"""Local files: reads with ``preadv`` straight into the caller's buffers, atomic publication by rename.

Nothing is read outside :attr:`LocalStorage.within` (the storage's root, or the checkpoint
directory a part such as ``model/`` belongs to), whatever symbolic links say: a name is resolved,
refused if it leads out, and opened at the place it resolved to without following a link there;
then the kernel is asked where the descriptor it opened leads (``/proc/self/fd``), and every
byte is read through that descriptor. So a link swapped between inside and outside targets
while a load runs gives the inside file or an error naming the file, never outside bytes.

A :meth:`LocalStorage.pinned` view (one per load: the header cache takes one) keeps the files
it opened open, so that the bytes of a file come from the file whose header was checked, even
when another file is renamed over it meanwhile; a file it opens again (at most
:data:`PINNED_FILES` stay open) must be the one first opened, else :class:`FileChangedError`.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import os
import shutil
import stat
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from .. import settings
from ..format.layout import temp_name
from . import libc, mapping, scatter
from .base import FileChangedError, ReadRequest, Storage, Writer, check_name
from .open_files import PINNED_FILES, OpenFile, OpenFiles, inside, where_opened
from .direct import DirectStream, direct_io_enabled

__all__ = ["LocalStorage", "LocalWriter", "fsync_dir", "PINNED_FILES"]

_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW  # a FIFO must not block the open
_IOV_MAX = 1024
GAP_READ = 64 << 10
"""The longest gap between two requests that :meth:`LocalStorage.read_into` reads rather than skips."""
_WRITEBACK_BYTES = 32 << 20
_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


_sync_file_range = libc.function("sync_file_range", [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint], ctypes.c_int)


def _drop_cached(fd: int, start: int, size: int) -> None:
    """Ask the kernel to drop these written bytes (``size`` 0: to the end) from the page cache."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, start, size, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # advice only


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    """The files under ``root``; nothing is read outside ``within`` (``root`` unless given: a
    part of a checkpoint, from :meth:`part`, reads nothing outside the checkpoint)."""

    def __init__(self, root: str, *, within: str | None = None):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        self.within = self.root if within is None else os.path.abspath(os.path.expanduser(within))
        self._files: OpenFiles | None = None

    def is_local(self) -> bool:
        return True

    def place(self) -> str:
        return os.path.realpath(self.url)

    def _resolve(self, name: str) -> tuple[str, str]:
        """``(path, real)``: the path of ``name`` and where its links lead; PermissionError when
        that is outside :attr:`within`."""
        path = os.path.join(self.root, check_name(name))
        real = os.path.realpath(path)
        within = os.path.realpath(self.within)
        if not inside(real, within):
            raise PermissionError(f"{path} resolves to {real}, outside {self.within}")
        return path, real

    def _path(self, name: str) -> str:
        return self._resolve(name)[0]

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(os.path.join(self.root, check_name(name)))

    def part(self, name: str) -> LocalStorage:
        part = self.child(name)
        part.within = self.within
        return part

    def pinned(self) -> LocalStorage:
        if self._files is not None:
            return self
        # A shallow copy: a subclass's overrides and attributes (tests count reads) carry over.
        view = copy.copy(self)
        view._files = files = OpenFiles()
        weakref.finalize(view, files.close)
        return view

    def close(self) -> None:
        if self._files is not None:
            self._files.close()

    def prepare(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def _open(self, name: str) -> OpenFile:
        """Open ``name`` for reading where it resolved to, as a regular file inside :attr:`within`."""
        path, real = self._resolve(name)
        try:
            fd = os.open(real, _OPEN_FLAGS)
        except OSError as ex:
            if ex.errno == errno.ELOOP:  # a link where the resolved path had none: it changed meanwhile
                raise PermissionError(f"{path} became a symbolic link while it was opened") from None
            raise
        checked = False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                if stat.S_ISDIR(st.st_mode):
                    raise IsADirectoryError(f"{path} is not a regular file")
                raise OSError(f"{path} is not a regular file")
            where = where_opened(fd, real)
            if not inside(where, os.path.realpath(self.within)):
                raise PermissionError(f"{path} was opened at {where}, outside {self.within}")
            checked = True
        finally:
            if not checked:
                os.close(fd)
        return OpenFile(fd, st, path)

    @contextmanager
    def _reading(self, name: str) -> Iterator[OpenFile]:
        """An open file for ``name``: this view's (pinned), or one opened for these reads alone."""
        files = self._files
        if files is None:
            entry = self._open(name)
            try:
                yield entry
            finally:
                os.close(entry.fd)
        else:
            entry = files.acquire(name, self._open)
            try:
                yield entry
            finally:
                files.release(entry)

    def size(self, name: str) -> int:
        with self._reading(name) as f:
            return f.st.st_size

    def exists(self, name: str) -> bool:
        try:
            return os.path.exists(self._path(name))
        except PermissionError:
            return False  # a symlink leading out of the root: nothing of this checkpoint is there

    def list(self) -> list[str]:
        if not inside(os.path.realpath(self.root), os.path.realpath(self.within)):
            return []  # a part leading out of its checkpoint: nothing of the checkpoint is there
        try:
            return sorted(os.listdir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def delete_tree(self, name: str) -> None:
        path = os.path.join(self.root, check_name(name))
        try:
            if os.path.islink(path) or not os.path.isdir(path):
                os.unlink(path)
            else:
                shutil.rmtree(path)
        except FileNotFoundError:
            pass

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        with self._reading(name) as f:
            out = bytearray()
            while end is None or start + len(out) < end:
                want = (1 << 24) if end is None else min(1 << 24, end - start - len(out))
                chunk = os.pread(f.fd, want, start + len(out))
                if not chunk:
                    break
                out += chunk
            return bytes(out)

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        """Requests in increasing file order that follow each other, or leave gaps of at most
        :data:`GAP_READ` bytes between them, go out as one ``preadv``: the gaps are read into one
        small scratch buffer (which stays in the CPU cache), not paid for with a system call each."""
        with self._reading(name) as f:
            scratch: memoryview | None = None
            i = 0
            while i < len(requests):
                offset, first = requests[i]
                bufs, end, j = [first], offset + first.nbytes, i + 1
                while j < len(requests) and len(bufs) < _IOV_MAX - 1:
                    start, buf = requests[j]
                    gap = start - end
                    if not buf.nbytes:  # nothing to read, wherever it points
                        j += 1
                        continue
                    if gap < 0 or gap > GAP_READ:
                        break
                    if gap:
                        if scratch is None:
                            scratch = memoryview(bytearray(GAP_READ))
                        bufs.append(scratch[:gap])
                    bufs.append(buf)
                    end = start + buf.nbytes
                    j += 1
                _preadv_exact(f.fd, bufs, offset, f.path)
                i = j

    def reads_runs(self) -> bool:
        return scatter.available()

    def read_runs(self, name: str, file_offsets: Any, addresses: Any, length: int) -> None:
        with self._reading(name) as f:
            scatter.preadv_runs(f.fd, file_offsets, addresses, length, f.path)

    def maps_files(self) -> bool:
        return mapping.available()

    @contextmanager
    def mapped(self, name: str, start: int, nbytes: int) -> Iterator[memoryview | None]:
        with self._reading(name) as f, mapping.mapped_range(f.fd, start, nbytes, f.path) as view:
            yield view

    def read_blocks(
        self, name: str, start: int, buf: memoryview, block: int, after: Callable[[memoryview], None]
    ) -> None:
        with self._reading(name) as f:
            buf = memoryview(buf).cast("B")
            for b in range(0, buf.nbytes, block):
                part = buf[b : b + block]
                _preadv_exact(f.fd, [part], start + b, f.path)
                after(part)

    def write(self, name: str, data: bytes) -> None:
        with self.open_writer(name) as writer:
            writer.write([memoryview(data)])
            writer.commit()

    def create_exclusive(self, name: str, data: bytes) -> None:
        """Written whole under a temporary name, then hard-linked to ``name`` (which fails if it
        exists): no one ever sees the file empty or cut short, even after a crash or a full disk,
        where an empty lock would never be judged stale. Without hard links, ``O_EXCL``."""
        path = self._path(name)
        directory, base = os.path.split(path)
        tmp = os.path.join(directory, temp_name(base))
        _write_new(tmp, os.O_EXCL, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links
            _write_new(path, os.O_EXCL, data)
        finally:
            os.unlink(tmp)
        fsync_dir(self.root)

    def open_writer(self, name: str) -> LocalWriter:
        return LocalWriter(self._path(name))


def _write_new(path: str, flags: int, data: bytes) -> None:
    """Create ``path`` (``flags``: ``O_EXCL``) holding ``data``, fsynced; a failure removes it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    done = False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        done = True
    finally:
        os.close(fd)
        if not done:
            os.unlink(path)


@contextmanager
def _naming(path: str) -> Iterator[None]:
    """A system call's error (a full disk, a file too large) names the file being written."""
    try:
        yield
    except OSError as ex:
        if ex.filename is None and ex.errno is not None and path not in str(ex):
            raise OSError(ex.errno, ex.strerror, path) from ex
        raise


def _preadv_exact(fd: int, bufs: list[memoryview], offset: int, path: str) -> None:
    bufs = [b.cast("B") for b in bufs if len(b)]
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n == 0:
            raise FileChangedError(f"{path} ends before byte {offset}: the file is truncated")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


class LocalWriter(Writer):
    """Writes to a hidden temp file beside the target; commit fsyncs and renames it into place.

    Where ``O_DIRECT`` is available (and ``CHECKPOINTER_DIRECT_IO`` is not ``0``), bytes go
    through a :class:`~checkpointer.storage.direct.DirectStream`, bypassing the page cache,
    unless (``auto``, the default) :meth:`expect_bytes` says that most of them would be copied
    into its buffers anyway. Otherwise they are written buffered, and every
    :data:`_WRITEBACK_BYTES` the range just written is sent to disk while the one before it is
    waited for and dropped from the page cache (:meth:`_write_back`): the disk works while the
    next range is copied in, dirty pages never pile up (left to the kernel, 2 x 1 GiB took
    1.2-2.9 s on the development machine instead of 0.9-1.1 s), and the file leaves the page
    cache as it would with ``O_DIRECT``.
    """

    def __init__(self, path: str, *, direct: bool | None = None):
        self.path = path
        directory, base = os.path.split(path)
        self.directory = directory
        self.tmp = os.path.join(directory, temp_name(base))
        use_direct = direct_io_enabled() if direct is None else direct  # a bad setting raises before any file is made
        self.direct_by_choice = direct is None and settings.direct_io() == "auto"
        self.done = False
        self.written = 0
        self.flushed = 0
        self.previous: tuple[int, int] | None = None
        self.writeback = _sync_file_range is not None
        self.stream: DirectStream | None = None
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        made = False
        try:
            self.stream = DirectStream(self.fd, self.tmp) if use_direct else None
            made = True
        finally:
            if not made:
                self.abort()

    def write(self, buffers: Sequence[memoryview]) -> None:
        with _naming(self.path):
            self._write(buffers)

    def _write(self, buffers: Sequence[memoryview]) -> None:
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
        if self.writeback and self.written - self.flushed >= _WRITEBACK_BYTES:
            self._write_back()

    def _write_back(self) -> None:
        """Start writing the bytes since the last call to disk; wait until the range before them
        is on disk and drop it from the page cache. At most two ranges are dirty at a time, the
        disk works while the next range is copied in, and the saved file leaves nothing cached."""
        assert self.fd is not None and _sync_file_range is not None
        if _sync_file_range(self.fd, self.flushed, self.written - self.flushed, _SYNC_FILE_RANGE_WRITE) != 0:
            self.writeback = False  # a file system without it: the fsync writes everything
            return
        if self.previous is not None:
            start, size = self.previous
            flags = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER
            if _sync_file_range(self.fd, start, size, flags) != 0:
                # A write error seen here is not reported again by the fsync on this descriptor.
                err = ctypes.get_errno()
                raise OSError(err, f"{self.path}: writing bytes {start}-{start + size}: {os.strerror(err)}")
            _drop_cached(self.fd, start, size)
        self.previous = (self.flushed, self.written - self.flushed)
        self.flushed = self.written

    def write_stable(self, buffers: Sequence[memoryview]) -> None:
        assert self.fd is not None, "writer is closed"
        with _naming(self.path):
            if self.stream is not None:
                self.stream.write_stable(buffers)
            else:
                self._write(buffers)

    def expect_bytes(self, total: int, uncopied: int) -> None:
        """``O_DIRECT`` spares a copy only for the bytes it sends from the caller's memory. Where
        most bytes would be copied into its buffers anyway (small pieces, or addresses that
        disagree with their file offsets), the page cache takes the same one copy; its writeback
        was faster on the development machine and on an H100 host, and from 11 % slower to 8 %
        faster on an H200 host (docs/performance.md)."""
        stream = self.stream
        if stream is not None and self.direct_by_choice and stream.position == 0 and 2 * uncopied < total:
            stream.close()
            self.stream = None

    def source_alignment(self) -> int | None:
        return self.stream.align if self.stream is not None and not self.stream.refused else None

    def commit(self) -> None:
        assert self.fd is not None, "writer is closed"
        with _naming(self.path):
            if self.stream is not None:
                self.stream.finish()
            os.fsync(self.fd)
        if self.stream is None:
            _drop_cached(self.fd, 0, 0)
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
