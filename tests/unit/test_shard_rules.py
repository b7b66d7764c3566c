"""Shard rules (format 2) against a brute-force oracle, and hostile rules refused in linear time."""

from __future__ import annotations

import json
import math
from itertools import product

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from checkpointer import CorruptCheckpointError
from checkpointer.format.metadata_parse import parse_metadata
from checkpointer.format.rules import MAX_RULE_CELLS, MAX_RULE_VALUES, RuleError, check_rule, detect_rule, expand_rule
from checkpointer.planning.pieces import Piece, PieceDesc
from checkpointer.planning.plan import build_save_plan


def chunk(size: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's i-th of ``parts`` pieces of ``size``: (start, length), by brute force."""
    step = -(-size // parts) if parts else size
    start = min(i * step, size)
    return start, min(start + step, size) - start


@st.composite
def mesh_state(draw):
    """A random mesh (1 to 3 dims), placements (Shard(d) or Replicate per mesh dim, a tensor
    dim sharded by at most one mesh dim), uneven sizes: every rank's box, as DTensor gives it."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    dims = list(range(ndim))
    placements = []
    for _ in mesh:
        choice = draw(st.sampled_from([None] + dims))
        if choice is not None:
            dims.remove(choice)
        placements.append(choice)
    world = math.prod(mesh)
    pieces = []
    for coords in product(*(range(n) for n in mesh)):
        ls, go = list(shape), [0] * ndim
        for size, c, d in zip(mesh, coords, placements):
            if d is not None:
                go[d], ls[d] = chunk(shape[d], size, c)
        pieces.append(Piece(local_shape=tuple(ls), global_offset=tuple(go)))
    flat = draw(st.booleans())
    if flat and all(p is None for p in placements[1:]) and ndim == 1:
        pieces = [Piece(flat=((p.global_offset[0], p.global_offset[0] + p.local_shape[0]),)) for p in pieces]
    return shape, world, pieces


@settings(max_examples=300, deadline=None)
@given(mesh_state())
def test_the_rule_and_the_list_give_every_rank_the_same_pieces(state):
    shape, world, pieces = state
    descs = [[PieceDesc("t", shape, "F32", True, pieces[r])] for r in range(world)]
    compact = build_save_plan(descs)
    verbose = build_save_plan(descs, compact=False)
    a = parse_metadata(compact.metadata.to_json_bytes(), where="compact")
    b = parse_metadata(verbose.metadata.to_json_bytes(), where="verbose")
    assert dict(a.tensors["t"].shard_spec_per_file) == dict(b.tensors["t"].shard_spec_per_file)
    # Oracle: each file's piece is one rank's piece, and together they hold each element once.
    held = {}
    for name, spec in a.tensors["t"].shard_spec_per_file.items():
        rank = int(name.split("_")[1].split(".")[0])
        mine = pieces[rank]
        assert (spec.flattened_offsets, spec.local_shape, spec.global_offset) == (
            mine.flat, mine.local_shape, mine.global_offset
        )
        if spec.local_shape is not None:
            for idx in product(*(range(o, o + n) for o, n in zip(spec.global_offset, spec.local_shape))):
                assert idx not in held
                held[idx] = name
        else:
            for s, e in spec.flattened_offsets:
                for i in range(s, e):
                    assert (i,) not in held
                    held[(i,)] = name
    assert len(held) == math.prod(shape)
    text = json.loads(compact.metadata.to_json_bytes())["tensors"]["t"]
    # Every mesh layout is regular: the compact form holds a rule (else this compared two lists).
    assert "shard_rule" in text and "shard_spec_per_file" not in text, text
    assert len(json.dumps(text["shard_rule"])) < 200  # the rule, not a list of ranks


def test_regular_layouts_are_rules():
    """Shard(0) over 8 uneven, HSDP 2 x 4, TP x FSDP rowwise, a replicated tensor: all rules."""
    shape = (10, 6)
    fsdp = [Piece(local_shape=(chunk(10, 8, r)[1], 6), global_offset=(chunk(10, 8, r)[0], 0)) for r in range(8)]
    hsdp = [Piece(local_shape=(chunk(10, 4, r % 4)[1], 6), global_offset=(chunk(10, 4, r % 4)[0], 0)) for r in range(8)]
    tp = [Piece(local_shape=(chunk(10, 4, r // 2)[1], 3), global_offset=(chunk(10, 4, r // 2)[0], 3 * (r % 2)))
          for r in range(8)]
    rep = [Piece.whole((4,))] * 8
    descs = [[PieceDesc("fsdp", shape, "F32", True, fsdp[r]), PieceDesc("hsdp", shape, "F32", True, hsdp[r]),
              PieceDesc("tp", shape, "F32", True, tp[r]), PieceDesc("rep", (4,), "F32", False, rep[r])]
             for r in range(8)]
    doc = json.loads(build_save_plan(descs).metadata.to_json_bytes())
    assert doc["format_version"] == 2
    assert all("shard_rule" in t for t in doc["tensors"].values()), doc
    assert doc["tensors"]["fsdp"]["shard_rule"] == {"form": "box", "cuts": [[0, 2]], "files": [0, [[1, 5, 1]]]}


HOSTILE = {
    "10^12 cells": {"form": "box", "cuts": [[0, 1], [1, 1]], "files": [0, [[1, 10**12, 1]]]},
    "dim twice (overlap)": {"form": "box", "cuts": [[0, 1], [0, 1]], "files": [0, [[1, 4, 1]]]},
    "dim outside the tensor": {"form": "box", "cuts": [[2, 1]], "files": [0, [[1, 4, 1]]]},
    "chunk 0": {"form": "box", "cuts": [[0, 0]], "files": [0, [[1, 4, 1]]]},
    "chunk past the dim": {"form": "box", "cuts": [[0, 5]], "files": [0, []]},
    "two pieces in one file": {"form": "box", "cuts": [[0, 1]], "files": [0, [[1, 2, 1]]]},
    "digits that repeat": {"form": "box", "cuts": [[0, 1]], "files": [0, [[2, 2, 1]]]},
    "multiplier reached": {"form": "box", "cuts": [[0, 1], [1, 1]], "files": [0, [[1, 6, 1], [6, 4, 3]]]},
    "negative first": {"form": "box", "cuts": [[0, 1]], "files": [-1, [[1, 4, 1]]]},
    "file past the world": {"form": "box", "cuts": [[0, 1]], "files": [0, [[1, 4, 3]]]},
    "not an object": [1, 2],
    "unknown form": {"form": "strided", "cuts": [], "files": [0, []]},
    "a boolean chunk": {"form": "box", "cuts": [[0, True]], "files": [0, [[1, 4, 1]]]},
    "flat on dim 1": {"form": "flat", "cuts": [[1, 4]], "files": [0, [[1, 6, 1]]]},
}


@pytest.mark.parametrize("rule", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_rules_are_corrupt(rule):
    doc = {"tensors": {"w": {"shape": [4, 6], "is_sharded": True, "dtype": "F32", "shard_rule": rule}},
           "world_size": 4, "format_version": 2}
    with pytest.raises(CorruptCheckpointError, match="tensors\\['w'\\]|world size"):
        parse_metadata(json.dumps(doc).encode(), where="hostile")


def test_many_rules_within_one_budget():
    """Distinct rules expand once each; their pieces together stay within one budget, so a
    document of many large rules is refused, not expanded (no large allocation)."""
    rule = lambda c: {"form": "flat", "cuts": [[0, c]], "files": [0, [[1, 2**20, 1]]]}  # noqa: E731
    tensors = {f"t{i}": {"shape": [2**20 * (i + 1)], "is_sharded": True, "dtype": "U8", "shard_rule": rule(i + 1)}
               for i in range(8)}
    doc = {"tensors": tensors, "world_size": 2**20, "format_version": 2}
    with pytest.raises(CorruptCheckpointError, match=f"more than {MAX_RULE_CELLS} pieces together"):
        parse_metadata(json.dumps(doc).encode(), where="hostile")


def test_a_rule_of_many_dims_describes_fewer_pieces():
    """Each piece of a box rule expands into 2 * ndim + 1 numbers: a 306-byte rule of 2**20
    pieces over 64 dims took 12 s and 2.7 GB to parse (found by a review). The document's
    budget counts numbers, so it is refused before anything is expanded."""
    import tracemalloc

    def doc(ndim: int) -> bytes:
        rule = {"form": "box", "cuts": [[0, 1]], "files": [0, [[1, 2**20, 1]]]}
        tensor = {"shape": [2**20] + [1] * (ndim - 1), "is_sharded": True, "dtype": "F32", "shard_rule": rule}
        return json.dumps({"tensors": {"w": tensor}, "world_size": 2**20, "format_version": 2}).encode()

    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=f"tensors\\['w'\\]: .* more than {MAX_RULE_VALUES} numbers"):
            parse_metadata(doc(64), where="hostile")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert tuple(parse_metadata(doc(2), where="fine").tensors["w"].shape) == (2**20, 1)


def test_check_is_linear_in_the_rule():
    with pytest.raises(RuleError, match="more than"):
        check_rule((10**6, 10**6), {"form": "box", "cuts": [[0, 1], [1, 1]], "files": [0, [[1, 10**12, 1]]]})


def test_detect_and_expand_round_trip_colwise_tp_fsdp():
    """dp x tp = 2 x 4 mesh, both on dim 0 (FSDP2 over colwise TP): cell j = tp * 2 + dp is in
    file dp * 4 + tp: two digits."""
    shape = (16, 3)
    names, ls, go = [], [], []
    for rank in range(8):
        dp, tp = divmod(rank, 4)
        names.append(f"rank_{rank}.safetensors")
        ls.append((2, 3))
        go.append((2 * (tp * 2 + dp), 0))
    rule = detect_rule(shape, names, None, ls, go)
    assert rule == {"form": "box", "cuts": [[0, 2]], "files": [0, [[1, 2, 4], [2, 4, 1]]]}
    e_names, _, e_ls, e_go = expand_rule(shape, rule)
    assert sorted(zip(e_names, e_ls, e_go)) == sorted(zip(names, ls, go))


def test_no_rule_for_a_piece_in_two_files():
    """Two files holding the same half and none the other: no rule (each cell once)."""
    names = ["rank_0.safetensors", "rank_1.safetensors"]
    assert detect_rule((8,), names, [((0, 4),), ((0, 4),)], None, None) is None
    assert detect_rule((8,), names, [((0, 4),), ((4, 8),)], None, None) is not None


def test_no_rule_whose_file_bound_passes_the_files():
    """Files 0, 2, 3 follow terms whose bound (0 + 2 + 3) passes the last file: a reader
    checking rules against the world size would refuse it, so the list is kept."""
    from checkpointer.format.rules import detect_rule

    names = ["rank_0.safetensors", "rank_2.safetensors", "rank_3.safetensors"]
    assert detect_rule((3,), names, [((0, 1),), ((1, 2),), ((2, 3),)], None, None) is None


@settings(max_examples=400, deadline=None)
@example(10, [(1, 4, 1), (3, 2, 4), (5, 2, 8)])
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(1, 12)), max_size=3))
def test_an_accepted_rule_puts_every_piece_in_its_own_file(cells, terms):
    """Against the brute force: every piece's file computed. A rule whose digits overlap (``[[1, 4, 1],
    [3, 2, 4], [5, 2, 8]]`` over 10 pieces puts pieces 5 and 9 in one file) was accepted, and a
    load read one piece's bytes for the other."""
    rule = {"form": "flat", "cuts": [[0, 1]], "files": [0, [list(t) for t in terms]]}
    try:
        check_rule((cells,), rule)
    except RuleError:
        return
    names = expand_rule((cells,), rule)[0]
    assert len(set(names)) == cells, (rule, names)
    assert names == [f"rank_{f}.safetensors" for f in _files_by_brute_force(cells, terms)]


def _files_by_brute_force(cells: int, terms) -> list[int]:
    """Each piece's file by a flat rule's definition: for piece ``i``, the sum over its terms
    ``(every, count, step)`` of ``((i // every) % count) * step``."""
    return [sum(((i // every) % count) * step for every, count, step in terms) for i in range(cells)]


@pytest.mark.parametrize("cells, terms", [
    (8, [(1, 8, 1)]),  # Shard(0) over 8
    (8, [(1, 4, 2), (4, 2, 1)]),  # a 2 x 4 mesh, ranks in column order
    (6, [(1, 3, 1), (3, 2, 3)]),  # 3 x 2
    (5, [(1, 5, 3)]),  # every third rank
    (12, [(1, 2, 1), (2, 3, 4), (6, 2, 2)]),
])
def test_rules_of_regular_layouts_are_accepted(cells, terms):
    rule = {"form": "flat", "cuts": [[0, 1]], "files": [0, [list(t) for t in terms]]}
    check_rule((cells,), rule)
    assert expand_rule((cells,), rule)[0] == [f"rank_{f}.safetensors" for f in _files_by_brute_force(cells, terms)]


def test_the_overlapping_digits_rule_is_refused():
    with pytest.raises(RuleError):
        check_rule((10,), {"form": "flat", "cuts": [[0, 1]], "files": [0, [[1, 4, 1], [3, 2, 4], [5, 2, 8]]]})
