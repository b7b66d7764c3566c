"""Google Cloud Storage through google-cloud-storage.

``gs://bucket/prefix``: a file ``name`` is the object ``prefix/name``. The client finds the
endpoint and credentials the standard way (``STORAGE_EMULATOR_HOST``, application default
credentials). Metadata calls (size, list, delete) go through the client's public API with
its retries off; the data path (ranged GETs, uploads) speaks the JSON API over the client's
authorized session, so bytes go straight between the socket and the caller's buffers. A file
of several parts is uploaded as part objects in parallel and composed
(:mod:`~checkpointer.storage.gcs_compose`), or with ``parallel_upload=False`` through one
resumable upload (:mod:`~checkpointer.storage.gcs_upload`). Every call is retried by :func:`call_with_retry` (``CHECKPOINTER_IO_RETRIES``).

A :meth:`GCSStorage.pinned` view (one per load) reads each object as it first saw it: later
GETs carry ``ifGenerationMatch`` with its generation, and an object replaced meanwhile is
:class:`~checkpointer.storage.base.FileChangedError`.

A resumable upload session URI is a bearer credential: it never appears in a message, a
log line or an exception (transport errors are re-raised with redacted text).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence, TypeVar
from urllib.parse import quote, urlencode

from .. import settings
from .base import ReadRequest, Storage, check_name
from .gcs_compose import GCSComposeWriter
from .gcs_upload import GCSWriter
from .parallel import run_parallel
from .ranges import RangeTask, StreamEnded, check_range_start, ended_as_sent, ends_before, fill_range, plan_ranges
from .redact import redact, redact_transport_logs
from .retry import RetryPolicy, call_with_retry, holds
from .transient import HTTPStatusError, certificate_refused, is_transient, transient_status
from .urls import bucket_url
from .versions import Versions, pinned_copy, replaced

__all__ = ["GCSStorage"]

T = TypeVar("T")

MiB = 1 << 20
CHUNK_UNIT = 256 * 1024  # resumable chunks (all but the last) are multiples of this


def _gcs():
    try:
        from google.api_core import exceptions as api_exceptions
        from google.cloud import storage as gcs
    except ImportError as e:  # pragma: no cover - a dependency
        raise ImportError("gs:// URLs need google-cloud-storage: pip install google-cloud-storage") from e
    return gcs, api_exceptions


def _transient(exc: BaseException) -> bool:
    _, api = _gcs()
    import google.auth.exceptions
    import requests
    import urllib3.exceptions

    if isinstance(exc, api.GoogleAPICallError):
        return transient_status(int(exc.code or 0))
    return isinstance(exc, (
        google.auth.exceptions.TransportError, requests.ConnectionError, requests.Timeout,
        requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError,
    )) or is_transient(exc)


@contextlib.contextmanager
def _transport_errors() -> Iterator[None]:
    """Re-raise transport errors as builtin ones with redacted text (they quote request URLs)."""
    import requests
    import urllib3.exceptions

    try:
        yield
    except (requests.Timeout, urllib3.exceptions.TimeoutError) as e:
        raise TimeoutError(f"{type(e).__name__}: {redact(str(e))}") from None
    except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError) as e:
        kind = OSError if certificate_refused(e) else ConnectionError  # a refused certificate is not retried
        raise kind(f"{type(e).__name__}: {redact(str(e))}") from None
    except requests.RequestException as e:
        raise OSError(f"{type(e).__name__}: {redact(str(e))}") from None


class GCSStorage(Storage):
    """Files under ``gs://bucket/prefix``.

    Args:
        url: ``gs://bucket`` or ``gs://bucket/prefix`` (``gcs://`` also accepted).
        client: a ``google.cloud.storage.Client`` (default: one from the standard settings).
            :meth:`child` views share it.
        part_size: bytes per upload part (or resumable-upload chunk) and per ranged GET
            (rounded up to 256 KiB).
        max_concurrency: parallel requests of one ``read_into`` or one writer.
        parallel_upload: upload a file of more than one part as part objects in parallel,
            composed at commit (:mod:`~checkpointer.storage.gcs_compose`, which says what that
            costs); ``False``: one resumable upload, one chunk at a time. Default:
            ``CHECKPOINTER_GCS_PARALLEL_UPLOAD`` (``0`` turns it off), else on.
        retry: retry bounds (default: :class:`RetryPolicy`, ``CHECKPOINTER_IO_RETRIES``).
        timeout: ``(connect, read)`` socket timeouts, in seconds.
    """

    def __init__(self, url: str, *, client: Any = None, part_size: int = 32 * MiB, max_concurrency: int = 8,
                 retry: RetryPolicy | None = None, timeout: tuple[float, float] = (10.0, 120.0),
                 parallel_upload: bool | None = None):
        self.bucket, self.prefix = bucket_url(url, ("gs", "gcs"))
        if self.prefix:
            check_name(self.prefix)
        self.url = f"gs://{self.bucket}/{self.prefix}" if self.prefix else f"gs://{self.bucket}"
        if part_size <= 0:
            raise ValueError(f"part_size must be positive, got {part_size}")
        self.part_size = -(-part_size // CHUNK_UNIT) * CHUNK_UNIT
        self.max_concurrency = max(1, max_concurrency)
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        if parallel_upload is None:
            parallel_upload = settings.gcs_parallel_upload()
        self.parallel_upload = parallel_upload
        if client is None:
            import google.auth.exceptions

            gcs, _ = _gcs()
            try:
                client = gcs.Client(project=None)
            except google.auth.exceptions.DefaultCredentialsError as e:
                raise OSError(f"no Google credentials for {self.url}: run `gcloud auth application-default login` "
                              "or set GOOGLE_APPLICATION_CREDENTIALS (or STORAGE_EMULATOR_HOST for an emulator)") from e
        self._client = client
        self._versions: Versions | None = None  # a pinned view's: the generation first seen per object
        redact_transport_logs()  # session URIs are in urllib3's debug lines

    # The authorized requests session the client itself uses (google-cloud-storage's
    # transfer_manager uses it the same way); it refreshes credentials on its own.
    @property
    def _session(self) -> Any:
        return self._client._http

    @property
    def _endpoint(self) -> str:
        return str(self._client.api_endpoint).rstrip("/")

    def _key(self, name: str) -> str:
        name = check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> GCSStorage:
        storage = GCSStorage.__new__(GCSStorage)
        storage.__dict__.update(self.__dict__)
        storage.prefix = self._key(name)
        storage.url = f"gs://{self.bucket}/{storage.prefix}"
        return storage

    def pinned(self) -> GCSStorage:
        return pinned_copy(self)

    def _saw(self, name: str, generation: object) -> None:
        if self._versions is not None:
            self._versions.saw(self._key(name), generation, self.join(name))

    def call(self, op: str, name: str, fn: Callable[[int], T]) -> T:
        """Run ``fn(attempt)`` with retries; errors become ``FileNotFoundError`` / ``OSError`` naming the URL."""
        _, api = _gcs()
        url = self.join(name)
        try:
            with _transport_errors():
                return call_with_retry(fn, op=op, url=url, transient=_transient, policy=self.retry)
        except api.NotFound as e:
            raise FileNotFoundError(url) from e
        except HTTPStatusError as e:
            if e.status == 404:
                raise FileNotFoundError(url) from e
            if e.status == 412 and self._versions is not None:
                raise replaced(url) from e
            raise OSError(f"{op} {url}: {e}") from e
        except api.GoogleAPICallError as e:
            raise OSError(f"{op} {url}: {type(e).__name__}: {redact(str(e))}") from e
        except OSError as e:
            if type(e) is OSError and url not in str(e):  # not retried (a refused certificate): name the URL
                raise OSError(f"{op} {url}: {e}") from e
            raise

    def request(self, method: str, url: str, *, ok: tuple[int, ...] = (200,), stream: bool = False, **kw: Any) -> Any:
        """One raw request on the authorized session; a status outside ``ok`` is :class:`HTTPStatusError`."""
        with _transport_errors():
            resp = self._session.request(method, url, timeout=self.timeout, stream=stream, **kw)
        if resp.status_code not in ok:
            err = HTTPStatusError(resp.status_code, redact(" ".join(resp.text[:300].split())) or str(resp.reason))
            resp.close()
            raise err
        return resp

    def size(self, name: str) -> int:
        key = self._key(name)
        bucket = self._client.bucket(self.bucket)
        blob = self.call("HEAD", name, lambda _: bucket.get_blob(key, retry=None, timeout=self.timeout))
        if blob is None:
            raise FileNotFoundError(self.join(name))
        self._saw(name, blob.generation)
        return int(blob.size)

    def exists(self, name: str) -> bool:
        blob = self._client.bucket(self.bucket).blob(self._key(name))
        return bool(self.call("HEAD", name, lambda _: blob.exists(retry=None, timeout=self.timeout)))

    def list(self) -> list[str]:
        root = f"{self.prefix}/" if self.prefix else ""

        def listing(_: int) -> list[str]:
            pages = self._client.list_blobs(self.bucket, prefix=root, delimiter="/", retry=None, timeout=self.timeout)
            names = {blob.name[len(root) :] for blob in pages}
            names.update(p[len(root) :].rstrip("/") for p in pages.prefixes)
            names.discard("")
            return sorted(names)

        return self.call("LIST", "", listing)

    def delete(self, name: str) -> None:
        blob = self._client.bucket(self.bucket).blob(self._key(name))
        try:
            self.call("DELETE", name, lambda _: blob.delete(retry=None, timeout=self.timeout))
        except FileNotFoundError:
            pass

    def delete_tree(self, name: str) -> None:
        """Every object under ``name/``, listed, then deleted one request each (on up to
        ``max_concurrency`` threads); one deleted meanwhile is fine."""
        root = f"{self._key(name)}/"
        bucket = self._client.bucket(self.bucket)

        def listing(_: int) -> list[str]:
            return [b.name for b in self._client.list_blobs(self.bucket, prefix=root, retry=None, timeout=self.timeout)]

        def delete(key: str) -> None:
            try:
                self.call("DELETE", key[len(self.prefix) + 1 :] if self.prefix else key,
                          lambda _: bucket.blob(key).delete(retry=None, timeout=self.timeout))
            except FileNotFoundError:
                pass

        run_parallel(delete, self.call("LIST", name, listing), self.max_concurrency)

    @property
    def _upload_url(self) -> str:
        return f"{self._endpoint}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"

    def _media_url(self, name: str) -> str:
        """The object's bytes; in a pinned view, on condition that it is still the generation
        first seen (a 412 otherwise)."""
        bucket, key = quote(self.bucket, safe=""), quote(self._key(name), safe="")
        generation = self._versions.expected(self._key(name)) if self._versions is not None else None
        condition = f"&ifGenerationMatch={generation}" if generation else ""
        return f"{self._endpoint}/download/storage/v1/b/{bucket}/o/{key}?alt=media{condition}"

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        if start < 0 or (end is not None and end <= start):
            self.size(name)  # a missing file is still FileNotFoundError
            return b""
        url = self._media_url(name)
        headers = {"Accept-Encoding": "identity"}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"

        def get(_: int) -> bytes:
            resp = self.request("GET", url, ok=(200, 206, 416), headers=headers)
            if resp.status_code == 416:  # the range starts at or past the end
                return b""
            data = resp.content
            self._saw(name, resp.headers.get("x-goog-generation"))
            check_range_start(start, resp.status_code, resp.headers.get("Content-Range"), f"GET {self.join(name)}")
            return data if end is None else data[: end - start]

        return self.call(f"GET bytes {start}-{'' if end is None else end - 1}", name, get)

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        url = self._media_url(name)
        tasks = plan_ranges(requests, self.part_size)
        run_parallel(lambda task: self._fetch(name, url, task), tasks, self.max_concurrency)

    def _fetch(self, name: str, url: str, task: RangeTask) -> None:
        def attempt(_: int) -> None:
            first = task.start + task.done
            headers = {"Range": f"bytes={first}-{task.end - 1}", "Accept-Encoding": "identity"}
            resp = self.request("GET", url, ok=(200, 206, 416), headers=headers, stream=True)
            with resp:
                self._saw(name, resp.headers.get("x-goog-generation"))
                length, content_range = resp.headers.get("Content-Length"), resp.headers.get("Content-Range")
                where = f"GET {self.join(name)}"
                if resp.status_code == 416 or ends_before(task.end, first, resp.status_code, length, content_range, where=where):
                    raise self._truncated(name, task.end)
                check_range_start(first, resp.status_code, content_range, where)
                with _transport_errors():
                    try:
                        fill_range(task, resp.raw)
                    except StreamEnded:
                        if ended_as_sent(bool(resp.raw.chunked), content_range):
                            raise self._truncated(name, task.end) from None
                        raise

        self.call(f"GET bytes {task.start}-{task.end - 1}", name, attempt)

    def _truncated(self, name: str, end: int) -> OSError:
        return OSError(f"{self.join(name)} ends before byte {end}: the file is truncated")

    def write(self, name: str, data: bytes) -> None:
        with self.open_writer(name) as writer:
            writer.write_stable([memoryview(data)])
            writer.commit()

    def create_exclusive(self, name: str, data: bytes) -> None:
        """A one-request upload on condition that no object has the name (``ifGenerationMatch=0``):
        of two callers, one creates the file and the other gets ``FileExistsError``, also when
        both start at once.

        gcp-storage-emulator ignores the condition (it has no preconditions at all), so there
        the check before the upload is all there is: two callers in the same instant may both
        succeed. ``data`` must not be empty (the emulator fails on an empty one-request upload).
        """
        if self.exists(name):
            raise FileExistsError(self.join(name))
        query = urlencode({"uploadType": "media", "name": self._key(name), "ifGenerationMatch": "0"})

        def post(attempt: int) -> None:
            try:
                self.request("POST", f"{self._upload_url}?{query}", data=data,
                             headers={"Content-Type": "application/octet-stream"}).close()
            except HTTPStatusError as e:
                if e.status != 412:
                    raise
                if attempt and holds(self, name, data):
                    return  # an earlier attempt created it and its answer was lost
                raise FileExistsError(self.join(name)) from e

        self.call("POST if absent", name, post)

    def open_writer(self, name: str) -> GCSWriter:
        if self.parallel_upload:
            return GCSComposeWriter(self, name)
        return GCSWriter(self, name)
