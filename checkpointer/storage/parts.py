"""Uploads in parts: what the S3 and GCS writers share.

* :class:`PartBuffer` cuts the buffers a writer is given into parts of a fixed size, each a
  list of segments: slices of the caller's memory where it may keep them (``write_stable``,
  or a buffer of a part or more, waited for), copies otherwise;
* :class:`PartReader` sends a part as one seekable file without joining its segments;
* :class:`PartWriter` uploads parts on a bounded pool, at most ``in_flight`` at a time, so
  memory stays bounded; the part size can grow past a store's part-count limit.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from abc import abstractmethod
from concurrent.futures import Future, wait
from typing import Iterator, Sequence

from .base import Writer
from .parallel import Workers

__all__ = ["Part", "PartBuffer", "PartReader", "PartWriter", "part_bytes"]

Part = list[memoryview]
"""One upload part: consecutive flat byte segments (slices of the caller's memory, or copies)."""


def part_bytes(part: Part) -> int:
    return sum(len(seg) for seg in part)


class PartReader:
    """A seekable binary file over a part's segments, from byte ``start`` on, so that a client
    library can send (and resend) the part without joining it into one buffer.

    ``read`` returns ``bytes`` (some libraries concatenate what they read), at most one
    segment's worth at a time.
    """

    def __init__(self, part: Part, start: int = 0):
        self._segs = [seg for seg in part if len(seg)]
        self._ends = list(itertools.accumulate(len(seg) for seg in self._segs))
        self._first = start
        self._pos = start
        self._total = self._ends[-1] if self._ends else 0

    def __len__(self) -> int:
        return self._total - self._first

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            n = self._total - self._pos
        out: list[bytes] = []
        while n > 0 and self._pos < self._total:
            i = bisect.bisect_right(self._ends, self._pos)
            seg_start = self._ends[i] - len(self._segs[i])
            piece = self._segs[i][self._pos - seg_start : self._pos - seg_start + n]
            out.append(piece.tobytes())
            self._pos += len(piece)
            n -= len(piece)
        return out[0] if len(out) == 1 else b"".join(out)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos - self._first, 2: len(self)}[whence]
        self._pos = self._first + max(0, min(len(self), base + pos))
        return self._pos - self._first

    def tell(self) -> int:
        return self._pos - self._first


class PartBuffer:
    """Cuts the buffers handed to a writer into parts of exactly ``size`` bytes.

    A part is a list of segments, and the bytes get there in one of three ways:

    * *stable* buffers (``feed(..., stable=True)``, from :meth:`Writer.write_stable`) are
      sliced, never copied: the caller keeps them until the writer is closed;
    * a buffer of a part or more that starts a part is cut into slices that are "borrowed":
      valid only until the caller's ``write`` returns, so the writer must wait for them;
    * any other bytes are copied into a buffer owned by the part (at most one part's worth),
      so a part being uploaded is never overwritten.

    The tail is kept for the next call or :meth:`rest`.
    """

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"part size must be positive, got {size}")
        self.size = size
        self.total = 0
        self._segs: Part = []
        self._fill = 0
        self._copy: bytearray | None = None  # the run of copied bytes at the end of the part
        self._copied = 0

    def feed(self, buffers: Sequence[memoryview], *, stable: bool = False) -> Iterator[tuple[Part, bool]]:
        """Full parts, in order, as ``(part, borrowed)``."""
        for buf in buffers:
            view = memoryview(buf).cast("B")
            self.total += len(view)
            while len(view):
                if not stable and self._fill == 0 and len(view) >= self.size:
                    yield [view[: self.size]], True
                    view = view[self.size :]
                    continue
                n = min(len(view), self.size - self._fill)
                if stable:
                    self._end_copy()
                    self._segs.append(view[:n])
                else:
                    if self._copy is None:
                        self._copy, self._copied = bytearray(self.size - self._fill), 0
                    self._copy[self._copied : self._copied + n] = view[:n]
                    self._copied += n
                self._fill += n
                view = view[n:]
                if self._fill == self.size:
                    yield self.rest(), False

    def _end_copy(self) -> None:
        if self._copy is not None:
            self._segs.append(memoryview(self._copy)[: self._copied])
            self._copy, self._copied = None, 0

    def rest(self) -> Part:
        """The bytes not yet in a full part (the last part), and forget them."""
        self._end_copy()
        part, self._segs, self._fill = self._segs, [], 0
        return part


class PartWriter(Writer):
    """A writer that uploads fixed-size parts on a pool of ``workers`` threads.

    At most ``in_flight`` parts are queued or uploading; :meth:`write` blocks for a slot, so
    at most ``in_flight + 1`` parts' worth of copied bytes exist. Parts borrowed from the
    caller's memory are waited for before :meth:`write` returns; :meth:`write_stable` copies
    nothing and waits for nothing but a slot. With ``grow_every``, the part size doubles after
    every that many parts. Subclasses say how a part is uploaded.
    """

    def __init__(self, url: str, part_size: int, *, workers: int, in_flight: int, max_parts: int | None = None,
                 grow_every: int | None = None):
        self.url = url
        self._parts = PartBuffer(part_size)
        self._workers = workers
        self._slots = threading.Semaphore(in_flight)
        self._max_parts = max_parts
        self._grow_every = grow_every
        self._futures: list[Future] = []
        self._pool: Workers | None = None
        self._offset = 0
        self._closed = False

    def _begin(self) -> None:
        """Called before the first part is uploaded (start a multipart upload or a session)."""

    @abstractmethod
    def _upload(self, number: int, offset: int, part: Part, total: int | None) -> None:
        """Upload part ``number`` (1-based), bytes ``[offset, offset + part_bytes(part))``; ``total`` is
        the file size when this is the last part (only :meth:`_finish_parts` says so)."""

    @property
    def started(self) -> bool:
        return self._pool is not None

    def _check(self) -> None:
        if self._closed:
            raise ValueError(f"writer for {self.url} is closed")
        for fut in self._futures:
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]

    def write(self, buffers: Sequence[memoryview]) -> None:
        self._feed(buffers, stable=False)

    def write_stable(self, buffers: Sequence[memoryview]) -> None:
        self._feed(buffers, stable=True)

    def _feed(self, buffers: Sequence[memoryview], stable: bool) -> None:
        self._check()
        borrowed: list[Future] = []
        try:
            for part, is_borrowed in self._parts.feed(buffers, stable=stable):
                fut = self._submit(part)
                if is_borrowed:
                    borrowed.append(fut)
        finally:
            wait(borrowed)  # the caller may reuse its buffers once write returns
        for fut in borrowed:
            fut.result()

    def _submit(self, part: Part, total: int | None = None) -> Future:
        number = len(self._futures) + 1
        if self._max_parts is not None and number > self._max_parts:
            raise OSError(f"{self.url} needs more than {self._max_parts} parts: raise part_size")
        if self._pool is None:
            self._begin()
            self._pool = Workers(self._workers, "ckpt-upload")
        offset, self._offset = self._offset, self._offset + part_bytes(part)
        self._slots.acquire()
        fut = None
        try:
            fut = self._pool.submit(self._upload, number, offset, part, total)
        finally:
            if fut is None:
                self._slots.release()
        fut.add_done_callback(lambda _: self._slots.release())
        self._futures.append(fut)
        if self._grow_every and number % self._grow_every == 0:
            # Between parts (none is half full): later parts are twice as big, so that a store's
            # part-count limit is not what limits the file's size.
            self._parts.size *= 2
        return fut

    def _finish_parts(self, last_if_empty: bool) -> None:
        """Upload the tail as the last part (also when empty, if ``last_if_empty``); wait for all."""
        rest = self._parts.rest()
        if rest or last_if_empty:
            self._submit(rest, total=self._offset + part_bytes(rest))
        for fut in self._futures:
            fut.result()

    def _close(self) -> None:
        self._closed = True
        self._parts.rest()
        if self._pool is not None:
            for fut in self._futures:
                fut.cancel()
            self._pool.shutdown()
