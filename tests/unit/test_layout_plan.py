"""The first save's plan from layouts every rank shares (planning/layouts.py) against the plan
from every rank's exchanged pieces (build_save_plan), for random meshes, placements and shapes:
the same metadata, the same writer for every piece, the same copies."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings, strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from checkpointer.planning.layouts import describe_layouts, plan_from_layouts
from checkpointer.planning.pieces import PieceDesc, RankPieces
from checkpointer.planning.plan import build_save_plan
from checkpointer.sharding import dtensor_box, dtensor_index_runs, runs_piece
from checkpointer.planning.pieces import Piece


def _torch_placement(code):
    if code[0] == "S":
        return Shard(code[1])
    if code[0] == "R":
        return Replicate()
    return _StridedShard(code[1], split_factor=code[2])


def _piece(shape, layout, rank):
    """What ``sharding.describe`` gives ``rank``, from torch's own placement objects."""
    if layout == ():
        return Piece.whole(shape)
    mesh, codes = layout
    coord = [int(c) for c in np.unravel_index(rank, mesh)]
    placements = [_torch_placement(c) for c in codes]
    if all(c[0] in "SR" for c in codes):
        sizes, offsets = dtensor_box(shape, placements, mesh, coord)
        return Piece(local_shape=sizes, global_offset=offsets)
    return runs_piece(shape, dtensor_index_runs(shape, placements, mesh, coord))


@st.composite
def _cases(draw):
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    tensors = []
    for i in range(draw(st.integers(1, 5))):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        if not shape or draw(st.integers(0, 5)) == 0:
            tensors.append((f"t{i}", shape, ()))
            continue
        codes = []
        for _ in mesh:
            kind = draw(st.sampled_from("SRT"))
            d = draw(st.integers(0, len(shape) - 1))
            codes.append(("R",) if kind == "R" else ("S", d) if kind == "S" else ("T", d, draw(st.integers(2, 3))))
        tensors.append((f"t{i}", shape, (mesh, tuple(codes))))
        if draw(st.booleans()):  # a second tensor of the same class (layers of a model)
            tensors.append((f"u{i}", shape, (mesh, tuple(codes))))
    return mesh, tensors


@settings(max_examples=150, deadline=None)
@given(_cases(), st.booleans())
def test_plan_from_layouts_is_the_exchanged_plan(case, compact):
    mesh, tensors = case
    world = math.prod(mesh)
    items = [(key, shape, "F32", layout != (), layout) for key, shape, layout in tensors]
    per_rank = [{key: _piece(shape, layout, r) for key, shape, layout in tensors} for r in range(world)]
    described = [describe_layouts(items, per_rank[r], {}, world=world, rank=r, form="x") for r in range(world)]
    assert all(d is not None for d in described)
    assert len({d.digest for d in described}) == 1
    full = build_save_plan(
        [RankPieces.from_descs([PieceDesc(k, s, "F32", lay != (), per_rank[r][k]) for k, s, lay in tensors])
         for r in range(world)], compact=compact)
    d = described[0]
    fast = plan_from_layouts(d.entries, d.classes, world, compact=compact)
    assert fast.metadata.to_json_bytes() == full.metadata.to_json_bytes()
    assert fast.keys == full.keys
    assert (fast.writes == full.writes).all()
    assert fast.shared == full.shared
    for r in range(world):
        assert fast.copies_for(r, per_rank[r]) == full.copies_for(r, per_rank[r])


def test_layouts_refused_when_they_do_not_describe_the_ranks():
    items = [("w", (8, 4), "F32", True, ((2, 2), (("S", 0), ("R",))))]
    own = {"w": Piece(local_shape=(4, 4), global_offset=(0, 0))}
    assert describe_layouts(items, own, {}, world=4, rank=0, form="x") is not None
    assert describe_layouts(items, own, {}, world=8, rank=0, form="x") is None  # the mesh is not every rank
    assert describe_layouts(items, own, {}, world=4, rank=2, form="x") is None  # not this rank's piece
    assert describe_layouts([("w", (8, 4), "F32", True, None)], own, {}, world=4, rank=0, form="x") is None
    other = describe_layouts(items, own, {"v": "w"}, world=4, rank=0, form="x")
    assert other.digest != describe_layouts(items, own, {}, world=4, rank=0, form="x").digest


def test_the_digest_covers_everything_the_ranks_must_agree_on():
    """Ranks agree on a plan from layouts by this digest alone: a field left out of it (the dtype
    was, under a mutation that no test caught) would let ranks that differ in it save one plan."""
    from checkpointer.planning.layouts import LayoutEntry, description_digest

    layout = (((2,), (("shard", 0),)),)
    entry = LayoutEntry("w", (4, 6), "F32", True, layout)
    base = description_digest([entry], {}, 2, "compact")
    changed = [
        [LayoutEntry("v", (4, 6), "F32", True, layout)],
        [LayoutEntry("w", (4, 7), "F32", True, layout)],
        [LayoutEntry("w", (4, 6), "BF16", True, layout)],
        [LayoutEntry("w", (4, 6), "F32", False, layout)],
        [LayoutEntry("w", (4, 6), "F32", True, (((2,), (("shard", 1),)),))],
    ]
    digests = {description_digest(entries, {}, 2, "compact") for entries in changed}
    digests |= {description_digest([entry], {"v": "w"}, 2, "compact"), description_digest([entry], {}, 3, "compact"),
                description_digest([entry], {}, 2, "verbose")}
    assert base not in digests and len(digests) == len(changed) + 3


def test_distinct_empty_tensors_are_not_aliases(tmp_path):
    """Empty tensors share the address 0: taking them for one tensor's names (found by mutation)
    would store one and alias the other, and a load into a model whose empty buffers are separate
    would see keys it did not save."""
    import torch

    from checkpointer import Checkpointer
    from checkpointer.format.metadata_parse import parse_metadata

    state = {"a": torch.zeros(0, 3), "b": torch.zeros(0, 3), "c": torch.ones(2)}
    Checkpointer().save(str(tmp_path / "ckpt"), state)
    metadata = parse_metadata((tmp_path / "ckpt" / "metadata.json").read_bytes(), where="m")
    assert not metadata.aliases and sorted(metadata.tensors) == ["a", "b", "c"]
    loaded = {"a": torch.full((0, 3), 1.0), "b": torch.full((0, 3), 1.0), "c": torch.zeros(2)}
    Checkpointer().load(str(tmp_path / "ckpt"), loaded)
    assert torch.equal(loaded["c"], torch.ones(2))
