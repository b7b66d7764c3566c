"""Read-only loading over ``http://`` and ``https://`` with ranged GETs.

``https://host/path/ckpt`` is a directory: the file ``name`` is ``https://host/path/ckpt/name``.
A query string on the root (a shared-access token, say) is sent with every file; user-info
(``https://user:password@host/...``) becomes a basic-auth header. Both are credentials: the
storage's :attr:`HTTPStorage.url`, its messages and its log lines show them as ``***``.

A server that ignores ``Range`` (``python -m http.server``) still works: the response is
read from its start and the bytes before the range are skipped.
"""

from __future__ import annotations

import contextlib
import io
import posixpath
import ssl
from typing import Any, Callable, Iterator, Sequence, TypeVar
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from .base import ReadRequest, Storage, Writer, check_name
from .parallel import run_parallel
from .ranges import RangeTask, StreamEnded, check_range_start, content_length, ended_as_sent, ends_before, fill_range, plan_ranges
from .redact import redact, redact_transport_logs
from .retry import RetryPolicy, call_with_retry
from .transient import HTTPStatusError, is_transient

__all__ = ["HTTPStorage"]

T = TypeVar("T")
MiB = 1 << 20


def _urllib3():
    try:
        import urllib3
    except ImportError as e:  # pragma: no cover - requests and botocore depend on it
        raise ImportError("http(s):// URLs need urllib3: pip install urllib3") from e
    return urllib3


@contextlib.contextmanager
def _transport_errors() -> Iterator[None]:
    """urllib3 errors as builtin ones; their text is redacted (it can quote the request URL)."""
    exc = _urllib3().exceptions
    try:
        try:
            yield
        except exc.MaxRetryError as e:  # raised for redirects; unwrap any transport error
            if isinstance(e.reason, (exc.TimeoutError, exc.ProtocolError, exc.NewConnectionError, exc.SSLError)):
                raise e.reason from None
            raise
    except exc.TimeoutError as e:
        raise TimeoutError(f"{type(e).__name__}: {redact(str(e))}") from None
    except (exc.ProtocolError, exc.NewConnectionError, exc.ProxyError) as e:
        raise ConnectionError(f"{type(e).__name__}: {redact(str(e))}") from None
    except exc.SSLError as e:
        # A connection closed or reset during the TLS handshake (or a read) is a dropped
        # connection, worth retrying; a refused certificate is not.
        dropped = isinstance(e.args[0] if e.args else None, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError))
        raise (ConnectionError if dropped else OSError)(f"{type(e).__name__}: {redact(str(e))}") from None
    except exc.HTTPError as e:
        raise OSError(f"{type(e).__name__}: {redact(str(e))}") from None


def _finish(resp: Any) -> None:
    """Hand the connection back when the body was read through; otherwise close it.

    A chunked body has no ``length_remaining`` (None): read up to the bytes asked for, its
    end is still on the connection unless the response says it is closed."""
    if resp.length_remaining or (resp.length_remaining is None and not resp.closed):
        resp.close()
    resp.release_conn()


class _Skip:
    """A stream whose first ``n`` bytes are read and dropped (for servers that ignore Range)."""

    def __init__(self, stream: Any, n: int):
        self._stream, self._n = stream, n

    def readinto(self, b: memoryview) -> int:
        while self._n:
            got = self._stream.readinto(b[: min(len(b), self._n)])
            if not got:
                return 0
            self._n -= got
        return self._stream.readinto(b)


class HTTPStorage(Storage):
    """Files under an ``http(s)://`` URL; reading only.

    Args:
        url: the directory URL.
        part_size: the largest single ranged GET of :meth:`read_into`.
        max_concurrency: parallel ranged GETs (and pooled connections per host).
        retry: retry bounds (default: :class:`RetryPolicy`, ``CHECKPOINTER_IO_RETRIES``).
        timeout: ``(connect, read)`` socket timeouts, in seconds.
    """

    def __init__(self, url: str, *, part_size: int = 64 * MiB, max_concurrency: int = 8,
                 retry: RetryPolicy | None = None, timeout: tuple[float, float] = (10.0, 60.0)):
        parts = urlsplit(str(url))
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s):// URL: {redact(str(url))!r}")
        self._parts = parts._replace(path=parts.path.rstrip("/"), fragment="")
        host = parts.hostname + (f":{parts.port}" if parts.port else "")
        if ":" in parts.hostname:
            host = f"[{parts.hostname}]" + (f":{parts.port}" if parts.port else "")
        self._netloc = host
        self._headers = {"Accept-Encoding": "identity"}
        if parts.username is not None:
            auth = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self._headers.update(_urllib3().util.make_headers(basic_auth=auth))
        self.url = redact(urlunsplit(self._parts))
        self.part_size = part_size
        self.max_concurrency = max(1, max_concurrency)
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        redact_transport_logs()  # the root's query (a token) is in urllib3's debug lines
        urllib3 = _urllib3()
        # Redirects are followed (credentials are dropped on a change of host); transport
        # errors are raised as they are, for call_with_retry to judge.
        retries = urllib3.Retry(total=None, connect=False, read=False, status=None, other=False, redirect=10)
        self._pool = urllib3.PoolManager(
            maxsize=self.max_concurrency, retries=retries, timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]))

    def _file_url(self, name: str) -> str:
        path = posixpath.join(self._parts.path or "/", quote(check_name(name)))
        return urlunsplit(self._parts._replace(netloc=self._netloc, path=path))

    def join(self, name: str) -> str:
        """The file's URL for messages: user-info and query shown as ``***``."""
        path = posixpath.join(self._parts.path or "/", quote(name)) if name else self._parts.path
        return redact(urlunsplit(self._parts._replace(path=path)))

    def child(self, name: str) -> HTTPStorage:
        storage = HTTPStorage.__new__(HTTPStorage)
        storage.__dict__.update(self.__dict__)
        storage._parts = self._parts._replace(path=posixpath.join(self._parts.path or "/", quote(check_name(name))))
        storage.url = redact(urlunsplit(storage._parts))
        return storage

    def call(self, op: str, name: str, fn: Callable[[int], T]) -> T:
        url = self.join(name)
        try:
            return call_with_retry(fn, op=op, url=url, policy=self.retry, transient=is_transient)
        except HTTPStatusError as e:
            if e.status in (404, 410):
                raise FileNotFoundError(url) from e
            if e.status == 403:
                raise PermissionError(f"{op} {url}: access denied ({e}; a store that may not be listed, "
                                      "a public S3 bucket say, answers so for a missing file too)") from e
            raise OSError(f"{op} {url}: {e}") from e
        except OSError as e:
            if type(e) is OSError and url not in str(e):  # not retried (a refused certificate): name the URL
                raise OSError(f"{op} {url}: {e}") from e
            raise

    def _request(self, method: str, name: str, headers: dict[str, str] | None = None,
                 ok: tuple[int, ...] = (200,)) -> Any:
        with _transport_errors():
            resp = self._pool.request(method, self._file_url(name), headers={**self._headers, **(headers or {})},
                                      preload_content=False, redirect=True)
        if resp.status not in ok:
            resp.close()
            resp.release_conn()
            raise HTTPStatusError(resp.status, resp.reason or "")
        return resp

    def size(self, name: str) -> int:
        def head(_: int) -> int:
            resp = self._request("HEAD", name)
            _finish(resp)
            length = content_length(resp.headers.get("Content-Length"), f"HEAD {self.join(name)}")
            if length is None:
                raise OSError(f"HEAD {self.join(name)}: the response has no Content-Length")
            return length

        return self.call("HEAD", name, head)

    def exists(self, name: str) -> bool:
        """False for 404, and for 403: a public S3 bucket without list permission answers 403
        for a missing key (a loader probing ``metadata.json``, then ``model/metadata.json``)."""
        try:
            self.size(name)
        except (FileNotFoundError, PermissionError):
            return False
        return True

    def _get(self, name: str, start: int, end: int | None) -> tuple[Any, Any]:
        """A response stream positioned at ``start``, and the response (to release)."""
        headers = {} if start == 0 and end is None else {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
        resp = self._request("GET", name, headers, ok=(200, 206, 416))
        if resp.status == 416:
            _finish(resp)
            return io.BytesIO(b""), resp
        try:  # urllib3 takes a length it cannot read for none, and would read to the connection's end
            content_length(resp.headers.get("Content-Length"), f"GET {self.join(name)}")
            check_range_start(start, resp.status, resp.headers.get("Content-Range"), f"GET {self.join(name)}", whole=True)
        except OSError:
            resp.close()
            resp.release_conn()
            raise
        return (_Skip(resp, start) if resp.status == 200 and start else resp), resp

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        if start < 0 or (end is not None and end <= start):
            self.size(name)
            return b""

        def get(_: int) -> bytes:
            stream, resp = self._get(name, start, end)
            try:
                out = bytearray()
                chunk = bytearray(MiB)
                with _transport_errors():
                    while end is None or len(out) < end - start:
                        want = len(chunk) if end is None else min(len(chunk), end - start - len(out))
                        n = stream.readinto(memoryview(chunk)[:want])
                        if not n:
                            break
                        out += chunk[:n]
                return bytes(out)
            finally:
                _finish(resp)

        return self.call(f"GET bytes {start}-{'' if end is None else end - 1}", name, get)

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        tasks = plan_ranges(requests, self.part_size)
        run_parallel(lambda task: self._fetch(name, task), tasks, self.max_concurrency)

    def _fetch(self, name: str, task: RangeTask) -> None:
        def attempt(_: int) -> None:
            first = task.start + task.done
            stream, resp = self._get(name, first, task.end)
            try:
                headers = resp.headers
                if resp.status == 416 or ends_before(task.end, first, resp.status, headers.get("Content-Length"),
                                                     headers.get("Content-Range"), where=f"GET {self.join(name)}"):
                    raise self._truncated(name, task.end)
                with _transport_errors():
                    try:
                        fill_range(task, stream)
                    except StreamEnded:
                        if ended_as_sent(bool(resp.chunked), headers.get("Content-Range")):
                            raise self._truncated(name, task.end) from None
                        raise
            finally:
                _finish(resp)

        self.call(f"GET bytes {task.start}-{task.end - 1}", name, attempt)

    def _truncated(self, name: str, end: int) -> OSError:
        return OSError(f"{self.join(name)} ends before byte {end}: the file is truncated")

    def _read_only(self, op: str) -> io.UnsupportedOperation:
        return io.UnsupportedOperation(f"{op} {self.url}: http(s) storage is read-only; save to a path, s3:// or gs://")

    def list(self) -> list[str]:
        raise io.UnsupportedOperation(f"LIST {self.url}: http(s) storage cannot list a directory")

    def delete(self, name: str) -> None:
        raise self._read_only("DELETE")

    def write(self, name: str, data: bytes) -> None:
        raise self._read_only("PUT")

    def open_writer(self, name: str) -> Writer:
        raise self._read_only("PUT")
