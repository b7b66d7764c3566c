"""The runs of a strided read item whose runs are contiguous on both sides (last stride 1 in the
stored piece and in the destination): where they start, and where to cut them into blocks; and
which strided items of one stored piece share a read.

Both work on a slice of the runs at a time, so memory stays bounded by :data:`RUNS_PER_SLICE`
(a piece of 10 million runs of 2 elements took 229 MiB to cut when all its starts were built at
once), and the Python work is one step per slice, never per run.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .load_plan import ReadItem

__all__ = ["RUNS_PER_SLICE", "overlapping", "run_blocks", "run_starts"]

RUNS_PER_SLICE = 1 << 16


def run_starts(item: ReadItem, lo: int, hi: int, *, dest: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """Where runs ``[lo, hi)`` start: stored element offsets, and destination ones (None without ``dest``)."""
    index = np.unravel_index(np.arange(lo, hi, dtype=np.int64), item.sizes[:-1])
    src = item.src_offset + sum(i * s for i, s in zip(index, item.src_strides[:-1]))
    return src, item.dst_offset + sum(i * s for i, s in zip(index, item.dst_strides[:-1])) if dest else None


def run_blocks(item: ReadItem, step: int) -> list[int]:
    """The first run of each block: run 0, then the first run that starts at or past each multiple
    of ``step`` stored elements after run 0's start (a multiple no run starts in adds no block).
    Runs start in increasing order, so each block's runs lie within about ``step`` elements."""
    runs = item.numel // item.sizes[-1]
    bounds, first, last = [0], None, 0
    for lo in range(0, runs, RUNS_PER_SLICE):
        starts = run_starts(item, lo, min(runs, lo + RUNS_PER_SLICE), dest=False)[0]
        first = int(starts[0]) if first is None else first
        block = (starts - first) // step
        bounds += (np.flatnonzero(np.diff(block, prepend=last)) + lo).tolist()
        last = int(block[-1])
    return bounds


def overlapping(items: Sequence[ReadItem], align: int = 1) -> list[tuple[int, int, tuple[ReadItem, ...]]]:
    """Strided items of one stored piece grouped where their spans overlap, each span widened to
    multiples of ``align`` elements first: ``(lo, hi, items)`` per group, in stored order. Column
    blocks of the same rows (an interleaved ``_StridedShard``) share one read of those rows."""
    groups: list[list] = []
    for item in sorted(items, key=lambda i: i.src_offset):
        lo, hi = item.src_offset - item.src_offset % align, -(-item.src_end // align) * align
        if groups and lo < groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], hi)
            groups[-1][2].append(item)
        else:
            groups.append([lo, hi, [item]])
    return [(lo, hi, tuple(group)) for lo, hi, group in groups]
