"""planning/overlap.py against brute-force oracles that enumerate every element."""

from __future__ import annotations

import math
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.planning.overlap import Overlap, SourceIndex, box_ranges, merge_adjacent

# ---------------------------------------------------------------------------------------------
# Oracles
# ---------------------------------------------------------------------------------------------


def strides_of(shape):
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def runs(indices):
    """Group a sequence of flat indices into maximal runs of consecutive values, in order."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, i + 1])
    return [tuple(r) for r in out]


def oracle_box_ranges(shape, local_shape, global_offset):
    """Every element of the box, in the box's row-major order, as flat indices, grouped into runs."""
    strides = strides_of(shape)
    flat = [
        sum((o + i) * s for o, i, s in zip(global_offset, index, strides))
        for index in product(*(range(n) for n in local_shape))
    ]
    return runs(flat)


def elements_of(ranges):
    """The element at each position of a piece stored as ``ranges`` back to back."""
    return [g for start, end in ranges for g in range(start, end)]


# ---------------------------------------------------------------------------------------------
# box_ranges
# ---------------------------------------------------------------------------------------------


@st.composite
def shape_and_box(draw, max_ndim=4, max_dim=5):
    ndim = draw(st.integers(0, max_ndim))
    shape = tuple(draw(st.lists(st.integers(0, max_dim), min_size=ndim, max_size=ndim)))
    local, offset = [], []
    for n in shape:
        off = draw(st.integers(0, n))
        size = draw(st.integers(0, n - off))
        offset.append(off)
        local.append(size)
    # Bias towards boxes that span trailing dimensions entirely (the single-range fast path).
    if ndim and draw(st.booleans()):
        k = draw(st.integers(0, ndim))
        for d in range(k, ndim):
            local[d], offset[d] = shape[d], 0
    return shape, tuple(local), tuple(offset)


@settings(max_examples=300, deadline=None)
@given(shape_and_box())
def test_box_ranges_matches_oracle(case):
    shape, local, offset = case
    assert box_ranges(shape, local, offset) == oracle_box_ranges(shape, local, offset)


@pytest.mark.parametrize(
    "shape, local, offset, expected",
    [
        ((), (), (), [(0, 1)]),
        ((5,), (5,), (0,), [(0, 5)]),
        ((5,), (2,), (3,), [(3, 5)]),
        ((5,), (0,), (5,), []),
        ((4, 3), (2, 3), (2, 0), [(6, 12)]),  # Shard(0): one range
        ((4, 3), (4, 1), (0, 1), [(1, 2), (4, 5), (7, 8), (10, 11)]),  # Shard(1): one per row
        ((2, 1, 3), (1, 1, 3), (1, 0, 0), [(3, 6)]),
        ((2, 2, 3), (2, 1, 3), (0, 1, 0), [(3, 6), (9, 12)]),
        ((0, 4), (0, 2), (0, 1), []),
        ((3, 0), (3, 0), (0, 0), []),
    ],
)
def test_box_ranges_examples(shape, local, offset, expected):
    assert box_ranges(shape, local, offset) == expected
    assert oracle_box_ranges(shape, local, offset) == expected


def test_box_ranges_large_full_box_is_one_range():
    # A box spanning the trailing dims entirely is one range however large (no per-row loop).
    shape = (1000, 1000, 1000)
    assert box_ranges(shape, (10, 1000, 1000), (990, 0, 0)) == [(990 * 10**6, 1000 * 10**6)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=10))
def test_merge_adjacent_matches_oracle(raw):
    # Ranges stored back to back (possibly empty or inverted: those hold nothing).
    expected = runs([g for s, e in raw for g in range(s, e)])
    assert merge_adjacent(raw) == expected


# ---------------------------------------------------------------------------------------------
# SourceIndex
# ---------------------------------------------------------------------------------------------


@st.composite
def disjoint_ranges(draw, numel):
    """Disjoint ranges within [0, numel) (some empty), in a random storage order."""
    cuts = sorted(draw(st.lists(st.integers(0, numel), max_size=8)))
    if len(cuts) % 2:
        cuts = cuts[:-1]
    ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts), 2)]
    return draw(st.permutations(ranges)) if ranges else []


@st.composite
def sources_and_wanted(draw, disjoint_wanted=True):
    numel = draw(st.integers(0, 30))
    pieces: list[list[tuple[int, int]]] = []
    for _ in range(draw(st.integers(0, 5))):
        if pieces and draw(st.integers(0, 3)) == 0:
            # A replica of an earlier source (same elements, maybe another storage order).
            twin = pieces[draw(st.integers(0, len(pieces) - 1))]
            pieces.append(list(draw(st.permutations(twin))) if twin else [])
        else:
            pieces.append(draw(disjoint_ranges(numel)))
    if disjoint_wanted:
        wanted = draw(disjoint_ranges(numel))
    else:
        wanted = [
            tuple(sorted(r))
            for r in draw(st.lists(st.tuples(st.integers(0, numel), st.integers(0, numel)), max_size=5))
        ]
    return numel, pieces, wanted


def check_overlaps(pieces, wanted, overlaps):
    held: dict[int, set[tuple[int, int]]] = {}
    for source, ranges in enumerate(pieces):
        for offset, g in enumerate(elements_of(ranges)):
            held.setdefault(g, set()).add((source, offset))
    dst_elements = elements_of(wanted)
    written = [0] * len(dst_elements)
    for o in overlaps:
        assert isinstance(o, Overlap)
        assert o.numel > 0
        assert 0 <= o.dst_offset and o.dst_offset + o.numel <= len(dst_elements)
        for k in range(o.numel):
            g = dst_elements[o.dst_offset + k]
            assert (o.source, o.src_offset + k) in held.get(g, ()), (
                f"destination position {o.dst_offset + k} (element {g}) read from source {o.source} "
                f"offset {o.src_offset + k}, which does not hold it"
            )
            written[o.dst_offset + k] += 1
    expected = [1 if g in held else 0 for g in dst_elements]
    assert written == expected
    return held


@settings(max_examples=200, deadline=None)
@given(sources_and_wanted())
def test_source_index_overlaps_matches_oracle(case):
    numel, pieces, wanted = case
    index = SourceIndex(pieces)
    held = check_overlaps(pieces, wanted, index.overlaps(wanted))
    # The cover: disjoint, sorted, every held element exactly once.
    segs = index.segments
    assert all(s.end > s.start for s in segs)
    assert all(a.end <= b.start for a, b in zip(segs, segs[1:]))
    assert index.covered() == len(held)
    missing = [g for g in range(numel) if g not in held]
    assert index.gaps(numel) == runs(missing)


@settings(max_examples=100, deadline=None)
@given(sources_and_wanted(disjoint_wanted=False))
def test_source_index_overlaps_repeated_wanted_elements(case):
    # Wanted ranges that overlap each other: every destination position is still filled once.
    _, pieces, wanted = case
    check_overlaps(pieces, wanted, SourceIndex(pieces).overlaps(wanted))


def test_first_start_wins_and_trims_later_sources():
    index = SourceIndex([[(0, 10)], [(5, 15)]])
    assert index.overlaps([(0, 15)]) == [Overlap(0, 0, 0, 10), Overlap(1, 5, 10, 5)]
    assert index.overlaps([(7, 12)]) == [Overlap(0, 7, 0, 3), Overlap(1, 5, 3, 2)]


def test_replicas_read_from_one_source():
    index = SourceIndex([[(0, 10)], [(0, 10)], [(0, 10)]])
    assert index.overlaps([(0, 10)]) == [Overlap(0, 0, 0, 10)]
    assert index.overlaps([(2, 4), (6, 9)]) == [Overlap(0, 2, 0, 2), Overlap(0, 6, 2, 3)]


def test_contiguous_reads_merge_across_ranges():
    # Source 0 stores [5, 10) then [0, 5); wanting [5, 10) then [0, 5) is one contiguous read.
    index = SourceIndex([[(5, 10), (0, 5)]])
    assert index.overlaps([(5, 10), (0, 5)]) == [Overlap(0, 0, 0, 10)]
    assert index.overlaps([(0, 10)]) == [Overlap(0, 5, 0, 5), Overlap(0, 0, 5, 5)]


def test_uncovered_elements_are_skipped_and_reported():
    index = SourceIndex([[(0, 3)], [(6, 8)]])
    assert index.overlaps([(0, 10)]) == [Overlap(0, 0, 0, 3), Overlap(1, 0, 6, 2)]
    assert index.gaps(10) == [(3, 6), (8, 10)]
    assert index.covered() == 5
    assert SourceIndex([]).overlaps([(0, 4)]) == []
    assert SourceIndex([]).gaps(4) == [(0, 4)]


def test_source_index_names_sources_that_overlap_other_than_as_replicas():
    assert SourceIndex([[(0, 10)], [(0, 10)], [(10, 12)], [(0, 10)]]).conflict is None  # replicas
    assert SourceIndex([[(0, 5), (5, 10)], [(10, 12)]]).conflict is None
    assert SourceIndex([[(0, 10)], [(5, 15)]]).conflict == (0, 1)  # partly
    assert SourceIndex([[(4, 6)], [(0, 10)]]).conflict == (1, 0)  # one inside the other
    assert SourceIndex([[(0, 10)], [(0, 10)], [(0, 4)]]).conflict == (0, 2)
