"""What the remote backends (S3, GCS, HTTP) share: retries, ranged-read planning, redaction.

Stdlib only; each backend says which of its vendor errors are transient.

* :func:`call_with_retry` retries a transient failure (throttling, 5xx, reset connections,
  timeouts) with exponential backoff and jitter, bounded in count (``CHECKPOINTER_IO_RETRIES``,
  default 8) and in time; then an ``OSError`` names the operation and the URL.
* :func:`plan_ranges` turns ``(offset, buffer)`` requests into ranged requests: adjacent
  requests coalesced, large ones split; :func:`fill_range` streams one range straight into
  its buffers and resumes where it stopped when retried; :func:`run_parallel` runs them on a
  bounded thread pool.
* :class:`PartWriter` cuts what a writer is given into upload parts (:class:`PartBuffer`)
  and uploads them on a bounded pool, so memory stays bounded.
* :func:`redact` removes user-info and query strings (signatures, tokens, upload ids) from
  URLs in text, so no credential reaches a message or a log line.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import random
import re
import threading
import time
from abc import abstractmethod
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

from .base import ReadRequest, Storage, Writer

__all__ = [
    "RetryPolicy", "HTTPStatusError", "RangeTask", "Part", "PartBuffer", "PartReader", "PartWriter", "part_bytes", "bucket_url", "io_retries",
    "call_with_retry", "holds", "is_transient", "transient_status", "plan_ranges", "fill_range", "run_parallel", "redact",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRIES_ENV = "CHECKPOINTER_IO_RETRIES"
DEFAULT_RETRIES = 8
READ_BLOCK = 256 * 1024
"""Bytes asked of a response stream per ``readinto``: bounds the transient copy that urllib3
makes, and what a dropped connection loses of a block in progress."""


def io_retries() -> int:
    """Retries allowed after a transient failure: ``CHECKPOINTER_IO_RETRIES`` (default 8)."""
    raw = os.environ.get(RETRIES_ENV, "").strip()
    if not raw:
        return DEFAULT_RETRIES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{RETRIES_ENV}={raw!r} is not an integer; set it to 0 or more") from None
    if value < 0:
        raise ValueError(f"{RETRIES_ENV}={value} is negative; set it to 0 or more")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry one operation.

    Args:
        retries: retries after the first attempt (default: ``CHECKPOINTER_IO_RETRIES`` or 8).
        base_delay: the first backoff, in seconds; each retry doubles it, up to ``max_delay``.
        max_delay: the longest single backoff.
        max_elapsed: no retry starts after this many seconds spent on the operation.
    """

    retries: int = field(default_factory=io_retries)
    base_delay: float = 0.25
    max_delay: float = 20.0
    max_elapsed: float = 600.0

    def delay(self, retry: int) -> float:
        """Backoff before retry number ``retry`` (1-based): exponential, jittered in its upper half."""
        cap = min(self.max_delay, self.base_delay * (2 ** (retry - 1)))
        return random.uniform(cap / 2, cap)


class HTTPStatusError(OSError):
    """An HTTP response whose status means failure (raised by the raw HTTP paths)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def transient_status(status: int) -> bool:
    """Request timeout, throttling and server errors (not 501) are worth retrying; other 4xx are not."""
    return status in (408, 429) or (500 <= status <= 599 and status != 501)


def is_transient(exc: BaseException) -> bool:
    """The builtin transient failures; backends add their vendor errors to this."""
    if isinstance(exc, HTTPStatusError):
        return transient_status(exc.status)
    return isinstance(exc, (ConnectionError, TimeoutError))


_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@'\"]+@")
_QUERY = re.compile(r"(?P<url>[a-zA-Z][a-zA-Z0-9+.-]*://[^\s?'\"]*|/[^\s?'\"]*)\?[^\s'\"#)]*")


def redact(text: str) -> str:
    """``text`` with URL user-info and query strings replaced by ``***``."""
    text = _USERINFO.sub(r"\g<scheme>***@", text)
    return _QUERY.sub(r"\g<url>?***", text)


def call_with_retry(
    fn: Callable[[int], T],
    *,
    op: str,
    url: str,
    transient: Callable[[BaseException], bool] = is_transient,
    policy: RetryPolicy | None = None,
) -> T:
    """Call ``fn(attempt)`` until it returns, retrying transient failures.

    Args:
        fn: the operation; it gets the attempt number (0 first) so that a retry can resume.
        op: what is being done, for messages (``"GET bytes 0-99"``).
        url: the object's URL, for messages; it must already be free of credentials.
        transient: says which exceptions are worth retrying; others propagate unchanged.
        policy: count and time bounds (default: :class:`RetryPolicy`).

    Returns:
        What ``fn`` returned.

    Raises:
        OSError: naming ``op`` and ``url`` when the retries or the time run out (the last
            failure is the cause).
    """
    policy = policy or RetryPolicy()
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn(attempt)
        except Exception as exc:
            if not transient(exc):
                raise
            attempt += 1
            elapsed = time.monotonic() - start
            pause = policy.delay(attempt)
            if attempt > policy.retries or elapsed + pause > policy.max_elapsed:
                raise OSError(
                    f"{op} {url} failed after {attempt} attempts in {elapsed:.1f}s "
                    f"(limit {policy.retries} retries, {RETRIES_ENV}): "
                    f"{type(exc).__name__}: {redact(str(exc))}"
                ) from exc
            log.debug("%s %s: retry %d in %.2fs after %s", op, url, attempt, pause, type(exc).__name__)
            time.sleep(pause)


def holds(storage: Storage, name: str, data: bytes) -> bool:
    """Whether the file ``name`` holds exactly ``data``: after a conditional create whose
    answer was lost, a retry that finds the file tells ours from someone else's this way."""
    try:
        return storage.read(name) == data
    except OSError:
        return False


@dataclass
class RangeTask:
    """Bytes ``[start, end)`` of one object, to land in ``buffers`` (consecutive, flat bytes).

    ``done`` counts the bytes already filled, so a retried attempt asks only for the rest.
    """

    start: int
    end: int
    buffers: list[memoryview]
    done: int = 0


def _flat(buf: memoryview) -> memoryview:
    buf = memoryview(buf)
    if buf.readonly:
        raise ValueError("read_into needs writable buffers")
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


def plan_ranges(requests: Sequence[ReadRequest], max_range: int) -> list[RangeTask]:
    """Group read requests into ranged requests.

    Requests are sorted by offset; a request that starts where the previous one ends joins
    it, and a group longer than ``max_range`` is cut into pieces of at most ``max_range``
    bytes (a buffer that straddles a cut is sliced, never copied). Empty buffers are dropped.

    Example:
        ``[(0, 4 bytes), (4, 4 bytes), (20, 2 bytes)]`` with ``max_range=6`` gives
        ``[0, 6)``, ``[6, 8)`` and ``[20, 22)``.
    """
    if max_range <= 0:
        raise ValueError(f"max_range must be positive, got {max_range}")
    flat = sorted(((off, _flat(buf)) for off, buf in requests if len(buf)), key=lambda r: r[0])
    groups: list[tuple[int, list[memoryview]]] = []
    end = -1
    for off, buf in flat:
        if off < 0:
            raise ValueError(f"negative read offset {off}")
        if groups and off == end:
            groups[-1][1].append(buf)
        else:
            groups.append((off, [buf]))
        end = off + len(buf)
    tasks: list[RangeTask] = []
    for off, bufs in groups:
        task = RangeTask(off, off, [])
        for buf in bufs:
            while len(buf):
                room = max_range - (task.end - task.start)
                if room == 0:
                    tasks.append(task)
                    task = RangeTask(task.end, task.end, [])
                    room = max_range
                piece, buf = buf[:room], buf[room:]
                task.buffers.append(piece)
                task.end += len(piece)
        tasks.append(task)
    return tasks


class _Readable(Protocol):
    def readinto(self, b: memoryview, /) -> int | None: ...


def fill_range(task: RangeTask, stream: _Readable, block: int = READ_BLOCK) -> None:
    """Read the rest of ``task`` (from ``task.start + task.done``) from ``stream`` into its buffers.

    ``stream`` must deliver exactly those bytes. ``task.done`` advances as bytes land, so a
    caller that retries after a failure opens a stream at the new position.

    Raises:
        ConnectionError: the stream ended early (transient: a dropped connection).
    """
    skip = task.done
    for buf in task.buffers:
        if skip >= len(buf):
            skip -= len(buf)
            continue
        pos, skip = skip, 0
        while pos < len(buf):
            n = stream.readinto(buf[pos : min(len(buf), pos + block)])
            if not n:
                raise ConnectionError(
                    f"response ended at byte {task.start + task.done} of range {task.start}-{task.end - 1}"
                )
            pos += n
            task.done += n


def run_parallel(fn: Callable[[T], None], items: Iterable[T], max_workers: int) -> None:
    """Call ``fn`` on every item, at most ``max_workers`` at a time; the first failure is raised.

    After a failure no new item starts; the ones running finish first.
    """
    items = list(items)
    if len(items) <= 1 or max_workers <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="ckpt-io") as pool:
        futures = [pool.submit(fn, item) for item in items]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in pending:
            fut.cancel()
        for fut in futures:
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]


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
        self._pool: ThreadPoolExecutor | None = None
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
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="ckpt-upload")
        offset, self._offset = self._offset, self._offset + part_bytes(part)
        self._slots.acquire()
        try:
            fut = self._pool.submit(self._upload, number, offset, part, total)
        except BaseException:
            self._slots.release()
            raise
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
            self._pool.shutdown(wait=True)


def bucket_url(url: str, schemes: tuple[str, ...]) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``scheme://bucket/prefix``, the prefix without outer slashes."""
    scheme, sep, rest = str(url).partition("://")
    if scheme.lower() not in schemes or not sep:
        raise ValueError(f"not a {schemes[0]}:// URL: {url!r}")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: use {schemes[0]}://bucket/prefix")
    return bucket, prefix.strip("/")
