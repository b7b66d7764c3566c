"""storage/local.py without O_DIRECT (``CHECKPOINTER_DIRECT_IO=0``): buffered writes whose
writeback is started range by range, each range waited for and dropped from the page cache two
ranges later. The bytes are exact, at most two ranges are dirty at a time, a write error seen
while waiting is raised (the fsync on the same descriptor would not report it again), and the
committed file leaves no page cached. Export and convert, which copy every byte, get these
writes under ``auto``."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys

import pytest

from checkpointer.storage import local
from checkpointer.storage.local import LocalWriter

pytestmark = pytest.mark.skipif(local._sync_file_range is None, reason="no sync_file_range here")

WAIT = local._SYNC_FILE_RANGE_WAIT_BEFORE | local._SYNC_FILE_RANGE_WRITE | local._SYNC_FILE_RANGE_WAIT_AFTER
RANGE = 64 << 10


@pytest.fixture
def small_ranges(monkeypatch):
    monkeypatch.setattr(local, "_WRITEBACK_BYTES", RANGE)


def write_buffered(path: str, parts: list[bytes]) -> None:
    with LocalWriter(path, direct=False) as writer:
        for part in parts:
            writer.write([memoryview(part)])
        writer.commit()


def resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (``mincore`` of a mapping of it)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, os.strerror(ctypes.get_errno())
        del address
        return sum(v & 1 for v in vec)


@pytest.mark.parametrize("sizes", [[1], [RANGE], [RANGE - 1, 2, RANGE], [5 * RANGE + 17], [3000] * 100])
def test_buffered_writes_round_trip_across_ranges(tmp_path, small_ranges, sizes):
    parts = [os.urandom(n) for n in sizes]
    path = str(tmp_path / "f")
    write_buffered(path, parts)
    assert (tmp_path / "f").read_bytes() == b"".join(parts)
    assert os.listdir(tmp_path) == ["f"]


def test_each_range_is_started_then_waited_for_and_dropped_one_range_later(tmp_path, small_ranges, monkeypatch):
    calls: list[tuple[str, int, int, int]] = []
    real_sync, real_fadvise = local._sync_file_range, os.posix_fadvise

    def sync(fd, start, size, flags):
        calls.append(("sync", start, size, flags))
        return real_sync(fd, start, size, flags)

    def fadvise(fd, start, size, advice):
        calls.append(("fadvise", start, size, advice))
        return real_fadvise(fd, start, size, advice)

    monkeypatch.setattr(local, "_sync_file_range", sync)
    monkeypatch.setattr(local.os, "posix_fadvise", fadvise)
    write_buffered(str(tmp_path / "f"), [os.urandom(RANGE)] * 3 + [os.urandom(100)])
    W, DROP = local._SYNC_FILE_RANGE_WRITE, os.POSIX_FADV_DONTNEED
    assert calls == [
        ("sync", 0, RANGE, W),
        ("sync", RANGE, RANGE, W), ("sync", 0, RANGE, WAIT), ("fadvise", 0, RANGE, DROP),
        ("sync", 2 * RANGE, RANGE, W), ("sync", RANGE, RANGE, WAIT), ("fadvise", RANGE, RANGE, DROP),
        ("fadvise", 0, 0, DROP),  # at commit, after the fsync: the rest
    ]


def test_a_write_error_seen_while_waiting_is_raised_naming_the_file(tmp_path, small_ranges, monkeypatch):
    real_sync = local._sync_file_range

    def failing(fd, start, size, flags):
        if flags & local._SYNC_FILE_RANGE_WAIT_AFTER:
            ctypes.set_errno(errno.EIO)
            return -1
        return real_sync(fd, start, size, flags)

    monkeypatch.setattr(local, "_sync_file_range", failing)
    path = str(tmp_path / "f")
    with pytest.raises(OSError) as info:
        write_buffered(path, [os.urandom(RANGE)] * 3)
    assert info.value.errno == errno.EIO
    assert path in str(info.value)
    assert os.listdir(tmp_path) == []


def test_a_file_system_without_sync_file_range_is_written_by_the_fsync(tmp_path, small_ranges, monkeypatch):
    calls = []

    def unsupported(fd, start, size, flags):
        calls.append(flags)
        ctypes.set_errno(errno.ESPIPE)
        return -1

    monkeypatch.setattr(local, "_sync_file_range", unsupported)
    data = os.urandom(5 * RANGE)
    write_buffered(str(tmp_path / "f"), [data[i: i + RANGE] for i in range(0, len(data), RANGE)])
    assert (tmp_path / "f").read_bytes() == data
    assert calls == [local._SYNC_FILE_RANGE_WRITE]  # tried once, then left to the fsync


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore of a file mapping: Linux")
def test_a_committed_file_leaves_no_page_cached(tmp_path):
    data = os.urandom(3 * local._WRITEBACK_BYTES + 12345)
    cached = tmp_path / "cached"
    cached.write_bytes(data)
    if resident_pages(str(cached)) == 0:
        pytest.skip("this file system keeps no written page cached; nothing to drop")
    path = str(tmp_path / "f")
    write_buffered(path, [data[i: i + (8 << 20)] for i in range(0, len(data), 8 << 20)])
    assert resident_pages(path) == 0
    with open(path, "rb") as f:
        assert f.read() == data


def test_libc_functions_are_found_by_name_and_missing_ones_are_none():
    from checkpointer.storage import libc

    getpid = libc.function("getpid", [], ctypes.c_int)
    assert getpid is not None and getpid() == os.getpid()
    assert libc.function("checkpointer_no_such_function", [ctypes.c_int], ctypes.c_int) is None


@pytest.mark.parametrize("to", ["hf", "checkpointer", "olmo"])
def test_tools_that_copy_every_byte_write_through_the_page_cache(tmp_path, monkeypatch, to):
    """Export and convert copy every byte they write, so ``auto`` gives them buffered writes, as a
    save of small pieces gets (on a disk of 0.4 GB/s, a 1.5 GiB export took 3.5-3.9 s this way,
    3.8-4.5 s through O_DIRECT's buffers)."""
    import torch

    from checkpointer import Checkpointer
    from checkpointer.tools.convert import convert

    monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", "auto")
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    Checkpointer().save(src, {"a": torch.arange(3000.0), "b": torch.ones(7, 5, dtype=torch.bfloat16)})
    told: list[tuple[str, int, int, bool]] = []
    expect_bytes = LocalWriter.expect_bytes

    def spy(self: LocalWriter, total: int, uncopied: int) -> None:
        expect_bytes(self, total, uncopied)
        told.append((self.path, total, uncopied, self.stream is None))

    monkeypatch.setattr(LocalWriter, "expect_bytes", spy)
    files = [f for f in convert(src, dst, to=to) if f.endswith((".safetensors", ".distcp"))]
    assert files and sorted(path for path, *_ in told) == sorted(files)
    assert all(total == os.path.getsize(path) and uncopied == 0 and buffered for path, total, uncopied, buffered in told)
