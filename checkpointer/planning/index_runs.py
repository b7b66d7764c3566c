"""Flattened ranges that are a product of index runs, as a few strided tiles.

A ``_StridedShard`` piece (FSDP2 over tensor parallelism, with uneven sizes) holds along each
dim a few runs of indices; the format stores it as flattened ranges, one or two per row. Read
as ranges, a ``[4096, 4097]`` piece is 8,192 of them: 8,192 tiles, items and copies. Read as
the runs it came from, it is two tiles.

The recipe (numpy over the ranges, a few Python steps per dim, never per range):

1. Find the outermost dim whose stride divides every range bound (the *split*): dims after it
   are whole in every range.
2. Cut the ranges at the ends of the split dim's rows (``merge_adjacent`` joined a run that
   ends a row to one that starts the next).
3. Each row must hold the same runs, and the rows must be every combination of a set of
   indices per outer dim, in row-major order: then those sets, as runs, and the split dim's
   runs describe the piece.
4. Each combination of one run per dim is a tile, with the local tensor's row-major strides.

Example: ``[4, 6]`` with rows ``{1, 2}`` and columns ``{0, 1, 4, 5}`` is stored as ranges
``(6, 8) (10, 14) (16, 18)``; its runs are ``[[(1, 3)], [(0, 2), (4, 6)]]`` and its tiles are
the boxes at ``(1, 0)`` and ``(1, 4)``, sizes ``(2, 2)``, strides ``(4, 1)``, offsets 0 and 2.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Sequence

import numpy as np

from .boxes import Tile, row_major_strides

__all__ = ["MIN_RANGES", "ranges_as_runs", "runs_tiles"]

MIN_RANGES = 4
"""Fewer flattened ranges than this are cheap as they are (``2 * ndim - 1`` tiles each at most)."""

Range = tuple[int, int]


def ranges_as_runs(shape: Sequence[int], flat: Sequence[Range]) -> list[list[Range]] | None:
    """Per dim, the index runs whose product, in row-major order, is exactly the elements of
    ``flat`` in their order; None when ``flat`` is not such a product (or is out of bounds)."""
    shape = tuple(int(n) for n in shape)
    if not shape or len(flat) < MIN_RANGES:
        return None
    bounds = np.asarray(flat, dtype=np.int64).reshape(-1, 2)
    bounds = bounds[bounds[:, 1] > bounds[:, 0]]
    numel = math.prod(shape)
    if not len(bounds) or bounds.min() < 0 or bounds.max() > numel or (bounds[1:, 0] < bounds[:-1, 1]).any():
        return None
    strides = row_major_strides(shape)
    split = next(d for d in range(len(shape)) if not (bounds % strides[d]).any())
    width = shape[split]
    units = bounds // strides[split]
    row_of_first, row_of_last = units[:, 0] // width, (units[:, 1] - 1) // width
    cut_count = row_of_last - row_of_first + 1
    if cut_count.sum() > 2 * len(units) + 2:
        return None  # ranges spanning many rows: whole rows, which step 1 should have found
    if (cut_count > 1).any():
        units = _cut_at_rows(units, row_of_first, cut_count, width)
    rows = units[:, 0] // width
    starts, ends = units[:, 0] - rows * width, units[:, 1] - rows * width
    per_row = int(np.count_nonzero(rows == rows[0]))
    if len(rows) % per_row:
        return None
    rows, starts, ends = (a.reshape(-1, per_row) for a in (rows, starts, ends))
    if (rows != rows[:, :1]).any() or (starts != starts[0]).any() or (ends != ends[0]).any():
        return None
    outer = _outer_indices(shape[:split], rows[:, 0])
    if outer is None:
        return None
    inner = [[(0, n)] for n in shape[split + 1 :]]
    return [*map(_as_runs, outer), list(zip(starts[0].tolist(), ends[0].tolist())), *inner]


def runs_tiles(runs: Sequence[Sequence[Range]]) -> list[Tile]:
    """The tiles of a local tensor holding, along each dim ``d``, the indices ``runs[d]`` in order
    (row-major): one per combination of a run per dim."""
    sizes = [sum(e - s for s, e in r) for r in runs]
    strides = row_major_strides(sizes)
    placed = []  # per dim: (start, length, local offset along the dim)
    for r in runs:
        at, dim = 0, []
        for s, e in r:
            dim.append((s, e - s, at))
            at += e - s
        placed.append(dim)
    return [
        Tile(sum(p[2] * st for p, st in zip(combo, strides)), strides, tuple(p[0] for p in combo), tuple(p[1] for p in combo))
        for combo in product(*placed)
    ]


def _cut_at_rows(units: np.ndarray, first: np.ndarray, count: np.ndarray, width: int) -> np.ndarray:
    """Ranges cut where a row of ``width`` ends (each into ``count`` parts)."""
    owner = np.repeat(np.arange(len(units)), count)
    part = np.arange(len(owner)) - np.repeat(np.cumsum(count) - count, count)
    row = first[owner] + part
    lo = np.maximum(units[owner, 0], row * width)
    hi = np.minimum(units[owner, 1], (row + 1) * width)
    return np.stack([lo, hi], axis=1)


def _outer_indices(shape: Sequence[int], rows: np.ndarray) -> list[np.ndarray] | None:
    """The index sets per dim of ``shape`` whose product in row-major order is ``rows`` (flat
    indices), or None."""
    if not shape:
        return [] if len(rows) == 1 and rows[0] == 0 else None
    if (np.diff(rows) <= 0).any():
        return None
    coords = np.unravel_index(rows, shape)
    sets = [np.unique(c) for c in coords]
    if math.prod(len(s) for s in sets) != len(rows):
        return None
    grid = np.ravel_multi_index(np.meshgrid(*sets, indexing="ij"), shape).reshape(-1)
    return sets if np.array_equal(grid, rows) else None


def _as_runs(indices: np.ndarray) -> list[Range]:
    """Sorted distinct indices as ``[start, end)`` runs."""
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    firsts = np.concatenate([[0], breaks])
    lasts = np.concatenate([breaks, [len(indices)]])
    return list(zip(indices[firsts].tolist(), (indices[lasts - 1] + 1).tolist()))
