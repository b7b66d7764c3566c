"""One contract, every backend: local, memory, S3 (moto_server), GCS (gcp-storage-emulator)."""

from __future__ import annotations

import array
import os
import threading

import pytest

from checkpointer.storage import Storage, open_storage
from checkpointer.storage.gcs import GCSStorage
from checkpointer.storage.local import LocalStorage
from checkpointer.storage.memory import MemoryStorage
from checkpointer.storage.s3 import MIN_PART, S3Storage
from storage_servers import FAST

BACKENDS = ["local", "memory", "s3", "gcs", "gcs-resumable"]


@pytest.fixture(params=BACKENDS)
def storage(request, tmp_path) -> Storage:
    kind = request.param
    if kind == "local":
        store: Storage = LocalStorage(str(tmp_path / "root"))
    elif kind == "memory":
        store = MemoryStorage()
    elif kind == "s3":
        store = S3Storage(request.getfixturevalue("s3_url"), client=request.getfixturevalue("s3_client"),
                          part_size=MIN_PART, max_concurrency=4, retry=FAST)
    else:
        store = GCSStorage(request.getfixturevalue("gcs_url"), part_size=256 * 1024, max_concurrency=4, retry=FAST,
                           parallel_upload=kind == "gcs")
    store.prepare()
    return store


def part(storage: Storage) -> int:
    return getattr(storage, "part_size", 256 * 1024)


def blob(n: int, seed: int = 0) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[seed % 256 :][:n] if n < 1 << 16 else os.urandom(n)


def subdir(storage: Storage, name: str) -> Storage:
    child = storage.child(name)
    child.prepare()
    return child


class TestStorageContract:
    def test_write_read_size_exists(self, storage: Storage) -> None:
        data = blob(10_000)
        assert not storage.exists("a.bin")
        storage.write("a.bin", data)
        assert storage.exists("a.bin")
        assert storage.size("a.bin") == len(data)
        assert storage.read("a.bin") == data
        assert storage.read("a.bin", 100) == data[100:]
        assert storage.read("a.bin", 100, 300) == data[100:300]
        assert storage.read("a.bin", 9_990, 20_000) == data[9_990:]
        assert storage.read("a.bin", 50_000, 60_000) == b""
        assert storage.read("a.bin", 7, 7) == b""

    def test_missing_file(self, storage: Storage) -> None:
        with pytest.raises(FileNotFoundError, match="nope"):
            storage.size("nope")
        with pytest.raises(FileNotFoundError, match="nope"):
            storage.read("nope")
        with pytest.raises(FileNotFoundError, match="nope"):
            storage.read_into("nope", [(0, memoryview(bytearray(4)))])
        assert not storage.exists("nope")
        storage.delete("nope")

    def test_read_into_several_requests(self, storage: Storage) -> None:
        size = 2 * part(storage) + 12_345
        data = blob(size)
        storage.write("f", data)
        floats = array.array("f", [0.0] * 16)
        big = bytearray(size - 1000)  # spans every part boundary: split into ranged pieces
        reqs = [
            (size - 10, memoryview(bytearray(10))),  # out of order
            (0, memoryview(bytearray(3))),
            (3, memoryview(bytearray(5))),  # adjacent to the one before
            (8, memoryview(floats)),  # a typed buffer
            (500, memoryview(bytearray(0))),
            (1000, memoryview(big)),
            (1002, memoryview(bytearray(7))),  # overlaps the big one
        ]
        storage.read_into("f", reqs)
        assert bytes(reqs[0][1]) == data[-10:]
        assert bytes(reqs[1][1]) + bytes(reqs[2][1]) == data[:8]
        assert floats.tobytes() == data[8:72]
        assert bytes(big) == data[1000:]
        assert bytes(reqs[6][1]) == data[1002:1009]

    def test_read_into_past_the_end(self, storage: Storage) -> None:
        storage.write("short", b"0123456789")
        with pytest.raises(OSError) as err:
            storage.read_into("short", [(5, memoryview(bytearray(20)))])
        assert "short" in str(err.value)

    def test_read_blocks_calls_back_after_each_block(self, storage: Storage) -> None:
        data = blob(100_000)
        storage.write("b", data)
        out = bytearray(70_001)
        seen: list[bytes] = []
        # The callback sees each block filled, in order, before the next is read.
        storage.read_blocks("b", 1_234, memoryview(out), 16_384, lambda part: seen.append(bytes(part)) or None)
        assert bytes(out) == data[1_234 : 1_234 + 70_001]
        assert [len(b) for b in seen] == [16_384] * 4 + [70_001 - 4 * 16_384]
        assert b"".join(seen) == bytes(out)
        with pytest.raises(OSError) as err:
            storage.read_blocks("b", 90_000, memoryview(bytearray(20_000)), 4_096, seen.append)
        assert "b" in str(err.value) and not isinstance(err.value, FileNotFoundError)
        with pytest.raises(FileNotFoundError):
            storage.read_blocks("nope", 0, memoryview(bytearray(8)), 4, seen.append)

    def test_read_into_from_threads(self, storage: Storage) -> None:
        data = blob(300_000)
        storage.write("t", data)
        outs = [bytearray(1000) for _ in range(8)]
        errors: list[BaseException] = []

        def reader(i: int) -> None:
            try:
                storage.read_into("t", [(i * 30_000, memoryview(outs[i]))])
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert all(bytes(outs[i]) == data[i * 30_000 : i * 30_000 + 1000] for i in range(8))

    def test_list_and_child(self, storage: Storage) -> None:
        assert storage.list() == []
        storage.write("a", b"1")
        sub = subdir(storage, "b")
        sub.write("c", b"2")
        subdir(sub, "d").write("e", b"3")
        assert storage.list() == ["a", "b"]
        assert sub.list() == ["c", "d"]
        assert storage.read("b/d/e") == b"3"
        assert sub.read("d/e") == b"3"
        assert sub.url.rstrip("/").endswith("/b")
        assert storage.child("missing").list() == []

    def test_delete(self, storage: Storage) -> None:
        storage.write("x", b"1")
        storage.write("y", b"2")
        storage.delete("x")
        assert not storage.exists("x")
        assert storage.list() == ["y"]
        storage.delete("x")

    def test_delete_tree(self, storage: Storage) -> None:
        storage.write("a", b"1")
        storage.write("bb", b"kept: a name beginning like the tree's")
        tree = subdir(storage, "b")
        tree.write("c", b"2")
        subdir(tree, "d").write("e", b"3")
        storage.delete_tree("b")
        assert storage.list() == ["a", "bb"]
        assert storage.child("b").list() == []
        assert not storage.exists("b/d/e")
        storage.delete_tree("b")  # missing is fine
        storage.delete_tree("nothing")

    def test_writer_commit(self, storage: Storage) -> None:
        p = part(storage)
        pieces = [blob(10), blob(p - 3, 1), blob(2 * p + 7, 2), blob(1, 3), blob(p, 4), blob(100, 5)]
        writer = storage.open_writer("w")
        writer.write([memoryview(x) for x in pieces[:3]])
        writer.write([memoryview(x) for x in pieces[3:]])
        assert not storage.exists("w")
        assert "w" not in storage.list()
        writer.commit()
        assert storage.read("w") == b"".join(pieces)
        assert storage.size("w") == sum(map(len, pieces))

    def test_writer_stable_and_plain_buffers_mixed(self, storage: Storage) -> None:
        p = part(storage)
        kept = [bytearray(blob(n, i)) for i, n in enumerate([7, p - 1, 2 * p + 3, 5, p])]
        plain = [blob(3, 9), blob(p + 2, 10)]
        with storage.open_writer("m") as writer:
            writer.write_stable([memoryview(kept[0]), memoryview(kept[1])])
            scratch = bytearray(plain[0])
            writer.write([memoryview(scratch)])
            scratch[:] = b"\xff" * len(scratch)  # the writer must have taken its own copy
            writer.write_stable([memoryview(kept[2])])
            writer.write([memoryview(plain[1])])
            writer.write_stable([memoryview(kept[3]), memoryview(kept[4])])
            writer.commit()
        want = kept[0] + kept[1] + plain[0] + kept[2] + plain[1] + kept[3] + kept[4]
        assert storage.read("m") == bytes(want)

    def test_writer_typed_buffers_and_small_file(self, storage: Storage) -> None:
        floats = array.array("d", [1.5, -2.25, 3.0])
        with storage.open_writer("small") as writer:
            writer.write([memoryview(floats), memoryview(b"tail")])
            writer.commit()
        assert storage.read("small") == floats.tobytes() + b"tail"

    def test_writer_abort_leaves_the_name_as_it_was(self, storage: Storage) -> None:
        storage.write("keep", b"old")
        writer = storage.open_writer("keep")
        writer.write([memoryview(blob(2 * part(storage) + 1))])
        writer.abort()
        writer.abort()
        assert storage.read("keep") == b"old"
        writer = storage.open_writer("gone")
        writer.write([memoryview(blob(3 * part(storage)))])
        writer.abort()
        assert not storage.exists("gone")
        assert storage.list() == ["keep"]

    def test_writer_context_aborts_on_error(self, storage: Storage) -> None:
        with pytest.raises(RuntimeError):
            with storage.open_writer("boom") as writer:
                writer.write([memoryview(blob(part(storage) + 5))])
                raise RuntimeError("failed mid-save")
        assert not storage.exists("boom")

    def test_create_exclusive(self, storage: Storage) -> None:
        storage.create_exclusive("lock", b"first")
        with pytest.raises(FileExistsError, match="lock"):
            storage.create_exclusive("lock", b"second")
        assert storage.read("lock") == b"first"
        storage.delete("lock")
        storage.create_exclusive("lock", b"third")
        assert storage.read("lock") == b"third"

    def test_writer_replaces(self, storage: Storage) -> None:
        storage.write("r", b"old contents")
        with storage.open_writer("r") as writer:
            writer.write([memoryview(b"new")])
            writer.commit()
        assert storage.read("r") == b"new"

    def test_empty_files(self, storage: Storage) -> None:
        storage.write("e1", b"")
        with storage.open_writer("e2") as writer:
            writer.write([])
            writer.commit()
        for name in ("e1", "e2"):
            assert storage.exists(name)
            assert storage.size(name) == 0
            assert storage.read(name) == b""
        storage.read_into("e1", [(0, memoryview(bytearray(0)))])

    @pytest.mark.parametrize("bad", ["", "/abs", "../up", "a/../b", "a//b", "./a"])
    def test_invalid_names(self, storage: Storage, bad: str) -> None:
        with pytest.raises(ValueError):
            storage.read(bad)
        with pytest.raises(ValueError):
            storage.child(bad)


def test_open_storage_dispatch(tmp_path, s3_url, gcs_url, monkeypatch) -> None:
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    s3 = open_storage(s3_url)
    gcs = open_storage(gcs_url)
    assert isinstance(s3, S3Storage) and s3.url == s3_url
    assert isinstance(gcs, GCSStorage) and gcs.url == gcs_url
    # The endpoints come from AWS_ENDPOINT_URL_S3 / STORAGE_EMULATOR_HOST alone.
    for store in (s3, gcs):
        store.write("hello", b"world")
        assert store.read("hello") == b"world"
    # the service-independent setting works too
    monkeypatch.setenv("AWS_ENDPOINT_URL", os.environ["AWS_ENDPOINT_URL_S3"])
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    assert open_storage(s3_url).read("hello") == b"world"
    memory = MemoryStorage()
    assert open_storage(memory) is memory


def test_memory_instances_are_separate() -> None:
    a, b = MemoryStorage(), MemoryStorage()
    a.write("x", b"1")
    assert not b.exists("x")
    assert a.child("sub").url == "memory://sub"


@pytest.mark.parametrize("url", ["htps://alice:tok3n@host/ckpt", "ftp://host/ckpt?sig=tok3n"])
def test_unsupported_url_error_shows_no_credentials(url) -> None:
    with pytest.raises(ValueError, match="unsupported storage URL") as err:
        open_storage(url)
    assert "tok3n" not in str(err.value) and "host/ckpt" in str(err.value)
