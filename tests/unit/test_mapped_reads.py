"""Strided pieces copied from a local file's mapped pages (storage/mapping.py, engine/reads.py):
the copy takes only its runs; a short file is an error naming it (not a ``SIGBUS``); a range
not wholly in the page cache, or a refused mapping, is read instead; only callers that ask map
(the loads of rank files a save wrote); no mapping outlives a load that succeeded."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from checkpointer.engine import reads
from checkpointer.errors import CorruptCheckpointError
from checkpointer.format.layout import rank_filename
from checkpointer.planning.plan import Piece
from checkpointer.storage import mapping
from checkpointer.storage.local import LocalStorage

from test_box_reads import load_piece, write_checkpoint

pytestmark = pytest.mark.skipif(not mapping.available(), reason="no mmap in this C library")

COLUMNS = [Piece(local_shape=(256, 64), global_offset=(0, 64 * r)) for r in range(2)]  # Shard(1) of 2
WANTED = Piece(local_shape=(256, 32), global_offset=(0, 48))  # columns from both files


def _mapped_calls(monkeypatch) -> list[tuple[str, int, int]]:
    calls: list[tuple[str, int, int]] = []
    real = LocalStorage.mapped

    def mapped(self, name, start, nbytes):
        calls.append((name, start, nbytes))
        return real(self, name, start, nbytes)

    monkeypatch.setattr(LocalStorage, "mapped", mapped)
    return calls


def _mapped_files() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def test_a_strided_piece_is_copied_from_mapped_blocks(tmp_path, monkeypatch):
    """Runs contiguous on both sides (a column block): blocks of whole runs, each mapping only
    the stored span from its first run to its last."""
    monkeypatch.setattr(reads, "_MAP_BYTES", 0)
    monkeypatch.setattr(reads, "STRIDED_BLOCK", 16 << 10)
    full = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    storage = write_checkpoint(str(tmp_path), full, COLUMNS)
    calls = _mapped_calls(monkeypatch)
    got = load_piece(storage, WANTED, torch.float32)
    assert torch.equal(got, full[:, 48:80].reshape(-1))
    # Each file holds 16 of the wanted columns: 256 runs of 16, a stored row of 64 apart; 64 runs a block.
    for r in range(2):
        blocks = sorted((start, n) for name, start, n in calls if name == rank_filename(r))
        assert [n for _, n in blocks] == [(63 * 64 + 16) * 4] * 4, blocks
        assert [b - a for (a, _), (b, _) in zip(blocks, blocks[1:])] == [64 * 64 * 4] * 3
    assert str(tmp_path) not in _mapped_files()  # every block unmapped


def test_an_interleaved_piece_is_copied_from_mapped_blocks_of_its_span(tmp_path, monkeypatch):
    """Elements one apart in the destination (a Shard(2) of 2 loaded as Shard(1)): the span is
    mapped in blocks that end inside rows, and together cover it exactly."""
    monkeypatch.setattr(reads, "_MAP_BYTES", 0)
    monkeypatch.setattr(reads, "STRIDED_BLOCK", 5000)
    full = torch.randn(256, 64, 2, generator=torch.Generator().manual_seed(6))
    stored = [Piece(local_shape=(256, 64, 1), global_offset=(0, 0, r)) for r in range(2)]
    storage = write_checkpoint(str(tmp_path), full, stored)
    calls = _mapped_calls(monkeypatch)
    got = load_piece(storage, Piece(local_shape=(256, 32, 2), global_offset=(0, 32, 0)), torch.float32)
    assert torch.equal(got, full[:, 32:].reshape(-1))
    for r in range(2):
        blocks = [n for name, _, n in calls if name == rank_filename(r)]
        assert sum(blocks) == (255 * 64 + 32) * 4 and max(blocks) <= 5000, blocks
    assert str(tmp_path) not in _mapped_files()


def test_spans_under_the_threshold_are_read_not_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(reads, "_MAP_BYTES", 1 << 30)
    full = torch.randn(256, 128, generator=torch.Generator().manual_seed(1))
    storage = write_checkpoint(str(tmp_path), full, COLUMNS)
    calls = _mapped_calls(monkeypatch)
    assert torch.equal(load_piece(storage, WANTED, torch.float32), full[:, 48:80].reshape(-1))
    assert calls == []


def test_a_file_cut_short_while_loading_is_an_error_naming_it_not_a_crash(tmp_path, monkeypatch):
    """Reading a mapped page past a file's end would kill the process (``SIGBUS``). The header
    check catches a file cut short before the load; one cut after it (here, just before its
    first block is mapped) is caught by the size check before mapping."""
    monkeypatch.setattr(reads, "_MAP_BYTES", 0)
    full = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))
    storage = write_checkpoint(str(tmp_path), full, COLUMNS)
    path = os.path.join(str(tmp_path), rank_filename(1))
    real = LocalStorage.mapped

    def cut_then_mapped(self, name, start, nbytes):
        if name == rank_filename(1):
            os.truncate(path, start + nbytes - 4096)
        return real(self, name, start, nbytes)

    monkeypatch.setattr(LocalStorage, "mapped", cut_then_mapped)
    with pytest.raises(CorruptCheckpointError, match=rank_filename(1)):
        load_piece(storage, WANTED, torch.float32)
    assert str(tmp_path) not in _mapped_files()


def test_mapped_range_checks_the_size_and_maps_any_offset(tmp_path):
    path = tmp_path / "f"
    data = os.urandom(3 * 4096 + 100)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        with mapping.mapped_range(fd, 5000, 7000, str(path)) as view:
            assert bytes(view) == data[5000:12000]  # from inside a page
        with mapping.mapped_range(fd, 0, len(data), str(path)) as view:
            assert bytes(view) == data
        with pytest.raises(EOFError, match="truncated"):
            with mapping.mapped_range(fd, 5000, len(data), str(path)):
                pass
    finally:
        os.close(fd)
    assert str(path) not in _mapped_files()


def _cached_pages(path: str) -> np.ndarray:
    """Whether each page of the file is in the page cache, by ``mincore``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        address = mapping._MMAP(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
        try:
            pages = np.zeros(-(-size // mmap.PAGESIZE), dtype=np.uint8)
            assert mapping._MINCORE(address, size, pages.ctypes.data) == 0
            return (pages & 1).astype(bool)
        finally:
            mapping._MUNMAP(address, size)
    finally:
        os.close(fd)


def _uncached(path: str) -> bool:
    """Drop the file's clean pages from the page cache; whether the kernel did (not on tmpfs),
    asked with ``mincore`` here rather than through the code under test."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return not _cached_pages(path).all()


def test_the_page_count_agrees_with_mincore(tmp_path):
    """``cachestat``'s count of a range's cached pages against ``mincore``'s page by page, over
    ranges starting and ending inside pages, around holes dropped from the cache."""
    path = tmp_path / "f"
    page = mmap.PAGESIZE
    path.write_bytes(os.urandom(64 * page + 100))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        for first, count in ((5, 1), (20, 3), (64, 1)):
            os.posix_fadvise(fd, first * page, count * page, os.POSIX_FADV_DONTNEED)
        cached = _cached_pages(str(path))
        if cached.all():
            pytest.skip("this file system keeps the files in memory (tmpfs)")
        if mapping._file_cached(fd, 0, page) is None:
            pytest.skip("no cachestat in this kernel (Linux 6.5)")
        size = os.fstat(fd).st_size
        for start in (0, 1, 4 * page, 5 * page + 7, 6 * page, 19 * page + 1, 23 * page, 63 * page + 5):
            for end in (start + 1, start + page, 6 * page, 20 * page, 23 * page + 3, 64 * page, size):
                if end <= start:
                    continue
                want = bool(cached[start // page : -(-end // page)].all())
                assert mapping._file_cached(fd, start, end - start) is want, (start, end)
    finally:
        os.close(fd)


@pytest.mark.parametrize("check", ["cachestat", "mincore"])
def test_a_range_not_in_the_page_cache_is_read_not_mapped(tmp_path, monkeypatch, check):
    """Reading an uncached mapped page whose disk read fails would be a ``SIGBUS``: such a block
    is read instead, with the same values: its many short runs a staging block at a time (a
    system call per block, not per 512 runs). The kernel's page count decides, or ``mincore``
    of the mapping where the kernel has no such count."""
    monkeypatch.setattr(reads, "_MAP_BYTES", 0)
    if check == "mincore":
        monkeypatch.setattr(mapping, "_cachestat_works", False)
    rows = 16384  # 4 MiB a file: reading its header does not bring in the rest
    full = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3))
    columns = [Piece(local_shape=(rows, 64), global_offset=(0, 64 * r)) for r in range(2)]
    wanted = Piece(local_shape=(rows, 32), global_offset=(0, 48))
    storage = write_checkpoint(str(tmp_path), full, columns)
    if not all(_uncached(os.path.join(str(tmp_path), rank_filename(r))) for r in range(2)):
        pytest.skip("this file system keeps the files in memory (tmpfs)")
    read = []
    for method in ("read_into", "read_runs"):
        real = getattr(LocalStorage, method)
        monkeypatch.setattr(LocalStorage, method, lambda self, name, *a, m=method, real=real: (read.append((m, name)), real(self, name, *a))[1])
    got = load_piece(storage, wanted, torch.float32)
    assert torch.equal(got, full[:, 48:80].reshape(-1))
    assert sorted(read) == [("read_into", rank_filename(0)), ("read_into", rank_filename(1))], read
    assert str(tmp_path) not in _mapped_files()
    read.clear()
    assert torch.equal(load_piece(storage, wanted, torch.float32), full[:, 48:80].reshape(-1))
    assert read == []  # the read brought the pages in: now they are mapped


def test_a_refused_mapping_is_read_instead(tmp_path, monkeypatch):
    monkeypatch.setattr(reads, "_MAP_BYTES", 0)
    full = torch.randn(256, 128, generator=torch.Generator().manual_seed(4))
    storage = write_checkpoint(str(tmp_path), full, COLUMNS)
    monkeypatch.setattr(mapping, "_MMAP", lambda *args: mapping._MAP_FAILED)  # as a FUSE direct_io mount answers
    assert torch.equal(load_piece(storage, WANTED, torch.float32), full[:, 48:80].reshape(-1))


def test_reads_map_only_when_asked(tmp_path, monkeypatch):
    """Files another program wrote (a Hugging Face directory) may be rewritten in place while
    read; only the loads of rank files ask for mapped copies."""
    monkeypatch.setattr(reads, "_MAP_BYTES", 0)
    full = torch.randn(256, 128, generator=torch.Generator().manual_seed(5))
    storage = write_checkpoint(str(tmp_path), full, COLUMNS)
    calls = _mapped_calls(monkeypatch)
    assert torch.equal(load_piece(storage, WANTED, torch.float32, map_pages=False), full[:, 48:80].reshape(-1))
    assert calls == []
    assert torch.equal(load_piece(storage, WANTED, torch.float32), full[:, 48:80].reshape(-1))
    assert calls
