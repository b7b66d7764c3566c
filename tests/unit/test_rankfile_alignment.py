"""engine/rankfile.py with a writer that sends tensor memory uncopied only where address and
file offset agree (local O_DIRECT): the rank file is ordered and its header padded so that the
most bytes agree, and it stays the same safetensors file with the same checksums."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from checkpointer.buffers import memoryview_of
from checkpointer.checksums import CHUNK_BYTES, chunk_crcs
from checkpointer.engine.checks import HeaderCache
from checkpointer.engine.rankfile import order_for_alignment
from checkpointer.engine.rankfile import write_rank_file
from checkpointer.format.dtypes import code_from_dtype
from checkpointer.storage import direct, local
from checkpointer.storage.local import LocalStorage

MiB = 1 << 20


class Arena:
    """Float tensors placed at chosen remainders of their address modulo 4096."""

    def __init__(self, nbytes: int) -> None:
        self.raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
        self.skip = -self.raw.data_ptr() % 4096
        self.used = 0

    def place(self, nbytes: int, remainder: int, seed: int) -> torch.Tensor:
        start = -(-self.used // 4096) * 4096 + remainder
        self.used = start + nbytes
        t = self.raw[self.skip + start : self.skip + start + nbytes].view(torch.float32)
        t.copy_(torch.randn(t.numel(), generator=torch.Generator().manual_seed(seed)))
        assert t.data_ptr() % 4096 == remainder
        return t


def piece(t: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(data=t, numel=t.numel(), dtype=code_from_dtype(t.dtype))


def keys(ordered) -> list[str]:
    return [k for k, _ in ordered]


def test_the_remainder_most_bytes_share_goes_first_in_order():
    arena = Arena(64 * MiB)
    tensors = {
        "a": arena.place(4 * MiB, 64, 0),
        "small": arena.place(100 * 4, 64, 1),  # under 2 MiB: copied whatever its address
        "d": arena.place(4 * MiB, 128, 2),
        "c": arena.place(8 * MiB, 64 + 512, 3),  # the same remainder modulo 512
        "odd": arena.place(4 * MiB + 4, 64, 4),  # its size would shift the pieces after it
        "strided": arena.place(8 * MiB, 64, 5)[::2],
        "e": arena.place(4 * MiB, 128, 6),
    }
    items = [(k, piece(t)) for k, t in tensors.items()]
    ordered, start, uncopied = order_for_alignment(items, 512, 2 * MiB)
    assert keys(ordered) == ["a", "c", "small", "d", "odd", "strided", "e"]
    assert start == (64, 512)
    assert uncopied == 12 * MiB - 2 * 512  # a and c, less each one's unaligned head block
    # Modulo 4096 c is alone, as many bytes as d + e: but each unaligned piece keeps one block
    # from memory back (its head and the rest of that block), so c alone sends more.
    ordered, start, uncopied = order_for_alignment(items, 4096, 2 * MiB)
    assert keys(ordered) == ["c", "a", "small", "d", "odd", "strided", "e"]
    assert start == (576, 4096) and uncopied == 8 * MiB - 4096


def test_a_tie_goes_to_the_smaller_remainder_and_nothing_qualifying_keeps_the_order():
    arena = Arena(32 * MiB)
    items = [("x", piece(arena.place(4 * MiB, 192, 0))), ("y", piece(arena.place(4 * MiB, 128, 1)))]
    ordered, start, uncopied = order_for_alignment(items, 512, 2 * MiB)
    assert keys(ordered) == ["y", "x"] and start == (128, 512) and uncopied == 4 * MiB - 512
    small = [("s", piece(torch.randn(10))), ("t", piece(torch.randn(3, 4).t()))]
    assert order_for_alignment(small, 512, 2 * MiB) == (small, None, 0)
    assert order_for_alignment(items, 96, 2 * MiB) == (items, None, 0)  # not a multiple of 64: no padding can give it


class Recording(LocalStorage):
    """Local storage that keeps its writers, to read their streams' counts afterwards."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.writers: list[local.LocalWriter] = []

    def open_writer(self, name: str) -> local.LocalWriter:
        writer = super().open_writer(name)
        self.writers.append(writer)
        return writer


def check_file(path: str, tensors: dict[str, torch.Tensor], crcs: dict[str, list[int]]) -> None:
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for key, t in tensors.items():
            flat = t.contiguous().reshape(-1)
            assert torch.equal(f.get_tensor(key), flat), key
            assert crcs[key] == chunk_crcs(memoryview_of(flat)), key


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layout=st.lists(
        st.tuples(st.sampled_from([4, 1000, 3 * MiB, 16 * MiB, 16 * MiB + 512, 70 * MiB]), st.sampled_from([0, 64, 128, 640])),
        min_size=1,
        max_size=6,
    )
)
@example(layout=[(16 * MiB, 0), (16 * MiB, 0), (16 * MiB, 64), (16 * MiB + 512, 64)])  # more bytes at 64, fewer from memory
def test_rank_files_write_the_best_aligned_bytes_from_tensor_memory(tmp_path_factory, monkeypatch, layout):
    """Whatever the addresses: the file reads back exactly, with the checksums of the bytes,
    and at least the bytes of the best-sharing remainder (less each piece's unaligned head)
    went to disk from tensor memory."""
    monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", "1")
    root = str(tmp_path_factory.mktemp("aligned"))
    storage = Recording(root)
    arena = Arena(sum(n for n, _ in layout) + 4096 * len(layout))
    tensors = {f"t{i}": arena.place(n, r, i) for i, (n, r) in enumerate(layout)}
    crcs = write_rank_file(storage, "rank_0.safetensors", [(k, piece(t)) for k, t in tensors.items()])
    check_file(os.path.join(root, "rank_0.safetensors"), tensors, crcs)
    stream = storage.writers[0].stream
    assert stream is not None
    if stream.refused:
        pytest.skip("this file system refuses O_DIRECT")
    align = stream.align
    shares: dict[int, list[int]] = {}
    for n, r in layout:
        if n >= direct.MIN_FROM_SOURCE and n % align == 0:
            shares.setdefault(r % align, []).append(n)
    best = max((sum(n - (align if r else 0) for n in sizes) for r, sizes in shares.items()), default=0)
    assert stream.from_source >= best
    assert stream.from_source + stream.copied == os.path.getsize(os.path.join(root, "rank_0.safetensors"))


def test_checksums_in_the_file_follow_the_keys_when_alignment_reorders_the_pieces(tmp_path, monkeypatch):
    """A reader takes the checksums a file holds in the order of its keys, sorted; the pieces are
    written in the order that aligns the most bytes. A file whose checksums followed the pieces'
    order instead would read as corrupt (found by mutation: no test wrote such a file)."""
    monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", "1")
    arena = Arena(70 * MiB)
    tensors = {"a": arena.place(16 * MiB, 128, 0), "b": arena.place(16 * MiB, 64, 1), "c": arena.place(32 * MiB, 64, 2)}
    storage = LocalStorage(str(tmp_path))
    crcs = write_rank_file(storage, "rank_0.safetensors", [(k, piece(t)) for k, t in tensors.items()], checksums_in_file=True)
    with safe_open(os.path.join(str(tmp_path), "rank_0.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), t) for k, t in tensors.items())
    header = HeaderCache(storage).get("rank_0.safetensors")
    in_file = sorted((k for k in header.entries if k in tensors), key=lambda k: header.entries[k].start)
    if in_file == sorted(tensors):
        pytest.skip("this file system refuses O_DIRECT: the pieces keep their order")
    got = HeaderCache(storage).checksums("rank_0.safetensors", CHUNK_BYTES)
    assert {k: list(v) for k, v in got.items()} == {k: list(crcs[k]) for k in tensors}


class Hinted(Recording):
    """Recording storage whose writers also keep what :meth:`expect_bytes` was told."""

    def open_writer(self, name: str) -> local.LocalWriter:
        writer = super().open_writer(name)
        told = writer.hints = []
        expect = writer.expect_bytes
        writer.expect_bytes = lambda total, uncopied: (told.append((total, uncopied)), expect(total, uncopied))[1]
        return writer


@pytest.mark.parametrize("checksums_in_file", [False, True])
@pytest.mark.parametrize(
    "setting, layout, direct_kept",
    [
        # auto: most bytes go from memory (two 16 MiB pieces that agree), O_DIRECT stays
        ("auto", [(16 * MiB, 64), (16 * MiB, 64), (2 * MiB, 128)], True),
        # auto: every byte would be copied (2 MiB pieces; 16 MiB ones at three remainders, the
        # largest share under half): the page cache takes the file
        ("auto", [(2 * MiB, 0), (2 * MiB, 64), (2 * MiB, 128)], False),
        ("auto", [(16 * MiB, 64), (16 * MiB, 128), (17 * MiB, 192)], False),
        # 1: O_DIRECT whatever is copied
        ("1", [(2 * MiB, 0), (2 * MiB, 64), (2 * MiB, 128)], True),
    ],
)
def test_auto_direct_io_keeps_o_direct_only_where_most_bytes_go_uncopied(
    tmp_path, monkeypatch, setting, layout, direct_kept, checksums_in_file
):
    monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", setting)
    storage = Hinted(str(tmp_path))
    arena = Arena(sum(n for n, _ in layout) + 4096 * len(layout))
    tensors = {f"t{i}": arena.place(n, r, i) for i, (n, r) in enumerate(layout)}
    crcs = write_rank_file(storage, "rank_0.safetensors", [(k, piece(t)) for k, t in tensors.items()],
                           checksums_in_file=checksums_in_file)
    path = tmp_path / "rank_0.safetensors"
    if not checksums_in_file:
        check_file(str(path), tensors, crcs)
    (writer,) = storage.writers
    if writer.stream is not None and writer.stream.refused:
        pytest.skip("this file system refuses O_DIRECT")
    ((total, uncopied),) = writer.hints
    assert total == path.stat().st_size
    assert (writer.stream is not None) is direct_kept
    if direct_kept:
        assert writer.stream.from_source >= uncopied
        assert writer.stream.from_source + writer.stream.copied == total
        assert (2 * uncopied >= total) is (setting == "auto")
    else:
        assert 2 * uncopied < total and writer.written == total  # every byte by the buffered path
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp file left


def test_a_failed_save_after_the_switch_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("CHECKPOINTER_DIRECT_IO", raising=False)  # auto, the default
    storage = Hinted(str(tmp_path))
    items = [(f"t{i}", piece(torch.randn(1 << 19))) for i in range(3)]  # 2 MiB each: all copied

    def refuse() -> None:
        raise RuntimeError("not this time")

    with pytest.raises(RuntimeError, match="not this time"):
        write_rank_file(storage, "rank_0.safetensors", items, before_commit=refuse)
    (writer,) = storage.writers
    assert writer.stream is None and writer.written == writer.hints[0][0]
    assert os.listdir(tmp_path) == []


def test_the_hint_is_ignored_when_forced_or_late(tmp_path, monkeypatch):
    monkeypatch.delenv("CHECKPOINTER_DIRECT_IO", raising=False)
    forced = local.LocalWriter(str(tmp_path / "forced"), direct=True)
    late = local.LocalWriter(str(tmp_path / "late"))
    try:
        forced.expect_bytes(1 << 20, 0)
        late.write([memoryview(b"x" * 4096)])
        late.expect_bytes(1 << 20, 0)
        assert forced.stream is not None and late.stream is not None
    finally:
        forced.abort()
        late.abort()
    fresh = local.LocalWriter(str(tmp_path / "fresh"))
    fresh.expect_bytes(1 << 20, 0)
    assert fresh.stream is None
    fresh.abort()
    assert os.listdir(tmp_path) == []
