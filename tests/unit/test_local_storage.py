"""storage/local.py and storage/base.py: exact reads, confinement to the root, atomic writers."""

from __future__ import annotations

import array
import errno
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointer.storage import open_storage
from checkpointer.storage.base import Storage, check_name
from checkpointer.storage.local import LocalStorage

DATA = bytes((i * 7 + i // 256) % 256 for i in range(4096))


@pytest.fixture
def storage(tmp_path) -> LocalStorage:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "data.bin").write_bytes(DATA)
    return LocalStorage(str(root))


def visible(path) -> list[str]:
    return sorted(os.listdir(path))


# ---------------------------------------------------------------------------------------------
# Reads
# ---------------------------------------------------------------------------------------------


def test_read_ranges(storage):
    assert storage.read("data.bin") == DATA
    assert storage.read("data.bin", 100) == DATA[100:]
    assert storage.read("data.bin", 100, 200) == DATA[100:200]
    assert storage.read("data.bin", 5, 5) == b""
    assert storage.size("data.bin") == len(DATA)
    assert storage.exists("data.bin") and not storage.exists("nope.bin")


def test_read_into_adjacent_and_scattered(storage):
    layout = [
        (0, 10),
        (10, 5),  # adjacent to the previous one
        (15, 1),  # and again
        (100, 20),  # a jump
        (50, 0),  # empty
        (60, 30),  # backwards
        (5, 3),  # overlapping an earlier request
        (4000, 96),  # up to the very end
        (4096, 0),  # empty, at the end
    ]
    bufs = [memoryview(bytearray(n)) for _, n in layout]
    storage.read_into("data.bin", list(zip((o for o, _ in layout), bufs)))
    for (offset, n), buf in zip(layout, bufs):
        assert bytes(buf) == DATA[offset : offset + n], (offset, n)


def test_read_into_joins_requests_a_short_gap_apart(tmp_path, monkeypatch):
    """Requests in file order at most ``GAP_READ`` bytes apart are one ``preadv`` (the gaps read
    into scratch); a longer gap starts another; an empty request past the end reads nothing."""
    from checkpointer.storage import local

    monkeypatch.setattr(local, "GAP_READ", 64)
    (tmp_path / "data.bin").write_bytes(DATA)
    storage = LocalStorage(str(tmp_path))
    layout = [(0, 8), (40, 8), (112, 16), (176, 4), (300, 10), (310, 2), (4090, 6), (4100, 0)]
    calls: list[int] = []
    real = os.preadv

    def preadv(fd, bufs, offset):
        calls.append(offset)
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    bufs = [memoryview(bytearray(n)) for _, n in layout]
    storage.read_into("data.bin", list(zip((o for o, _ in layout), bufs)))
    for (offset, n), buf in zip(layout, bufs):
        assert bytes(buf) == DATA[offset : offset + n], (offset, n)
    assert calls == [0, 300, 4090]  # gaps of 32, 64, 48 joined; 120 and 3778 bytes not


def test_read_into_typed_and_sliced_buffers(storage):
    ints = array.array("i", [0] * 8)  # 32 bytes, item format "i"
    doubles = array.array("d", [0.0] * 4)  # 32 bytes, item format "d"
    backing = bytearray(b"\xee" * 40)
    window = memoryview(backing)[10:30]  # a slice of a larger buffer: the rest is untouched
    storage.read_into("data.bin", [(64, memoryview(ints)), (96, memoryview(doubles)), (200, window)])
    assert ints.tobytes() == DATA[64:96]
    assert doubles.tobytes() == DATA[96:128]
    assert bytes(backing) == b"\xee" * 10 + DATA[200:220] + b"\xee" * 10


def test_read_into_typed_buffer_followed_by_adjacent_request(storage):
    # ints covers bytes [0, 16); the second request starts at byte 4 (= len(ints) items).
    ints = array.array("i", [0] * 4)
    tail = bytearray(4)
    storage.read_into("data.bin", [(0, memoryview(ints)), (4, memoryview(tail))])
    assert ints.tobytes() == DATA[0:16]
    assert bytes(tail) == DATA[4:8]


def test_base_read_into_typed_buffer():
    ints = array.array("i", [0] * 4)
    BytesStorage(DATA).read_into("f", [(8, memoryview(ints))])
    assert ints.tobytes() == DATA[8:24]


def test_read_into_many_adjacent_requests(storage):
    # More adjacent requests than one preadv takes (IOV_MAX): all filled, in order.
    bufs = [memoryview(bytearray(1)) for _ in range(3000)]
    storage.read_into("data.bin", [(i, b) for i, b in enumerate(bufs)])
    assert b"".join(bytes(b) for b in bufs) == DATA[:3000]


@pytest.fixture(scope="module")
def shared_storage(tmp_path_factory) -> LocalStorage:
    root = tmp_path_factory.mktemp("shared")
    (root / "data.bin").write_bytes(DATA)
    return LocalStorage(str(root))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, len(DATA)), st.integers(0, 300)), max_size=12), st.booleans())
def test_read_into_property(shared_storage, raw, chain):
    requests = []
    pos = 0
    for offset, n in raw:
        if chain:
            offset = pos  # every request follows the previous one
        n = min(n, len(DATA) - offset)
        requests.append((offset, memoryview(bytearray(n))))
        pos = offset + n
    shared_storage.read_into("data.bin", requests)
    for offset, buf in requests:
        assert bytes(buf) == DATA[offset : offset + len(buf)]


@pytest.mark.parametrize(
    "requests",
    [
        [(4090, 10)],  # runs past the end
        [(5000, 1)],  # starts past the end
        [(0, 10), (10, 4090)],  # an adjacent chain that runs past the end
        [(0, 10), (4095, 2)],
    ],
)
def test_read_into_truncated_file_is_oserror(storage, requests):
    with pytest.raises(OSError):
        storage.read_into("data.bin", [(o, memoryview(bytearray(n))) for o, n in requests])


def test_missing_file_is_file_not_found(storage):
    with pytest.raises(FileNotFoundError):
        storage.read("missing.bin")
    with pytest.raises(FileNotFoundError):
        storage.read_into("missing.bin", [(0, memoryview(bytearray(1)))])
    with pytest.raises(FileNotFoundError):
        storage.size("missing.bin")
    storage.delete("missing.bin")  # missing is fine


class BytesStorage(Storage):
    """The base class's read_into over a minimal in-memory read()."""

    def __init__(self, data: bytes):
        self.data, self.url = data, "mem://x"

    def read(self, name, start=0, end=None):
        return self.data[start:end]

    child = size = exists = list = delete = write = open_writer = None  # type: ignore[assignment]


BytesStorage.__abstractmethods__ = frozenset()


def test_base_read_into_and_short_read():
    s = BytesStorage(DATA)
    bufs = [memoryview(bytearray(n)) for n in (3, 0, 8)]
    s.read_into("f", [(0, bufs[0]), (9, bufs[1]), (3, bufs[2])])
    assert [bytes(b) for b in bufs] == [DATA[0:3], b"", DATA[3:11]]
    with pytest.raises(OSError, match="mem://x/f"):
        s.read_into("f", [(4090, memoryview(bytearray(10)))])


# ---------------------------------------------------------------------------------------------
# Confinement
# ---------------------------------------------------------------------------------------------

BAD_NAMES = ["", "..", ".", "../data.bin", "a/../data.bin", "a/..", "/etc/passwd", "/", "a//b", "./data.bin", "a/./b", "a\\b", "a\x00b", "x/"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_value_errors(storage, name):
    with pytest.raises(ValueError):
        check_name(name)
    calls = [
        lambda: storage.read(name),
        lambda: storage.read_into(name, [(0, memoryview(bytearray(1)))]),
        lambda: storage.size(name),
        lambda: storage.exists(name),
        lambda: storage.delete(name),
        lambda: storage.write(name, b"x"),
        lambda: storage.open_writer(name),
        lambda: storage.child(name),
    ]
    for call in calls:
        with pytest.raises(ValueError):
            call()
    assert visible(storage.root) == ["data.bin"]


@pytest.mark.parametrize("name", ["data.bin", "sub/file", "a.b-c_d", "rank_0.safetensors", "..x", "x.."])
def test_good_names(name):
    assert check_name(name) == name


@pytest.fixture
def outside(tmp_path):
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret").write_bytes(b"secret bytes")
    return d


def test_symlink_out_of_the_root_is_refused(storage, outside):
    root = storage.root
    os.symlink(outside / "secret", os.path.join(root, "link"))
    os.symlink(outside, os.path.join(root, "subdir"))
    for name in ["link", "subdir/secret", "subdir/new"]:
        with pytest.raises(PermissionError):
            storage.read(name)
        with pytest.raises(PermissionError):
            storage.read_into(name, [(0, memoryview(bytearray(1)))])
        with pytest.raises(PermissionError):
            storage.size(name)
        with pytest.raises(PermissionError):
            storage.open_writer(name)
        with pytest.raises(PermissionError):
            storage.write(name, b"overwritten")
        with pytest.raises(PermissionError):
            storage.delete(name)
    assert visible(outside) == ["secret"]
    assert (outside / "secret").read_bytes() == b"secret bytes"


def test_symlink_inside_the_root_is_fine(storage):
    os.symlink(os.path.join(storage.root, "data.bin"), os.path.join(storage.root, "alias.bin"))
    assert storage.read("alias.bin", 0, 16) == DATA[:16]


def test_root_given_through_a_symlink(tmp_path, storage):
    link = tmp_path / "link-to-ckpt"
    os.symlink(storage.root, link)
    s = LocalStorage(str(link))
    assert s.read("data.bin", 1, 3) == DATA[1:3]


def test_open_storage_dispatch(tmp_path):
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    local = open_storage(f"file://{tmp_path}")
    assert isinstance(local, LocalStorage) and local.root == str(tmp_path)
    assert open_storage(local) is local
    with pytest.raises(ValueError):
        open_storage("ftp://host/x")


# ---------------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------------


def test_writer_invisible_before_commit_whole_after(storage):
    root = storage.root
    w = storage.open_writer("rank_0.safetensors")
    w.write([memoryview(b"hello "), memoryview(b"")])
    w.write([memoryview(bytearray(b"world")), memoryview(array.array("i", [1, 2]))])
    assert not storage.exists("rank_0.safetensors")
    assert "rank_0.safetensors" not in storage.list()
    assert all(n == "data.bin" or n.startswith(".") for n in visible(root))  # only a hidden temp file
    w.commit()
    assert storage.read("rank_0.safetensors") == b"hello world" + array.array("i", [1, 2]).tobytes()
    assert visible(root) == ["data.bin", "rank_0.safetensors"]  # no temp file left
    w.abort()  # after commit: a no-op, the file stays
    assert storage.read("rank_0.safetensors").startswith(b"hello world")


def test_writer_abort_leaves_nothing(storage):
    w = storage.open_writer("rank_1.safetensors")
    w.write([memoryview(b"x" * 1000)])
    w.abort()
    w.abort()  # twice is fine
    assert visible(storage.root) == ["data.bin"]


def test_writer_exception_in_context_aborts(storage):
    with pytest.raises(RuntimeError):
        with storage.open_writer("rank_1.safetensors") as w:
            w.write([memoryview(b"partial")])
            raise RuntimeError("boom")
    assert visible(storage.root) == ["data.bin"]


def test_writer_context_exit_without_commit_leaves_nothing(storage):
    with storage.open_writer("rank_1.safetensors") as w:
        w.write([memoryview(b"never committed")])
    assert visible(storage.root) == ["data.bin"]


def test_commit_replaces_existing_file(storage):
    storage.write("metadata.json", b"old contents, longer")
    storage.write("metadata.json", b"new")
    assert storage.read("metadata.json") == b"new"
    assert visible(storage.root) == ["data.bin", "metadata.json"]


def test_writer_many_buffers(storage):
    chunks = [bytes([i % 256]) * (i % 5) for i in range(5000)]  # more than IOV_MAX, some empty
    with storage.open_writer("big.bin") as w:
        w.write([memoryview(c) for c in chunks])
        w.write([memoryview(DATA)])
        w.commit()
    assert storage.read("big.bin") == b"".join(chunks) + DATA


def test_writer_in_subdirectory_and_child(storage):
    os.mkdir(os.path.join(storage.root, "model"))
    storage.write("model/metadata.json", b"{}")
    child = storage.child("model")
    assert child.read("metadata.json") == b"{}"
    assert child.list() == ["metadata.json"]
    assert "model" in storage.list()
    assert LocalStorage(os.path.join(storage.root, "does-not-exist")).list() == []


def test_prepare_and_delete(tmp_path):
    s = LocalStorage(str(tmp_path / "a" / "b"))
    s.prepare()
    s.prepare()
    s.write("f", b"1")
    assert s.exists("f")
    s.delete("f")
    assert not s.exists("f") and s.list() == []


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else set()


def test_a_bad_direct_io_setting_makes_no_file_and_holds_no_descriptor(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", "bogus")
    storage, before = LocalStorage(str(tmp_path)), _open_fds()
    with pytest.raises(ValueError, match="CHECKPOINTER_DIRECT_IO='bogus'"):
        storage.open_writer("x")
    assert os.listdir(tmp_path) == [] and _open_fds() == before


@pytest.mark.parametrize("direct", ["0", "1"])
def test_a_failed_write_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch, direct):
    """A write the kernel refuses (here a file over the process's size limit: EFBIG, as a full disk
    gives ENOSPC) is an OSError naming the rank file, buffered or with O_DIRECT."""
    import resource
    import signal

    import torch

    from checkpointer import Checkpointer

    monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", direct)
    path = str(tmp_path / "ckpt")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(OSError) as caught:
            Checkpointer().save(path, {"w": torch.ones(1 << 20)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert caught.value.errno == errno.EFBIG and caught.value.filename == os.path.join(path, "rank_0.safetensors")
    assert "metadata.json" not in os.listdir(path) and not any(n.startswith(".rank") for n in os.listdir(path))


@pytest.mark.parametrize("cap", [1, 5, 4096])
def test_scattered_runs_go_on_after_short_reads_and_interrupted_ones(tmp_path, monkeypatch, cap):
    """A ``preadv`` that returns fewer bytes than asked (a signal, a network or FUSE file system)
    or fails with EINTR is continued from where it stopped; only a read of nothing is a truncated file."""
    import ctypes

    import numpy as np

    from checkpointer.storage import scatter

    data = os.urandom(64 << 10)
    (tmp_path / "f").write_bytes(data)
    real, calls, shorts = scatter._PREADV, [], []

    def short(fd, iov_address, count, offset):
        calls.append(count)
        if len(calls) % 3 == 1:
            ctypes.set_errno(errno.EINTR)
            return -1
        rows = np.ctypeslib.as_array(ctypes.cast(iov_address, ctypes.POINTER(ctypes.c_uint64)), (count, 2)).copy()
        ends = np.cumsum(rows[:, 1])
        keep = min(len(rows), int(np.searchsorted(ends, cap, side="left")) + 1)
        rows = rows[:keep]
        rows[-1, 1] -= max(0, int(ends[keep - 1]) - cap)
        shorts.append(int(ends[-1]) > cap)
        return real(fd, rows.ctypes.data, len(rows), offset)

    monkeypatch.setattr(scatter, "_PREADV", short)
    offsets = np.arange(100, 8 << 10, 1000, dtype=np.int64)
    out, tail = np.zeros((len(offsets), 7), dtype=np.uint8), np.zeros(7, dtype=np.uint8)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        scatter.preadv_runs(fd, offsets, out.ctypes.data + np.arange(len(offsets), dtype=np.uint64) * 7, 7, "f")
        assert any(shorts) and len(calls) > len(shorts)  # short reads and EINTR, each continued
        with pytest.raises(EOFError, match="truncated"):
            scatter.preadv_runs(fd, np.array([(64 << 10) - 3]), np.array([tail.ctypes.data], dtype=np.uint64), 7, "f")
    finally:
        os.close(fd)
    assert all(bytes(out[i]) == data[o : o + 7] for i, o in enumerate(offsets.tolist()))


def test_an_exclusive_create_that_fails_to_write_leaves_no_file(tmp_path, monkeypatch):
    """A full disk while the save lock is written: it was left empty, and an empty lock is never
    judged stale (a lock that cannot be read), so the directory stayed locked."""
    storage = LocalStorage(str(tmp_path))
    real = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        storage.create_exclusive(".lock", b'{"token": "x"}')
    monkeypatch.setattr(os, "write", real)
    assert os.listdir(tmp_path) == []
    storage.create_exclusive(".lock", b'{"token": "x"}')
    with pytest.raises(FileExistsError):
        storage.create_exclusive(".lock", b'{"token": "y"}')
    assert (tmp_path / ".lock").read_bytes() == b'{"token": "x"}' and os.listdir(tmp_path) == [".lock"]


def test_an_exclusive_create_without_hard_links_still_refuses_an_existing_file(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path))
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EPERM, "no hard links")))
    storage.create_exclusive(".lock", b"a")
    with pytest.raises(FileExistsError):
        storage.create_exclusive(".lock", b"b")
    assert (tmp_path / ".lock").read_bytes() == b"a" and os.listdir(tmp_path) == [".lock"]
