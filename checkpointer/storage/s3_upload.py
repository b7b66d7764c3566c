"""Uploads to S3 (:class:`S3Writer`): a multipart upload, or one PUT for a small file.

A writer sends its requests through the :class:`~checkpointer.storage.s3.S3Storage` that
opened it, which retries them and names the URL in errors. Parts are uploaded in parallel (sent
from the caller's memory when it writes with ``write_stable``), CRC32 declared as boto3's
``upload_file`` does. Nothing is visible before ``commit``. A multipart upload whose creation
had to be retried may have been created twice (the answer to the first was lost): the other
one is aborted (:meth:`S3Writer._abort_orphans`).
"""

from __future__ import annotations

import binascii
import datetime
import hashlib
import logging
import time
from typing import Any, Callable, Protocol, TypeVar

from .parts import Part, PartReader, PartWriter
from .s3_client import boto_modules, error_code

__all__ = ["S3Writer", "Uploads"]

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PARTS = 10_000  # parts double in size every quarter of this: 16 MiB parts reach 586 GiB
CLOCK_SKEW_S = 300.0  # how far the store's clock may be behind ours, when judging its upload times


class Uploads(Protocol):
    """What a writer uses of the :class:`~checkpointer.storage.s3.S3Storage` that opened it."""

    bucket: str
    part_size: int
    max_concurrency: int
    _client: Any

    def _key(self, name: str) -> str: ...

    def _checksum_args(self) -> dict[str, str]: ...

    def join(self, name: str) -> str: ...

    def call(self, op: str, name: str, fn: Callable[[int], T]) -> T: ...


class S3Writer(PartWriter):
    """Streams a file into a multipart upload, ``max_concurrency`` parts in flight at most.
    Buffers given to :meth:`write_stable` (a save's tensors), or of a part or more, are sent from
    the caller's memory; other small ones are copied into part buffers (``max_concurrency + 1``
    parts' worth at most). A file smaller than one part is a single PUT at commit."""

    def __init__(self, storage: Uploads, name: str):
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
        _, botocore = boto_modules()
        parts = [self._parts_done[n] for n in sorted(self._parts_done)]

        def complete(attempt: int) -> None:
            try:
                self._s._client.complete_multipart_upload(
                    Bucket=self._s.bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            except botocore.exceptions.ClientError as e:
                # A retry after a lost response finds the upload gone: it completed if the
                # object now has this upload's ETag.
                if attempt == 0 or error_code(e)[0] != "NoSuchUpload" or not self._completed(parts):
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
