"""Amazon S3 and S3-compatible stores (MinIO, moto) through boto3.

``s3://bucket/prefix``: a file ``name`` is the key ``prefix/name``. The endpoint and the
credentials come from boto3's standard settings (``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, the credential chain), never from this module.
botocore's own retries are turned off: every call goes through :func:`call_with_retry`, so
``CHECKPOINTER_IO_RETRIES`` bounds all of them.

Reads are ranged GETs read straight into the caller's buffers (:meth:`S3Storage.read_into`).
A :meth:`S3Storage.pinned` view (one per load) reads each object as it first saw it: later
GETs carry ``If-Match`` with its ETag, and an object replaced meanwhile is
:class:`~checkpointer.storage.base.FileChangedError`. Writes go through
:class:`~checkpointer.storage.s3_upload.S3Writer`. :meth:`S3Storage.create_exclusive` (the save
lock) is a conditional PUT.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Callable, Sequence, TypeVar

from .base import ReadRequest, Storage, check_name
from .parallel import run_parallel
from .ranges import RangeTask, check_range_start, ends_before, fill_range, plan_ranges
from .redact import redact
from .retry import RetryPolicy, call_with_retry, holds
from .s3_client import CLIENT_SETTINGS, NO_CREDENTIALS, NOT_FOUND, boto_modules, error_code, shared_client, transient
from .s3_upload import S3Writer
from .urls import bucket_url
from .versions import Versions, pinned_copy, replaced

__all__ = ["S3Storage"]

T = TypeVar("T")

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's smallest part (all but the last)


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
        self._versions: Versions | None = None  # a pinned view's: the ETag first seen per key

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
        settings = tuple(os.environ.get(name) for name in CLIENT_SETTINGS)
        return shared_client(settings, self.max_concurrency, self._timeouts)

    def _key(self, name: str) -> str:
        name = check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> S3Storage:
        storage = S3Storage.__new__(S3Storage)
        storage.__dict__.update(self.__dict__)
        storage.prefix = self._key(name)
        storage.url = f"s3://{self.bucket}/{storage.prefix}"
        return storage

    def pinned(self) -> S3Storage:
        return pinned_copy(self)

    def _pin(self, key: str) -> dict[str, str]:
        """A pinned view's condition on a request for ``key``: the ETag it first saw."""
        etag = self._versions.expected(key) if self._versions is not None else None
        return {"IfMatch": etag} if etag else {}

    def _saw(self, name: str, key: str, resp: dict) -> None:
        if self._versions is not None:
            self._versions.saw(key, resp.get("ETag"), self.join(name))

    def call(self, op: str, name: str, fn: Callable[[int], T]) -> T:
        """Run ``fn(attempt)`` with retries; S3 errors become ``FileNotFoundError`` / ``OSError`` naming the URL."""
        _, botocore = boto_modules()
        url = self.join(name)
        try:
            return call_with_retry(fn, op=op, url=url, transient=transient, policy=self.retry)
        except botocore.exceptions.ClientError as e:
            code, status = error_code(e)
            if code == "NoSuchUpload":  # a 404 too: the upload is gone, not the file
                raise FileNotFoundError(errno.ENOENT, f"{op}: the multipart upload was aborted while this save wrote it "
                                        "(NoSuchUpload), by another process or a bucket lifecycle rule", url) from e
            if code in NOT_FOUND or status == 404:
                raise FileNotFoundError(url) from e
            if self._versions is not None and (code == "PreconditionFailed" or status == 412):
                raise replaced(url) from e
            raise OSError(f"{op} {url}: {redact(str(e))}") from e
        except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError) as e:
            raise OSError(f"{op} {url}: {NO_CREDENTIALS} ({type(e).__name__}: {redact(str(e))})") from e
        except botocore.exceptions.BotoCoreError as e:
            raise OSError(f"{op} {url}: {type(e).__name__}: {redact(str(e))}") from e

    def size(self, name: str) -> int:
        key = self._key(name)
        head = self.call("HEAD", name, lambda _: self._client.head_object(Bucket=self.bucket, Key=key, **self._pin(key)))
        self._saw(name, key, head)
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
            resp = self._client.get_object(Bucket=self.bucket, Key=key, **self._pin(key))
        else:
            rng = f"bytes={first}-" + ("" if last is None else str(last))
            resp = self._client.get_object(Bucket=self.bucket, Key=key, Range=rng, **self._pin(key))
        try:
            self._saw(name, key, resp)
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
        _, botocore = boto_modules()

        def get(_: int) -> bytes:
            try:
                resp = self._get(name, key, start, None if end is None else end - 1)
            except botocore.exceptions.ClientError as e:
                if error_code(e)[0] == "InvalidRange":  # the range starts at or past the end
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
        _, botocore = boto_modules()

        def attempt(_: int) -> None:
            first = task.start + task.done
            try:
                resp = self._get(name, key, first, task.end - 1)
            except botocore.exceptions.ClientError as e:
                if error_code(e)[0] != "InvalidRange":
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
        _, botocore = boto_modules()

        def put(attempt: int) -> None:
            try:
                self._client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*",
                                        **self._checksum_args())
            except botocore.exceptions.ClientError as e:
                code, status = error_code(e)
                if code != "PreconditionFailed" and status != 412:
                    raise
                if attempt and holds(self, name, data):
                    return  # an earlier attempt created it and its answer was lost
                raise FileExistsError(self.join(name)) from e

        self.call("PUT if absent", name, put)

    def open_writer(self, name: str) -> S3Writer:
        return S3Writer(self, name)
