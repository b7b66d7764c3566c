"""Amazon S3 and S3-compatible stores (MinIO, moto) through boto3.

``s3://bucket/prefix``: a file ``name`` is the key ``prefix/name``. The endpoint and the
credentials come from boto3's standard settings (``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, the credential chain), never from this module.
botocore's own retries are turned off: every call goes through :func:`call_with_retry`, so
``CHECKPOINTER_IO_RETRIES`` bounds all of them.

Reads are ranged GETs read straight into the caller's buffers (:meth:`S3Storage.read_into`).
A :class:`S3Writer` streams into a multipart upload, parts uploaded in parallel (sent from
the caller's memory when it writes with ``write_stable``), CRC32 declared as boto3's
``upload_file`` does; a file smaller than one part is a single PUT. Nothing is visible
before ``commit``. :meth:`S3Storage.create_exclusive` (the save lock) is a conditional PUT.
A multipart upload whose creation had to be retried may have been created twice (the answer
to the first was lost): the other one is aborted (:meth:`S3Writer._abort_orphans`).
"""

from __future__ import annotations

import binascii
import datetime
import errno
import functools
import hashlib
import logging
import os
import time
from typing import Any, Callable, Sequence, TypeVar

from .base import ReadRequest, Storage, check_name
from .parallel import run_parallel
from .parts import Part, PartReader, PartWriter
from .ranges import RangeTask, check_range_start, ends_before, fill_range, plan_ranges
from .redact import redact
from .retry import RetryPolicy, call_with_retry, holds
from .transient import is_transient, transient_status
from .urls import bucket_url

__all__ = ["S3Storage", "S3Writer"]

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # parts double in size every quarter of this: 16 MiB parts reach 586 GiB
CLOCK_SKEW_S = 300.0  # how far the store's clock may be behind ours, when judging its upload times
_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_THROTTLE = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
             "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequestsException",
             "ConditionalRequestConflict"}  # 409: a conditional write to the same key in progress; retry


def _boto():
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as e:  # pragma: no cover - boto3 is a dependency
        raise ImportError("s3:// URLs need boto3: pip install boto3") from e
    return boto3, botocore


def _error_code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(response.get("Error", {}).get("Code", "")), int(status or 0)


def _transient(exc: BaseException) -> bool:
    _, botocore = _boto()
    e = botocore.exceptions
    if isinstance(exc, e.ClientError):
        code, status = _error_code(exc)
        return code in _THROTTLE or transient_status(status)
    if isinstance(exc, (e.HTTPClientError, e.ConnectionError, e.IncompleteReadError, e.ChecksumError,
                        e.CredentialRetrievalError)):
        return True
    import urllib3.exceptions

    return isinstance(exc, (urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError)) or is_transient(exc)


NO_CREDENTIALS = (
    "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN "
    "for temporary ones), or AWS_PROFILE naming a profile of ~/.aws/credentials or ~/.aws/config "
    "(aws configure; aws sso login), or run where an instance or container role provides them; for "
    "MinIO or another S3-compatible store, also AWS_ENDPOINT_URL_S3"
)
"""What to set when boto3's credential chain found nothing (botocore says only "Unable to locate credentials")."""

# The environment settings a client is built from: a client is shared while they are unchanged.
_CLIENT_SETTINGS = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION",
)


@functools.lru_cache(maxsize=8)
def _shared_client(settings: tuple, max_concurrency: int, timeouts: tuple[float, float]) -> Any:
    """One boto3 client per set of settings (clients are thread-safe; building one costs ~0.3 s)."""
    boto3, botocore = _boto()
    config = botocore.config.Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=2 * max_concurrency + 4,
        connect_timeout=timeouts[0],
        read_timeout=timeouts[1],
        tcp_keepalive=True,
    )
    return boto3.session.Session().client("s3", config=config)


class S3Storage(Storage):
    """Files under ``s3://bucket/prefix``.

    Args:
        url: ``s3://bucket`` or ``s3://bucket/prefix``.
        client: a boto3 S3 client to use (default: one from the standard settings, with
            botocore retries off). :meth:`child` views share it.
        part_size: bytes per multipart-upload part and per ranged GET (at least 5 MiB).
        max_concurrency: parallel requests of one ``read_into`` or one writer.
        retry: retry bounds (default: :class:`RetryPolicy`, ``CHECKPOINTER_IO_RETRIES``).
        connect_timeout, read_timeout: per-request socket timeouts, in seconds.
    """

    def __init__(self, url: str, *, client: Any = None, part_size: int = 16 * MiB, max_concurrency: int = 8,
                 retry: RetryPolicy | None = None, connect_timeout: float = 10.0, read_timeout: float = 60.0):
        self.bucket, self.prefix = bucket_url(url, ("s3",))
        if self.prefix:
            check_name(self.prefix)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        if part_size < MIN_PART:
            raise ValueError(f"part_size {part_size} is below S3's minimum part of {MIN_PART} bytes")
        self.part_size = part_size
        self.max_concurrency = max(1, max_concurrency)
        self.retry = retry or RetryPolicy()
        self._timeouts = (connect_timeout, read_timeout)
        self._client = client if client is not None else self._make_client()

    def _checksum_args(self) -> dict[str, str]:
        """``ChecksumAlgorithm=CRC32`` as boto3's ``upload_file`` sends it, unless the client was told
        to checksum only when required (``request_checksum_calculation``).

        Declaring the algorithm when the multipart upload is created makes the store check each
        part's CRC32 and keep a composite checksum. Left undeclared, a store may instead compute
        a full-object checksum at completion (moto copies the whole object once more for it).
        """
        mode = getattr(self._client.meta.config, "request_checksum_calculation", None)
        return {} if mode == "when_required" else {"ChecksumAlgorithm": "CRC32"}

    def _make_client(self) -> Any:
        settings = tuple(os.environ.get(name) for name in _CLIENT_SETTINGS)
        return _shared_client(settings, self.max_concurrency, self._timeouts)

    def _key(self, name: str) -> str:
        name = check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> S3Storage:
        storage = S3Storage.__new__(S3Storage)
        storage.__dict__.update(self.__dict__)
        storage.prefix = self._key(name)
        storage.url = f"s3://{self.bucket}/{storage.prefix}"
        return storage

    def call(self, op: str, name: str, fn: Callable[[int], T]) -> T:
        """Run ``fn(attempt)`` with retries; S3 errors become ``FileNotFoundError`` / ``OSError`` naming the URL."""
        _, botocore = _boto()
        url = self.join(name)
        try:
            return call_with_retry(fn, op=op, url=url, transient=_transient, policy=self.retry)
        except botocore.exceptions.ClientError as e:
            code, status = _error_code(e)
            if code == "NoSuchUpload":  # a 404 too: the upload is gone, not the file
                raise FileNotFoundError(errno.ENOENT, f"{op}: the multipart upload was aborted while this save wrote it "
                                        "(NoSuchUpload), by another process or a bucket lifecycle rule", url) from e
            if code in _NOT_FOUND or status == 404:
                raise FileNotFoundError(url) from e
            raise OSError(f"{op} {url}: {redact(str(e))}") from e
        except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError) as e:
            raise OSError(f"{op} {url}: {NO_CREDENTIALS} ({type(e).__name__}: {redact(str(e))})") from e
        except botocore.exceptions.BotoCoreError as e:
            raise OSError(f"{op} {url}: {type(e).__name__}: {redact(str(e))}") from e

    def size(self, name: str) -> int:
        key = self._key(name)
        head = self.call("HEAD", name, lambda _: self._client.head_object(Bucket=self.bucket, Key=key))
        return int(head["ContentLength"])

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
        except FileNotFoundError:
            return False
        return True

    def list(self) -> list[str]:
        root = f"{self.prefix}/" if self.prefix else ""

        def listing(_: int) -> list[str]:
            names: set[str] = set()
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=root, Delimiter="/"):
                names.update(obj["Key"][len(root) :] for obj in page.get("Contents", ()))
                names.update(p["Prefix"][len(root) :].rstrip("/") for p in page.get("CommonPrefixes", ()))
            names.discard("")
            return sorted(names)

        return self.call("LIST", "", listing)

    def delete(self, name: str) -> None:
        key = self._key(name)
        try:
            self.call("DELETE", name, lambda _: self._client.delete_object(Bucket=self.bucket, Key=key))
        except FileNotFoundError:
            pass

    def delete_tree(self, name: str) -> None:
        """Every object under ``name/``, listed, then deleted up to 1,000 per request."""
        root = f"{self._key(name)}/"

        def listing(_: int) -> list[str]:
            paginator = self._client.get_paginator("list_objects_v2")
            return [obj["Key"] for page in paginator.paginate(Bucket=self.bucket, Prefix=root)
                    for obj in page.get("Contents", ())]

        keys = self.call("LIST", name, listing)
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            resp = self.call("DELETE objects", name, lambda _: self._client.delete_objects(Bucket=self.bucket, Delete=batch))
            failed = [e for e in resp.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if failed:
                raise OSError(f"DELETE {self.join(name)}: {len(failed)} objects not deleted, first "
                              f"{failed[0].get('Key')}: {failed[0].get('Code')} {redact(str(failed[0].get('Message')))}")

    def _get(self, name: str, key: str, first: int, last: int | None) -> Any:
        """GetObject from byte ``first`` to ``last`` (inclusive). A store that ignores Range
        answers 200 with the whole object: usable from byte 0 (the body is read no further than
        asked), refused from any later byte."""
        if first == 0 and last is None:
            return self._client.get_object(Bucket=self.bucket, Key=key)
        rng = f"bytes={first}-" + ("" if last is None else str(last))
        resp = self._client.get_object(Bucket=self.bucket, Key=key, Range=rng)
        try:
            check_range_start(first, int(resp["ResponseMetadata"]["HTTPStatusCode"]), resp.get("ContentRange"), f"GET {self.join(name)}")
        except OSError:
            resp["Body"].close()
            raise
        return resp

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        key = self._key(name)
        if start < 0 or (end is not None and end <= start):
            self.size(name)  # a missing file is still FileNotFoundError
            return b""
        _, botocore = _boto()

        def get(_: int) -> bytes:
            try:
                resp = self._get(name, key, start, None if end is None else end - 1)
            except botocore.exceptions.ClientError as e:
                if _error_code(e)[0] == "InvalidRange":  # the range starts at or past the end
                    return b""
                raise
            with resp["Body"] as body:
                return body.read() if end is None else body.read(end - start)

        return self.call(f"GET bytes {start}-{'' if end is None else end - 1}", name, get)

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        key = self._key(name)
        tasks = plan_ranges(requests, self.part_size)
        run_parallel(lambda task: self._fetch(name, key, task), tasks, self.max_concurrency)

    def _fetch(self, name: str, key: str, task: RangeTask) -> None:
        _, botocore = _boto()

        def attempt(_: int) -> None:
            first = task.start + task.done
            try:
                resp = self._get(name, key, first, task.end - 1)
            except botocore.exceptions.ClientError as e:
                if _error_code(e)[0] != "InvalidRange":
                    raise
                raise OSError(f"{self.join(name)} ends before byte {first}: the file is truncated") from e
            with resp["Body"] as body:
                status = int(resp["ResponseMetadata"]["HTTPStatusCode"])
                if ends_before(task.end, first, status, resp.get("ContentLength"), resp.get("ContentRange")):
                    raise OSError(f"{self.join(name)} ends before byte {task.end}: the file is truncated")
                fill_range(task, body)

        self.call(f"GET bytes {task.start}-{task.end - 1}", name, attempt)

    def write(self, name: str, data: bytes) -> None:
        with self.open_writer(name) as writer:
            writer.write_stable([memoryview(data)])
            writer.commit()

    def create_exclusive(self, name: str, data: bytes) -> None:
        """A conditional PUT (``If-None-Match: *``): of two callers, one creates the file and the
        other gets ``FileExistsError``, also when both start at once. A store that ignores the
        condition (older S3-compatible stores) still gets the check before it."""
        if self.exists(name):
            raise FileExistsError(self.join(name))
        key = self._key(name)
        _, botocore = _boto()

        def put(attempt: int) -> None:
            try:
                self._client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*",
                                        **self._checksum_args())
            except botocore.exceptions.ClientError as e:
                code, status = _error_code(e)
                if code != "PreconditionFailed" and status != 412:
                    raise
                if attempt and holds(self, name, data):
                    return  # an earlier attempt created it and its answer was lost
                raise FileExistsError(self.join(name)) from e

        self.call("PUT if absent", name, put)

    def open_writer(self, name: str) -> S3Writer:
        return S3Writer(self, name)


class S3Writer(PartWriter):
    """Streams a file into a multipart upload, ``max_concurrency`` parts in flight at most.
    Buffers given to :meth:`write_stable` (a save's tensors), or of a part or more, are sent from
    the caller's memory; other small ones are copied into part buffers (``max_concurrency + 1``
    parts' worth at most). A file smaller than one part is a single PUT at commit."""

    def __init__(self, storage: S3Storage, name: str):
        super().__init__(storage.join(name), storage.part_size, workers=storage.max_concurrency,
                         in_flight=storage.max_concurrency, max_parts=MAX_PARTS, grow_every=MAX_PARTS // 4)
        self._s = storage
        self._name = name
        self._key = storage._key(name)
        self._upload_id: str | None = None
        self._parts_done: dict[int, dict[str, Any]] = {}
        self._extra = storage._checksum_args()

    def _begin(self) -> None:
        started = time.time()
        attempts: list[int] = []

        def create(attempt: int) -> dict[str, Any]:
            attempts.append(attempt)
            return self._s._client.create_multipart_upload(Bucket=self._s.bucket, Key=self._key, **self._extra)

        resp = self._s.call("CreateMultipartUpload", self._name, create)
        self._upload_id = resp["UploadId"]
        if len(attempts) > 1:
            self._abort_orphans(since=started - CLOCK_SKEW_S)

    def _abort_orphans(self, since: float) -> None:
        """Abort the other uploads of this key initiated since ``since`` (a time.time()).

        A failed create may have been carried out with its answer lost; the retry then created
        a second upload and the first, empty, would cost storage until a lifecycle rule removes
        it. Only uploads of exactly this key started since the create began (less the clock skew
        allowed) are taken for such orphans: the save lock keeps other jobs off the key, and
        older uploads are left alone.
        """
        oldest = datetime.datetime.fromtimestamp(since, tz=datetime.timezone.utc)

        def listing(_: int) -> list[str]:
            paginator = self._s._client.get_paginator("list_multipart_uploads")
            return [u["UploadId"] for page in paginator.paginate(Bucket=self._s.bucket, Prefix=self._key)
                    for u in page.get("Uploads", ())
                    if u["Key"] == self._key and u["UploadId"] != self._upload_id and u["Initiated"] >= oldest]

        try:
            for upload_id in self._s.call("ListMultipartUploads", self._name, listing):
                self._abort_upload(upload_id)
        except OSError as e:
            log.warning("could not look for an upload of %s left by a retried create: %s", self.url, e)

    def _upload(self, number: int, offset: int, part: Part, total: int | None) -> None:
        resp = self._s.call(f"PUT part {number}", self._name, lambda _: self._s._client.upload_part(
            Bucket=self._s.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number,
            Body=PartReader(part), **self._extra))
        done = {"ETag": resp["ETag"], "PartNumber": number}
        if "ChecksumCRC32" in resp and self._extra:
            done["ChecksumCRC32"] = resp["ChecksumCRC32"]
        self._parts_done[number] = done

    def commit(self) -> None:
        self._check()
        done = False
        try:
            if not self.started:
                data = self._parts.rest()
                self._s.call("PUT", self._name, lambda _: self._s._client.put_object(
                    Bucket=self._s.bucket, Key=self._key, Body=PartReader(data), **self._extra))
            else:
                self._finish_parts(last_if_empty=False)
                self._complete()
                self._upload_id = None
            done = True
        finally:
            if not done:
                self.abort()
        self._close()

    def _complete(self) -> None:
        _, botocore = _boto()
        parts = [self._parts_done[n] for n in sorted(self._parts_done)]

        def complete(attempt: int) -> None:
            try:
                self._s._client.complete_multipart_upload(
                    Bucket=self._s.bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            except botocore.exceptions.ClientError as e:
                # A retry after a lost response finds the upload gone: it completed if the
                # object now has this upload's ETag.
                if attempt == 0 or _error_code(e)[0] != "NoSuchUpload" or not self._completed(parts):
                    raise

        self._s.call("CompleteMultipartUpload", self._name, complete)

    def _completed(self, parts: list[dict]) -> bool:
        try:
            head = self._s._client.head_object(Bucket=self._s.bucket, Key=self._key)
            etag = str(head.get("ETag", "")).strip('"')
            if not etag.endswith(f"-{len(parts)}") or int(head["ContentLength"]) != self._parts.total:
                return False
            digest = hashlib.md5(b"".join(binascii.unhexlify(p["ETag"].strip('"')) for p in parts)).hexdigest()
        except (binascii.Error, ValueError):
            return True  # ETags that are not MD5s (SSE-KMS): the part count and size match
        except Exception:
            return False
        return etag == f"{digest}-{len(parts)}"

    def abort(self) -> None:
        self._close()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            self._abort_upload(upload_id)

    def _abort_upload(self, upload_id: str) -> None:
        try:
            self._s.call("AbortMultipartUpload", self._name, lambda _: self._s._client.abort_multipart_upload(
                Bucket=self._s.bucket, Key=self._key, UploadId=upload_id))
        except FileNotFoundError:
            pass
        except OSError as e:
            # Raising here would hide the error that made the caller abort (or fail a save
            # that succeeded); an incomplete upload is invisible and a bucket lifecycle rule
            # removes it.
            log.warning("could not abort the multipart upload of %s: %s", self.url, e)
