"""S3 and GCS through a loopback proxy that answers 503, drops connections, loses responses,
truncates bodies and stalls: operations succeed within the retry budget and fail cleanly,
with an ``OSError`` naming the URL and the operation, beyond it."""

from __future__ import annotations

import logging
import os
import time
import traceback
import tracemalloc

import pytest

from checkpointer.storage import Storage
from checkpointer.storage.gcs import GCSStorage
from checkpointer.storage.retry import RetryPolicy
from checkpointer.storage.s3 import MIN_PART, S3Storage
from storage_servers import FAST, GCS_BUCKET, S3_BUCKET, SECRET_KEY, FaultProxy, unique

GCS_CHUNK = 256 * 1024


def make_remote(kind: str, request, fault_proxy, monkeypatch, *, proxy_options: dict | None = None,
                **kw) -> tuple[Storage, FaultProxy]:
    """A storage whose endpoint (from the standard setting) is a fault proxy in front of the emulator."""
    if kind == "s3":
        proxy = fault_proxy(request.getfixturevalue("moto_endpoint"), **(proxy_options or {}))
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        kw.setdefault("part_size", MIN_PART)
        return S3Storage(f"s3://{S3_BUCKET}/{unique()}", **kw), proxy
    proxy = fault_proxy(request.getfixturevalue("gcs_endpoint"), **(proxy_options or {}))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    kw.setdefault("part_size", GCS_CHUNK)
    kw.setdefault("parallel_upload", kind != "gcs-resumable")
    return GCSStorage(f"gs://{GCS_BUCKET}/{unique()}", **kw), proxy


@pytest.fixture(params=["s3", "gcs", "gcs-resumable"])
def kind(request, loopback_env) -> str:
    return request.param


@pytest.fixture
def remote(kind, request, fault_proxy, monkeypatch) -> tuple[Storage, FaultProxy]:
    return make_remote(kind, request, fault_proxy, monkeypatch, retry=FAST, max_concurrency=4)


def chain_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("mode", ["503", "drop", "reset"])
def test_every_operation_survives_transient_failures(remote, mode) -> None:
    store, proxy = remote
    part = store.part_size
    data = os.urandom(2 * part + 999)

    def faulty(fn, *args):
        fault = proxy.fail(3, mode)
        out = fn(*args)
        assert fault.fired == 3, f"{fn.__name__} saw {fault.fired} faults"
        return out

    faulty(store.write, "small", b"hello")
    writer = store.open_writer("big")
    faulty(writer.write, [memoryview(data)])
    faulty(writer.commit)
    assert faulty(store.read, "big") == data
    assert faulty(store.read, "small", 1, 3) == b"el"
    out = bytearray(part + 10)
    faulty(store.read_into, "big", [(part - 5, memoryview(out))])
    assert bytes(out) == data[part - 5 : 2 * part + 5]
    assert faulty(store.size, "big") == len(data)
    assert faulty(store.exists, "small")
    assert faulty(store.list) == ["big", "small"]
    faulty(store.delete, "small")
    assert not store.exists("small")


def test_a_truncated_body_resumes_from_where_it_stopped(kind, request, fault_proxy, monkeypatch) -> None:
    # a range of several read blocks, so that the bytes before the cut are kept
    store, proxy = make_remote(kind, request, fault_proxy, monkeypatch, retry=FAST, part_size=MIN_PART)
    size = store.part_size
    data = os.urandom(2 * size)
    store.write("f", data)
    proxy.clear()
    proxy.fail(1, "truncate", method="GET")
    out = bytearray(size)
    store.read_into("f", [(100, memoryview(out))])
    assert bytes(out) == data[100 : 100 + size]
    first, retry = [s.headers.get("Range") for s in proxy.seen if s.method == "GET"]
    assert first == f"bytes=100-{100 + size - 1}"
    resumed = int(retry.removeprefix("bytes=").split("-")[0])
    assert 100 < resumed <= 100 + size // 2 and retry.endswith(f"-{100 + size - 1}")  # only what was missing


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_a_read_past_the_end_through_chunked_answers_fails_at_once(kind_, request, fault_proxy, monkeypatch,
                                                                  loopback_env) -> None:
    """GETs answered chunked, without Content-Length (a gateway in front of the store): a ranged
    read past the end of a file gets a 206 whose Content-Range gives the file's size. That is
    a truncated file, raised at the first answer, not a dropped connection retried."""
    store, proxy = make_remote(kind_, request, fault_proxy, monkeypatch, proxy_options={"chunked_gets": True},
                               retry=FAST)
    data = os.urandom(10_000)
    store.write("f", data)
    out = bytearray(5000)
    store.read_into("f", [(1000, memoryview(out))])
    assert bytes(out) == data[1000:6000]
    proxy.clear()
    with pytest.raises(OSError, match="the file is truncated") as err:
        store.read_into("f", [(9000, memoryview(bytearray(2000)))])
    assert f"{store.join('f')} ends before byte 11000" in str(err.value)
    assert [s.method for s in proxy.seen] == ["GET"]


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_a_store_that_ignores_range_is_refused_not_misread(kind_, request, fault_proxy, monkeypatch,
                                                           loopback_env) -> None:
    """A store (or a cache in front of it) that ignores Range answers a read from byte 1000
    with the whole object: its first bytes must not land in the buffer as bytes 1000 on."""
    store, proxy = make_remote(kind_, request, fault_proxy, monkeypatch, proxy_options={"ignore_range": True},
                               retry=FAST)
    data = os.urandom(10_000)
    store.write("f", data)
    whole = bytearray(10_000)
    store.read_into("f", [(0, memoryview(whole))])  # from byte 0 the whole object is the answer
    assert bytes(whole) == data
    assert store.read("f", 0, 8) == data[:8]
    out = bytearray(5000)
    with pytest.raises(OSError, match="ignored the Range header") as err:
        store.read_into("f", [(1000, memoryview(out))])
    assert store.join("f") in str(err.value)
    with pytest.raises(OSError, match="ignored the Range header"):
        store.read("f", 1000, 2000)


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_an_answer_with_another_part_of_the_object_is_refused(kind_, request, fault_proxy, monkeypatch,
                                                             loopback_env) -> None:
    """A cache in front of the store answers a range with another part of the object (its
    Content-Range says so): an error naming the file, not those bytes as the ones asked for."""
    store, proxy = make_remote(kind_, request, fault_proxy, monkeypatch, proxy_options={"wrong_part": True},
                               retry=FAST)
    data = os.urandom(10_000)
    store.write("f", data)
    out = bytearray(5000)
    with pytest.raises(OSError, match=r"asked for bytes from 1000, the server answered with 'bytes 0-4999/10000'") as err:
        store.read_into("f", [(1000, memoryview(out))])
    assert store.join("f") in str(err.value) and bytes(out) == bytes(5000)
    with pytest.raises(OSError, match="asked for bytes from 1000"):
        store.read("f", 1000, 2000)
    assert store.read("f", 0, 8) == data[:8]


def test_read_into_asks_only_for_the_requested_ranges(remote) -> None:
    store, proxy = remote
    part = store.part_size
    data = os.urandom(4 * part)
    store.write("f", data)
    proxy.clear()
    a, b, c = bytearray(10), bytearray(20), bytearray(2 * part + 1)
    store.read_into("f", [(1000, memoryview(b)), (990, memoryview(a)), (part // 2, memoryview(c))])
    assert bytes(a) + bytes(b) == data[990:1020] and bytes(c) == data[part // 2 : part // 2 + len(c)]
    got = sorted(s.headers.get("Range") for s in proxy.seen if s.method == "GET")
    lo = part // 2
    want = sorted(["bytes=990-1019",  # two adjacent requests, one GET
                   f"bytes={lo}-{lo + part - 1}", f"bytes={lo + part}-{lo + 2 * part - 1}",  # split
                   f"bytes={lo + 2 * part}-{lo + 2 * part}"])
    assert got == want


def test_a_lost_response_is_resumed(kind, remote) -> None:
    """The server acts but the answer never arrives: S3's CompleteMultipartUpload (the retry
    finds the upload gone and the object whole), GCS's compose (composed again from the same
    parts), a resumable upload's chunk PUT (the retry asks the session how much it holds and
    goes on from there)."""
    store, proxy = remote
    data = os.urandom(2 * store.part_size + 77)
    if kind == "s3":
        fault = proxy.fail(1, "lost", method="POST", path="uploadId=")
    elif kind == "gcs":
        fault = proxy.fail(1, "lost", method="POST", path="/compose")
    else:
        fault = proxy.fail(1, "lost", method="PUT")
    with store.open_writer("f") as writer:
        writer.write([memoryview(data)])
        writer.commit()
    assert fault.fired == 1
    assert store.read("f") == data


def test_gcs_chunk_failures_midway_are_retried(request, fault_proxy, monkeypatch, loopback_env) -> None:
    # gcp-storage-emulator answers a status query on a session that holds no bytes yet with
    # "Range: bytes=0-0" (one byte held; real GCS sends no Range header), so the failing
    # chunks here are the second and later ones; the first chunk's retry is covered by the
    # lost-response test, where the emulator holds the chunk and reports it correctly.
    store, proxy = make_remote("gcs-resumable", request, fault_proxy, monkeypatch, retry=FAST)
    data = os.urandom(3 * GCS_CHUNK + 5)
    fault = proxy.fail(4, "503", method="PUT", skip=1)
    store.write("f", data)
    assert fault.fired == 4
    assert store.read("f") == data


def test_timeouts_are_retried(kind, request, fault_proxy, monkeypatch) -> None:
    timeouts = {"read_timeout": 0.5} if kind == "s3" else {"timeout": (5.0, 0.5)}
    store, proxy = make_remote(kind, request, fault_proxy, monkeypatch, retry=FAST, **timeouts)
    store.write("f", b"payload")
    fault = proxy.fail(1, "stall", method="GET", stall_s=1.5)
    assert store.read("f") == b"payload"
    assert fault.fired == 1


@pytest.mark.parametrize("mode", ["503", "drop"])
def test_beyond_the_budget_an_oserror_names_url_and_operation(kind, request, fault_proxy, monkeypatch, caplog, mode):
    monkeypatch.setenv("CHECKPOINTER_IO_RETRIES", "2")
    store, proxy = make_remote(kind, request, fault_proxy, monkeypatch,
                               retry=RetryPolicy(base_delay=0.005, max_delay=0.01))
    assert store.retry.retries == 2
    store.write("f", b"x" * 1000)
    caplog.set_level(logging.DEBUG)
    fault = proxy.fail(10_000, mode)
    with pytest.raises(OSError) as err:
        store.read("f")
    assert not isinstance(err.value, FileNotFoundError)
    assert fault.fired == 3  # the first attempt and two retries
    msg = str(err.value)
    assert store.join("f") in msg and "GET" in msg and "3 attempts" in msg
    with pytest.raises(OSError, match="LIST"):
        store.list()
    writer = store.open_writer("big")
    with pytest.raises(OSError) as err:
        writer.write([memoryview(os.urandom(2 * store.part_size))])
        writer.commit()
    writer.abort()
    assert store.join("big") in str(err.value)
    for text in (chain_text(err.value), caplog.text):
        assert SECRET_KEY not in text
        assert "upload_id=" not in text  # a GCS session URI is a bearer credential
    proxy.clear()
    assert not store.exists("big")


def test_gcs_session_uri_never_appears_in_errors(request, fault_proxy, monkeypatch, loopback_env) -> None:
    monkeypatch.setenv("CHECKPOINTER_IO_RETRIES", "1")
    policy = RetryPolicy(base_delay=0.005, max_delay=0.01)
    store, proxy = make_remote("gcs-resumable", request, fault_proxy, monkeypatch, retry=policy)
    proxy.fail(10_000, "drop", method="PUT", skip=1)
    writer = store.open_writer("f")
    with pytest.raises(OSError) as err:
        writer.write([memoryview(os.urandom(3 * GCS_CHUNK))])
        writer.commit()
    writer.abort()
    text = chain_text(err.value)
    assert "PUT bytes" in text and store.join("f") in text
    assert "upload_id" not in text


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_a_failed_commit_leaves_no_upload_behind_without_an_abort(kind_, request, fault_proxy, monkeypatch,
                                                                 s3_client) -> None:
    """The last request of a commit (S3's CompleteMultipartUpload, GCS's compose) fails past
    the budget: commit itself discards the upload and its parts, the caller need not abort."""
    store, proxy = make_remote(kind_, request, fault_proxy, monkeypatch,
                               retry=RetryPolicy(retries=1, base_delay=0.005, max_delay=0.01))
    proxy.fail(10_000, "503", method="POST", path="uploadId=" if kind_ == "s3" else "/compose")
    writer = store.open_writer("f")
    writer.write([memoryview(os.urandom(2 * store.part_size + 5))])
    with pytest.raises(OSError, match="failed after 2 attempts"):
        writer.commit()
    proxy.clear()
    assert store.list() == []
    if kind_ == "s3":
        assert s3_client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=store.prefix).get("Uploads", []) == []


def test_s3_multipart_and_abort_as_seen_by_the_server(s3_env, s3_client) -> None:
    store = S3Storage(f"s3://{S3_BUCKET}/{unique()}", part_size=MIN_PART, retry=FAST)
    data = os.urandom(2 * MIN_PART + 10)
    store.write("multi", data)
    store.write("single", b"small")
    key = f"{store.prefix}/multi"
    assert s3_client.head_object(Bucket=S3_BUCKET, Key=key)["ETag"].strip('"').endswith("-3")
    assert "-" not in s3_client.head_object(Bucket=S3_BUCKET, Key=f"{store.prefix}/single")["ETag"]
    writer = store.open_writer("aborted")
    writer.write([memoryview(data)])
    uploads = s3_client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=store.prefix).get("Uploads", [])
    assert [u["Key"] for u in uploads] == [f"{store.prefix}/aborted"]
    writer.abort()
    assert not s3_client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=store.prefix).get("Uploads")


def test_s3_upload_created_twice_after_a_lost_answer_leaves_no_orphan(request, s3_client, fault_proxy,
                                                                        monkeypatch) -> None:
    """CreateMultipartUpload is carried out but its answer is lost: the retry creates a second
    upload, and the first, empty, is aborted once the second exists. Uploads of other keys
    under the same prefix, and older uploads of the same key, are left alone. (The proxy lists
    the uploads created through it with their creation time, see ``FaultProxy.upload_times``;
    moto lists every upload as created in 2010.)"""
    store, proxy = make_remote("s3", request, fault_proxy, monkeypatch, proxy_options={"upload_times": True},
                               retry=FAST)
    key = f"{store.prefix}/f"
    old = s3_client.create_multipart_upload(Bucket=S3_BUCKET, Key=key)["UploadId"]  # from 2010, as listed
    neighbour = store._client.create_multipart_upload(Bucket=S3_BUCKET, Key=f"{key}x")["UploadId"]  # just now
    lost = proxy.fail(1, "lost", method="POST", path="?uploads")
    data = os.urandom(2 * MIN_PART + 1)
    store.write("f", data)
    assert lost.fired == 1
    assert store.read("f") == data
    creates = [s for s in proxy.seen if s.method == "POST" and s.path.endswith("?uploads")]
    assert len(creates) == 3  # the neighbour's, the lost one, its retry
    left = s3_client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=store.prefix).get("Uploads", [])
    assert sorted(u["UploadId"] for u in left) == sorted([old, neighbour])


@pytest.mark.parametrize("kind_", ["s3", "gcs", "gcs-resumable"])
def test_writer_memory_stays_bounded(kind_, request) -> None:
    """Many small buffers go through at most (in-flight + 1) part buffers, never a whole copy."""
    if kind_ == "s3":
        request.getfixturevalue("s3_env")
        store: Storage = S3Storage(f"s3://{S3_BUCKET}/{unique()}", part_size=MIN_PART, max_concurrency=2, retry=FAST)
    else:
        request.getfixturevalue("gcs_env")
        store = GCSStorage(f"gs://{GCS_BUCKET}/{unique()}", part_size=GCS_CHUNK, max_concurrency=2, retry=FAST,
                           parallel_upload=kind_ == "gcs")
    part = store.part_size
    total = 8 * part
    chunk = os.urandom(part // 4 + 3)
    tracemalloc.start()
    try:
        with store.open_writer("f") as writer:
            written = 0
            while written < total:
                writer.write([memoryview(chunk)] * 4)
                written += 4 * len(chunk)
            writer.commit()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    bound = (2 if kind_ == "gcs-resumable" else 3) * part  # 2 in flight + 1 filling; resumable: 1 + 1
    assert peak < bound + part, f"peak {peak} bytes for a {written}-byte file"
    assert store.size("f") == written


def test_stable_buffers_are_sent_without_copies(s3_env, gcs_env) -> None:
    """write_stable keeps slices of the caller's buffers: no part buffer is allocated. What
    remains is transient: botocore reads a body 1 MiB at a time (checksum, signature, send)."""
    for store in (S3Storage(f"s3://{S3_BUCKET}/{unique()}", part_size=4 * MIN_PART, max_concurrency=2, retry=FAST),
                  GCSStorage(f"gs://{GCS_BUCKET}/{unique()}", part_size=8 * GCS_CHUNK, max_concurrency=2, retry=FAST)):
        part = store.part_size
        blocks = [bytearray(os.urandom(part // 4 + 3)) for _ in range(4 * 3)]
        tracemalloc.start()
        try:
            with store.open_writer("f") as writer:
                for block in blocks:
                    writer.write_stable([memoryview(block)])
                writer.commit()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < part // 2, f"{store.url}: peak {peak} bytes with {part}-byte parts"
        assert store.read("f") == b"".join(blocks)


def test_gcs_parallel_upload_composes_in_two_rounds_and_leaves_no_parts(gcs_env) -> None:
    from checkpointer.storage.gcs_compose import MAX_COMPOSE_SOURCES

    store = GCSStorage(f"gs://{GCS_BUCKET}/{unique()}", part_size=GCS_CHUNK, max_concurrency=4, retry=FAST)
    data = os.urandom((MAX_COMPOSE_SOURCES + 8) * GCS_CHUNK + 11)  # 41 parts: 2 composes, then 1
    store.write("f", data)
    assert store.read("f") == data
    assert store.list() == ["f"]
    blob = store._client.bucket(GCS_BUCKET).get_blob(f"{store.prefix}/f")
    assert blob.size == len(data) and blob.component_count in (None, 41)  # the emulator keeps no count


def test_gcs_parallel_upload_setting(gcs_env, monkeypatch) -> None:
    from checkpointer.storage.gcs_compose import GCSComposeWriter
    from checkpointer.storage.gcs_upload import GCSWriter

    url = f"gs://{GCS_BUCKET}/{unique()}"
    assert type(GCSStorage(url).open_writer("f")) is GCSComposeWriter
    assert type(GCSStorage(url, parallel_upload=False).open_writer("f")) is GCSWriter
    monkeypatch.setenv("CHECKPOINTER_GCS_PARALLEL_UPLOAD", "0")
    assert type(GCSStorage(url).open_writer("f")) is GCSWriter
    assert type(GCSStorage(url, parallel_upload=True).open_writer("f")) is GCSComposeWriter


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_a_refused_certificate_is_not_retried(kind_, tmp_path, file_server, monkeypatch, loopback_env) -> None:
    """An https endpoint whose certificate nobody trusts (a missing CA bundle for a private
    MinIO, say): the client libraries call it a connection error, but retrying cannot help,
    and 8 retries with backoff cost about 40 s per call. Each call fails at its first attempt
    (google's client may reconnect once on its own, hence at most 2 connections a call)."""
    import ssl

    from storage_servers import self_signed_cert

    cert, key = self_signed_cert(str(tmp_path))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = file_server(str(tmp_path), tls=context)
    if kind_ == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.url)
        store: Storage = S3Storage(f"s3://{S3_BUCKET}/{unique()}", retry=FAST)
    else:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        store = GCSStorage(f"gs://{GCS_BUCKET}/{unique()}", retry=FAST)
    calls = [lambda: store.read("f"), lambda: store.exists("f"), lambda: store.write("f", b"data"),
             lambda: store.read_into("f", [(0, memoryview(bytearray(4)))])]
    for call in calls:
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED") as err:
            call()
        assert "attempts" not in str(err.value)  # not "failed after 9 attempts"
        assert f"{store.url}/f" in str(err.value)  # gs:// did not say which (found by a review)
    time.sleep(0.2)  # the server counts a connection when it accepts it
    assert 0 < server._server.connections <= 2 * len(calls)


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_a_refused_request_is_not_retried_and_names_url_and_operation(kind_, tmp_path, file_server, monkeypatch,
                                                                      loopback_env) -> None:
    """An endpoint that answers 403 to everything (a key without the permission): no retries,
    an ``OSError`` (not a missing file) that names the operation and the file's URL."""
    server = file_server(str(tmp_path), missing_status=403)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3" if kind_ == "s3" else "STORAGE_EMULATOR_HOST", server.url)
    store = (S3Storage(f"s3://{S3_BUCKET}/{unique()}", retry=FAST) if kind_ == "s3"
             else GCSStorage(f"gs://{GCS_BUCKET}/{unique()}", retry=FAST))
    for call, op in [(lambda: store.read("f", 2, 9), "GET bytes 2-8"), (lambda: store.size("f"), "HEAD")]:
        seen = len(server.authorization_seen)
        with pytest.raises(OSError) as err:
            call()
        assert not isinstance(err.value, FileNotFoundError)
        assert len(server.authorization_seen) - seen <= 2  # google's client may resend once on its own
        assert str(err.value).startswith(f"{op} {store.join('f')}: "), str(err.value)


def test_gcs_session_uri_never_appears_in_debug_logs(gcs_env, caplog) -> None:
    """urllib3 logs each request's path and query at DEBUG: a resumable upload's chunk PUTs
    carry the session's id, a bearer credential."""
    store = GCSStorage(f"gs://{GCS_BUCKET}/{unique()}", part_size=GCS_CHUNK, retry=FAST, parallel_upload=False)
    caplog.set_level(logging.DEBUG)
    store.write("f", os.urandom(3 * GCS_CHUNK + 1))
    puts = [r.getMessage() for r in caplog.records if '"PUT /upload/' in r.getMessage()]
    assert len(puts) >= 4  # the chunks were logged...
    assert "upload_id" not in caplog.text  # ...without the session
