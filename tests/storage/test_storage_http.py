"""Read-only http(s):// loading against a tiny loopback file server with Range support."""

from __future__ import annotations

import io
import os
import time

import pytest

from checkpointer.storage import open_storage
from checkpointer.storage.http import HTTPStorage
from checkpointer.storage.local import LocalStorage
from checkpointer.storage.retry import RetryPolicy
from storage_servers import FAST


@pytest.fixture
def served(tmp_path, file_server):
    """A checkpoint-like directory on disk and a file server for its parent."""
    local = LocalStorage(str(tmp_path / "ckpt"))
    local.prepare()
    data = os.urandom(2_000_000)
    local.write("rank_0.bin", data)
    local.write("metadata.json", b'{"ok": true}')
    sub = local.child("sub dir")
    sub.prepare()
    sub.write("x", b"nested")
    return str(tmp_path), data


def test_http_reads(served, file_server) -> None:
    root, data = served
    server = file_server(root)
    store = open_storage(f"{server.url}/ckpt/")
    assert isinstance(store, HTTPStorage)
    store = HTTPStorage(f"{server.url}/ckpt", part_size=64 * 1024, retry=FAST)
    assert store.size("rank_0.bin") == len(data)
    assert store.exists("metadata.json") and not store.exists("nope")
    assert store.read("metadata.json") == b'{"ok": true}'
    assert store.read("rank_0.bin", 10, 20) == data[10:20]
    assert store.read("rank_0.bin", 1_999_990) == data[1_999_990:]
    assert store.read("rank_0.bin", 2_400_000, 2_400_010) == b""
    assert store.child("sub dir").read("x") == b"nested"
    with pytest.raises(FileNotFoundError, match="nope"):
        store.read("nope")
    with pytest.raises(FileNotFoundError):
        store.size("nope")

    server.ranges_seen.clear()
    a, b, c = bytearray(100), bytearray(50), bytearray(150_000)
    store.read_into("rank_0.bin", [(150, memoryview(b)), (50, memoryview(a)), (100_000, memoryview(c))])
    assert bytes(a) + bytes(b) == data[50:200] and bytes(c) == data[100_000:250_000]
    # adjacent requests coalesced, the large one split into part-size GETs
    assert sorted(server.ranges_seen) == sorted(
        ["bytes=50-199", "bytes=100000-165535", "bytes=165536-231071", "bytes=231072-249999"])
    with pytest.raises(OSError, match="truncated"):
        store.read_into("rank_0.bin", [(1_999_000, memoryview(bytearray(2000)))])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("length", ["abc", "-5", "1.5", "12, 12", "+12", "0x10", "\u00b2", ""])
def test_http_content_length_that_is_not_a_number(served, file_server, length) -> None:
    """Each way in that reads the header (HEAD for a size, ranged and whole GETs) raises an
    OSError naming the file; int() made it a ValueError, and a GET read to the connection's end."""
    root, _ = served
    store = HTTPStorage(f"{file_server(root, content_length=length).url}/ckpt", retry=FAST, timeout=(5.0, 5.0))
    calls = {
        "size": lambda: store.size("rank_0.bin"),
        "exists": lambda: store.exists("rank_0.bin"),
        "read": lambda: store.read("metadata.json"),
        "read_range": lambda: store.read("rank_0.bin", 10, 20),
        "read_into": lambda: store.read_into("rank_0.bin", [(0, memoryview(bytearray(100)))]),
    }
    for what, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(OSError, match="Content-Length .* is not a number of bytes") as err:
            call()
        assert "rank_0.bin" in str(err.value) or "metadata.json" in str(err.value), (what, err.value)
        assert time.monotonic() - t0 < 4.0, f"{what} waited for the connection to end"


@pytest.mark.timeout(60)
def test_http_loaders_with_a_content_length_that_is_not_a_number(tmp_path, file_server) -> None:
    """What a user calls: an OSError (or a CheckpointError), never a ValueError."""
    import torch

    from checkpointer import CheckpointError, Checkpointer, lazy_load

    Checkpointer().save(str(tmp_path / "ck"), {"w": torch.arange(6.0)})
    url = f"{file_server(str(tmp_path), content_length='lots').url}/ck"
    calls = {
        "get_metadata": lambda: Checkpointer().get_metadata(url, no_dist=True),
        "unshard": lambda: Checkpointer().unshard(url, no_dist=True),
        "lazy_load": lambda: dict(lazy_load(url)),
    }
    for what, call in calls.items():
        with pytest.raises((OSError, CheckpointError)) as err:
            call()
        assert "not a number of bytes" in str(err.value) or "not a number of bytes" in str(err.value.__cause__), (what, err.value)


def test_http_is_read_only(served, file_server) -> None:
    store = HTTPStorage(f"{file_server(served[0]).url}/ckpt")
    for call in (lambda: store.write("a", b"1"), lambda: store.open_writer("a"), lambda: store.delete("a"), store.list):
        with pytest.raises(io.UnsupportedOperation):
            call()


def test_http_server_without_range_support(served, file_server) -> None:
    root, data = served
    store = HTTPStorage(f"{file_server(root, ranges=False).url}/ckpt", retry=FAST)
    out = bytearray(1000)
    store.read_into("rank_0.bin", [(123_456, memoryview(out))])
    assert bytes(out) == data[123_456:124_456]
    assert store.read("rank_0.bin", 5, 9) == data[5:9]


def test_http_credentials_are_sent_but_never_shown(served, file_server) -> None:
    root, data = served
    server = file_server(root, auth=("alice", "hunter2"), token="s3cr3t")
    port = server.url.rsplit(":", 1)[1]
    store = HTTPStorage(f"http://alice:hunter2@127.0.0.1:{port}/ckpt?token=s3cr3t", retry=FAST)
    assert store.read("metadata.json") == b'{"ok": true}'
    assert "hunter2" not in store.url and "s3cr3t" not in store.url
    wrong = HTTPStorage(f"http://alice:wrong-pw@127.0.0.1:{port}/ckpt?token=s3cr3t", retry=FAST)
    with pytest.raises(OSError) as err:
        wrong.read("metadata.json")
    assert "401" in str(err.value)
    assert "wrong-pw" not in str(err.value) and "s3cr3t" not in str(err.value)


def test_http_403_is_a_missing_file_to_exists_and_access_denied_to_reads(served, file_server) -> None:
    """A public S3 bucket without list permission answers 403 for a missing key: ``exists`` says
    False (loaders probe for files); a read or a size of it says access was denied. A 401 (wrong
    credentials) is still an error, also to ``exists``."""
    root, _ = served
    server = file_server(root, missing_status=403, auth=("alice", "pw"))
    port = server.url.rsplit(":", 1)[1]
    store = HTTPStorage(f"http://alice:pw@127.0.0.1:{port}/ckpt", retry=FAST)
    assert store.exists("metadata.json") and not store.exists("nope")
    for op, call in [("GET", lambda: store.read("nope")), ("HEAD", lambda: store.size("nope")),
                     ("GET", lambda: store.read_into("nope", [(0, memoryview(bytearray(4)))]))]:
        with pytest.raises(PermissionError, match="access denied") as err:
            call()
        assert f"{op} " in str(err.value) and store.join("nope") in str(err.value)
    wrong = HTTPStorage(f"http://alice:wrong@127.0.0.1:{port}/ckpt", retry=FAST)
    with pytest.raises(OSError, match="401"):
        wrong.exists("metadata.json")


def test_http_410_is_a_missing_file_and_other_refusals_name_op_and_file(served, file_server) -> None:
    """A server that answers 410 Gone for a missing file: missing to ``exists`` and to reads.
    A refusal that says nothing of the file (401) is an ``OSError`` naming the operation and it."""
    root, _ = served
    server = file_server(root, missing_status=410, token="t0k")
    store = HTTPStorage(f"{server.url}/ckpt?token=t0k", retry=FAST)
    assert store.exists("metadata.json") and not store.exists("nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        store.read("nope")
    wrong = HTTPStorage(f"{server.url}/ckpt?token=wrong", retry=FAST)
    with pytest.raises(OSError) as err:
        wrong.read("metadata.json", 0, 4)
    assert str(err.value).startswith(f"GET bytes 0-3 {wrong.join('metadata.json')}: HTTP 401"), str(err.value)


def test_http_follows_redirects_without_forwarding_credentials(served, file_server) -> None:
    root, data = served
    target = file_server(root)
    front = file_server(root, redirect_to=target.url, auth=("alice", "pw"))
    port = front.url.rsplit(":", 1)[1]
    store = HTTPStorage(f"http://alice:pw@127.0.0.1:{port}/ckpt", retry=FAST)
    assert store.size("rank_0.bin") == len(data)
    out = bytearray(1000)
    store.read_into("rank_0.bin", [(5000, memoryview(out))])
    assert bytes(out) == data[5000:6000]
    assert target.ranges_seen[-1] == "bytes=5000-5999"
    assert all(front.authorization_seen) and not any(target.authorization_seen)


def test_http_retries_and_resumes(served, file_server, fault_proxy) -> None:
    root, data = served
    proxy = fault_proxy(file_server(root).url)
    store = HTTPStorage(f"{proxy.url}/ckpt", retry=FAST)
    proxy.fail(3, "503")
    assert store.size("rank_0.bin") == len(data)
    proxy.fail(2, "drop")
    assert store.read("metadata.json") == b'{"ok": true}'
    proxy.fail(2, "reset")
    assert store.exists("metadata.json")
    proxy.clear()
    proxy.fail(1, "truncate", method="GET")
    out = bytearray(1_500_000)
    store.read_into("rank_0.bin", [(1000, memoryview(out))])
    assert bytes(out) == data[1000:1_501_000]
    first, retry = [s.headers.get("Range") for s in proxy.seen]
    assert first == "bytes=1000-1500999"
    resumed = int(retry.removeprefix("bytes=").split("-")[0])
    assert 1000 < resumed <= 1000 + 750_000 and retry.endswith("-1500999")  # only what was missing


def test_http_beyond_the_budget(served, file_server, fault_proxy, monkeypatch) -> None:
    monkeypatch.setenv("CHECKPOINTER_IO_RETRIES", "2")
    root, _ = served
    proxy = fault_proxy(file_server(root).url)
    store = HTTPStorage(f"{proxy.url}/ckpt?token=abc", retry=RetryPolicy(base_delay=0.005, max_delay=0.01))
    fault = proxy.fail(100, "drop")
    with pytest.raises(OSError) as err:
        store.read_into("rank_0.bin", [(0, memoryview(bytearray(10)))])
    assert fault.fired == 3
    assert f"{proxy.url}/ckpt/rank_0.bin?***" in str(err.value)
    assert "GET bytes 0-9" in str(err.value) and "abc" not in str(err.value)


def test_http_chunked_responses_leave_no_bytes_on_a_pooled_connection(served, file_server) -> None:
    """A ranged body without Content-Length (chunked), of which a read takes only the bytes it
    asked for, leaves the chunked body's end unread: the connection must not go back to the
    pool with it, or the next request on it reads that as its answer. No retries here: each
    request must succeed the first time."""
    root, data = served
    server = file_server(root, chunked=True)
    store = HTTPStorage(f"{server.url}/ckpt", max_concurrency=1, retry=RetryPolicy(retries=0))
    for i in range(4):
        assert store.read("rank_0.bin", 10 * i, 10 * i + 10) == data[10 * i : 10 * i + 10]
        out = bytearray(5000)
        store.read_into("rank_0.bin", [(100_000 + i, memoryview(out))])
        assert bytes(out) == data[100_000 + i : 105_000 + i]
        assert store.read("metadata.json") == b'{"ok": true}'
        assert store.size("rank_0.bin") == len(data)


def test_http_answer_from_another_part_of_the_file_is_refused(served, file_server) -> None:
    """A 206 whose Content-Range starts elsewhere than the byte asked for (a cache or proxy that
    serves another part) is an error naming the file and the answer, not those bytes."""
    root, data = served
    store = HTTPStorage(f"{file_server(root, wrong_part=True).url}/ckpt", retry=FAST)
    out = bytearray(100)
    with pytest.raises(OSError, match=r"rank_0\.bin: asked for bytes from 300, the server answered with 'bytes 0-99/2000000'"):
        store.read_into("rank_0.bin", [(300, memoryview(out))])
    assert bytes(out) == bytes(100)
    with pytest.raises(OSError, match="asked for bytes from 300"):
        store.read("rank_0.bin", 300, 400)
    assert store.read("rank_0.bin", 0, 100) == data[:100]  # the part asked for


@pytest.mark.parametrize("ranges", [True, False], ids=["206", "200-whole-file"])
def test_http_short_chunked_answer_fails_at_once_as_a_truncated_file(served, file_server, monkeypatch,
                                                                     ranges) -> None:
    """A read past the end of a file, from a server that sends bodies chunked (no Content-Length):
    a 206 whose Content-Range gives the file's size, or (Range ignored) a 200 of the whole file
    whose last chunk arrived. The file is short, the connection is fine: the read fails at the
    first answer, not after CHECKPOINTER_IO_RETRIES retries with backoff (about 40 s)."""
    monkeypatch.delenv("CHECKPOINTER_IO_RETRIES", raising=False)
    root, data = served
    server = file_server(root, chunked=True, ranges=ranges)
    store = HTTPStorage(f"{server.url}/ckpt")  # the library's own retries and backoff
    started = time.monotonic()
    with pytest.raises(OSError, match="the file is truncated") as err:
        store.read_into("rank_0.bin", [(len(data) - 1000, memoryview(bytearray(2000)))])
    assert time.monotonic() - started < 5
    assert not isinstance(err.value, FileNotFoundError)
    assert f"{store.join('rank_0.bin')} ends before byte {len(data) + 1000}" in str(err.value)
    assert len(server.ranges_seen) == 1


def test_http_chunked_body_cut_midway_is_retried_and_resumed(served, file_server) -> None:
    """A chunked body whose connection closes before its last chunk is a dropped connection."""
    root, data = served
    server = file_server(root, chunked=True)
    store = HTTPStorage(f"{server.url}/ckpt", retry=FAST)
    server.cut_bodies = 2
    out = bytearray(1_500_000)  # several read blocks, so that the bytes before a cut are kept
    store.read_into("rank_0.bin", [(1000, memoryview(out))])
    assert bytes(out) == data[1000:1_501_000]
    first, *retries = server.ranges_seen
    assert first == "bytes=1000-1500999" and len(retries) == 2
    assert all(1000 < int(r.removeprefix("bytes=").split("-")[0]) for r in retries)  # resumed


def test_https_handshakes_cut_short_are_retried_and_a_refused_certificate_is_not(served, file_server, tmp_path,
                                                                                  monkeypatch) -> None:
    """A server (a load balancer) that closes connections during the TLS handshake is a dropped
    connection, retried like one over plain http; a certificate nobody trusts fails at once."""
    import ssl

    from storage_servers import self_signed_cert

    root, data = served
    cert, key = self_signed_cert(str(tmp_path))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = file_server(root, tls=context)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED") as err:
        HTTPStorage(f"{server.url}/ckpt", retry=FAST).read("metadata.json")
    assert f"{server.url}/ckpt/metadata.json" in str(err.value)  # which file (found by a review)
    assert server._server.connections == 1  # not retried

    monkeypatch.setenv("SSL_CERT_FILE", cert)  # trusted from here on
    server._server.drop_handshakes = 3
    store = HTTPStorage(f"{server.url}/ckpt", retry=FAST)
    assert store.read("metadata.json") == b'{"ok": true}'
    assert server._server.connections == 1 + 3 + 1
    server._server.drop_handshakes = 100
    with pytest.raises(OSError, match="failed after 3 attempts"):
        HTTPStorage(f"{server.url}/ckpt", retry=RetryPolicy(retries=2, base_delay=0.005, max_delay=0.01)).read("x")
    assert server._server.connections == 5 + 3


def test_http_token_never_appears_in_debug_logs(served, file_server, caplog) -> None:
    import logging

    root, data = served
    server = file_server(root, token="s3cr3t")
    store = HTTPStorage(f"{server.url}/ckpt?token=s3cr3t", retry=FAST)
    caplog.set_level(logging.DEBUG)
    assert store.read("metadata.json") == b'{"ok": true}'
    assert any('"GET /ckpt/metadata.json?***' in r.getMessage() for r in caplog.records)  # logged, redacted
    assert "s3cr3t" not in caplog.text
