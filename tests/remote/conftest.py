"""Fixtures of the end-to-end remote-storage tests: the engine against S3 and GCS emulators.

Reused, not copied: the loopback helpers of ``tests/support`` (``storage_servers``: free ports,
the fault proxy, the Range-capable file server; ``storage_fixtures``: ``loopback_env``,
``file_server`` and the emulators ``moto_endpoint`` and ``gcs_endpoint``, imported here as this
folder's fixtures), and ``run_distributed`` of ``tests/conftest.py`` (the harness's worker pools).

Workers get the endpoints as arguments (an ``env`` dict, see :func:`remote_workers.remote_env`),
never from the pool's inherited environment.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest
import remote_workers
from remote_proxy import CountingProxy
from storage_fixtures import file_server, gcs_endpoint, loopback_env, moto_endpoint  # noqa: F401  (fixtures)
from storage_servers import GCS_BUCKET, S3_BUCKET


@pytest.fixture
def proxies() -> Iterator[Callable[[str], CountingProxy]]:
    """``proxies(upstream, **options)`` starts a :class:`CountingProxy`; all are closed after the test."""
    started: list[CountingProxy] = []

    def start(upstream: str, **options) -> CountingProxy:
        started.append(CountingProxy(upstream, **options))
        return started[-1]

    yield start
    for proxy in started:
        proxy.close()


# --------------------------------------------------------------------------------------
# The backends
# --------------------------------------------------------------------------------------


@dataclass
class Backend:
    """One object store on loopback, and how to point a process (or a worker) at it."""

    kind: str  # "s3" or "gcs"
    endpoint: str
    bucket: str
    client: Any  # boto3 S3 client, or google.cloud.storage.Client

    @property
    def endpoint_var(self) -> str:
        return "AWS_ENDPOINT_URL_S3" if self.kind == "s3" else "STORAGE_EMULATOR_HOST"

    def url(self, *names: str) -> str:
        """A fresh prefix: ``s3://bucket/<unique>/names...``."""
        scheme = "s3" if self.kind == "s3" else "gs"
        return "/".join([f"{scheme}://{self.bucket}", f"r-{uuid.uuid4().hex[:10]}", *names])

    def env(self, endpoint: str | None = None, **extra: str | None) -> dict[str, str | None]:
        """Settings for a worker: test credentials, no proxies, this store (or ``endpoint``)."""
        return remote_workers.loopback_settings({self.endpoint_var: endpoint or self.endpoint, **extra})

    def _prefix(self, url: str) -> str:
        return url.split("://", 1)[1].split("/", 1)[1].rstrip("/") + "/"

    def names(self, url: str) -> list[str]:
        """Every object under the prefix ``url``, relative to it (recursive), from the server's listing."""
        prefix = self._prefix(url)
        if self.kind == "s3":
            out = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                out.extend(obj["Key"][len(prefix):] for obj in page.get("Contents", ()))
            return sorted(out)
        return sorted(b.name[len(prefix):] for b in self.client.list_blobs(self.bucket, prefix=prefix))

    def etags(self, url: str) -> dict[str, str]:
        prefix = self._prefix(url)
        if self.kind == "s3":
            objs = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("Contents", ())
            return {o["Key"][len(prefix):]: f"{o['ETag']}/{o['LastModified']}" for o in objs}
        return {b.name[len(prefix):]: f"{b.md5_hash}/{b.generation}/{b.updated}" for b in self.client.list_blobs(self.bucket, prefix=prefix)}

    def delete(self, url: str, name: str) -> None:
        key = self._prefix(url) + name
        if self.kind == "s3":
            self.client.delete_object(Bucket=self.bucket, Key=key)
        else:
            self.client.bucket(self.bucket).blob(key).delete()

    def put(self, url: str, name: str, data: bytes) -> None:
        key = self._prefix(url) + name
        if self.kind == "s3":
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        else:
            self.client.bucket(self.bucket).blob(key).upload_from_string(data)

    def size(self, url: str, name: str) -> int:
        key = self._prefix(url) + name
        if self.kind == "s3":
            return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        return int(self.client.bucket(self.bucket).get_blob(key).size)


@pytest.fixture(scope="session")
def _s3_client(moto_endpoint):
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=moto_endpoint)


@pytest.fixture(scope="session")
def _gcs_client(gcs_endpoint):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="test-project", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": gcs_endpoint})


@pytest.fixture(params=["s3", "gcs"])
def backend(request, monkeypatch) -> Backend:
    """Each test runs against S3 (moto) and GCS (the emulator); this process points at it too."""
    if request.param == "s3":
        b = Backend("s3", request.getfixturevalue("moto_endpoint"), S3_BUCKET, request.getfixturevalue("_s3_client"))
    else:
        b = Backend("gcs", request.getfixturevalue("gcs_endpoint"), GCS_BUCKET, request.getfixturevalue("_gcs_client"))
    monkeypatch.setenv(b.endpoint_var, b.endpoint)
    return b
