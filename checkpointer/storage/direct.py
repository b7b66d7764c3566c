"""Sequential file writes that bypass the page cache (``O_DIRECT``).

A buffered write copies the bytes into the page cache and leaves the kernel to write them back
later; on the machines we measured, that writeback, not the copy, is what a save waits for
(2 x 1.6 GB written and fsynced: 4.8 to 6.5 s buffered, 1.0 to 1.4 s this way).

``O_DIRECT`` needs the memory address, the file offset and the length of each write aligned to
the device (:func:`dio_alignment`: 512 bytes on common disks). The stream aligns its writes to
the file system's block as well (:func:`write_alignment`: 4096 bytes on ext4): ext4 runs a
write that starts or ends inside a block one at a time, after every write in flight, and
zeroes the rest of the block first (1.5 GB written with 512-byte alignment took 3.5-10.9 s on
the development machine, 4096-byte 2.2-3.3 s, as fast as plain 64 MiB writes).
Bytes go to the file two ways:

* from where they are, with no copy (:meth:`DirectStream.write_stable`, for memory the caller
  keeps unchanged until :meth:`DirectStream.finish`), for a buffer of at least
  :data:`MIN_FROM_SOURCE` whose address and place in the file agree modulo that alignment: the
  part between its first and last aligned byte is written straight from that memory, in pieces
  of :data:`PIECE_BYTES`;
* otherwise copied into page-aligned buffers (four of 4 MiB, a request of this machine's disk).

Writer threads write up to three buffers or pieces at once while the caller goes on. The
file's last, partial block is written without ``O_DIRECT``. A file system that refuses
``O_DIRECT`` (at ``fcntl``, or at the first write of a buffer or from the caller's memory, each
made in the caller's thread before writes run in parallel) gets the same bytes written the
ordinary way, as are the bytes of any later piece of the caller's memory that ``O_DIRECT``
will not take. The descriptor's flags change only while no write is in flight.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import struct
from collections import deque
from concurrent.futures import Future
from typing import Sequence

from .. import settings
from . import libc
from .parallel import Workers

__all__ = [
    "BLOCK_BYTES", "DEPTH", "MIN_FROM_SOURCE", "PIECE_BYTES", "DirectStream", "dio_alignment", "direct_io_enabled",
    "write_alignment",
]

BLOCK_BYTES = 4 << 20
DEPTH = 4  # buffers: one being filled while the others are written; also the writes in flight + 1
PIECE_BYTES = 16 << 20  # one write straight from the caller's memory
_FALLBACK_ALIGN = 4096  # the largest logical block size of common devices; BLOCK_BYTES is a multiple
_MAX_FS_BLOCK = 64 << 10  # a larger st_blksize (network file systems) is a transfer size, not a block
# Smaller buffers are copied: each run from memory adds one small write of the unaligned bytes
# around it (a save of 400 pieces of 2-4 MiB took 0.87-0.93 s written from memory, 0.64-0.65 s
# copied, on one process with a core to spare for the copy).
MIN_FROM_SOURCE = PIECE_BYTES

_Rest = tuple[memoryview, int]  # what a writer thread left to write: (bytes, file offset)


def direct_io_enabled() -> bool:
    """``O_DIRECT`` exists here and ``CHECKPOINTER_DIRECT_IO`` is not ``0``."""
    return hasattr(os, "O_DIRECT") and settings.direct_io() != "never"


_statx = libc.function("statx", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p], ctypes.c_int)
_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000
_STATX_DIO_OFFSETS = 0x98  # stx_dio_mem_align, stx_dio_offset_align: two u32 (Linux 6.1+)


def dio_alignment(fd: int) -> int:
    """The alignment ``O_DIRECT`` asks of addresses and offsets for this file, as ``statx``
    reports it (the larger of the two), or 4096 where it does not (older kernels, other
    systems) or reports one that does not divide :data:`BLOCK_BYTES`."""
    if _statx is None:
        return _FALLBACK_ALIGN
    buf = ctypes.create_string_buffer(256)
    if _statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return _FALLBACK_ALIGN
    (mask,) = struct.unpack_from("<I", buf.raw, 0)
    mem, offset = struct.unpack_from("<II", buf.raw, _STATX_DIO_OFFSETS)
    align = max(mem, offset)
    if not mask & _STATX_DIOALIGN or align == 0 or BLOCK_BYTES % align:
        return _FALLBACK_ALIGN
    return align


def write_alignment(fd: int) -> int:
    """What the stream aligns its writes to: :func:`dio_alignment`, or the file system's block
    (``st_blksize``) where that is larger, a power of two up to 64 KiB."""
    align = dio_alignment(fd)
    block = os.fstat(fd).st_blksize
    if 0 < block <= _MAX_FS_BLOCK and block & (block - 1) == 0 and BLOCK_BYTES % block == 0:
        return max(align, block)
    return align


def _address(view: memoryview) -> int | None:
    """The address of a writable buffer's first byte (None for read-only memory, as ``bytes``)."""
    if view.readonly or not len(view):
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class DirectStream:
    """Appends to ``fd`` (an empty file opened for writing) from offset 0; :meth:`finish`
    writes what is left. The descriptor stays the caller's to fsync and close."""

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path
        self.align = write_alignment(fd)
        self.direct = False  # O_DIRECT set on the descriptor now
        self.refused = False  # the file system refused O_DIRECT: write the ordinary way
        self.copied = 0  # bytes that went through the buffers
        self.from_source = 0  # bytes written straight from the caller's memory
        self._proven: set[bool] = set()  # write kinds (from the caller's memory or not) that worked once
        self._buffers: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self._free: list[int] = []
        self._current: int | None = None  # the buffer being filled
        self._fill = 0
        self._offset = 0  # file offset of the current buffer's first byte: a multiple of align
        self._pool: Workers | None = None
        self._pending: deque[tuple[int | None, Future]] = deque()  # (buffer or None, its write), oldest first

    def write(self, buffers: Sequence[memoryview]) -> None:
        """Append copies of the buffers (the caller may reuse them once this returns)."""
        for buf in buffers:
            src = memoryview(buf).cast("B")
            pos = 0
            while pos < len(src):
                if self._current is None:
                    self._current = self._take()
                take = min(BLOCK_BYTES - self._fill, len(src) - pos)
                self._views[self._current][self._fill : self._fill + take] = src[pos : pos + take]
                self._fill += take
                self.copied += take
                pos += take
                if self._fill == BLOCK_BYTES:
                    self._submit_buffer()

    def write_stable(self, buffers: Sequence[memoryview]) -> None:
        """Append the buffers, which stay alive and unchanged until :meth:`finish` or
        :meth:`close` returns: written from where they are when their address allows it."""
        for buf in buffers:
            src = memoryview(buf).cast("B")
            address = _address(src) if len(src) >= MIN_FROM_SOURCE else None
            if address is None or (not self.refused and (address - self.position) % self.align):
                self.write([src])
            else:
                self._write_from_source(src)

    @property
    def position(self) -> int:
        """The file offset the next byte goes to."""
        return self._offset + self._fill

    def finish(self) -> None:
        """Write every byte given so far; raise the first error of any write."""
        self._drain()
        if self._fill:
            assert self._current is not None
            aligned = self._fill - self._fill % self.align
            if aligned:
                self._pwrite(self._views[self._current][:aligned], self._offset, direct=True)
            if aligned < self._fill:
                self._pwrite(self._views[self._current][aligned : self._fill], self._offset + aligned, direct=False)
            self._offset += self._fill
            self._fill = 0
        self.close()

    def close(self) -> None:
        """Stop the writer threads and free the buffers (after :meth:`finish`, or to give up).
        Returns only once no write is in flight: the caller's memory is then its own again."""
        while self._pending:
            self._pending.popleft()[1].exception()  # wait; an error here is the caller's to have seen, or moot
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for view in self._views:
            view.release()
        for buf in self._buffers:
            try:
                buf.close()
            except BufferError:
                pass  # a failed write's traceback still holds a slice: freed with it
        self._views, self._buffers, self._free, self._current = [], [], [], None

    def _write_from_source(self, src: memoryview) -> None:
        head = -self.position % self.align
        self.write([src[:head]])  # copied: the buffer now ends at an aligned offset
        if self._current is not None:
            if self._fill:
                self._submit_buffer()
            else:
                self._free.append(self._current)
                self._current = None
        end = head + (len(src) - head) // self.align * self.align
        for start in range(head, end, PIECE_BYTES):
            piece = src[start : min(start + PIECE_BYTES, end)]
            self._submit(None, piece, self._offset)
            self._offset += len(piece)
            self.from_source += len(piece)
        self.write([src[end:]])

    def _take(self) -> int:
        """A buffer to fill: a free one, a new one (up to DEPTH), or the next one written."""
        while not self._free and len(self._buffers) >= DEPTH:
            self._retire_oldest()
        if self._free:
            return self._free.pop()
        buf = mmap.mmap(-1, BLOCK_BYTES)  # anonymous: page aligned, pages touched only when filled
        self._buffers.append(buf)
        self._views.append(memoryview(buf))
        return len(self._buffers) - 1

    def _submit_buffer(self) -> None:
        assert self._current is not None
        index, nbytes = self._current, self._fill
        offset = self._offset
        self._offset += nbytes
        self._current = None
        self._fill = 0
        self._submit(index, self._views[index][:nbytes], offset)

    def _submit(self, index: int | None, view: memoryview, offset: int) -> None:
        """Write ``view`` (buffer ``index``, or the caller's memory for None) at ``offset``."""
        kind = index is None
        if kind not in self._proven:
            # The first write of each kind in this thread: a refusal of O_DIRECT is found here,
            # before any write runs in parallel.
            self._drain()
            self._pwrite(view, offset, direct=True)
            self._proven.add(kind)
            if index is not None:
                self._free.append(index)
            return
        while len(self._pending) >= DEPTH - 1:
            self._retire_oldest()
        if not self._pending:
            self._set_direct(True)  # nothing in flight: the flags may change (a short write cleared it)
        if self._pool is None:
            self._pool = Workers(DEPTH - 1, "checkpointer-write")
        self._pending.append((index, self._pool.submit(self._write_block, view, offset, index is None)))

    def _retire_oldest(self) -> None:
        """Wait for the oldest write in flight (raising its error) and free its buffer."""
        index, future = self._pending.popleft()
        rest = future.result()
        if index is not None:
            self._free.append(index)
        if rest is not None:
            self._drain([rest])

    def _write_block(self, view: memoryview, offset: int, from_memory: bool = False) -> _Rest | None:
        """``pwrite`` with the descriptor's flags as they are (in a writer thread, or from
        :meth:`_pwrite`): None once every byte is written, or what a short write left unaligned
        (for :meth:`_drain` to write once nothing is in flight). ``from_memory``: the caller's
        memory, which ``O_DIRECT`` may refuse where it took other memory (EINVAL, EFAULT: a
        mapping it cannot pin): that is left to :meth:`_drain` too, to write the ordinary way."""
        while len(view):
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as ex:
                if from_memory and self.direct and ex.errno in (errno.EINVAL, errno.EFAULT):
                    return view, offset
                raise
            if n == 0:
                raise OSError(errno.EIO, f"write of {self.path} at byte {offset} wrote nothing")
            view, offset = view[n:], offset + n
            if len(view) and (n % self.align):
                return view, offset
        return None

    def _drain(self, rests: list[_Rest] | None = None) -> None:
        """Wait for every write in flight (raising the first error), then write what short
        writes left, in this thread, now that the descriptor's flags may change."""
        rests = list(rests or [])
        while self._pending:
            index, future = self._pending.popleft()
            rest = future.result()
            if index is not None:
                self._free.append(index)
            if rest is not None:
                rests.append(rest)
        for view, offset in rests:
            self._pwrite(view, offset, direct=False)

    def _pwrite(self, view: memoryview, offset: int, direct: bool) -> None:
        """Write all of ``view`` in this thread, with nothing in flight (the flags may change)."""
        self._set_direct(direct)
        while True:
            try:
                rest = self._write_block(view, offset)
            except OSError as ex:
                if ex.errno != errno.EINVAL or not self.direct:
                    raise
                self.refused = True  # this file system takes O_DIRECT at fcntl but not at write
                self._set_direct(False)
                continue  # from the start: bytes written before the refusal are written again, the same
            if rest is None:
                return
            view, offset = rest
            self._set_direct(False)  # a short write left the rest unaligned

    def _set_direct(self, on: bool) -> None:
        on = on and not self.refused
        if on == self.direct:
            return
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
        except OSError:
            if not on:
                raise
            self.refused = True
            return
        self.direct = on
