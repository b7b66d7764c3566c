"""Parallel uploads to Google Cloud Storage: part objects uploaded at once, then ``compose``.

GCS takes the chunks of one resumable upload strictly in order, so one session cannot go
faster than one connection. A parallel composite upload (what ``gcloud storage`` and gsutil
do for big files) makes each part an object of its own, uploads several at a time, and
joins them with ``compose``; the target appears, whole, when the last compose returns.

1. Part ``n`` goes to the hidden object ``.{name}.part-{token}-{n}`` beside the target, in one
   request (resent whole if it fails); at most ``max_concurrency`` parts are in flight.
2. At commit, up to 32 parts (compose's limit) are composed per request: at most 1024 parts
   (the component limit of a composite object) take two rounds, the first in parallel.
   Parts double in size every 256, so 32 MiB parts reach 120 GiB.
3. The parts and intermediate objects are deleted, in parallel. A failure here is logged and
   left: the file is committed, and a leftover part is a hidden object beside it.

The cost, compared with a resumable upload: a composite object has a CRC32C but no MD5; the
parts need ``storage.objects.delete`` to be removed; in a bucket whose default storage class
is Nearline, Coldline or Archive, the short-lived parts are billed for the minimum storage
duration. There, pass ``GCSStorage(..., parallel_upload=False)``.
"""

from __future__ import annotations

import logging
import posixpath
from urllib.parse import quote, urlencode

from ..format.layout import part_prefix
from .gcs_upload import GCSWriter, Uploads, _body, check_stored
from .parallel import run_parallel
from .parts import Part, part_bytes

__all__ = ["GCSComposeWriter", "MAX_COMPONENTS", "MAX_COMPOSE_SOURCES"]

log = logging.getLogger(__name__)

MAX_COMPOSE_SOURCES = 32
MAX_COMPONENTS = 1024


class GCSComposeWriter(GCSWriter):
    """Streams a file into part objects uploaded in parallel, composed into the target at commit.

    A file smaller than one part is one request, as with :class:`~checkpointer.storage.gcs_upload.GCSWriter`.
    """

    def __init__(self, storage: Uploads, name: str):
        super().__init__(storage, name, workers=storage.max_concurrency, in_flight=storage.max_concurrency,
                         max_parts=MAX_COMPONENTS, grow_every=MAX_COMPONENTS // 4)
        directory, base = posixpath.split(name)
        self._part_prefix = posixpath.join(directory, part_prefix(base))
        self._temporaries: list[str] = []  # intermediate composites, deleted with the parts
        self._committed = self._cleaned = False

    def _begin(self) -> None:
        pass  # parts are objects of their own: nothing to start

    def _object_url(self, key: str) -> str:
        return f"{self._s._endpoint}/storage/v1/b/{quote(self._s.bucket, safe='')}/o/{quote(key, safe='')}"

    def _upload(self, number: int, offset: int, part: Part, total: int | None) -> None:
        name = f"{self._part_prefix}{number}"
        key = self._s._key(name)
        query = urlencode({"uploadType": "media", "name": key})
        self._s.call(f"POST part {number}", self._name, lambda _: check_stored(self._s.request(
            "POST", f"{self._upload_base}?{query}", data=_body(part),
            headers={"Content-Type": "application/octet-stream"}), part_bytes(part)))

    def commit(self) -> None:
        self._check()
        if not self.started:
            super().commit()  # smaller than one part: one request
            return
        composed = False
        try:
            self._finish_parts(last_if_empty=False)
            parts = self._part_names()
            if len(parts) > MAX_COMPOSE_SOURCES:
                groups = [parts[i : i + MAX_COMPOSE_SOURCES] for i in range(0, len(parts), MAX_COMPOSE_SOURCES)]
                middle = [f"{self._part_prefix}c{i}" for i in range(len(groups))]
                self._temporaries = middle
                run_parallel(lambda i: self._compose(groups[i], middle[i]), range(len(groups)),
                             self._s.max_concurrency)
                parts = middle
            self._compose(parts, self._name)
            composed = True
        finally:
            if not composed:
                self.abort()
        self._committed = True
        self._close()
        self._delete_temporaries()

    def _part_names(self) -> list[str]:
        return [f"{self._part_prefix}{n}" for n in range(1, len(self._futures) + 1)]

    def _compose(self, sources: list[str], target: str) -> None:
        key = self._s._key(target)
        body = {"sourceObjects": [{"name": self._s._key(s)} for s in sources],
                "destination": {"contentType": "application/octet-stream"}}
        self._s.call(f"POST compose of {len(sources)} parts", self._name, lambda _: self._s.request(
            "POST", f"{self._object_url(key)}/compose", json=body).close())

    def abort(self) -> None:
        if self._committed:
            return
        super().abort()  # waits for the uploads in flight
        self._delete_temporaries()

    def _delete_temporaries(self) -> None:
        if self._cleaned or not self.started:
            return
        self._cleaned = True
        names = self._part_names() + self._temporaries

        def delete(name: str) -> None:
            try:
                self._s.call("DELETE", name, lambda _: self._s.request(
                    "DELETE", self._object_url(self._s._key(name)), ok=(200, 204, 404)).close())
            except OSError as e:
                log.warning("could not delete the upload part %s: %s", self._s.join(name), e)

        run_parallel(delete, names, self._s.max_concurrency)
