"""S3 error codes whose HTTP status says something else: retried where the code means "try again"
(``RequestTimeout`` comes as a 400, ``ConditionalRequestConflict`` as a 409), and a multipart upload
aborted under a save (``NoSuchUpload``, a 404) said to be that, not a missing file. Answers come
from a loopback proxy in front of moto (``FaultProxy``'s ``error`` mode)."""

from __future__ import annotations

import os

import pytest

from checkpointer.storage.s3 import MIN_PART, S3Storage
from storage_servers import FAST, S3_BUCKET, unique


@pytest.fixture
def s3(request, fault_proxy, monkeypatch, loopback_env):
    proxy = fault_proxy(request.getfixturevalue("moto_endpoint"), conditional=True)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    return S3Storage(f"s3://{S3_BUCKET}/{unique()}", retry=FAST, part_size=MIN_PART, max_concurrency=2), proxy


@pytest.mark.parametrize(("operation", "status", "code"), [("write", 400, "RequestTimeout"),
                                                        ("create_exclusive", 409, "ConditionalRequestConflict")])
def test_a_code_that_means_retry_is_retried_under_any_status(s3, operation, status, code) -> None:
    store, proxy = s3
    fault = proxy.fail(2, "error", method="PUT", status=status, code=code)
    getattr(store, operation)("file", b"hello")
    assert fault.fired == 2
    assert store.read("file") == b"hello"
    if operation == "create_exclusive":  # the retried create still holds the name: the next is refused
        with pytest.raises(FileExistsError):
            store.create_exclusive("file", b"theirs")
        assert store.read("file") == b"hello"


def test_an_upload_aborted_under_a_save_names_the_upload_not_a_missing_file(s3) -> None:
    store, proxy = s3
    data = os.urandom(2 * MIN_PART + 10)
    proxy.fail(1, "error", method="PUT", path="partNumber=", status=404, code="NoSuchUpload")
    writer = store.open_writer("big")
    with pytest.raises(FileNotFoundError) as gone:
        writer.write([memoryview(data)])
        writer.commit()
    message = str(gone.value)
    assert "PUT part" in message and "NoSuchUpload" in message and "aborted while this save wrote it" in message
    assert store.join("big") in message
    assert not store.exists("big")
    assert [e.fault for e in proxy.seen if "partNumber=" in e.path].count("error") == 1
