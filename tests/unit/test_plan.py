"""build_save_plan + build_load_plan, simulating every rank in one process.

The full tensor holds ``arange(numel)``. A saving rank's file holds its local piece, computed
by slicing the full tensor (independently of ``box_ranges``); a loading rank executes the
``ReadItem`` s of its plan against those simulated files and must end with exactly the
elements slicing gives, each written once.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.errors import CorruptCheckpointError
from checkpointer.format.dtypes import itemsize
from checkpointer.format.layout import rank_filename
from checkpointer.format.metadata_parse import parse_metadata
from checkpointer.planning.plan import Piece, PieceDesc, build_save_plan
from checkpointer.planning.load_plan import build_load_plan
from checkpointer.planning.pieces import piece_ranges

# ---------------------------------------------------------------------------------------------
# Topologies: the piece each rank holds
# ---------------------------------------------------------------------------------------------


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk / DTensor Shard semantics: chunks of ceil(n/k), trailing ranks may be empty."""
    c = -(-n // k)
    return [(min(r * c, n), min((r + 1) * c, n)) for r in range(k)]


def box(shape, bounds_per_dim: dict[int, tuple[int, int]]) -> Piece:
    local = list(shape)
    offset = [0] * len(shape)
    for d, (lo, hi) in bounds_per_dim.items():
        local[d], offset[d] = hi - lo, lo
    return Piece(local_shape=tuple(local), global_offset=tuple(offset))


def shard_pieces(shape, dim: int, world: int) -> list[Piece]:
    """Shard(dim) over ``world`` ranks."""
    return [box(shape, {dim: b}) for b in chunk_bounds(shape[dim], world)]


def mesh_pieces(shape, dim: int, replicas: int, shards: int) -> list[Piece]:
    """A (Replicate, Shard(dim)) mesh: rank i*shards + j holds shard j."""
    per = shard_pieces(shape, dim, shards)
    return [per[j] for _ in range(replicas) for j in range(shards)]


def shard2d_pieces(shape, d0: int, d1: int, w0: int, w1: int) -> list[Piece]:
    """A (Shard(d0), Shard(d1)) mesh (TP + FSDP): rank i*w1 + j."""
    b0, b1 = chunk_bounds(shape[d0], w0), chunk_bounds(shape[d1], w1)
    return [box(shape, {d0: b0[i], d1: b1[j]}) for i in range(w0) for j in range(w1)]


def flat_split_pieces(numel: int, cuts: list[int]) -> list[Piece]:
    """Contiguous flat pieces [bounds[r], bounds[r+1]) (FSDP1 / ShardedFlatTensor style)."""
    bounds = [0, *sorted(cuts), numel]
    return [Piece(flat=((bounds[r], bounds[r + 1]),)) for r in range(len(bounds) - 1)]


def round_robin_pieces(numel: int, world: int, block: int) -> list[Piece]:
    """Flat pieces of several ranges each: blocks r, r + world, r + 2*world, ..."""
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for b, start in enumerate(range(0, numel, block)):
        ranges[b % world].append((start, min(start + block, numel)))
    return [Piece(flat=tuple(r)) for r in ranges]


def replicated_pieces(shape, world: int) -> list[Piece]:
    return [Piece.whole(shape)] * world


KINDS = ["shard0", "shard1", "flat", "flat_rr", "replicated"]


def named_topology(kind: str, shape, world: int) -> tuple[list[Piece], bool] | None:
    numel = math.prod(shape)
    if kind == "shard0":
        return (shard_pieces(shape, 0, world), True) if len(shape) >= 1 else None
    if kind == "shard1":
        return (shard_pieces(shape, 1, world), True) if len(shape) >= 2 else None
    if kind == "flat":
        cuts = [b for _, b in chunk_bounds(numel, world)][:-1]
        return flat_split_pieces(numel, cuts), True
    if kind == "flat_rr":
        return round_robin_pieces(numel, world, 2), True
    if kind == "replicated":
        return replicated_pieces(shape, world), False
    if kind == "mesh":  # 2 x (world // 2), Replicate x Shard(0)
        if len(shape) < 1 or world % 2:
            return None
        return mesh_pieces(shape, 0, 2, world // 2), True
    raise AssertionError(kind)


SHAPES = [(10, 7), (3, 5), (16,), (9, 4, 3), (0, 5), (), (1,), (5, 0, 2), (2, 3, 4, 5)]

# ---------------------------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------------------------


def full_tensor(shape) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.int64)


def extract(shape, piece: Piece) -> torch.Tensor:
    """What a local tensor holding ``piece`` contains, flattened (the oracle: plain slicing)."""
    full = full_tensor(shape)
    if piece.flat is not None:
        return torch.cat([full[s:e] for s, e in piece.flat]) if piece.flat else full[:0]
    idx = tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.local_shape))
    return full.reshape(shape)[idx].reshape(-1)


def from_ranges(shape, ranges) -> torch.Tensor:
    full = full_tensor(shape)
    return torch.cat([full[s:e] for s, e in ranges]) if ranges else full[:0]


Tensors = dict[str, tuple[tuple[int, ...], list[Piece | None], bool]]


def simulate_save(tensors: Tensors, world: int, dtype: str = "F32"):
    """Plan the save; return the plan, the metadata as a loader parses it, and the files' pieces."""
    descs = [
        [
            PieceDesc(key, shape, dtype, sharded, pieces[r])
            for key, (shape, pieces, sharded) in tensors.items()
            if pieces[r] is not None
        ]
        for r in range(world)
    ]
    plan = build_save_plan(descs)
    assert len(plan.keys_per_rank) == world
    assert plan.metadata.world_size == world
    assert sorted(plan.metadata.tensors) == sorted(tensors)

    files: dict[tuple[str, str], torch.Tensor] = {}
    for rank, keys in enumerate(plan.keys_per_rank):
        name = rank_filename(rank)
        assert len(set(keys)) == len(keys)
        for key in keys:
            shape, pieces, _ = tensors[key]
            piece = pieces[rank]
            assert piece is not None, f"rank {rank} writes {key!r}, which it does not hold"
            spec = plan.metadata.tensors[key].shard_spec_per_file[name]
            assert spec == piece.to_spec()
            data = extract(shape, piece)
            # What the writer streams (piece_ranges) is what the local tensor holds.
            assert torch.equal(from_ranges(shape, piece_ranges(piece, shape)), data)
            assert spec.local_numel == data.numel()
            files[(name, key)] = data
    for key, meta in plan.metadata.tensors.items():
        writers = {rank_filename(r) for r, keys in enumerate(plan.keys_per_rank) if key in keys}
        assert set(meta.shard_spec_per_file) == writers
        shape, pieces, sharded = tensors[key]
        assert meta.shape == tuple(shape) and meta.dtype == dtype and meta.is_sharded == sharded

    # The loader sees the metadata through JSON, validated.
    metadata = parse_metadata(plan.metadata.to_json_bytes(), where="simulated/metadata.json")
    assert metadata == plan.metadata
    return plan, metadata, files


def simulate_load(metadata, files, key: str, piece: Piece) -> None:
    meta = metadata.tensors[key]
    shape = meta.shape
    lp = build_load_plan(key, meta, piece)
    assert lp.key == key and lp.dtype == meta.dtype
    n = piece.numel
    dest = torch.full((n,), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    for item in lp.items:
        assert item.numel > 0
        src = files[(item.file, key)].contiguous()  # as the rank file holds it
        assert 0 <= item.src_offset and item.src_end <= src.numel()
        if item.sizes:  # a strided box on both sides
            assert math.prod(item.sizes) == item.numel
            dst_view = dest.as_strided(item.sizes, item.dst_strides, item.dst_offset)
            assert item.dst_offset + sum((z - 1) * s for z, s in zip(item.sizes, item.dst_strides)) < n
            dst_view.copy_(src.as_strided(item.sizes, item.src_strides, src.storage_offset() + item.src_offset))
            count.as_strided(item.sizes, item.dst_strides, item.dst_offset).add_(1)
            continue
        assert 0 <= item.dst_offset and item.dst_offset + item.numel <= n
        dest[item.dst_offset : item.dst_offset + item.numel] = src[item.src_offset : item.src_offset + item.numel]
        count[item.dst_offset : item.dst_offset + item.numel] += 1
    assert lp.numel == n
    assert torch.equal(count, torch.ones(n, dtype=torch.int64)), f"{key}: elements written {count.tolist()}"
    assert torch.equal(dest, extract(shape, piece)), f"{key}: loaded {dest.tolist()}"


def roundtrip(save: Tensors, save_ws: int, load: dict[str, list[Piece]]) -> None:
    _, metadata, files = simulate_save(save, save_ws)
    for key, pieces in load.items():
        for piece in pieces:
            simulate_load(metadata, files, key, piece)


# ---------------------------------------------------------------------------------------------
# Helper sanity: chunk_bounds is torch.chunk
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 3, 7, 8, 10, 17])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_chunk_bounds_is_torch_chunk(n, k):
    chunks = torch.arange(n).chunk(k) if n else ()
    sizes = [c.numel() for c in chunks] + [0] * (k - len(chunks))
    assert [hi - lo for lo, hi in chunk_bounds(n, k)] == sizes
    assert sum(sizes) == n


# ---------------------------------------------------------------------------------------------
# Save world size -> load world size, every pair of topologies
# ---------------------------------------------------------------------------------------------

WS_PAIRS = [(8, 4), (4, 3), (1, 4), (1, 7), (4, 1), (8, 1), (2, 3), (3, 2), (4, 8), (3, 3)]


@pytest.mark.parametrize("load_kind", KINDS)
@pytest.mark.parametrize("save_kind", KINDS)
@pytest.mark.parametrize("save_ws, load_ws", WS_PAIRS, ids=[f"{a}to{b}" for a, b in WS_PAIRS])
def test_reshard(save_ws, load_ws, save_kind, load_kind):
    save, load = {}, {}
    for i, shape in enumerate(SHAPES):
        s = named_topology(save_kind, shape, save_ws)
        l = named_topology(load_kind, shape, load_ws)
        if s is None or l is None:
            continue
        save[f"t{i}"] = (shape, s[0], s[1])
        load[f"t{i}"] = l[0]
    assert save
    roundtrip(save, save_ws, load)


@pytest.mark.parametrize("load_ws", [1, 2, 3, 4])
@pytest.mark.parametrize("load_kind", KINDS + ["mesh"])
def test_2x2_mesh_replicate_x_shard(load_kind, load_ws):
    save, load = {}, {}
    for i, shape in enumerate(SHAPES):
        if len(shape) < 1:
            continue
        for dim in range(min(len(shape), 2)):
            key = f"t{i}_d{dim}"
            save[key] = (shape, mesh_pieces(shape, dim, 2, 2), True)
            l = named_topology(load_kind, shape, load_ws)
            if l is not None:
                load[key] = l[0]
    plan, metadata, files = simulate_save(save, 4)
    for key, (shape, pieces, _) in save.items():
        nonempty = {p for p in pieces if p.numel} if math.prod(shape) else {pieces[0]}
        # Each distinct shard is written once, by one of its two holders (rank j or 2 + j).
        specs = metadata.tensors[key].shard_spec_per_file
        assert len(specs) == len(nonempty)
        for name in specs:
            rank = int(name[len("rank_") : -len(".safetensors")])
            assert pieces[rank] in nonempty
    for key, pieces in load.items():
        for piece in pieces:
            simulate_load(metadata, files, key, piece)


@pytest.mark.parametrize("save_kind", KINDS)
@pytest.mark.parametrize("save_ws", [1, 3, 4])
def test_load_into_2x2_mesh(save_kind, save_ws):
    save, load = {}, {}
    for i, shape in enumerate(SHAPES):
        s = named_topology(save_kind, shape, save_ws)
        l = named_topology("mesh", shape, 4)
        if s is None or l is None:
            continue
        save[f"t{i}"] = (shape, s[0], s[1])
        load[f"t{i}"] = l[0]
    roundtrip(save, save_ws, load)


def test_2d_tp_fsdp_mesh():
    shape = (7, 10)
    save = {"w": (shape, shard2d_pieces(shape, 0, 1, 2, 3), True)}
    load = {"w": shard2d_pieces(shape, 1, 0, 3, 2) + shard_pieces(shape, 0, 5) + [Piece.whole(shape)]}
    roundtrip(save, 6, load)


def test_ranks_without_the_key():
    # A key only some ranks hold (None) is written by them alone.
    shape = (6, 2)
    save = {"a": (shape, [Piece.whole(shape), None, None], False), "b": (shape, shard_pieces(shape, 0, 3), True)}
    plan, metadata, files = simulate_save(save, 3)
    assert plan.keys_per_rank[1] == ("b",) and plan.keys_per_rank[2] == ("b",)
    simulate_load(metadata, files, "a", Piece(flat=((3, 9),)))


# ---------------------------------------------------------------------------------------------
# Writers and balance
# ---------------------------------------------------------------------------------------------


def test_replicated_tensor_is_written_by_exactly_one_rank():
    world = 4
    save = {f"r{i}": ((3, 2), replicated_pieces((3, 2), world), False) for i in range(9)}
    save["s"] = ((8, 2), shard_pieces((8, 2), 0, world), True)
    plan, metadata, _ = simulate_save(save, world)
    for i in range(9):
        key = f"r{i}"
        writers = [r for r, keys in enumerate(plan.keys_per_rank) if key in keys]
        assert len(writers) == 1
        (spec,) = metadata.tensors[key].shard_spec_per_file.values()
        assert spec.flattened_offsets == ((0, 6),)
        assert metadata.tensors[key].is_sharded is False
    assert all("s" in keys for keys in plan.keys_per_rank)


def independent_bytes_per_rank(plan) -> list[int]:
    out = [0] * len(plan.keys_per_rank)
    for key, meta in plan.metadata.tensors.items():
        for name, spec in meta.shard_spec_per_file.items():
            rank = int(name[len("rank_") : -len(".safetensors")])
            held = sum(e - s for s, e in spec.flattened_offsets) if spec.flattened_offsets is not None else math.prod(spec.local_shape)
            out[rank] += held * itemsize(meta.dtype)
    return out


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 8),
    count=st.integers(0, 40),
    numel=st.integers(1, 6),
    dtype=st.sampled_from(["F32", "BF16", "I64", "BOOL"]),
)
def test_equal_replicated_tensors_are_balanced(world, count, numel, dtype):
    save = {f"k{i:02d}": ((numel,), replicated_pieces((numel,), world), False) for i in range(count)}
    descs = [[PieceDesc(k, s, dtype, sh, p[r]) for k, (s, p, sh) in save.items()] for r in range(world)]
    plan = build_save_plan(descs)
    per_rank = plan.bytes_per_rank()
    assert per_rank == independent_bytes_per_rank(plan)
    assert sum(per_rank) == count * numel * itemsize(dtype)
    assert max(per_rank) - min(per_rank) <= numel * itemsize(dtype)


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 6), sizes=st.lists(st.integers(0, 50), max_size=25))
def test_unequal_replicated_tensors_are_balanced_within_largest(world, sizes):
    save = {f"k{i:02d}": ((n,), replicated_pieces((n,), world), False) for i, n in enumerate(sizes)}
    descs = [[PieceDesc(k, s, "F32", sh, p[r]) for k, (s, p, sh) in save.items()] for r in range(world)]
    plan = build_save_plan(descs)
    per_rank = plan.bytes_per_rank()
    assert per_rank == independent_bytes_per_rank(plan)
    assert sum(per_rank) == 4 * sum(sizes)
    assert max(per_rank) - min(per_rank) <= 4 * max(sizes, default=0)


def test_replicated_tensors_are_placed_longest_first():
    """Longest first, each to the least-loaded rank: 2, 1 and 1 elements on 2 ranks are 2 and 2
    (shortest first gives 3 and 1, which the bound above still allows; found by mutation)."""
    save = {k: ((n,), replicated_pieces((n,), 2), False) for k, n in (("a", 1), ("b", 2), ("c", 1))}
    descs = [[PieceDesc(k, s, "F32", sh, p[r]) for k, (s, p, sh) in save.items()] for r in range(2)]
    assert build_save_plan(descs).bytes_per_rank() == [8, 8]


def test_mesh_replicas_share_the_writing():
    # 2 x 2 mesh, 8 tensors: every rank writes something (the replica pair splits the shards).
    shape = (4, 4)
    save = {f"k{i}": (shape, mesh_pieces(shape, 0, 2, 2), True) for i in range(8)}
    plan, _, _ = simulate_save(save, 4)
    per_rank = plan.bytes_per_rank()
    assert sum(per_rank) == 8 * 16 * 4
    assert max(per_rank) - min(per_rank) <= 8 * 4


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def desc(key="w", shape=(4, 4), dtype="F32", piece=None, sharded=True):
    return PieceDesc(key, tuple(shape), dtype, sharded, piece if piece is not None else Piece.whole(shape))


def test_shape_disagreement_names_the_key():
    with pytest.raises(ValueError, match="'layer.weight'"):
        build_save_plan([[desc("layer.weight", (4, 4))], [desc("layer.weight", (4, 5))]])


def test_dtype_disagreement_names_the_key():
    with pytest.raises(ValueError, match="'layer.bias'"):
        build_save_plan([[desc("layer.bias", (4,), "F32")], [desc("layer.bias", (4,), "BF16")]])


@pytest.mark.parametrize(
    "pieces",
    [
        [Piece(flat=((0, 10),)), Piece(flat=((8, 16),))],  # flat overlap
        [Piece(flat=((0, 10),)), Piece(flat=((0, 16),))],  # one contains another
        [box((4, 4), {0: (0, 3)}), box((4, 4), {0: (2, 4)})],  # box overlap
        [box((4, 4), {1: (0, 2)}), Piece.whole((4, 4))],
    ],
)
def test_overlapping_pieces_raise(pieces):
    with pytest.raises(ValueError, match="'w'.*overlap"):
        build_save_plan([[desc(piece=p)] for p in pieces])


@pytest.mark.parametrize(
    "pieces",
    [
        [Piece(flat=((0, 7),)), Piece(flat=((8, 16),))],  # hole in the middle
        [Piece(flat=((0, 8),)), Piece(flat=((8, 15),))],  # short at the end
        [Piece(flat=((1, 16),))],  # short at the start
        [box((4, 4), {0: (0, 2)}), box((4, 4), {0: (3, 4)})],
        [box((4, 4), {1: (0, 2)}), box((4, 4), {0: (0, 4), 1: (2, 3)})],
        [Piece(flat=((0, 0),)), Piece(flat=((0, 0),))],  # nothing at all
    ],
)
def test_gaps_raise(pieces):
    with pytest.raises(ValueError, match="'w'.*leave elements"):
        build_save_plan([[desc(piece=p)] for p in pieces])


def test_missing_piece_in_metadata_is_corrupt():
    shape = (8, 3)
    save = {"w": (shape, shard_pieces(shape, 0, 4), True)}
    plan, metadata, files = simulate_save(save, 4)
    raw = json.loads(plan.metadata.verbose().to_json_bytes())
    del raw["tensors"]["w"]["shard_spec_per_file"]["rank_2.safetensors"]  # rows 4..5
    broken = parse_metadata(json.dumps(raw).encode(), where="broken")
    meta = broken.tensors["w"]
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        build_load_plan("w", meta, [(0, 24)])
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        build_load_plan("w", meta, [(14, 15)])
    # What is still there loads.
    simulate_load(broken, files, "w", box(shape, {0: (0, 4)}))
    simulate_load(broken, files, "w", box(shape, {0: (6, 8)}))
    # No files at all.
    del raw["tensors"]["w"]["shard_spec_per_file"]
    raw["tensors"]["w"]["shard_spec_per_file"] = {}
    empty = parse_metadata(json.dumps(raw).encode(), where="empty")
    with pytest.raises(CorruptCheckpointError):
        build_load_plan("w", empty.tensors["w"], [(0, 1)])


def test_aliases_are_recorded():
    plan = build_save_plan([[desc("a", (2,))]], aliases={"b": "a"})
    assert plan.metadata.aliases == {"b": "a"}
    again = parse_metadata(plan.metadata.to_json_bytes(), where="x")
    assert again.aliases == {"b": "a"}


def test_alias_listed_as_a_key_by_a_rank_with_an_empty_piece():
    """Rank 1's pieces of tied ``a``/``b`` are empty, so it cannot see that they share memory."""
    rows = lambda lo, hi: Piece(local_shape=(hi - lo, 3), global_offset=(lo, 0))  # noqa: E731
    rank0 = [desc("a", (2, 3), piece=rows(0, 2))]
    rank1 = [desc("a", (2, 3), piece=rows(2, 2)), desc("b", (2, 3), piece=rows(2, 2))]
    plan = build_save_plan([rank0, rank1], aliases={"b": "a"})
    assert set(plan.metadata.tensors) == {"a"} and plan.metadata.aliases == {"b": "a"}
    assert plan.keys_per_rank == (("a",), ())
    # A rank that holds elements of ``b`` in memory of its own: the tie is not real.
    rank1[1] = desc("b", (2, 3), piece=rows(0, 2))
    with pytest.raises(ValueError, match="'b' shares memory with 'a' on some ranks but not on others"):
        build_save_plan([rank0, rank1], aliases={"b": "a"})


# ---------------------------------------------------------------------------------------------
# Property test: random shape, random save and load topologies, oracle = element copy
# ---------------------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def topology(draw, shape, world: int, for_load: bool = False):
    ndim, numel = len(shape), math.prod(shape)
    kinds = ["flat", "flat_rr", "replicated"]
    if ndim >= 1:
        kinds += ["shard", "mesh"]
    if ndim >= 2:
        kinds += ["shard2d"]
    if for_load:
        kinds += ["random"]
    kind = draw(st.sampled_from(kinds))
    if kind == "flat":
        cuts = draw(st.lists(st.integers(0, numel), min_size=world - 1, max_size=world - 1))
        return flat_split_pieces(numel, cuts), True
    if kind == "flat_rr":
        pieces = round_robin_pieces(numel, world, draw(st.integers(1, 4)))
        if draw(st.booleans()):  # ranges stored in any order
            pieces = [Piece(flat=tuple(draw(st.permutations(p.flat)))) for p in pieces]
        return pieces, True
    if kind == "replicated":
        return replicated_pieces(shape, world), False
    if kind == "shard":
        return shard_pieces(shape, draw(st.integers(0, ndim - 1)), world), True
    if kind == "mesh":
        shards = draw(st.sampled_from(divisors(world)))
        return mesh_pieces(shape, draw(st.integers(0, ndim - 1)), world // shards, shards), True
    if kind == "shard2d":
        w0 = draw(st.sampled_from(divisors(world)))
        d0, d1 = draw(st.permutations(range(ndim)))[:2]
        return shard2d_pieces(shape, d0, d1, w0, world // w0), True
    # random destination pieces: any box, or any disjoint flat ranges in any order
    pieces = []
    for _ in range(world):
        if ndim and draw(st.booleans()):
            bounds = {}
            for d, n in enumerate(shape):
                lo = draw(st.integers(0, n))
                bounds[d] = (lo, draw(st.integers(lo, n)))
            pieces.append(box(shape, bounds))
        else:
            cuts = sorted(draw(st.lists(st.integers(0, numel), max_size=6)))
            ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
            pieces.append(Piece(flat=tuple(draw(st.permutations(ranges)))))
    return pieces, True


@st.composite
def reshard_case(draw):
    save_ws = draw(st.integers(1, 8))
    load_ws = draw(st.integers(1, 8))
    save, load = {}, {}
    for i in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(0, 4))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
        pieces, sharded = draw(topology(shape, save_ws))
        save[f"t{i}"] = (shape, pieces, sharded)
        load[f"t{i}"] = draw(topology(shape, load_ws, for_load=True))[0]
    return save_ws, save, load


@settings(max_examples=200, deadline=None)
@given(reshard_case())
def test_reshard_property(case):
    save_ws, save, load = case
    roundtrip(save, save_ws, load)


# ---------------------------------------------------------------------------------------------
# _StridedShard on 2-D meshes (FSDP2 over tensor parallelism): interleaved flat pieces
# ---------------------------------------------------------------------------------------------


def torch_local(shape, placements, mesh_sizes, coord) -> torch.Tensor:
    """The oracle: what ``distribute_tensor`` gives a coordinate, by torch's own placement splits."""
    local = full_tensor(shape).reshape(shape)
    for placement, n, c in zip(placements, mesh_sizes, coord):
        if hasattr(placement, "_split_tensor"):
            local = placement._split_tensor(local, n, with_padding=False, contiguous=False)[0][c]
    return local.reshape(-1)


@st.composite
def strided_mesh_case(draw, shape=None):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if shape is None:
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    ndim = len(shape)
    mesh_sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=2, max_size=2)))
    placements = []
    for _ in mesh_sizes:
        kind = draw(st.sampled_from(["strided", "strided", "shard", "replicate"]))
        d = draw(st.integers(0, ndim - 1))
        if kind == "strided":
            placements.append(_StridedShard(d, split_factor=draw(st.integers(1, 4))))
        elif kind == "shard":
            placements.append(Shard(d))
        else:
            placements.append(Replicate())
    return shape, tuple(placements), mesh_sizes


def strided_pieces(shape, placements, mesh_sizes) -> list[Piece]:
    from checkpointer.sharding import dtensor_index_runs, runs_piece

    coords = [(i, j) for i in range(mesh_sizes[0]) for j in range(mesh_sizes[1])]
    return [runs_piece(shape, dtensor_index_runs(shape, placements, mesh_sizes, c)) for c in coords]


@settings(max_examples=300, deadline=None)
@given(strided_mesh_case(), st.data())
def test_strided_pieces_cover_each_tensor_exactly_once(case, data):
    """Each coordinate's piece holds exactly what torch's splits give it, in its order; the pieces
    of all coordinates cover the full tensor once per replica; a save of them plans and loads back
    into other layouts (2-D strided ones included)."""
    from torch.distributed.tensor import Replicate

    shape, placements, mesh_sizes = case
    pieces = strided_pieces(shape, placements, mesh_sizes)
    coords = [(i, j) for i in range(mesh_sizes[0]) for j in range(mesh_sizes[1])]
    for coord, piece in zip(coords, pieces):
        assert torch.equal(extract(shape, piece), torch_local(shape, placements, mesh_sizes, coord)), (coord, piece)
        assert torch.equal(from_ranges(shape, piece_ranges(piece, shape)), extract(shape, piece))
    replicas = math.prod(n for p, n in zip(placements, mesh_sizes) if isinstance(p, Replicate))
    count = torch.zeros(math.prod(shape), dtype=torch.int64)
    for piece in pieces:
        for s, e in piece_ranges(piece, shape):
            count[s:e] += 1
    assert torch.equal(count, torch.full_like(count, replicas))
    world = len(pieces)
    _, load_placements, load_mesh = data.draw(strided_mesh_case(shape))
    load = strided_pieces(shape, load_placements, load_mesh) + data.draw(topology(shape, 3, for_load=True))[0]
    roundtrip({"w": (shape, pieces, True)}, world, {"w": load})


def test_interleaved_strided_pieces_on_a_2x2_mesh():
    """(Shard(0), _StridedShard(0, 2)) on 8 rows: every rank holds two rows that are not neighbours."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shape = (8, 3)
    pieces = strided_pieces(shape, (Shard(0), _StridedShard(0, split_factor=2)), (2, 2))
    rows = [[r for s, e in p.flat for r in range(s // 3, e // 3)] for p in pieces]
    assert rows == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # FSDP2 over a 2-way TP split of dim 0 is a box: (dp, tp) rank (d, t) holds rows 4t + 2d, 4t + 2d + 1.
    boxes = strided_pieces(shape, (_StridedShard(0, split_factor=2), Shard(0)), (2, 2))
    assert [(p.local_shape, p.global_offset) for p in boxes] == [((2, 3), (0, 0)), ((2, 3), (4, 0)), ((2, 3), (2, 0)), ((2, 3), (6, 0))]
    roundtrip({"w": (shape, pieces, True)}, 4, {"w": boxes + shard_pieces(shape, 1, 3) + [Piece.whole(shape)]})
