"""planning/runs.py: where the runs of a strided read item start, and the blocks they are cut
into, against a brute-force oracle (every run's start from its index, and the grid of block
starts searched in them); cutting 4 million runs, or reading a million short runs, holds the
offsets of a slice of them in memory, not of all."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.engine import reads
from checkpointer.planning import runs
from checkpointer.planning.load_plan import ReadItem
from checkpointer.planning.plan import Piece

from test_box_reads import load_piece, write_checkpoint


def _box_item(shape: tuple[int, ...], origin: tuple[int, ...], sizes: tuple[int, ...]) -> ReadItem:
    """The box ``sizes`` at ``origin`` of a row-major stored piece of ``shape`` into a destination
    of exactly the box: its runs (along the last dimension) are contiguous on both sides."""
    src_strides = tuple(int(np.prod(shape[d + 1:])) for d in range(len(shape)))
    dst_strides = tuple(int(np.prod(sizes[d + 1:])) for d in range(len(sizes)))
    offset = sum(o * s for o, s in zip(origin, src_strides))
    return ReadItem("f", offset, 0, int(np.prod(sizes)), sizes, src_strides, dst_strides)


def _oracle_starts(item: ReadItem) -> list[int]:
    return [item.src_offset + sum(i * s for i, s in zip(index, item.src_strides))
            for index in itertools.product(*map(range, item.sizes[:-1]))]


def _oracle_blocks(starts: list[int], step: int) -> list[int]:
    grid = np.arange(starts[0], starts[-1] + 1, step)
    return [int(b) for b in np.unique(np.searchsorted(np.array(starts), grid))]


@st.composite
def _items(draw):
    ndim = draw(st.integers(2, 4))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim - 1)) + (draw(st.integers(1, 5)),)
    origin = tuple(draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, origin))
    return _box_item(shape, origin, sizes)


@settings(max_examples=300, deadline=None)
@given(_items(), st.integers(1, 200), st.integers(1, 7))
def test_run_starts_and_blocks_against_the_oracle(item, step, per_slice):
    starts = _oracle_starts(item)
    got_src, got_dst = runs.run_starts(item, 0, len(starts))
    assert got_src.tolist() == starts
    assert got_dst.tolist() == [i * item.sizes[-1] for i in range(len(starts))]
    original = runs.RUNS_PER_SLICE
    runs.RUNS_PER_SLICE = per_slice  # slices that end anywhere, a block across them
    try:
        assert runs.run_blocks(item, step) == _oracle_blocks(starts, step)
    finally:
        runs.RUNS_PER_SLICE = original


def test_cutting_millions_of_runs_holds_one_slice_of_them():
    item = _box_item((4 << 20, 8), (0, 0), (4 << 20, 2))  # 2 of 8 columns: 4M runs of 2 elements
    tracemalloc.start()
    try:
        blocks = runs.run_blocks(item, 1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert blocks == list(range(0, 4 << 20, 1 << 17))  # a block per 2**17 runs of 8 elements apart
    assert peak < 16 << 20, peak  # all 4M starts at once: over 100 MiB


def test_a_million_short_runs_read_by_runs_hold_a_slice_of_offsets(tmp_path, monkeypatch):
    """Two of four columns of [2**20, 4] fp32 read by scattered reads (not mapped): one read task
    of a million 8-byte runs. Its offsets took over 60 MiB when built for all of them at once."""
    monkeypatch.setattr(reads, "_MAP_BYTES", 1 << 40)
    full = torch.arange(4 << 20, dtype=torch.float32).reshape(1 << 20, 4)
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(1 << 20, 4), global_offset=(0, 0))])
    tracemalloc.start()
    try:
        got = load_piece(storage, Piece(local_shape=(1 << 20, 2), global_offset=(0, 1)), torch.float32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(got, full[:, 1:3].reshape(-1))
    assert peak < 24 << 20, peak


def _aligned_span(item: ReadItem, align: int) -> tuple[int, int]:
    return item.src_offset - item.src_offset % align, -(-item.src_end // align) * align


@settings(max_examples=300, deadline=None)
@given(
    boxes=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 6), st.integers(1, 4), st.integers(0, 8)), min_size=1, max_size=8),
    align=st.sampled_from([1, 4, 16, 64]),
)
def test_items_sharing_a_span_are_grouped_against_the_oracle(boxes, align):
    """Groups are the connected parts of "their spans, widened to ``align``, overlap": every item
    is in one group, a group's bounds are its items', and no two groups' spans meet."""
    items = [ReadItem("f", offset, 0, rows * cols, (rows, cols), (cols + gap, 1), (cols, 1)) for offset, rows, cols, gap in boxes]
    part = list(range(len(items)))  # union-find over pairs whose widened spans overlap

    def find(i: int) -> int:
        while part[i] != i:
            i = part[i]
        return i

    spans = [_aligned_span(item, align) for item in items]
    for i, j in itertools.combinations(range(len(items)), 2):
        if spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1]:
            part[find(i)] = find(j)
    expected = sorted(sorted(i for i in range(len(items)) if find(i) == root) for root in set(map(find, range(len(items)))))
    groups = runs.overlapping(items, align)
    got = sorted(sorted(i for i in range(len(items)) for member in group if member is items[i]) for _, _, group in groups)
    assert got == expected
    for lo, hi, group in groups:
        assert (lo, hi) == (min(_aligned_span(m, align)[0] for m in group), max(_aligned_span(m, align)[1] for m in group))
    assert all(a[1] <= b[0] for a, b in zip(groups, groups[1:]))
