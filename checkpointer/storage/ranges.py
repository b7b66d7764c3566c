"""Ranged reads of a remote object: which requests to send, and the bytes of each into place.

Stdlib only. :func:`plan_ranges` turns ``(offset, buffer)`` requests into ranged requests
(:class:`RangeTask`): adjacent requests coalesced, large ones split. :func:`fill_range`
streams one range straight into its buffers and resumes where it stopped when retried.
:func:`ends_before` and :func:`ended_as_sent` tell a file shorter than the range asked for
(fail at once) from a dropped connection (:class:`StreamEnded`, retried); :func:`check_range_start`
refuses a part of the file other than the one asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from .base import ReadRequest

__all__ = [
    "READ_BLOCK", "RangeTask", "StreamEnded", "plan_ranges", "fill_range", "content_range_total", "content_length", "ends_before",
    "ended_as_sent", "check_range_start",
]

READ_BLOCK = 256 * 1024
"""Bytes asked of a response stream per ``readinto``: bounds the transient copy that urllib3
makes, and what a dropped connection loses of a block in progress."""


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


def content_length(value: str | int | None, where: str) -> int | None:
    """A ``Content-Length`` header as a number of bytes, None when absent. Anything but ASCII
    digits (a sign, a fraction, two values joined by a comma, a word) is an ``OSError`` naming
    ``where``: a server that says that much is not a store to read a checkpoint from."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()):
        raise OSError(f"{where}: the server's Content-Length {str(value)[:40]!r} is not a number of bytes")
    return int(text)


def ends_before(end: int, first: int, status: int, length: str | int | None,
                content_range: str | None, *, where: str = "the response") -> bool:
    """Whether the answer to a GET from byte ``first`` shows the file ending before ``end``: a
    200's Content-Length is the file's size, a 206's counts from ``first``, and a 206's
    Content-Range gives the size. A Content-Length that is not a number is an ``OSError``."""
    size = content_length(length, where)
    if size is not None and size < (end if status == 200 else end - first):
        return True
    total = content_range_total(content_range) if status == 206 else None
    return total is not None and total < end


def check_range_start(first: int, status: int, content_range: str | None, where: str, *, whole: bool = False) -> None:
    """A 206 whose ``Content-Range`` starts anywhere but at ``first``, the byte asked for, is an
    ``OSError`` naming ``where``: its bytes belong elsewhere in the file (a proxy or a cache that
    answers with another part). A 206 without the header cannot be checked. A 200 (the whole
    file: the server ignored the range) is one too where ``first`` is past 0, unless ``whole``
    (the caller skips to ``first``)."""
    if status == 200 and first and not whole:
        raise OSError(f"{where}: the server ignored the Range header (asked for bytes from {first})")
    if status != 206 or content_range is None:
        return
    unit, _, spec = content_range.strip().partition(" ")
    start = spec.partition("-")[0].strip()
    if unit != "bytes" or not (start.isascii() and start.isdigit()) or int(start) != first:
        raise OSError(f"{where}: asked for bytes from {first}, the server answered with {content_range[:80]!r}")


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
