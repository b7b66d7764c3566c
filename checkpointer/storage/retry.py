"""What the remote backends (S3, GCS, HTTP) share: retries, ranged-read planning, redaction.

Stdlib only; each backend says which of its vendor errors are transient.

* :func:`call_with_retry` retries a transient failure (throttling, 5xx, reset connections,
  timeouts) with exponential backoff and jitter, bounded in count (``CHECKPOINTER_IO_RETRIES``,
  default 8) and in time; then an ``OSError`` names the operation and the URL.
* :func:`plan_ranges` turns ``(offset, buffer)`` requests into ranged requests: adjacent
  requests coalesced, large ones split; :func:`fill_range` streams one range straight into
  its buffers and resumes where it stopped when retried; :func:`run_parallel` runs them on a
  bounded thread pool; :func:`ends_before` and :func:`ended_as_sent` tell a file shorter than
  the range asked for (fail at once) from a dropped connection (retry).
* :func:`holds` tells a conditional create's own file from someone else's after a lost answer.

The upload side (parts uploaded on a bounded pool) is in :mod:`~checkpointer.storage.parts`.
* :func:`redact` removes user-info and query strings (signatures, tokens, upload ids) from
  URLs in text, so no credential reaches a message or a log line.
"""

from __future__ import annotations

import logging
import random
import re
import ssl
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence, TypeVar

from .. import settings
from .base import ReadRequest, Storage

__all__ = [
    "RetryPolicy", "HTTPStatusError", "RangeTask", "StreamEnded", "bucket_url",
    "call_with_retry", "certificate_refused", "content_range_total", "ended_as_sent", "ends_before", "holds",
    "is_transient", "transient_status", "plan_ranges", "fill_range", "run_parallel", "redact",
    "redact_transport_logs",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

READ_BLOCK = 256 * 1024
"""Bytes asked of a response stream per ``readinto``: bounds the transient copy that urllib3
makes, and what a dropped connection loses of a block in progress."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry one operation.

    Args:
        retries: retries after the first attempt (default: ``CHECKPOINTER_IO_RETRIES`` or 8).
        base_delay: the first backoff, in seconds; each retry doubles it, up to ``max_delay``.
        max_delay: the longest single backoff.
        max_elapsed: no retry starts after this many seconds spent on the operation.
    """

    retries: int = field(default_factory=settings.io_retries)
    base_delay: float = 0.25
    max_delay: float = 20.0
    max_elapsed: float = 600.0

    def delay(self, retry: int) -> float:
        """Backoff before retry number ``retry`` (1-based): exponential, jittered in its upper half."""
        cap = min(self.max_delay, self.base_delay * (2 ** (retry - 1)))
        return _JITTER.uniform(cap / 2, cap)


_JITTER = random.Random()  # its own: retries must not move the sequence of a user's seeded `random`


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


def certificate_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it wraps) is a server certificate that failed verification:
    client libraries report it as a connection error, but no retry can change it."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen or len(seen) > 32:
            continue
        seen.add(id(e))
        if isinstance(e, ssl.SSLCertVerificationError):
            return True
        todo.extend([e.__cause__, e.__context__, getattr(e, "reason", None), *e.args,
                     *(getattr(e, "kwargs", None) or {}).values()])
    return False


_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@'\"]+@")
_QUERY = re.compile(r"(?P<url>[a-zA-Z][a-zA-Z0-9+.-]*://[^\s?'\"]*|/[^\s?'\"]*)\?[^\s'\"#)]*")


def redact(text: str) -> str:
    """``text`` with URL user-info and query strings replaced by ``***``."""
    text = _USERINFO.sub(r"\g<scheme>***@", text)
    return _QUERY.sub(r"\g<url>?***", text)


class _RedactingFilter(logging.Filter):
    """Redacts a record's message (see :func:`redact`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def redact_transport_logs() -> None:
    """urllib3 logs every request's path and query at DEBUG: a GCS upload session's id (a
    bearer credential), an http(s) root's token. Redact that logger's records (in this
    process, for every user of urllib3: its debug lines then show queries as ``***``)."""
    logger = logging.getLogger("urllib3.connectionpool")
    if not any(isinstance(f, _RedactingFilter) for f in logger.filters):
        logger.addFilter(_RedactingFilter())


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
            if not transient(exc) or certificate_refused(exc):
                raise
            attempt += 1
            elapsed = time.monotonic() - start
            pause = policy.delay(attempt)
            if attempt > policy.retries or elapsed + pause > policy.max_elapsed:
                raise OSError(
                    f"{op} {url} failed after {attempt} attempts in {elapsed:.1f}s "
                    f"(limit {policy.retries} retries, {settings.IO_RETRIES_ENV}): "
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


class StreamEnded(ConnectionError):
    """A response body ended, with no transport error, before the bytes asked for.

    Transient as a rule (a connection closed early); a backend whose response framing shows
    the body was complete takes it for a file shorter than asked for instead."""


def content_range_total(header: str | None) -> int | None:
    """The file size in ``Content-Range: bytes a-b/total`` (or ``bytes */total``); None when absent or ``*``."""
    total = (header or "").rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None


def ends_before(end: int, first: int, status: int, content_length: str | int | None,
                content_range: str | None) -> bool:
    """Whether the answer to a GET from byte ``first`` shows the file ending before ``end``: a
    200's Content-Length is the file's size, a 206's counts from ``first``, and a 206's
    Content-Range gives the size."""
    if content_length is not None and int(content_length) < (end if status == 200 else end - first):
        return True
    total = content_range_total(content_range) if status == 206 else None
    return total is not None and total < end


def ended_as_sent(chunked: bool, content_range: str | None) -> bool:
    """Whether a body that ended early (:class:`StreamEnded`) is all the server meant to send:
    the last chunk of a chunked body arrived (a connection cut mid-body is a transport error
    instead) and no Content-Range promised more of the file."""
    return chunked and content_range_total(content_range) is None


class _Readable(Protocol):
    def readinto(self, b: memoryview, /) -> int | None: ...


def fill_range(task: RangeTask, stream: _Readable, block: int = READ_BLOCK) -> None:
    """Read the rest of ``task`` (from ``task.start + task.done``) from ``stream`` into its buffers.

    ``stream`` must deliver exactly those bytes. ``task.done`` advances as bytes land, so a
    caller that retries after a failure opens a stream at the new position.

    Raises:
        StreamEnded: the stream ended early (a ``ConnectionError``, transient: a dropped connection).
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
                raise StreamEnded(
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


def bucket_url(url: str, schemes: tuple[str, ...]) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``scheme://bucket/prefix``, the prefix without outer slashes."""
    scheme, sep, rest = str(url).partition("://")
    if scheme.lower() not in schemes or not sep:
        raise ValueError(f"not a {schemes[0]}:// URL: {url!r}")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: use {schemes[0]}://bucket/prefix")
    return bucket, prefix.strip("/")
