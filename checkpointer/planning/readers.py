"""Two-stage loading, planned: which rank reads each piece that several ranks need.

Every rank says which element intervals of which ``(file, key)`` piece it needs; the
intervals are cut at every boundary any rank has, so each resulting unit is needed by a
fixed set of ranks. Each unit gets one reader among the ranks that need it, the one with
the fewest bytes to read so far (largest units first), so reads spread over the ranks.
Pure: the same inputs give the same schedule on every rank.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Need", "ReadUnit", "assign_readers"]


@dataclass(frozen=True, slots=True)
class Need:
    """Elements ``[start, end)`` of the piece of tensor ``key`` stored in ``file``."""

    file: str
    key: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class ReadUnit:
    file: str
    key: str
    start: int
    end: int
    reader: int
    ranks: tuple[int, ...]  # every rank that needs it, the reader included


def assign_readers(needs_per_rank: Sequence[Sequence[Need]], itemsizes: dict[str, int]) -> list[ReadUnit]:
    """Cut the needs into units, each needed by one set of ranks, and give each unit one reader.

    Returns the units in a fixed order (by file, key, start).
    """
    by_piece: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)
    for rank, needs in enumerate(needs_per_rank):
        for n in needs:
            if n.end > n.start:
                by_piece[(n.file, n.key)].append((n.start, n.end, rank))
    raw: list[tuple[str, str, int, int, tuple[int, ...]]] = []
    for (file, key), intervals in sorted(by_piece.items()):
        cuts = sorted({p for s, e, _ in intervals for p in (s, e)})
        # Sweep the cut points, tracking which ranks' intervals are open.
        opens: dict[int, list[int]] = defaultdict(list)
        closes: dict[int, list[int]] = defaultdict(list)
        for s, e, r in intervals:
            opens[s].append(r)
            closes[e].append(r)
        active: dict[int, int] = {}  # rank -> its open intervals, only ranks with some open
        for lo, hi in zip(cuts, cuts[1:]):
            for r in closes.get(lo, ()):
                active[r] -= 1
                if not active[r]:
                    del active[r]
            for r in opens.get(lo, ()):
                active[r] = active.get(r, 0) + 1
            ranks = tuple(sorted(active))
            if not ranks:
                continue
            if raw and raw[-1][:2] == (file, key) and raw[-1][3] == lo and raw[-1][4] == ranks:
                raw[-1] = (file, key, raw[-1][2], hi, ranks)
            else:
                raw.append((file, key, lo, hi, ranks))
    load: dict[int, int] = defaultdict(int)
    reader_of: dict[int, int] = {}
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i][3] - raw[i][2]) * itemsizes[raw[i][1]], i))
    for i in order:
        file, key, lo, hi, ranks = raw[i]
        reader = min(ranks, key=lambda r: (load[r], r))
        reader_of[i] = reader
        load[reader] += (hi - lo) * itemsizes[key]
    return [ReadUnit(f, k, lo, hi, reader_of[i], ranks) for i, (f, k, lo, hi, ranks) in enumerate(raw)]
