"""Uploads to Google Cloud Storage through one resumable upload session (:class:`GCSWriter`).

The writers (this one and :class:`~checkpointer.storage.gcs_compose.GCSComposeWriter`) send
their requests through the :class:`~checkpointer.storage.gcs.GCSStorage` that opened them,
which retries them and names the URL in errors; :class:`Uploads` is what they use of it.
A resumable upload session URI is a bearer credential: it never appears in a message or a
log line.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, TypeVar
from urllib.parse import urlencode

from .parts import Part, PartReader, PartWriter, part_bytes

__all__ = ["GCSWriter", "Uploads", "check_stored"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Uploads(Protocol):
    """What a writer uses of the :class:`~checkpointer.storage.gcs.GCSStorage` that opened it."""

    bucket: str
    part_size: int
    max_concurrency: int

    @property
    def _endpoint(self) -> str: ...

    @property
    def _upload_url(self) -> str: ...

    def _key(self, name: str) -> str: ...

    def join(self, name: str) -> str: ...

    def call(self, op: str, name: str, fn: Callable[[int], T]) -> T: ...

    def request(self, method: str, url: str, *, ok: tuple[int, ...] = (200,), stream: bool = False, **kw: Any) -> Any: ...


def check_stored(resp: Any, expected: int) -> None:
    """Close the answer to the request that completed an object, which describes the object,
    after checking that it holds ``expected`` bytes. It can hold fewer: after a 401, the
    authorized session refreshes its credentials and sends the request again with the same
    body object, which a :class:`PartReader` body has already been read to its end. A
    ``ConnectionError``, which the caller's retries send again with a body read from its start."""
    with resp:
        try:
            size = int(resp.json()["size"])
        except (ValueError, KeyError, TypeError):
            return  # no object resource in the answer: nothing to compare
    if size != expected:
        raise ConnectionError(f"the stored object holds {size} bytes, not the {expected} sent")


def _body(part: Part, start: int = 0) -> memoryview | bytes | PartReader:
    """A request body of ``part`` from byte ``start`` on, without joining its segments."""
    if part_bytes(part) <= start:
        return b""  # requests sends an empty memoryview chunked; an empty body must be b""
    if len(part) == 1:
        return part[0][start:]
    return PartReader(part, start)


class GCSWriter(PartWriter):
    """Streams a file into a resumable upload; a file smaller than one chunk is one request.

    GCS takes the chunks of a resumable upload strictly in order, so the parallelism is a
    pipeline: one chunk uploads while the caller fills the next (at most two chunk buffers).
    A buffer of a chunk or more is uploaded straight from the caller's memory. The object
    appears when the last chunk, which carries the total size, lands.
    """

    def __init__(self, storage: Uploads, name: str, **parts: Any):
        super().__init__(storage.join(name), storage.part_size, **(parts or {"workers": 1, "in_flight": 1}))
        self._s = storage
        self._name = name
        self._key = storage._key(name)
        self._session_url: str | None = None

    @property
    def _upload_base(self) -> str:
        return self._s._upload_url

    def _begin(self) -> None:
        self._start_session()

    def _upload(self, number: int, offset: int, part: Part, total: int | None) -> None:
        self._send_chunk(offset, part, total)

    def _start_session(self) -> None:
        query = urlencode({"uploadType": "resumable", "name": self._key})
        resp = self._s.call("POST resumable session", self._name, lambda _: self._s.request(
            "POST", f"{self._upload_base}?{query}", json={"name": self._key},
            headers={"X-Upload-Content-Type": "application/octet-stream"}))
        with resp:
            location = resp.headers.get("Location")
        if not location:
            raise OSError(f"POST resumable session {self.url}: the response has no Location")
        self._session_url = location

    def _persisted(self) -> int | None:
        """Bytes the session holds (a status query); None once the object is complete."""
        # gcp-storage-emulator answers this query with "Range: bytes=0-0" when it holds no
        # bytes at all (real GCS sends no Range header), so it is only asked after a failure.
        resp = self._s.request("PUT", self._session_url, ok=(200, 201, 308), headers={"Content-Range": "bytes */*"})
        with resp:
            return None if resp.status_code in (200, 201) else _range_end(resp.headers.get("Range"))

    def _send_chunk(self, offset: int, part: Part, total: int | None) -> None:
        """Send bytes ``[offset, ...)`` of the session; ``total`` (the file size) with the last chunk."""
        end = offset + part_bytes(part)

        def attempt(n: int) -> None:
            pos = offset
            if n:  # after a failure, ask the session what it holds and go on from there
                held = self._persisted()
                if held is None:
                    if total is None:
                        raise OSError("the upload session completed before its last chunk")
                    return
                if held < offset:
                    raise OSError(f"the upload session holds {held} bytes, fewer than the {offset} already sent")
                pos = min(held, end)
            while total is not None or pos < end:
                if pos < end:
                    rng = f"bytes {pos}-{end - 1}/{'*' if total is None else total}"
                else:
                    rng = f"bytes */{total}"
                resp = self._s.request("PUT", self._session_url, ok=(200, 201, 308),
                                       data=_body(part, pos - offset), headers={"Content-Range": rng})
                if resp.status_code in (200, 201):
                    try:
                        check_stored(resp, end if total is None else total)
                    except ConnectionError as e:  # the session is over: sending again cannot mend it
                        raise OSError(str(e)) from e
                    return
                with resp:
                    held = _range_end(resp.headers.get("Range"))
                if held <= pos:
                    raise ConnectionError(f"the upload session took none of the bytes from {pos}")
                pos = min(held, end)

        self._s.call(f"PUT bytes {offset}-{end - 1}" + ("" if total is None else f" of {total}"), self._name, attempt)

    def commit(self) -> None:
        self._check()
        done = False
        try:
            if not self.started:
                self._one_request()
            else:
                self._finish_parts(last_if_empty=True)
            self._session_url = None
            done = True
        finally:
            if not done:
                self.abort()
        self._close()

    def _one_request(self) -> None:
        """The whole file, smaller than one chunk, in one request."""
        data = self._parts.rest()
        if not data:
            # An empty file goes through a session: gcp-storage-emulator fails on an empty
            # one-request upload (real GCS takes it).
            self._start_session()
            self._send_chunk(0, data, 0)
            return
        query = urlencode({"uploadType": "media", "name": self._key})
        self._s.call("POST", self._name, lambda _: check_stored(self._s.request(
            "POST", f"{self._upload_base}?{query}", data=_body(data),
            headers={"Content-Type": "application/octet-stream"}), part_bytes(data)))

    def abort(self) -> None:
        self._close()
        session, self._session_url = self._session_url, None
        if session is None:
            return
        # Real GCS cancels a session on DELETE (answering 499); gcp-storage-emulator has no
        # such route (501) and simply keeps the unfinished bytes out of sight. Best effort:
        # an unfinished session is invisible and expires after a week.
        try:
            self._s.request("DELETE", session, ok=(200, 204, 404, 410, 499)).close()
        except OSError as e:
            log.debug("could not cancel the upload session of %s: %s", self.url, e)


def _range_end(header: str | None) -> int:
    """Bytes persisted according to a ``Range: bytes=0-N`` header (none: 0)."""
    if not header:
        return 0
    return int(header.rsplit("-", 1)[1]) + 1
