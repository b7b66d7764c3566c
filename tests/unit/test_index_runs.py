"""Flattened ranges read back as the index runs they came from (planning/index_runs.py), against
a brute-force oracle: the tiles must hold exactly the ranges' elements, at the ranges' positions."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from checkpointer.format.metadata import TensorStorageMetadata
from checkpointer.planning import index_runs
from checkpointer.planning.index_runs import MIN_RANGES, ranges_as_runs, runs_tiles
from checkpointer.planning.load_plan import build_load_plan
from checkpointer.planning.pieces import Piece, piece_tiles
from checkpointer.sharding import dtensor_index_runs, runs_piece


def ranges_positions(flat) -> np.ndarray:
    """The flat index of each element of the ranges, in order (the piece's memory)."""
    return np.concatenate([np.arange(s, e) for s, e in flat]) if flat else np.zeros(0, np.int64)


def tiles_positions(tiles, shape, numel: int) -> np.ndarray:
    """The flat index each tile puts at each position of the piece's memory (-1: none; an
    element placed twice fails)."""
    out = np.full(numel, -1, dtype=np.int64)
    for t in tiles:
        for index in itertools.product(*(range(n) for n in t.sizes)):
            at = t.offset + sum(i * s for i, s in zip(index, t.strides))
            assert out[at] == -1, ("placed twice", at)
            out[at] = np.ravel_multi_index(tuple(o + i for o, i in zip(t.origin, index)), shape)
    return out


@st.composite
def index_sets(draw):
    """A shape and, per dim, a non-empty sorted set of indices (whole dims now and then)."""
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    sets = []
    for n in shape:
        if draw(st.booleans()):
            sets.append(list(range(n)))
        else:
            sets.append(sorted(draw(st.sets(st.integers(0, n - 1), min_size=1))))
    return shape, sets


def as_runs(indices):
    runs = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


@settings(max_examples=400, deadline=None)
@given(index_sets(), st.data())
def test_runs_piece_lists_the_held_elements_in_local_order(case, data):
    """The save side's ranges (built with numpy) against the brute force: every combination of
    held indices, in row-major order of the local tensor; runs given in any order."""
    shape, sets = case
    runs = [data.draw(st.permutations(as_runs(s))) for s in sets]
    expected = [np.ravel_multi_index(index, shape) for index in itertools.product(*([i for a, b in r for i in range(a, b)] for r in runs))]
    piece = runs_piece(shape, runs)
    if piece.flat is None:
        box = np.arange(math.prod(shape)).reshape(shape)[tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.local_shape))]
        assert box.reshape(-1).tolist() == expected
    else:
        assert ranges_positions(piece.flat).tolist() == expected
        assert all(a < b for a, b in piece.flat) and all(b != c for (_, b), (c, _) in zip(piece.flat, piece.flat[1:]))  # touching ranges joined


@settings(max_examples=400, deadline=None)
@given(index_sets())
def test_a_product_of_index_runs_is_found_again(case):
    shape, sets = case
    runs = [as_runs(s) for s in sets]
    piece = runs_piece(shape, runs)
    if piece.flat is None or len(piece.flat) < MIN_RANGES:
        return
    found = ranges_as_runs(shape, piece.flat)
    assert found is not None, (shape, runs, piece.flat)
    assert runs_piece(shape, found) == piece
    numel = piece.numel
    assert np.array_equal(tiles_positions(runs_tiles(found), shape, numel), ranges_positions(piece.flat))


@st.composite
def sorted_ranges(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 8), min_size=ndim, max_size=ndim)))
    numel = math.prod(shape)
    cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=2 * MIN_RANGES, max_size=24)))
    return shape, [(a, b) for a, b in zip(cuts[0::2], cuts[1::2])]


@settings(max_examples=400, deadline=None)
@given(sorted_ranges())
def test_any_sorted_ranges_are_read_as_runs_only_when_exactly_equal(case):
    shape, flat = case
    found = ranges_as_runs(shape, flat)
    if found is None:
        return
    expected = ranges_positions(flat)
    assert np.array_equal(tiles_positions(runs_tiles(found), shape, len(expected)), expected), (shape, flat, found)


@pytest.mark.parametrize(
    "flat",
    [
        [(0, 2), (6, 8), (12, 14), (18, 30)],  # one range spans rows: not one pattern per row
        [(0, 2), (6, 8), (4, 5), (18, 20)],  # not in order
        [(0, 2), (1, 3), (6, 8), (12, 14)],  # overlapping
        [(0, 2), (6, 8), (12, 14), (18, 20), (30, 40)],  # past the end of a [6, 6] tensor
        [(-6, -4), (0, 2), (6, 8), (12, 14)],
    ],
)
def test_ranges_that_are_no_product_are_left_as_ranges(flat):
    assert ranges_as_runs((6, 6), flat) is None


def test_the_worked_example(monkeypatch):
    """The module docstring's example (three ranges: below MIN_RANGES, so lowered here)."""
    assert ranges_as_runs((4, 6), [(6, 8), (10, 14), (16, 18)]) is None
    monkeypatch.setattr(index_runs, "MIN_RANGES", 1)
    runs = ranges_as_runs((4, 6), [(6, 8), (10, 14), (16, 18)])
    assert runs == [[(1, 3)], [(0, 2), (4, 6)]]
    assert [(t.origin, t.sizes, t.strides, t.offset) for t in runs_tiles(runs)] == [
        ((1, 0), (2, 2), (4, 1), 0),
        ((1, 4), (2, 2), (4, 1), 2),
    ]


def _strided_pieces(rows: int, cols: int, placements, mesh) -> list[Piece]:
    shape = (rows, cols)
    return [runs_piece(shape, dtensor_index_runs(shape, placements, mesh, c)) for c in itertools.product(*map(range, mesh))]


@pytest.mark.parametrize(
    "cols, placements, mesh",
    [
        (4097, [_StridedShard(1, split_factor=2), Shard(1)], (4, 2)),  # uneven: one rank's piece is ranges
        (64, [Shard(1), _StridedShard(1, split_factor=2)], (2, 2)),  # every piece interleaved columns
    ],
)
def test_doubling_the_rows_of_strided_pieces_doubles_no_tiles_or_items(cols, placements, mesh):
    """A ``_StridedShard`` piece stored as two ranges per row plans as a few tiles, whatever its rows."""
    counts = []
    for rows in (1024, 2048):
        pieces = _strided_pieces(rows, cols, placements, mesh)
        assert any(p.flat is not None and len(p.flat) >= rows for p in pieces)  # stored as ranges, per row
        meta = TensorStorageMetadata(
            shape=[rows, cols], is_sharded=True, dtype="F32",
            shard_spec_per_file={f"rank_{r}.safetensors": p.to_spec() for r, p in enumerate(pieces)},
        )
        other = _strided_pieces(rows, cols, [Shard(0), _StridedShard(1, split_factor=4)], (2, 2))[3]
        wanted = [*pieces, other, Piece(local_shape=(rows // 2, cols), global_offset=(rows // 4, 0)),
                  Piece(local_shape=(rows, cols // 3), global_offset=(0, cols // 3))]
        plans = [build_load_plan("w", meta, w) for w in wanted]
        assert [p.numel for p in plans] == [w.numel for w in wanted]
        counts.append(([len(piece_tiles(p, (rows, cols))) for p in pieces], [len(p.items) for p in plans]))
    assert counts[0] == counts[1]
    tiles, items = counts[0]
    assert max(tiles) <= 2 and max(items) <= 9, counts[0]  # a box meets at most every stored tile
    assert items[: len(pieces)] == [1] * len(pieces)  # the same layout: one contiguous read per piece
