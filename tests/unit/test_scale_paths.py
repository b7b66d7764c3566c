"""The bulk paths that keep planning flat at 16,384 ranks, against the paths they stand in for.

* Save: :func:`planning.box_groups.box_groups` (every rank's box grouped and proven to tile the
  tensor with numpy) against a brute-force oracle and the piece-by-piece analysis
  (``plan._split``: the same pieces, holders and plan, and ``None`` wherever that one raises).
* Load: the reads of a box shard rule found from the rule (``planning.rule_reads``) against the
  reads the tile index over every file gives for the same layout: the same items, in the same
  order, for random rules, file orders and wanted pieces.
"""

from __future__ import annotations

import json
import math
from itertools import product

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.errors import CorruptCheckpointError
from checkpointer.format.layout import rank_filename
from checkpointer.format.metadata import TensorStorageMetadata
from checkpointer.format.metadata_parse import parse_metadata
from checkpointer.format.rules import detect_rule, expand_rule
from checkpointer.format.specs import Layout, ShardSpecs
from checkpointer.planning import plan as planmod
from checkpointer.planning.box_groups import box_groups
from checkpointer.planning.layouts import layout_pieces, layout_entries
from checkpointer.planning.load_plan import build_load_plan, stored_cover_exactly
from checkpointer.planning.pieces import BOX, Piece, whole


# ---------------------------------------------------------------------------------------------
# Save: box_groups
# ---------------------------------------------------------------------------------------------


@st.composite
def box_blocks(draw):
    """Every rank's box from a random mesh and placements (Shard, Replicate, _StridedShard), then
    perhaps spoiled: a box moved, resized or copied over another rank's (overlaps and gaps)."""
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    codes = []
    for _ in mesh:
        kind = draw(st.sampled_from("SSRT"))
        d = draw(st.integers(0, len(shape) - 1))
        codes.append(("R",) if kind == "R" else ("S", d) if kind == "S" else ("T", d, draw(st.integers(2, 3))))
    world = math.prod(mesh)
    entries = layout_entries([("t", shape, "F32", True, (mesh, tuple(codes)))])
    pieces = layout_pieces(entries, world)[(shape, (mesh, tuple(codes)))]
    if pieces.kind != BOX:
        block = np.array([[*shape, *(0,) * len(shape)]] * world, dtype=np.int64).T
    else:
        block = pieces.block.copy()
    spoiled = draw(st.integers(0, 2))
    for _ in range(spoiled):
        r, row = draw(st.integers(0, world - 1)), draw(st.integers(0, 2 * len(shape) - 1))
        how = draw(st.sampled_from(["set", "copy"]))
        if how == "set":
            block[row, r] = draw(st.integers(0, 8))
        else:
            block[:, r] = block[:, draw(st.integers(0, world - 1))]
    return shape, block, spoiled > 0


def _tiles_exactly(shape, boxes) -> bool:
    seen = set()
    for sizes, offset in boxes:
        if any(s < 0 or o < 0 or o + s > n for s, o, n in zip(sizes, offset, shape)):
            return False
        for idx in product(*(range(o, o + s) for o, s in zip(offset, sizes))):
            if idx in seen:
                return False
            seen.add(idx)
    return len(seen) == math.prod(shape)


@settings(max_examples=300, deadline=None)
@given(box_blocks(), st.booleans())
def test_box_groups_are_the_pieces_split_one_by_one(case, compact):
    shape, block, spoiled = case
    ndim, world = len(shape), block.shape[1]
    columns = block.T.tolist()
    pieces = [Piece.from_numbers(BOX, c) for c in columns]
    distinct, holders = planmod._distinct(list(range(world)), pieces)
    kept = [(p, by) for p, by in zip(distinct, holders) if p.numel > 0]
    groups = box_groups(shape, block)
    oracle = _tiles_exactly(shape, [(p.local_shape, p.global_offset) for p, _ in kept]) and all(
        s >= 0 for c in columns for s in c[:ndim])
    if groups is None:
        assert spoiled  # a mesh's boxes are always proven (a spoiled tiling may be beyond the grid)
    else:
        assert oracle
        assert [pieces[j] for j in groups.first.tolist()] == [p for p, _ in kept]
        assert [h.tolist() for h in groups.holders()] == [by for _, by in kept]
        assert groups.numels.tolist() == [p.numel for p, _ in kept]
    # The plan the bulk path makes is the one the piece-by-piece path makes, or that one raises.
    ranks, names = np.arange(world), [rank_filename(r) for r in range(world)]
    try:
        slow = planmod._replica_blocks("t", shape, list(range(world)), pieces) if compact else None
        slow = slow or planmod._mixed("t", shape, list(range(world)), pieces, everyone=True)
    except ValueError:
        assert groups is None
        return
    fast = planmod._grouped(shape, block, ranks, names, {}, everyone=True, compact=compact)
    if fast is None:
        assert groups is None
        return
    plans = [planmod._assign(world, ("t",), [shape], ["F32"], [True], [p], names, {}, None, compact)
             for p in (slow, fast)]
    assert plans[0].metadata.to_json_bytes() == plans[1].metadata.to_json_bytes()
    assert (plans[0].writes == plans[1].writes).all()
    assert plans[0].shared == plans[1].shared


# ---------------------------------------------------------------------------------------------
# Load: reads found from a box rule
# ---------------------------------------------------------------------------------------------


@st.composite
def box_rules(draw):
    """A random box rule: some dims cut at random chunks, the cells' digits given files in a random
    order of place values, from a random first file."""
    shape = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=3)))
    cut = sorted(draw(st.sets(st.integers(0, len(shape) - 1), max_size=len(shape))))
    cuts = [[d, draw(st.integers(1, shape[d]))] for d in cut]
    parts = [-(-shape[d] // c) for d, c in cuts]
    divs = [math.prod(parts[k + 1:]) for k in range(len(parts))]  # row-major: the last cut dim varies fastest
    order = draw(st.permutations(range(len(parts))))
    muls, place = [0] * len(parts), 1
    for k in order:
        muls[k], place = place, place * parts[k]
    first = draw(st.integers(0, 3))
    terms = [[div, n, mul] for div, n, mul in zip(divs, parts, muls) if n > 1]
    return shape, {"form": "box", "cuts": cuts, "files": [first, terms]}, first + math.prod(parts)


@st.composite
def wanted_pieces(draw, shape):
    """A box (inside the tensor, or reaching past it), flattened ranges, or the whole tensor."""
    kind = draw(st.sampled_from(["box", "box", "flat", "whole", "outside"]))
    if kind == "whole":
        return whole(shape)
    if kind == "flat":
        numel = math.prod(shape)
        cuts = sorted(draw(st.sets(st.integers(0, numel), min_size=2, max_size=6)))
        return Piece(flat=tuple(zip(cuts[0::2], cuts[1::2])) or ((0, numel),))
    offset = [draw(st.integers(0, n - 1)) for n in shape]
    sizes = [draw(st.integers(0, n - o)) for o, n in zip(offset, shape)]
    if kind == "outside":
        d = draw(st.integers(0, len(shape) - 1))
        sizes[d] = shape[d] - offset[d] + draw(st.integers(1, 3))
    return Piece(local_shape=tuple(sizes), global_offset=tuple(offset))


def _plan_or_error(key, meta, wanted):
    try:
        return build_load_plan(key, meta, wanted)
    except CorruptCheckpointError as ex:
        return str(ex)


@settings(max_examples=300, deadline=None)
@given(box_rules(), st.data())
def test_rule_reads_are_the_tile_index_reads(case, data):
    shape, rule, world = case
    doc = {"tensors": {"t": {"shape": list(shape), "is_sharded": True, "dtype": "F32", "shard_rule": rule}},
           "world_size": world, "format_version": 2}
    read = parse_metadata(json.dumps(doc).encode(), where="rule").tensors["t"]
    layout = read.shard_spec_per_file.layout  # in cell order, as read
    by_file = sorted(range(len(layout.names)), key=lambda i: int(layout.names[i][5:-12]))
    ranked = Layout(shape, [layout.names[i] for i in by_file], None, [layout.local_shape[i] for i in by_file],
                    [layout.global_offset[i] for i in by_file])  # in file order, as a save plans it
    for lay in (layout, ranked):
        with_rule, listed = (
            TensorStorageMetadata.model_construct(
                shape=shape, is_sharded=True, dtype="F32", shard_spec_per_file=ShardSpecs(lay, rule=r))
            for r in (rule, None))
        assert stored_cover_exactly(with_rule) and stored_cover_exactly(listed)
        for _ in range(4):
            wanted = data.draw(wanted_pieces(shape))
            assert _plan_or_error("t", with_rule, wanted) == _plan_or_error("t", listed, wanted)


def test_rule_reads_touch_only_the_files_they_read():
    """16,384 files of a TP x FSDP layout: one rank's box meets a handful, and planning its reads
    builds nothing per file (the layout's name index stays unmade)."""
    shape = (8192, 28672)
    rule = {"form": "box", "cuts": [[0, 4], [1, 3584]], "files": [0, [[1, 8, 1], [8, 2048, 8]]]}
    doc = {"tensors": {"t": {"shape": list(shape), "is_sharded": True, "dtype": "F32", "shard_rule": rule}},
           "world_size": 16384, "format_version": 2}
    meta = parse_metadata(json.dumps(doc).encode(), where="rule").tensors["t"]
    plan = build_load_plan("t", meta, Piece(local_shape=(6, 4779), global_offset=(10, 4779)))
    assert plan.files == ["rank_17.safetensors", "rank_18.safetensors", "rank_25.safetensors",
                          "rank_26.safetensors"]
    layout = meta.shard_spec_per_file.layout
    assert "tile_index" not in layout.memo and "source_index" not in layout.memo
    assert plan.numel == 6 * 4779



@settings(max_examples=200, deadline=None)
@given(box_blocks())
def test_a_detected_rule_expands_to_the_columns(case):
    """``detect_rule`` checks its rule in bulk, not by expanding it: what it finds expands back to
    exactly the columns it was given, and the ranks the planner vouches for change nothing."""
    shape, block, _ = case
    groups = box_groups(shape, block)
    if groups is None:
        return
    ndim = len(shape)
    ranks = groups.first.tolist()
    names = [rank_filename(r) for r in ranks]
    kept = block[:, groups.first].T.tolist()
    ls, go = [tuple(v[:ndim]) for v in kept], [tuple(v[ndim:]) for v in kept]
    rule = detect_rule(shape, names, None, ls, go)
    assert detect_rule(shape, names, None, ls, go, ranks=ranks) == rule
    if rule is not None:
        e_names, _, e_ls, e_go = expand_rule(shape, rule)
        assert sorted(zip(e_names, e_ls, e_go)) == sorted(zip(names, ls, go))
