"""planning/readers.py (two-stage load) against a per-element oracle."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.planning.readers import Need, ReadUnit, assign_readers

PIECES = [("rank_0.safetensors", "a"), ("rank_0.safetensors", "b"), ("rank_1.safetensors", "a")]
ITEMSIZES = {"a": 4, "b": 2}


@st.composite
def needs(draw):
    world = draw(st.integers(1, 6))
    per_rank = []
    for _ in range(world):
        mine = []
        for _ in range(draw(st.integers(0, 4))):
            file, key = draw(st.sampled_from(PIECES))
            start = draw(st.integers(0, 20))
            end = draw(st.integers(start, 24))
            mine.append(Need(file, key, start, end))
        per_rank.append(mine)
    return per_rank


def check_units(needs_per_rank, units):
    needers: dict[tuple[str, str, int], set[int]] = defaultdict(set)
    for rank, mine in enumerate(needs_per_rank):
        for n in mine:
            for e in range(n.start, n.end):
                needers[(n.file, n.key, e)].add(rank)
    covered: dict[tuple[str, str, int], int] = defaultdict(int)
    for u in units:
        assert isinstance(u, ReadUnit)
        assert u.end > u.start
        assert u.reader in u.ranks
        assert list(u.ranks) == sorted(set(u.ranks))
        for e in range(u.start, u.end):
            assert needers[(u.file, u.key, e)] == set(u.ranks), (u, e)
            covered[(u.file, u.key, e)] += 1
    assert dict(covered) == {k: 1 for k in needers}
    # Fixed order, and maximal: touching units of one piece needed by the same ranks are one.
    assert [(u.file, u.key, u.start) for u in units] == sorted((u.file, u.key, u.start) for u in units)
    for a, b in zip(units, units[1:]):
        assert not ((a.file, a.key) == (b.file, b.key) and a.end == b.start and a.ranks == b.ranks)


@settings(max_examples=100, deadline=None)
@given(needs())
def test_assign_readers_matches_oracle(needs_per_rank):
    units = assign_readers(needs_per_rank, ITEMSIZES)
    check_units(needs_per_rank, units)
    assert assign_readers(needs_per_rank, ITEMSIZES) == units  # deterministic


@settings(max_examples=50, deadline=None)
@given(world=st.integers(1, 8), sizes=st.lists(st.integers(1, 30), min_size=1, max_size=20))
def test_units_everyone_needs_are_balanced(world, sizes):
    # Every rank needs every piece (a replicated model): reading is spread within one largest unit.
    files = [f"rank_{i}.safetensors" for i in range(len(sizes))]
    per_rank = [[Need(f, "a", 0, n) for f, n in zip(files, sizes)] for _ in range(world)]
    units = assign_readers(per_rank, ITEMSIZES)
    check_units(per_rank, units)
    load = [0] * world
    for u in units:
        assert u.ranks == tuple(range(world))
        load[u.reader] += (u.end - u.start) * ITEMSIZES[u.key]
    assert sum(load) == 4 * sum(sizes)
    assert max(load) - min(load) <= 4 * max(sizes)


def test_example():
    f = "rank_0.safetensors"
    units = assign_readers([[Need(f, "a", 0, 10)], [Need(f, "a", 5, 15)], []], ITEMSIZES)
    assert [(u.start, u.end, u.ranks) for u in units] == [(0, 5, (0,)), (5, 10, (0, 1)), (10, 15, (1,))]
    # Equal sizes, in order: unit 0 to rank 0; the shared unit to the less loaded rank 1.
    assert [u.reader for u in units] == [0, 1, 1]


@pytest.mark.parametrize("per_rank", [[], [[]], [[], []], [[Need("rank_0.safetensors", "a", 3, 3)]]])
def test_nothing_needed(per_rank):
    assert assign_readers(per_rank, ITEMSIZES) == []
