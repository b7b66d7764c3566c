"""Pieces as strided boxes, and the copies between them, in time that never grows with rows.

A piece's memory is a 1-D array of elements. It is described by *tiles*: each a strided view
of that array (storage ``offset`` and ``strides``) holding one box of the full tensor
(``origin``, ``sizes``). A box piece (``local_shape`` at ``global_offset``) is one tile with
row-major strides. A flattened range ``[start, end)`` is at most ``2 * ndim - 1`` tiles whose
strides are the full tensor's own (:func:`range_tiles`). So a piece is a handful of tiles,
however many rows it has.

The recipe to fill a destination piece from stored pieces:

1. Describe both sides as tiles (:func:`piece_tiles`).
2. Index the stored tiles once per layout (:class:`TileIndex`): it proves them disjoint (a
   grid, in O(tiles); anything else by a bounded sweep) or gives up, and the caller falls back
   to flattened ranges.
3. Intersect each wanted tile with the stored tiles it touches: one box each, in O(ndim).
4. Each intersection is one :class:`BoxCopy`, a strided view on both sides. Dimensions that are
   contiguous on both sides are merged, so a copy between contiguous runs is 1-D.

Worked example: a ``[4, 6]`` tensor saved as ``Shard(1)`` over 2 files (``[4, 3]`` at
``(0, 0)`` and at ``(0, 3)``), wanted as rows ``[1, 3)`` whole. The wanted tile meets both
stored tiles: file 0 gives box ``(1, 0)`` sizes ``(2, 3)``, read from offset 3 with strides
``(3, 1)`` (contiguous: 6 elements) into offset 0 with strides ``(6, 1)`` (every other half
row); file 1 likewise into offset 3.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "Tile",
    "BoxCopy",
    "TileIndex",
    "row_major_strides",
    "range_tiles",
    "box_tile",
    "index_range_boxes",
    "count_below",
    "span_boxes",
    "normalize",
    "tile_copy",
    "MAX_SWEEP_PAIRS",
]

MAX_SWEEP_PAIRS = 1 << 22
"""Pairs of tiles the disjointness sweep of an irregular layout may compare before giving up."""


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(sizes):
        out.append(step)
        step *= n
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class Tile:
    """A box of the full tensor (``origin``, ``sizes``) held in a piece's memory at element
    ``offset``, with ``strides`` (elements) per dimension."""

    offset: int
    strides: tuple[int, ...]
    origin: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class BoxCopy:
    """Copy a box of ``sizes`` from source piece ``source`` (at ``src_offset``, ``src_strides``)
    to the destination piece (at ``dst_offset``, ``dst_strides``). After :func:`normalize`, a
    copy whose ``sizes`` are ``(n,)`` with unit strides on both sides is a contiguous run."""

    source: int
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def contiguous(self) -> bool:
        return len(self.sizes) <= 1 and self.src_strides in ((), (1,)) and self.dst_strides in ((), (1,))


def box_tile(local_shape: Sequence[int], global_offset: Sequence[int], offset: int = 0) -> Tile:
    sizes = tuple(local_shape)
    return Tile(offset, row_major_strides(sizes), tuple(global_offset), sizes)


def index_range_boxes(sizes: Sequence[int], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The row-major positions ``[lo, hi)`` of an array of ``sizes`` as boxes ``(origin, sizes)``,
    in order: at most ``2 * len(sizes) - 1`` of them (a partial row at each end, per dimension,
    and whole rows between)."""
    sizes = tuple(sizes)
    if hi <= lo:
        return []
    if not sizes:
        return [((), ())]
    inner_sizes = sizes[1:]
    inner = math.prod(inner_sizes)
    a, ra = divmod(lo, inner)
    b, rb = divmod(hi, inner)
    zeros = (0,) * len(inner_sizes)
    if a == b:
        return [((a, *o), (1, *s)) for o, s in index_range_boxes(inner_sizes, ra, rb)]
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if ra:
        out += [((a, *o), (1, *s)) for o, s in index_range_boxes(inner_sizes, ra, inner)]
        a += 1
    if b > a:
        out.append(((a, *zeros), (b - a, *inner_sizes)))
    if rb:
        out += [((b, *o), (1, *s)) for o, s in index_range_boxes(inner_sizes, 0, rb)]
    return out


def range_tiles(shape: Sequence[int], start: int, end: int, offset: int = 0) -> list[Tile]:
    """The flattened range ``[start, end)`` of a tensor of ``shape``, stored back to back from
    element ``offset``, as tiles with the tensor's own strides."""
    strides = row_major_strides(shape)
    out = []
    for origin, sizes in index_range_boxes(shape, start, end):
        flat = sum(o * s for o, s in zip(origin, strides))
        out.append(Tile(offset + flat - start, strides, origin, sizes))
    return out


def count_below(sizes: Sequence[int], strides: Sequence[int], r: int) -> int:
    """How many elements of a view (row-major order, each dimension's stride at least the span
    of the dimensions after it, as a box of a row-major array has) sit at offsets below ``r``."""
    if r <= 0:
        return 0
    if not sizes:
        return 1
    inner = math.prod(sizes[1:])
    if sizes[0] == 1 or strides[0] == 0:
        return count_below(sizes[1:], strides[1:], r)
    k = r // strides[0]
    if k >= sizes[0]:
        return sizes[0] * inner
    return k * inner + count_below(sizes[1:], strides[1:], r - k * strides[0])


def span_boxes(
    sizes: Sequence[int], strides: Sequence[int], lo: int, hi: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes ``(origin, sizes)`` of a view (see :func:`count_below`) whose elements sit at
    offsets ``[lo, hi)``: the elements a buffer holding those offsets can give."""
    return index_range_boxes(sizes, count_below(sizes, strides, lo), count_below(sizes, strides, hi))


def normalize(copy: BoxCopy) -> BoxCopy:
    """Drop dimensions of size 1 and merge neighbours that are contiguous on both sides."""
    sizes: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    for n, s, d in zip(copy.sizes, copy.src_strides, copy.dst_strides):
        if n == 1:
            continue
        if sizes and src[-1] == s * n and dst[-1] == d * n:
            sizes[-1] *= n
            src[-1], dst[-1] = s, d
        else:
            sizes.append(n)
            src.append(s)
            dst.append(d)
    if not sizes and copy.numel == 1:
        sizes, src, dst = [1], [1], [1]
    return BoxCopy(copy.source, copy.src_offset, tuple(src), copy.dst_offset, tuple(dst), tuple(sizes))


def intersect(a_origin, a_sizes, b_origin, b_sizes) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a_origin, b_origin))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a_origin, a_sizes, b_origin, b_sizes))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _position(tile: Tile, origin: Sequence[int]) -> int:
    return tile.offset + sum((o - t) * s for o, t, s in zip(origin, tile.origin, tile.strides))


def tile_copy(source: int, stored: Tile, wanted: Tile) -> BoxCopy | None:
    """The copy of what ``stored`` (of source ``source``) holds of ``wanted``, normalized; ``None``
    when they do not meet."""
    box = intersect(wanted.origin, wanted.sizes, stored.origin, stored.sizes)
    if box is None:
        return None
    origin, sizes = box
    return normalize(BoxCopy(
        source, _position(stored, origin), stored.strides, _position(wanted, origin), wanted.strides, sizes
    ))


class TileIndex:
    """The stored tiles of one tensor (``tiles[i]`` those of source ``i``), proven disjoint,
    searchable by box.

    Identical boxes held by several sources (replicas) are read from the first. Construction
    sets ``ok`` False when the tiles could not be proven disjoint (partly overlapping boxes, or
    an irregular layout too large to sweep): the caller then plans with flattened ranges.
    ``conflict``: two sources whose boxes were found to overlap (not as replicas).
    """

    def __init__(self, shape: Sequence[int], tiles: Sequence[Sequence[Tile]]):
        self.shape = tuple(shape)
        seen: dict[tuple, int] = {}
        flat: list[tuple[int, Tile]] = []
        self.replicas = 0  # tiles dropped because an earlier source holds the same box
        for source, piece in enumerate(tiles):
            for t in piece:
                if t.numel == 0:
                    continue
                box = (t.origin, t.sizes)
                if box in seen:
                    if seen[box] != source:
                        self.replicas += 1
                        continue  # a replica: the first holder's copy is read
                seen[box] = source
                flat.append((source, t))
        self.tiles = flat
        self.conflict: tuple[int, int] | None = None
        self.covered = sum(t.numel for _, t in flat)
        ndim = len(self.shape)
        if ndim == 0:
            self.ok = len(flat) <= 1
            self._key = 0
            return
        inside = all(
            all(0 <= o and o + n <= full for o, n, full in zip(t.origin, t.sizes, self.shape)) for _, t in flat
        )
        # Index along the dimension with the most distinct starts: a band holds few tiles.
        distinct = [len({t.origin[d] for _, t in flat}) for d in range(ndim)]
        self._key = key = max(range(ndim), key=lambda d: (distinct[d], -d))
        flat.sort(key=lambda st: st[1].origin[key])
        self._starts = [t.origin[key] for _, t in flat]
        self._longest = max((t.sizes[key] for _, t in flat), default=0)
        self.ok = inside and (self._grid() or self._sweep())

    def _grid(self) -> bool:
        """Disjoint because each tile is one cell of the grid cut by all tiles' boundaries, and
        no cell is held twice."""
        ndim = len(self.shape)
        cuts = [sorted({t.origin[d] for _, t in self.tiles} | {t.origin[d] + t.sizes[d] for _, t in self.tiles})
                for d in range(ndim)]
        where = [{c: i for i, c in enumerate(cs)} for cs in cuts]
        cells = set()
        for _, t in self.tiles:
            cell = []
            for d in range(ndim):
                i = where[d][t.origin[d]]
                if cuts[d][i + 1] != t.origin[d] + t.sizes[d]:
                    return False
                cell.append(i)
            cells.add(tuple(cell))
        return len(cells) == len(self.tiles)

    def _sweep(self) -> bool:
        """Disjoint by comparing every pair whose key-dimension extents meet (bounded work)."""
        key, tiles = self._key, self.tiles
        pairs = 0
        for i, (_, a) in enumerate(tiles):
            end = a.origin[key] + a.sizes[key]
            for j in range(i + 1, len(tiles)):
                b = tiles[j][1]
                if b.origin[key] >= end:
                    break
                pairs += 1
                if pairs > MAX_SWEEP_PAIRS:
                    return False
                if intersect(a.origin, a.sizes, b.origin, b.sizes) is not None:
                    self.conflict = (tiles[i][0], tiles[j][0])
                    return False
        return True

    def copies(self, wanted: Sequence[Tile]) -> list[BoxCopy]:
        """The copies that fill the wanted tiles from the stored ones, normalized, in the order of
        the wanted tiles, then of the stored tiles along the key dimension."""
        out: list[BoxCopy] = []
        key = self._key
        for w in wanted:
            if w.numel == 0:
                continue
            if not self.shape:
                out += [normalize(BoxCopy(s, t.offset, (), w.offset, (), ())) for s, t in self.tiles]
                continue
            lo, hi = w.origin[key], w.origin[key] + w.sizes[key]
            first = bisect.bisect_right(self._starts, lo - self._longest)
            last = bisect.bisect_left(self._starts, hi)
            for source, t in self.tiles[first:last]:
                copy = tile_copy(source, t, w)
                if copy is not None:
                    out.append(copy)
        return out
