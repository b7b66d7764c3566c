"""Replicas agree before a commit, in one process: which copies each rank hashes
(``SavePlan.copies_for``), that a copy hashes to exactly what the writer computes, and what
rank 0 says when they differ (``rankfile.check_copies``). The multi-process saves are in
tests/dist/test_dist_replicas.py."""

from __future__ import annotations


import pytest
import torch

from checkpointer import CheckpointError, ReplicaMismatchError
from checkpointer.checksums import CHUNK_BYTES
from checkpointer.engine import rankfile
from checkpointer.engine.rankfile import hash_pieces, write_rank_file
from checkpointer.planning.plan import Piece, PieceDesc, build_save_plan
from checkpointer.sharding import describe
from checkpointer.storage.memory import MemoryStorage


def _box(shape, dim, lo, hi) -> Piece:
    local, offset = list(shape), [0] * len(shape)
    local[dim], offset[dim] = hi - lo, lo
    return Piece(local_shape=tuple(local), global_offset=tuple(offset))


def _rows(shape, world) -> list[Piece]:
    c = -(-shape[0] // world)
    return [_box(shape, 0, min(r * c, shape[0]), min((r + 1) * c, shape[0])) for r in range(world)]


def _check_copies(per_rank: list[dict[str, Piece]], world: int) -> list[dict[str, int]]:
    """Plan the save; every rank's non-empty piece is either written by it or a copy of exactly
    the piece another rank writes. Returns each rank's copies."""
    shapes = {}
    for pieces in per_rank:
        for key, piece in pieces.items():
            shapes[key] = SHAPES[key]
    descs = [[PieceDesc(k, shapes[k], "F32", True, p) for k, p in pieces.items()] for pieces in per_rank]
    plan = build_save_plan(descs)
    out = []
    for rank in range(world):
        copies = plan.copies_for(rank, per_rank[rank])
        written = set(plan.keys_for(rank))
        for key, piece in per_rank[rank].items():
            if not piece.numel:
                assert key not in copies, (rank, key)
                continue
            assert (key in written) != (key in copies), (rank, key, written, copies)
            if key in copies:
                writer = copies[key]
                assert writer != rank and key in plan.keys_for(writer), (rank, key, writer)
                assert per_rank[writer][key] == piece, (rank, key, writer)
        out.append(copies)
    return out


SHAPES = {"r": (5, 3), "s": (8, 2), "tiny": (1, 4), "m": (6, 4), "e": (0, 3)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_replicated_and_sharded(world):
    per_rank = [{"r": Piece.whole(SHAPES["r"]), "s": _rows(SHAPES["s"], world)[r],
                 "tiny": _rows(SHAPES["tiny"], world)[r], "e": Piece.whole(SHAPES["e"])} for r in range(world)]
    copies = _check_copies(per_rank, world)
    assert sum(len(c) for c in copies) == world - 1  # "r": every rank but its writer; "e" is empty
    assert all(set(c) <= {"r"} for c in copies)


def test_hsdp_each_shard_copied_within_its_replica_group():
    world, shards = 4, 2  # (Replicate, Shard(0)): rank i*2 + j holds shard j
    per = _rows(SHAPES["m"], shards)
    per_rank = [{"m": per[r % shards], "r": Piece.whole(SHAPES["r"])} for r in range(world)]
    copies = _check_copies(per_rank, world)
    holders_of_copies = [r for r, c in enumerate(copies) if "m" in c]
    assert len(holders_of_copies) == 2 and {r % shards for r in holders_of_copies} == {0, 1}


def test_ranks_holding_different_keys():
    # Rank 2 lacks "r"; ranks 0 and 1 hold one piece of "m" each, rank 2 the other half alone.
    half = _rows(SHAPES["m"], 2)
    per_rank = [
        {"r": Piece.whole(SHAPES["r"]), "m": half[0]},
        {"r": Piece.whole(SHAPES["r"]), "m": half[0]},
        {"m": half[1], "s": Piece.whole(SHAPES["s"])},
    ]
    copies = _check_copies(per_rank, 3)
    assert sorted(k for c in copies for k in c) == ["m", "r"]
    assert copies[2] == {}


def test_hashing_a_copy_gives_the_writers_checksums():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "big": torch.randn(CHUNK_BYTES // 4 + 1000, generator=g),  # two chunks
        "T": torch.randn(300, 700, generator=g).t(),  # not contiguous: staged
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "flag": torch.tensor([True, False, True]),
    }
    written = write_rank_file(MemoryStorage("copies"), "rank_0.safetensors",
                              [(k, describe(v)) for k, v in tensors.items()])
    assert hash_pieces(list(tensors.values())) == [written[k] for k in tensors]
    assert hash_pieces(list(tensors.values()), threads=3) == [written[k] for k in tensors]
    assert len(written["big"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hashing_a_copy_on_the_gpu_gives_the_checksums_of_its_bytes(monkeypatch):
    monkeypatch.setenv("CHECKPOINTER_STAGING_MIB", "1")  # several blocks through pinned staging
    g = torch.Generator().manual_seed(1)
    host = [torch.randn(CHUNK_BYTES // 4 + 12345, generator=g), torch.randn(700, 300, generator=g)]
    on_gpu = [host[0].cuda(), host[1].cuda().t()]
    assert hash_pieces(on_gpu) == hash_pieces([host[0], host[1].t().contiguous()])


def _status(crcs=None, copies=None) -> dict:
    return {"ok": True, "crcs": crcs or {}, "id": None, "copies": copies or []}


def test_agreeing_copies_pass():
    rankfile.check_copies([_status({"w": [1, 2]}), _status(copies=[["w", 0, [1, 2]]])])


def test_a_differing_copy_names_the_key_and_ranks():
    statuses = [
        _status({"w": [1, 2]}),
        _status(copies=[["w", 0, [1, 2]]]),
        _status({"x": [5]}, copies=[["w", 0, [1, 9]]]),
    ]
    with pytest.raises(ReplicaMismatchError) as info:
        rankfile.check_copies(statuses)
    msg = str(info.value)
    assert isinstance(info.value, CheckpointError)
    assert "'w'" in msg and "ranks 0, 1 (rank 0's copy was written) / rank 2" in msg
    assert f"byte {CHUNK_BYTES}" in msg and "not committed" in msg and rankfile.VERIFY_ENV in msg


def test_many_differing_tensors_are_counted():
    n = 9
    statuses = [_status({f"k{i}": [i] for i in range(n)}), _status(copies=[[f"k{i}", 0, [-1]] for i in range(n)])]
    with pytest.raises(ReplicaMismatchError, match=f"and {n - 5} more"):
        rankfile.check_copies(statuses)


def test_turned_off(monkeypatch):
    piece = describe(torch.ones(3))
    monkeypatch.setenv(rankfile.VERIFY_ENV, "0")
    assert not rankfile.replica_check_enabled()
    assert rankfile.start_hashing({"w": 0}, {"w": piece}).result() == []
    monkeypatch.delenv(rankfile.VERIFY_ENV)
    assert rankfile.replica_check_enabled()
    (entry,) = rankfile.start_hashing({"w": 0}, {"w": piece}).result()
    assert entry[:2] == ["w", 0] and entry[2] == hash_pieces([torch.ones(3)])[0]
