"""Element ranges of shard specs, and their intersection by binary search.

Every piece of a tensor, whatever its form, is a list of ``[start, end)`` ranges of the
row-major flattened full tensor, stored back to back. A box (``local_shape`` at
``global_offset``) becomes one range per run of contiguous elements: a box that spans the
trailing dimensions entirely is a single range, however large.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from itertools import product
from typing import Iterable, Sequence

__all__ = ["Range", "box_ranges", "merge_adjacent", "Segment", "SourceIndex", "Overlap"]

Range = tuple[int, int]


def box_ranges(shape: Sequence[int], local_shape: Sequence[int], global_offset: Sequence[int]) -> list[Range]:
    """The flattened ranges of a box, in row-major order of the box."""
    ndim = len(shape)
    if math.prod(local_shape) == 0:
        return []
    if ndim == 0:
        return [(0, 1)]
    # Dimensions after `split` are covered entirely, so each run spans dims split.. contiguously.
    split = ndim - 1
    while split > 0 and local_shape[split] == shape[split] and global_offset[split] == 0:
        split -= 1
    strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    run = local_shape[split] * strides[split]
    base = global_offset[split] * strides[split]
    if split == 0:
        return [(base, base + run)]
    outer = [range(global_offset[d], global_offset[d] + local_shape[d]) for d in range(split)]
    ranges = []
    for index in product(*outer):
        start = base + sum(i * s for i, s in zip(index, strides))
        ranges.append((start, start + run))
    return ranges


def merge_adjacent(ranges: Iterable[Range]) -> list[Range]:
    """Drop empty ranges and join a range to the previous one when they touch."""
    out: list[Range] = []
    for start, end in ranges:
        if end <= start:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[start, end)`` of the full tensor, held at ``offset`` elements into ``source``'s piece."""

    start: int
    end: int
    source: int
    offset: int


@dataclass(frozen=True, slots=True)
class Overlap:
    source: int
    src_offset: int  # elements into the source piece
    dst_offset: int  # elements into the destination piece
    numel: int


class SourceIndex:
    """A disjoint cover of a tensor by source pieces, searchable by element index.

    ``pieces[i]`` is the list of ranges source ``i`` holds, in storage order. Where sources
    overlap (replicas), the earliest-starting one wins and later ones are trimmed, so every
    element is read from exactly one place. ``conflict``: the first two sources found to overlap
    other than as identical ranges (replicas), which a checkpoint's pieces never do.
    """

    def __init__(self, pieces: Sequence[Sequence[Range]]):
        segments: list[Segment] = []
        for source, ranges in enumerate(pieces):
            offset = 0
            for start, end in ranges:
                if end > start:
                    segments.append(Segment(start, end, source, offset))
                offset += end - start
        segments.sort(key=lambda s: (s.start, -s.end, s.source))
        cover: list[Segment] = []
        reached, holder, previous = -1, -1, None
        self.conflict: tuple[int, int] | None = None
        for seg in segments:
            if seg.start < reached and self.conflict is None and (
                previous is None or (seg.start, seg.end) != (previous.start, previous.end)
            ):
                self.conflict = (holder, seg.source)
            previous = seg
            if seg.end <= reached:
                continue
            holder = seg.source
            if seg.start < reached:
                seg = Segment(reached, seg.end, seg.source, seg.offset + reached - seg.start)
            if cover and cover[-1].end == seg.start and cover[-1].source == seg.source and (
                cover[-1].offset + cover[-1].end - cover[-1].start == seg.offset
            ):
                last = cover.pop()
                seg = Segment(last.start, seg.end, seg.source, last.offset)
            cover.append(seg)
            reached = seg.end
        self.segments = cover
        self._ends = [s.end for s in cover]

    def covered(self) -> int:
        return sum(s.end - s.start for s in self.segments)

    def gaps(self, numel: int) -> list[Range]:
        out, pos = [], 0
        for s in self.segments:
            if s.start > pos:
                out.append((pos, s.start))
            pos = max(pos, s.end)
        if pos < numel:
            out.append((pos, numel))
        return out

    def overlaps(self, wanted: Sequence[Range]) -> list[Overlap]:
        """Where each element of ``wanted`` (ranges stored back to back) comes from."""
        out: list[Overlap] = []
        segments, ends = self.segments, self._ends
        dst = 0
        for start, end in wanted:
            i = bisect.bisect_right(ends, start)
            while i < len(segments) and segments[i].start < end:
                seg = segments[i]
                lo, hi = max(start, seg.start), min(end, seg.end)
                if hi > lo:
                    src_offset = seg.offset + lo - seg.start
                    dst_offset = dst + lo - start
                    prev = out[-1] if out else None
                    if (
                        prev is not None
                        and prev.source == seg.source
                        and prev.src_offset + prev.numel == src_offset
                        and prev.dst_offset + prev.numel == dst_offset
                    ):
                        out[-1] = Overlap(prev.source, prev.src_offset, prev.dst_offset, prev.numel + hi - lo)
                    else:
                        out.append(Overlap(seg.source, src_offset, dst_offset, hi - lo))
                i += 1
            dst += end - start
        return out
