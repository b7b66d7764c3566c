"""Pieces as columns: the lossless conversion, the bulk save plan against the per-tensor one,
and the bytes the engine sends rank 0."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from checkpointer.planning.pieces import parse_pieces as _parse_pieces, pieces_payload as _pieces_payload
from checkpointer.errors import CheckpointError
from checkpointer.planning.pieces import BOX, Piece, PieceDesc, RankPieces, Structure
from checkpointer.planning.plan import _plan_general, _plan_uniform, build_save_plan

from test_plan import box, chunk_bounds, flat_split_pieces, round_robin_pieces, shard2d_pieces, shard_pieces, topology


@st.composite
def a_piece(draw):
    if draw(st.booleans()):
        ndim = draw(st.integers(0, 4))
        ints = st.lists(st.integers(0, 2**40), min_size=ndim, max_size=ndim)
        return Piece(local_shape=tuple(draw(ints)), global_offset=tuple(draw(ints)))
    ranges = draw(st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), max_size=5))
    return Piece(flat=tuple(ranges))


@settings(max_examples=200, deadline=None)
@given(st.lists(a_piece(), max_size=8))
def test_columns_hold_exactly_the_descriptions(pieces):
    descs = [
        PieceDesc(f"k{i}", tuple([3] * len(p.local_shape or ())), "F32", i % 2 == 0, p) for i, p in enumerate(pieces)
    ]
    columns = RankPieces.from_descs(descs)
    assert columns.descs() == descs
    assert columns.structure.width == len(columns.values)
    again = Structure.from_json_bytes(columns.structure.json_bytes)
    assert again == columns.structure and again.digest == columns.structure.digest
    assert [again.span(i) for i in range(len(descs))] == [columns.structure.span(i) for i in range(len(descs))]


def test_a_rank_pieces_array_must_match_its_structure():
    structure = Structure(["w"], [(4, 2)], ["F32"], [True], [BOX])
    RankPieces(structure, np.array([2, 2, 0, 0], dtype=np.int64))
    with pytest.raises(ValueError, match="4 int64 values"):
        RankPieces(structure, np.array([2, 2, 0], dtype=np.int64))
    with pytest.raises(ValueError):
        Structure(["w"], [(4, 2)], ["F32"], [True], [-2])


@st.composite
def uniform_state(draw):
    """Every rank holds every key (an FSDP model): a few tensors, each sharded some way."""
    world = draw(st.integers(1, 6))
    tensors = []
    for i in range(draw(st.integers(1, 5))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
        pieces, sharded = draw(topology(shape, world))
        tensors.append((f"t{i}", shape, pieces, sharded))
        if draw(st.booleans()):  # a layer of the same shape, sharded alike
            tensors.append((f"t{i}.again", shape, pieces, sharded))
    dtype = draw(st.sampled_from(["F32", "BF16", "I64"]))
    return [[PieceDesc(k, s, dtype, sh, p[r]) for k, s, p, sh in tensors] for r in range(world)]


def same_plan(a, b) -> None:
    assert a.metadata.to_json_bytes() == b.metadata.to_json_bytes()
    assert a.keys_per_rank == b.keys_per_rank


@settings(max_examples=300, deadline=None)
@given(uniform_state())
def test_bulk_plan_equals_the_per_tensor_plan(descs_per_rank):
    """The columns' plan (tensors of equal pieces analysed once) decides as the general one."""
    columns = [RankPieces.from_descs(d) for d in descs_per_rank]
    assume(all(c.structure == columns[0].structure for c in columns))  # else the pieces' kinds differ
    errors = []
    plans = []
    for plan in (
        lambda: _plan_uniform(columns[0].structure, np.stack([c.values for c in columns]), None),
        lambda: _plan_general(descs_per_rank, None),
    ):
        try:
            plans.append(plan())
        except ValueError as ex:
            errors.append(str(ex))
    assert len(errors) in (0, 2), errors
    if plans:
        same_plan(*plans)
        assert build_save_plan(descs_per_rank).metadata == plans[0].metadata


def test_bulk_plan_of_common_layouts():
    """Shard(0) with ranks past the rows, flat ranges, a 2-D mesh, replicated scalars."""
    world = 4
    tensors = {
        "rows": ((6, 3), shard_pieces((6, 3), 0, world)),  # torch.chunk: rank 3 holds nothing
        "cols": ((5, 8), shard_pieces((5, 8), 1, world)),
        "flat": ((10,), flat_split_pieces(10, [2, 2, 7])),  # rank 1 holds an empty range
        "robin": ((11,), round_robin_pieces(11, world, 2)),
        "mesh": ((4, 6), shard2d_pieces((4, 6), 0, 1, 2, 2)),
        "step": ((), [Piece(local_shape=(), global_offset=())] * world),
    }
    descs = [[PieceDesc(k, s, "F32", k != "step", p[r]) for k, (s, p) in tensors.items()] for r in range(world)]
    plan = build_save_plan(descs)
    same_plan(plan, _plan_general(descs, None))
    specs = plan.metadata.tensors["rows"].shard_spec_per_file
    assert sorted(specs) == ["rank_0.safetensors", "rank_1.safetensors", "rank_2.safetensors"]
    assert specs["rank_2.safetensors"].global_offset == (4, 0)
    assert "rank_1.safetensors" not in plan.metadata.tensors["flat"].shard_spec_per_file
    assert sum("step" in keys for keys in plan.keys_per_rank) == 1


def test_ranks_holding_the_same_keys_take_the_bulk_path(monkeypatch):
    """The engine's usual input (every rank describes the same keys) never goes tensor by tensor."""
    import checkpointer.planning.plan as plan_module

    def refuse(*args, **kwargs):
        raise AssertionError("uniform ranks were planned tensor by tensor")

    monkeypatch.setattr(plan_module, "_plan_general", refuse)
    world = 4
    descs = [[PieceDesc(f"layer{i}", (8, 3), "F32", True, shard_pieces((8, 3), 0, world)[r]) for i in range(3)]
             for r in range(world)]
    plan = build_save_plan([RankPieces.from_descs(d) for d in descs])
    assert plan.keys_per_rank == (("layer0", "layer1", "layer2"),) * world
    layouts = {id(m.shard_spec_per_file.layout) for m in plan.metadata.tensors.values()}
    assert len(layouts) == 1  # equal layers share one layout


def test_bulk_plan_refuses_pieces_that_overlap_or_leave_gaps():
    world = 3
    bounds = chunk_bounds(9, world)
    overlapping = [box((9, 2), {0: (lo, min(hi + 1, 9))}) for lo, hi in bounds]
    half = [box((9, 2), {0: (0, 4)})] * world  # the same rows everywhere: rows 4-8 are in no file
    for pieces, what in ((overlapping, "overlap"), (half, "leave elements")):
        descs = [[PieceDesc("w", (9, 2), "F32", True, pieces[r])] for r in range(world)]
        with pytest.raises(ValueError, match=what) as caught:
            build_save_plan(descs)
        assert "'w'" in str(caught.value)


def test_ranks_holding_different_keys_take_the_general_path():
    descs = [
        [PieceDesc("shared", (4,), "F32", True, Piece(flat=((0, 2),))), PieceDesc("stage0", (3,), "F32", False, Piece.whole((3,)))],
        [PieceDesc("shared", (4,), "F32", True, Piece(flat=((2, 4),))), PieceDesc("stage1", (5,), "F32", False, Piece.whole((5,)))],
    ]
    plan = build_save_plan(descs)
    assert plan.keys_per_rank == (("shared", "stage0"), ("shared", "stage1"))


def test_payload_round_trip_and_structure_only_when_sent():
    ours = RankPieces.from_descs([PieceDesc("w", (4, 2), "F32", True, Piece(local_shape=(2, 2), global_offset=(2, 0)))])
    other = RankPieces.from_descs([PieceDesc("v", (3,), "BF16", False, Piece.whole((3,)))])
    named = _pieces_payload(ours, {"tied": "w"}, with_structure=False)
    assert b'"structure"' not in named
    known = {ours.structure.digest: ours.structure}
    parsed, aliases, _ = _parse_pieces(named, known)
    assert parsed.structure is ours.structure and parsed.values.tolist() == [2, 2, 2, 0] and aliases == {"tied": "w"}
    differs = _parse_pieces(_pieces_payload(other, {}, with_structure=True), known)[0]
    assert differs.structure == other.structure and differs.descs() == other.descs()
    again = _parse_pieces(_pieces_payload(other, {}, with_structure=False), known)[0]
    assert again.structure is differs.structure  # decoded once, then named by its digest
    with pytest.raises(CheckpointError, match="no rank sent"):
        _parse_pieces(_pieces_payload(other, {}, with_structure=False), {})


def test_a_payload_with_a_negative_number_is_refused():
    """Sizes, offsets and flattened bounds are never negative: such a piece is no piece, and the
    tiling proofs must not see it (a negative box once passed as covering nothing)."""
    bad = RankPieces.from_descs([PieceDesc("w", (4, 4), "F32", True, Piece(local_shape=(4, -2), global_offset=(0, 0)))])
    with pytest.raises(CheckpointError, match="negative size or offset"):
        _parse_pieces(_pieces_payload(bad, {}, with_structure=True), {})


def test_payload_is_never_taken_for_an_error_report():
    """A header whose length starts with the byte of ``{`` is still a rank's pieces."""
    ours = RankPieces.from_descs([PieceDesc("w", (2,), "F32", False, Piece.whole((2,)))])
    for n in range(300):
        payload = _pieces_payload(ours, {"a" * n: "w"}, with_structure=False)
        if payload[1:2] == b"{":
            break
    else:
        pytest.fail("no header length ending in 0x7b")
    assert payload[:1] == b"P"
    assert json.loads(payload[9 : 9 + int.from_bytes(payload[1:9], "little")])["aliases"] == {"a" * n: "w"}


class _CountedRanges(tuple):
    """Ranges that count how often they are walked and hashed."""

    walks = hashes = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()

    def __hash__(self):
        type(self).hashes += 1
        return super().__hash__()


def test_a_piece_counts_its_elements_once():
    """A _StridedShard piece of 2,048 ranges summed them on every ``numel`` (143 ms of a load of
    64 such tensors); counted once now, and equality, hashing and ``replace`` ignore the count."""
    from dataclasses import replace

    _CountedRanges.walks = 0
    piece = Piece(flat=_CountedRanges(((0, 2), (4, 7))))
    assert piece.numel == 5 and piece.numel == 5 and _CountedRanges.walks == 1
    assert piece == Piece(flat=((0, 2), (4, 7))) and hash(piece) == hash(Piece(flat=((0, 2), (4, 7))))
    assert replace(piece, flat=((0, 1),)).numel == 1


def test_a_piece_hashes_its_ranges_once():
    """A _StridedShard piece's 2,048 ranges took 48 us to hash, and a load hashes each tensor's
    piece three times (the alias check twice, the layout's remembered plans once); one
    ``Piece`` object is shared by every tensor of a layout, so its hash is computed once."""
    from dataclasses import replace

    _CountedRanges.hashes = 0
    piece = Piece(flat=_CountedRanges(((0, 2), (4, 7))))
    seen = {piece: "w"}
    assert hash(piece) == hash(piece) and seen[piece] == "w" and _CountedRanges.hashes == 1
    assert hash(piece) == hash(Piece(flat=((0, 2), (4, 7)))) and piece == Piece(flat=((0, 2), (4, 7)))
    assert hash(replace(piece, flat=((0, 1),))) == hash(Piece(flat=((0, 1),)))
    with pytest.raises(TypeError):
        hash(Piece(flat=[[0, 1]]))  # ranges given as lists: not a key, as before


def test_a_pickled_piece_leaves_its_hash_behind():
    """The hash is remembered, not sent: on Python 3.11 a hash of ``None`` (every piece holds one)
    differs between processes, so a piece unpickled elsewhere must hash there afresh."""
    import pickle

    for piece in (Piece(local_shape=(4, 8), global_offset=(0, 8)), Piece(flat=((0, 2), (4, 7)))):
        hash(piece)
        copy = pickle.loads(pickle.dumps(piece))
        assert copy._hash is None and copy == piece and hash(copy) == hash(piece) and copy.numel == piece.numel
