"""Box pieces read as boxes: planning (planning/boxes.py, build_load_plan) and reading
(engine/reads.py) against a brute-force oracle, in one process over real rank files.

A checkpoint is written as simulated ranks would write it (a random mesh and placements, the
strided shards FSDP2 makes over tensor parallelism, or random flattened cuts), then random
destination pieces are loaded from it and compared element by element with the full tensor.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peak_memory import peak_extra_mib
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from checkpointer import Checkpointer
from checkpointer.buffers import StagingBlocks
from checkpointer.checksums import ALGORITHM, CHUNK_BYTES, chunk_crcs
from checkpointer.engine import load, reads
from checkpointer.engine.checks import HeaderCache
from checkpointer.engine.rankfile import write_rank_file
from checkpointer.engine.reads import ReadJob, execute_reads
from checkpointer.errors import CorruptCheckpointError
from checkpointer.format.dtypes import code_from_dtype
from checkpointer.format.layout import METADATA_FILENAME, rank_filename
from checkpointer.format.metadata_parse import parse_metadata
from checkpointer.planning.boxes import (
    BoxCopy,
    Tile,
    TileIndex,
    count_below,
    index_range_boxes,
    normalize,
    range_tiles,
    row_major_strides,
    span_boxes,
)
from checkpointer.planning.plan import Piece, PieceDesc, build_save_plan
from checkpointer.planning.load_plan import build_load_plan
from checkpointer.planning.pieces import whole
from checkpointer.sharding import LocalTensor, dtensor_index_runs, runs_piece
from checkpointer.storage import scatter
from checkpointer.storage.local import LocalStorage

# ---------------------------------------------------------------------------------------------
# Oracles
# ---------------------------------------------------------------------------------------------


def piece_indices(piece: Piece, shape) -> list[int]:
    """The flat index of every element a piece holds, in its storage order."""
    if piece.flat is not None:
        return [i for s, e in piece.flat for i in range(s, e)]
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    box = full[tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.local_shape))]
    return box.reshape(-1).tolist()


def extract(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    flat = full.reshape(-1)
    index = torch.tensor(piece_indices(piece, tuple(full.shape)), dtype=torch.int64)
    return flat[index].clone() if index.numel() else flat[:0].clone()


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


@st.composite
def shapes(draw, max_ndim=4, max_dim=7):
    ndim = draw(st.integers(1, max_ndim))
    return tuple(draw(st.lists(st.integers(0, max_dim), min_size=ndim, max_size=ndim)))


@st.composite
def layouts(draw, shape):
    """Every rank's piece: a DTensor mesh layout (Shard, Replicate, _StridedShard) or flat cuts."""
    ndim, numel = len(shape), math.prod(shape)
    kind = draw(st.sampled_from(["mesh", "mesh", "strided", "flat"]))
    if kind == "flat":
        world = draw(st.integers(1, 4))
        cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=world - 1, max_size=world - 1)))
        bounds = [0, *cuts, numel]
        return [Piece(flat=((bounds[r], bounds[r + 1]),)) for r in range(world)]
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    placements = []
    for n in mesh:
        choice = draw(st.sampled_from(["shard", "shard", "replicate", "strided"] if kind == "strided" else ["shard", "replicate"]))
        d = draw(st.integers(0, ndim - 1))
        if choice == "shard":
            placements.append(Shard(d))
        elif choice == "replicate":
            placements.append(Replicate())
        else:
            placements.append(_StridedShard(d, split_factor=draw(st.integers(1, 3))))
    pieces = []
    for coord in _coords(mesh):
        pieces.append(runs_piece(shape, dtensor_index_runs(shape, placements, mesh, coord)))
    return pieces


def _coords(mesh):
    out = [()]
    for n in mesh:
        out = [c + (i,) for c in out for i in range(n)]
    return out


def _tiling_layout(pieces, shape) -> bool:
    """The distinct pieces cover every element exactly once (what a save can write)."""
    counts = [0] * math.prod(shape)
    seen = set()
    for p in pieces:
        if (p.flat, p.local_shape, p.global_offset) in seen:
            continue
        seen.add((p.flat, p.local_shape, p.global_offset))
        for i in piece_indices(p, shape):
            counts[i] += 1
    return all(c == 1 for c in counts)


def write_checkpoint(
    path: str, full: torch.Tensor, pieces: list[Piece], key: str = "w", chunk_bytes: int = CHUNK_BYTES
) -> LocalStorage:
    """Rank files as a save writes them; with a small ``chunk_bytes``, the metadata's checksums
    are of chunks that small (computed here), so verified reads cross chunk boundaries."""
    shape, code = tuple(full.shape), code_from_dtype(full.dtype)
    plan = build_save_plan([[PieceDesc(key, shape, code, True, p)] for p in pieces])
    storage = LocalStorage(path)
    crcs = {}
    for rank, keys in enumerate(plan.keys_per_rank):
        if keys:
            local = extract(full, pieces[rank])
            lt = LocalTensor(local, shape, code, True, pieces[rank])
            crcs[rank_filename(rank)] = write_rank_file(storage, rank_filename(rank), [(key, lt)])
            if chunk_bytes != CHUNK_BYTES:
                crcs[rank_filename(rank)] = {key: chunk_crcs(memoryview(local.view(torch.uint8).numpy()), chunk_bytes)}
    metadata = plan.metadata.with_checksums(crcs, algorithm=ALGORITHM, chunk_bytes=chunk_bytes)
    storage.write(METADATA_FILENAME, metadata.to_json_bytes())
    return storage


def load_piece(
    storage: LocalStorage, piece: Piece, dtype, key: str = "w", verify: bool = False, map_pages: bool = True
) -> torch.Tensor:
    metadata = parse_metadata(storage.read(METADATA_FILENAME, 0, storage.size(METADATA_FILENAME)), where="m")
    meta = metadata.tensors[key]
    plan = build_load_plan(key, meta, piece)
    dest = torch.full((piece.numel,), -1, dtype=dtype) if dtype.is_floating_point else torch.zeros(piece.numel, dtype=dtype)
    specs = meta.shard_spec_per_file
    job = ReadJob(plan, dest, {f: specs[f].local_numel for f in plan.files}, {f: specs[f].checksums for f in plan.files})
    execute_reads(storage, [job], headers=HeaderCache(storage), verify_chunk_bytes=metadata.checksum_chunk_bytes if verify else None, map_pages=map_pages)
    return dest


# ---------------------------------------------------------------------------------------------
# The property: every element lands exactly once, with the right value
# ---------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_save_and_load_layouts_against_the_oracle(tmp_path_factory, data, monkeypatch):
    shape = data.draw(shapes())
    saved = data.draw(layouts(shape))
    if not _tiling_layout(saved, shape):
        return  # replicas that only partly agree cannot be saved
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    full = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape).to(dtype)
    # Checksum chunks of a few elements: verified strided reads cross chunk boundaries.
    chunk_bytes = data.draw(st.sampled_from([8, 24, 72, CHUNK_BYTES]))
    storage = write_checkpoint(str(tmp_path_factory.mktemp("ckpt")), full, saved, chunk_bytes=chunk_bytes)
    # Small staging blocks: a block boundary falls inside rows and between a row's elements.
    monkeypatch.setattr(reads, "STRIDED_BLOCK", data.draw(st.sampled_from([8, 24, 1 << 20])))
    if data.draw(st.booleans()):  # no strided item read run by run with preadv requests
        monkeypatch.setattr(reads, "_FEW_RUNS", 0)
        monkeypatch.setattr(reads, "_RUN_BYTES", 1 << 62)
    # Without scattered reads (as on an object store) every other strided item goes through staging blocks.
    monkeypatch.setattr(LocalStorage, "reads_runs", lambda self, scattered=data.draw(st.booleans()): scattered)
    # Gaps a scattered read skips (256 KiB, never in shapes this small): items read alone, by their runs.
    gap = data.draw(st.sampled_from([scatter.MAX_GAP, 0, 8]))
    monkeypatch.setattr(scatter, "MAX_GAP", gap)
    monkeypatch.setattr(reads, "MAX_GAP", gap)
    # Copied from mapped pages: every strided item, or none.
    monkeypatch.setattr(reads, "_MAP_BYTES", data.draw(st.sampled_from([0, 1 << 62])))
    wanted = data.draw(layouts(shape)) + [whole(shape)]
    verify = data.draw(st.booleans())
    for piece in wanted:
        got = load_piece(storage, piece, dtype, verify=verify)
        assert torch.equal(got, extract(full, piece)), (shape, saved, piece)


# ---------------------------------------------------------------------------------------------
# The pieces of the machinery, each against its own oracle
# ---------------------------------------------------------------------------------------------


@given(shape=shapes(), data=st.data())
def test_index_range_boxes_cover_the_range_in_order(shape, data):
    numel = math.prod(shape)
    lo = data.draw(st.integers(0, numel))
    hi = data.draw(st.integers(lo, numel))
    boxes = index_range_boxes(shape, lo, hi)
    assert len(boxes) <= 2 * len(shape) - 1 or hi == lo
    strides = row_major_strides(shape)
    flat = []
    for origin, sizes in boxes:
        flat += piece_indices(Piece(local_shape=sizes, global_offset=origin), shape)
    assert flat == list(range(lo, hi))
    tiles = range_tiles(shape, lo, hi, offset=5)
    for t in tiles:
        first = sum(o * s for o, s in zip(t.origin, strides))
        assert t.offset == 5 + first - lo and t.strides == strides


@given(shape=shapes(), data=st.data())
def test_count_below_and_span_boxes_of_a_box_view(shape, data):
    """A box of a row-major array: which of its elements sit below an offset, and as boxes."""
    origin = tuple(data.draw(st.integers(0, n)) for n in shape)
    sizes = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, origin))
    strides = row_major_strides(shape)
    offsets = [i - sum(o * s for o, s in zip(origin, strides)) for i in piece_indices(Piece(local_shape=sizes, global_offset=origin), shape)]
    r = data.draw(st.integers(-1, math.prod(shape) + 1))
    assert count_below(sizes, strides, r) == sum(1 for x in offsets if x < r)
    lo = data.draw(st.integers(0, max(0, math.prod(shape))))
    hi = data.draw(st.integers(lo, max(lo, math.prod(shape))))
    picked = []
    for o, z in span_boxes(sizes, strides, lo, hi):
        base = sum(a * s for a, s in zip(o, strides))
        picked += [base + x for x in _box_offsets(z, strides)]
    assert picked == [x for x in offsets if lo <= x < hi]


def _box_offsets(sizes, strides):
    out = [0]
    for n, s in zip(sizes, strides):
        out = [x + i * s for x in out for i in range(n)]
    return out


def test_normalize_merges_what_is_contiguous_on_both_sides():
    # Whole rows on both sides: one run.
    c = normalize(BoxCopy(0, 12, (6, 1), 0, (6, 1), (4, 6)))
    assert c.contiguous and c.sizes == (24,)
    # Columns of a row-major source into a contiguous destination: stays 2-D.
    c = normalize(BoxCopy(0, 3, (6, 1), 0, (3, 1), (4, 3)))
    assert not c.contiguous and c.sizes == (4, 3) and c.src_strides == (6, 1) and c.dst_strides == (3, 1)
    # A size-1 dimension disappears.
    c = normalize(BoxCopy(0, 0, (12, 6, 1), 0, (12, 6, 1), (1, 2, 6)))
    assert c.contiguous and c.sizes == (12,)


def test_tile_index_refuses_what_it_cannot_prove_disjoint():
    a = Tile(0, (4, 1), (0, 0), (2, 4))
    b = Tile(0, (4, 1), (1, 0), (2, 4))  # overlaps a's second row
    assert not TileIndex((4, 4), [[a], [b]]).ok
    c = Tile(0, (4, 1), (2, 0), (2, 4))
    index = TileIndex((4, 4), [[a], [c]])
    assert index.ok and index.covered == 16
    assert TileIndex((4, 4), [[a], [a]]).ok  # a replica: read from the first


def test_a_gap_in_box_pieces_is_corrupt(tmp_path):
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(4, 3), global_offset=(0, 0)), Piece(local_shape=(4, 3), global_offset=(0, 3))])
    text = storage.read(METADATA_FILENAME, 0, storage.size(METADATA_FILENAME)).replace(b'"local_shape":[4,3],"global_offset":[0,3]', b'"local_shape":[3,3],"global_offset":[0,3]')
    meta = parse_metadata(text, where="m").tensors["w"]
    with pytest.raises(CorruptCheckpointError, match=r"'w': 3 of the 24 elements to load are in no file"):
        build_load_plan("w", meta, whole((4, 6)))


def test_a_flipped_byte_in_a_strided_read_is_caught(tmp_path):
    full = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(64, 16), global_offset=(0, 0)), Piece(local_shape=(64, 16), global_offset=(0, 16))])
    path = tmp_path / rank_filename(1)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10
    path.write_bytes(bytes(data))
    rows = Piece(local_shape=(32, 32), global_offset=(32, 0))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'w'"):
        load_piece(storage, rows, torch.float32, verify=True)


# ---------------------------------------------------------------------------------------------
# Work per piece does not grow with rows
# ---------------------------------------------------------------------------------------------


def _shard2_reads(tmp_path, rows: int, monkeypatch) -> tuple[int, int]:
    """(read requests, plan items) to unshard a ``[rows, 64, 2]`` tensor saved as Shard(2) of 2."""
    full = torch.randn(rows, 64, 2, generator=torch.Generator().manual_seed(rows))
    pieces = [Piece(local_shape=(rows, 64, 1), global_offset=(0, 0, r)) for r in range(2)]
    (tmp_path / str(rows)).mkdir()
    storage = write_checkpoint(str(tmp_path / str(rows)), full, pieces)
    requests = []
    real, real_mapped = LocalStorage.read_into, LocalStorage.mapped

    def counting(self, name, reqs):
        requests.extend(reqs)
        return real(self, name, reqs)

    def counting_mapped(self, name, start, nbytes):
        requests.append((start, nbytes))
        return real_mapped(self, name, start, nbytes)

    monkeypatch.setattr(LocalStorage, "read_into", counting)
    monkeypatch.setattr(LocalStorage, "mapped", counting_mapped)
    metadata = parse_metadata(storage.read(METADATA_FILENAME, 0, storage.size(METADATA_FILENAME)), where="m")
    plan = build_load_plan("w", metadata.tensors["w"], whole(full.shape))
    got = load_piece(storage, whole(full.shape), torch.float32)
    monkeypatch.setattr(LocalStorage, "read_into", real)
    monkeypatch.setattr(LocalStorage, "mapped", real_mapped)
    assert torch.equal(got, full.reshape(-1))
    return len(requests), len(plan.items)


def test_doubling_the_rows_doubles_neither_reads_nor_items(tmp_path, monkeypatch):
    monkeypatch.setattr(reads, "STRIDED_BLOCK", 1 << 20)
    monkeypatch.setattr(reads, "_MAP_BYTES", 1 << 62)  # read, as pages not in the page cache are: one request a block
    monkeypatch.setattr(reads, "_FEW_RUNS", 64)
    small_reads, small_items = _shard2_reads(tmp_path, 1024, monkeypatch)  # 256 KiB a piece: one block each
    large_reads, large_items = _shard2_reads(tmp_path, 2048, monkeypatch)
    assert small_items == large_items == 2
    assert small_reads == large_reads == 2


def _column_pieces_calls(tmp_path, rows: int, monkeypatch) -> int:
    """System calls that read a ``[rows, 8]`` tensor saved as two column pieces (runs of 16
    bytes) whole, from pages not in the page cache."""
    full = torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8)
    (tmp_path / str(rows)).mkdir()
    storage = write_checkpoint(str(tmp_path / str(rows)), full, [Piece(local_shape=(rows, 4), global_offset=(0, 4 * r)) for r in range(2)])
    calls = []
    real_into, real_runs = LocalStorage.read_into, scatter._preadv_all
    monkeypatch.setattr(LocalStorage, "read_into", lambda self, name, reqs: (calls.append(name), real_into(self, name, reqs))[1])
    monkeypatch.setattr(scatter, "_preadv_all", lambda *args: (calls.append("runs"), real_runs(*args))[1])
    got = load_piece(storage, whole(full.shape), torch.float32)
    monkeypatch.setattr(LocalStorage, "read_into", real_into)
    monkeypatch.setattr(scatter, "_preadv_all", real_runs)
    assert torch.equal(got, full.reshape(-1))
    return len(calls)


def test_doubling_the_rows_of_short_runs_doubles_no_system_calls(tmp_path, monkeypatch):
    """Many short runs (a column piece of a tall matrix) are read a staging block at a time,
    not one ``preadv`` per 512 rows."""
    monkeypatch.setattr(reads, "STRIDED_BLOCK", 1 << 20)
    monkeypatch.setattr(reads, "_MAP_BYTES", 1 << 62)  # as for pages not in the page cache
    assert _column_pieces_calls(tmp_path, 8192, monkeypatch) == 2  # 128 KiB a piece: one block each
    assert _column_pieces_calls(tmp_path, 16384, monkeypatch) == 2


def _calls_to_read(tmp_path, full: torch.Tensor, wanted: Piece, monkeypatch) -> list[tuple[str, int]]:
    """The storage calls (``into``: requests of one read; ``runs``: runs of one scattered read)
    that read ``wanted`` of ``full``, saved whole; checks the values read."""
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=tuple(full.shape), global_offset=(0, 0))])
    monkeypatch.setattr(reads, "_MAP_BYTES", 1 << 62)  # read, as pages not in the page cache are
    calls: list[tuple[str, int]] = []
    real_into, real_runs = LocalStorage.read_into, LocalStorage.read_runs

    def read_into(self, name, reqs):
        calls.append(("into", len(reqs)))
        return real_into(self, name, reqs)

    def read_runs(self, name, offsets, addresses, length):
        calls.append(("runs", len(offsets)))
        return real_runs(self, name, offsets, addresses, length)

    monkeypatch.setattr(LocalStorage, "read_into", read_into)
    monkeypatch.setattr(LocalStorage, "read_runs", read_runs)
    got = load_piece(storage, wanted, torch.float32)
    (rows, cols), (row, col) = wanted.local_shape, wanted.global_offset
    assert torch.equal(got, full[row : row + rows, col : col + cols].reshape(-1))
    return calls


def test_doubling_the_rows_of_slabs_far_apart_doubles_no_system_calls(tmp_path, monkeypatch):
    """Half the columns of half the rows of two slabs (runs of 16 bytes, a gap of 256 KiB or more
    between the slabs): more runs than one scattered read takes, so the span is read a staging
    block at a time, not a ``preadv`` per 512 runs and a segment per run and per gap."""
    calls = []
    real_into, real_runs = LocalStorage.read_into, scatter._preadv_all
    monkeypatch.setattr(reads, "_MAP_BYTES", 1 << 62)  # as for pages not in the page cache
    for rows in (32768, 65536):
        calls.clear()
        full = torch.arange(2 * rows * 8, dtype=torch.float32).reshape(2, rows, 8)
        (tmp_path / str(rows)).mkdir()
        storage = write_checkpoint(str(tmp_path / str(rows)), full, [Piece(local_shape=(2, rows, 8), global_offset=(0, 0, 0))])
        monkeypatch.setattr(LocalStorage, "read_into", lambda self, name, reqs: (calls.append(name), real_into(self, name, reqs))[1])
        monkeypatch.setattr(scatter, "_preadv_all", lambda *args: (calls.append("runs"), real_runs(*args))[1])
        wanted = Piece(local_shape=(2, rows // 2, 4), global_offset=(0, 0, 0))
        got = load_piece(storage, wanted, torch.float32)
        monkeypatch.setattr(LocalStorage, "read_into", real_into)
        monkeypatch.setattr(scatter, "_preadv_all", real_runs)
        assert torch.equal(got, extract(full, wanted))
        assert len(calls) == 1, (rows, len(calls))  # one 8 MiB block (64 and 128 scattered reads before)


def test_short_runs_with_short_gaps_are_one_read_of_their_span(tmp_path, monkeypatch):
    """A column block of a small matrix (64 runs of 64 bytes, 64-byte gaps) is one read of its
    span and a strided copy, not a scattered read of a ``preadv`` segment per run and per gap
    (a quarter of each 4 KiB row, 4 processes: 26 ms of CPU against 17 ms staged)."""
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    assert _calls_to_read(tmp_path, full, Piece(local_shape=(64, 16), global_offset=(0, 8)), monkeypatch) == [("into", 1)]


def test_long_runs_are_one_scattered_read(tmp_path, monkeypatch):
    """Runs of 16 KiB are read straight into the destination by one scattered read, not staged
    and copied again."""
    full = torch.arange(64 * 8192, dtype=torch.float32).reshape(64, 8192)
    assert _calls_to_read(tmp_path, full, Piece(local_shape=(64, 4096), global_offset=(0, 2048)), monkeypatch) == [("runs", 64)]


@pytest.mark.parametrize("verify", [False, True])
def test_column_blocks_of_the_same_rows_read_those_rows_once(tmp_path, monkeypatch, verify):
    """A destination of two column blocks a row from one stored piece (``[Shard(1),
    _StridedShard(1, 2)]`` loaded from a ``Shard(1)`` save) reads the piece's bytes once, not once
    per block: the blocks' spans overlap, so they share their staged reads (and checksums)."""
    full = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3))
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(1024, 512), global_offset=(0, 512 * r)) for r in range(2)], chunk_bytes=64 << 10)
    runs = dtensor_index_runs((1024, 1024), [Shard(1), _StridedShard(1, split_factor=2)], (2, 2), (0, 1))
    assert runs[1] == [(128, 256), (384, 512)]
    wanted = runs_piece((1024, 1024), runs)
    read_bytes: list[int] = []
    real_into, real_runs = LocalStorage.read_into, LocalStorage.read_runs
    monkeypatch.setattr(LocalStorage, "read_into", lambda self, name, reqs: (read_bytes.extend(len(b) for _, b in reqs), real_into(self, name, reqs))[1])
    monkeypatch.setattr(LocalStorage, "read_runs", lambda self, name, offsets, addresses, length: (read_bytes.append(int(offsets[-1] - offsets[0]) + length), real_runs(self, name, offsets, addresses, length))[1])
    got = load_piece(storage, wanted, torch.float32, verify=verify, map_pages=False)
    assert torch.equal(got.view(1024, 256), torch.cat([full[:, 128:256], full[:, 384:512]], dim=1))
    assert sum(read_bytes) <= 1024 * 512 * 4, sum(read_bytes)  # the stored piece, once (twice before)


def test_column_blocks_far_apart_in_wide_rows_read_only_their_runs(tmp_path, monkeypatch):
    """Two column blocks of 512 bytes a row from rows of 512 KiB: the gaps are longer than a
    scattered read skips, so each block keeps its own scattered reads of exactly its runs, not one
    shared read of the rows (8 MiB for 16 KiB)."""
    full = torch.randn(16, 131072, generator=torch.Generator().manual_seed(4))
    storage = write_checkpoint(str(tmp_path), full, [whole(full.shape)])
    wanted = runs_piece((16, 131072), [[(0, 16)], [(0, 128), (65536, 65664)]])
    read_bytes: list[int] = []
    real_into, real_preadv = LocalStorage.read_into, scatter._preadv_all
    monkeypatch.setattr(LocalStorage, "read_into", lambda self, name, reqs: (read_bytes.extend(len(b) for _, b in reqs), real_into(self, name, reqs))[1])
    monkeypatch.setattr(scatter, "_preadv_all", lambda fd, iov, *args: (read_bytes.append(int(iov[:, 1].sum())), real_preadv(fd, iov, *args))[1])
    got = load_piece(storage, wanted, torch.float32, map_pages=False)
    assert torch.equal(got.view(16, 256), torch.cat([full[:, :128], full[:, 65536:65664]], dim=1))
    assert sum(read_bytes) == 16 * 256 * 4, sum(read_bytes)


def test_column_blocks_of_slabs_far_apart_read_only_their_runs(tmp_path, monkeypatch):
    """Two column blocks of 64 rows in each of 4 slabs 4 MiB apart: the gaps between rows are short
    but those between slabs are longer than a scattered read skips, so each block keeps its own
    scattered reads (128 KiB), not one shared read of the slabs (12 MiB)."""
    shape = (4, 16384, 64)
    full = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
    storage = write_checkpoint(str(tmp_path), full, [whole(shape)])
    wanted = runs_piece(shape, [[(0, 4)], [(0, 64)], [(0, 8), (32, 40)]])
    read_bytes: list[int] = []
    real_into, real_preadv = LocalStorage.read_into, scatter._preadv_all
    monkeypatch.setattr(LocalStorage, "read_into", lambda self, name, reqs: (read_bytes.extend(len(b) for _, b in reqs), real_into(self, name, reqs))[1])
    monkeypatch.setattr(scatter, "_preadv_all", lambda fd, iov, *args: (read_bytes.append(int(iov[:, 1].sum())), real_preadv(fd, iov, *args))[1])
    got = load_piece(storage, wanted, torch.float32, map_pages=False)
    assert torch.equal(got, torch.cat([full[:, :64, 0:8], full[:, :64, 32:40]], dim=2).reshape(-1))
    assert sum(read_bytes) <= 2 * 4 * 64 * 64 * 4, sum(read_bytes)


@pytest.mark.parametrize("rows", [64, 1024])  # 64: each block's runs are few (scattered reads alone)
@pytest.mark.parametrize("mapped", [False, True])
def test_column_blocks_sharing_rows_land_whole(tmp_path, monkeypatch, rows, mapped):
    """Every item of a shared read lands, from staged blocks and from mapped pages, several
    blocks a group."""
    full = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(5))
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(rows, 512), global_offset=(0, 512 * r)) for r in range(2)])
    wanted = runs_piece((rows, 1024), dtensor_index_runs((rows, 1024), [Shard(1), _StridedShard(1, split_factor=2)], (2, 2), (0, 1)))
    monkeypatch.setattr(reads, "_MAP_BYTES", 0 if mapped else 1 << 62)
    monkeypatch.setattr(reads, "STRIDED_BLOCK", 64 << 10)
    got = load_piece(storage, wanted, torch.float32, map_pages=mapped)
    assert torch.equal(got.view(rows, 256), torch.cat([full[:, 128:256], full[:, 384:512]], dim=1))


def test_reads_are_told_the_bytes_they_fill(tmp_path, monkeypatch):
    """The read tasks of a load know the bytes their destinations take (which bounds their threads)."""
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(64, 16), global_offset=(0, 16 * r)) for r in range(2)])
    payloads: list[int] = []
    real = reads._run
    monkeypatch.setattr(reads, "_run", lambda threads, tasks, payload=None: (payloads.append(payload), real(threads, tasks, payload)))
    wanted = Piece(local_shape=(64, 8), global_offset=(0, 12))
    assert torch.equal(load_piece(storage, wanted, torch.float32), full[:, 12:20].reshape(-1))
    assert payloads == [64 * 8 * 4]


def _two_tensor_doc(rule_texts: tuple[str, str]) -> bytes:
    entry = '{{"shape":[4,6],"is_sharded":true,"dtype":"F32","shard_rule":{}}}'
    return ('{"tensors":{"a":' + entry.format(rule_texts[0]) + ',"b":' + entry.format(rule_texts[1])
            + '},"world_size":2,"format_version":2}').encode()


COLUMNS = '{"form":"box","cuts":[[1,3]],"files":[0,[[1,2,1]]]}'  # Shard(1) over 2 files


def test_tensors_of_one_layout_share_their_read_items():
    """Planning works once per (layout, wanted piece): a second tensor with the same stored
    layout and the same wanted piece gets the first one's items; another piece its own, as a
    fresh parse plans it."""
    tensors = parse_metadata(_two_tensor_doc((COLUMNS, COLUMNS)), where="m").tensors
    left, middle = Piece(local_shape=(4, 2), global_offset=(0, 0)), Piece(local_shape=(4, 2), global_offset=(0, 2))
    a = build_load_plan("a", tensors["a"], middle)
    b = build_load_plan("b", tensors["b"], middle)
    assert b.key == "b" and b.items is a.items
    assert len(a.items) == 2  # column 2 from file 0, column 3 from file 1
    other = build_load_plan("b", tensors["b"], left)
    fresh = parse_metadata(_two_tensor_doc((COLUMNS, COLUMNS)), where="m").tensors
    assert other.items == build_load_plan("b", fresh["b"], left).items != a.items


def test_a_piece_of_lists_is_planned_not_remembered():
    tensors = parse_metadata(_two_tensor_doc((COLUMNS, COLUMNS)), where="m").tensors
    listed = Piece(local_shape=[4, 2], global_offset=[0, 2])  # type: ignore[arg-type]
    assert build_load_plan("a", tensors["a"], listed).items == build_load_plan("b", tensors["b"], Piece(local_shape=(4, 2), global_offset=(0, 2))).items


def test_tensors_sharing_items_read_their_own_bytes(tmp_path):
    """Two tensors of one layout, read through one parse of the metadata: the second tensor's
    plan comes from the first's, and each destination gets its own tensor's values."""
    fulls = {"a": torch.arange(48, dtype=torch.float32).reshape(6, 8), "b": -torch.arange(48, dtype=torch.float32).reshape(6, 8)}
    saved = [Piece(local_shape=(6, 4), global_offset=(0, 0)), Piece(local_shape=(6, 4), global_offset=(0, 4))]
    plan = build_save_plan([[PieceDesc(k, (6, 8), "F32", True, p) for k in fulls] for p in saved])
    storage = LocalStorage(str(tmp_path))
    crcs = {}
    for rank, piece in enumerate(saved):
        pieces = [(k, LocalTensor(extract(full, piece), (6, 8), "F32", True, piece)) for k, full in fulls.items()]
        crcs[rank_filename(rank)] = write_rank_file(storage, rank_filename(rank), pieces)
    storage.write(METADATA_FILENAME, plan.metadata.with_checksums(crcs, algorithm=ALGORITHM, chunk_bytes=CHUNK_BYTES).to_json_bytes())
    metadata = parse_metadata(storage.read(METADATA_FILENAME, 0, storage.size(METADATA_FILENAME)), where="m")
    for wanted in (Piece(local_shape=(6, 3), global_offset=(0, 3)), Piece(local_shape=(2, 8), global_offset=(4, 0))):
        plans = {k: build_load_plan(k, metadata.tensors[k], wanted) for k in fulls}
        assert plans["b"].items is plans["a"].items
        jobs = []
        for k, p in plans.items():
            specs = metadata.tensors[k].shard_spec_per_file
            jobs.append(ReadJob(p, torch.full((wanted.numel,), 7.0), {f: specs[f].local_numel for f in p.files}, {f: specs[f].checksums for f in p.files}))
        execute_reads(storage, jobs, headers=HeaderCache(storage))
        for k, job in zip(plans, jobs):
            assert torch.equal(job.dest, extract(fulls[k], wanted)), k


def test_a_plan_that_fails_is_not_remembered(tmp_path):
    """A layout with a gap fails for every tensor that uses it, not only the first."""
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(4, 3), global_offset=(0, 0)), Piece(local_shape=(4, 3), global_offset=(0, 3))])
    text = storage.read(METADATA_FILENAME, 0, storage.size(METADATA_FILENAME)).replace(b'"local_shape":[4,3],"global_offset":[0,3]', b'"local_shape":[3,3],"global_offset":[0,3]')
    meta = parse_metadata(text, where="m").tensors["w"]
    for _ in range(2):
        with pytest.raises(CorruptCheckpointError, match=r"'w': 3 of the 24 elements to load are in no file"):
            build_load_plan("w", meta, whole((4, 6)))


def test_a_repeated_rule_is_checked_once_and_still_counted(monkeypatch):
    """The second tensor with the same rule text skips the rule's check and expansion, but its
    members still count: a duplicate key inside it is still refused."""
    from checkpointer.format import spec_parser

    checked = []
    real = spec_parser.check_rule
    monkeypatch.setattr(spec_parser, "check_rule", lambda shape, raw: checked.append(shape) or real(shape, raw))
    parse_metadata(_two_tensor_doc((COLUMNS, COLUMNS)), where="m")
    assert checked == [(4, 6)]
    duplicate = COLUMNS.replace('"form":"box",', '"form":"box","form":"box",')
    with pytest.raises(CorruptCheckpointError, match=r"tensors\['b'\] gives a key twice"):
        parse_metadata(_two_tensor_doc((COLUMNS, duplicate)), where="m")


def test_a_layout_keeps_a_bounded_number_of_pieces(monkeypatch):
    """A streaming read wants a new piece per block: a layout keeps the first few, then plans
    without remembering."""
    from checkpointer.planning import load_plan

    monkeypatch.setattr(load_plan, "_REMEMBERED_PIECES", 2)
    meta = parse_metadata(_two_tensor_doc((COLUMNS, COLUMNS)), where="m").tensors["a"]
    for start in range(4):
        assert build_load_plan("a", meta, Piece(flat=((start * 6, start * 6 + 6),))).numel == 6
    assert len(meta.shard_spec_per_file.layout.memo["items"]) == 2


# ---------------------------------------------------------------------------------------------
# Destinations that cannot be read into are staged a block of rows at a time
# ---------------------------------------------------------------------------------------------


def _staged_fill(storage: LocalStorage, piece: Piece, dest: torch.Tensor, full: torch.Tensor) -> None:
    metadata = parse_metadata(storage.read(METADATA_FILENAME, 0, storage.size(METADATA_FILENAME)), where="m")
    meta = metadata.tensors["w"]
    specs = meta.shard_spec_per_file
    plan = build_load_plan("w", meta, piece)
    lt = LocalTensor(dest, tuple(full.shape), code_from_dtype(full.dtype), True, piece)
    numels = {f: specs[f].local_numel for f in plan.files}
    crcs = {f: specs[f].checksums for f in plan.files}
    load.fill_in_place_from([(HeaderCache(storage), [load.LocalLoad("w", lt, plan, numels, crcs, meta)])])


@pytest.mark.parametrize("kind", ["box", "flat"])
def test_a_strided_destination_is_staged_in_blocks_of_rows(tmp_path, monkeypatch, kind):
    """A destination that cannot be read into (here transposed; on a GPU the same) goes
    through host buffers of whole rows no larger than the staging budget allows, each with a
    plan of its own, not one buffer the size of the tensor."""
    full = torch.arange(48 * 40, dtype=torch.float32).reshape(48, 40)
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(48, 20), global_offset=(0, 20 * r)) for r in range(2)])
    monkeypatch.setattr(load, "_STAGE_BYTES", 2 * 7 * 30 * 4)  # 7 rows of 30 a batch
    monkeypatch.setattr(load, "_MIN_STAGE_BYTES", 0)
    staged: list[int] = []
    real = load.execute_reads
    monkeypatch.setattr(load, "execute_reads", lambda storage, jobs, **kw: (staged.extend(j.dest.numel() for j in jobs), real(storage, jobs, **kw))[1])
    if kind == "box":
        piece, expected = Piece(local_shape=(45, 30), global_offset=(2, 5)), full[2:47, 5:35]
    else:  # a flat piece: elements [65, 1415) of the flattened tensor, as rows of 30
        piece, expected = Piece(flat=((65, 1415),)), full.reshape(-1)[65:1415].reshape(45, 30)
    dest = torch.full((30, 45), -1.0).t()
    _staged_fill(storage, piece, dest, full)
    assert torch.equal(dest, expected)
    assert staged == [7 * 30] * 6 + [3 * 30], staged


@pytest.mark.parametrize("shape", [(3, 600), (3, 150, 4)])
def test_a_row_larger_than_the_staging_budget_is_staged_in_slabs(tmp_path, monkeypatch, shape):
    """A destination whose rows are each larger than a staging batch (``[2, 100M]`` on a GPU)
    goes through slabs of its second dim, each with a plan of its own, not whole rows."""
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    half = shape[1] // 2
    stored = [Piece(local_shape=(shape[0], half, *shape[2:]), global_offset=(0, half * r, *[0] * (len(shape) - 2))) for r in range(2)]
    storage = write_checkpoint(str(tmp_path), full, stored)
    inner = math.prod(shape[2:])
    monkeypatch.setattr(load, "_STAGE_BYTES", 2 * 100 * 4)  # batches of 100 elements: a row is 600
    monkeypatch.setattr(load, "_MIN_STAGE_BYTES", 0)
    staged: list[int] = []
    real = load.execute_reads
    monkeypatch.setattr(load, "execute_reads", lambda storage, jobs, **kw: (staged.extend(j.dest.numel() for j in jobs), real(storage, jobs, **kw))[1])
    piece = Piece(local_shape=(2, shape[1] - 2, *shape[2:]), global_offset=(1, 1, *[0] * (len(shape) - 2)))
    expected = full[1:3, 1:-1]
    dest = torch.full(tuple(reversed(piece.local_shape)), -1.0).permute(*reversed(range(len(shape))))  # not contiguous
    _staged_fill(storage, piece, dest, full)
    assert torch.equal(dest, expected)
    slab = 100 // inner * inner
    per_row = [slab] * ((shape[1] - 2) * inner // slab) + ([(shape[1] - 2) * inner % slab] if (shape[1] - 2) * inner % slab else [])
    assert staged == per_row * 2, staged


def test_a_row_of_flattened_ranges_larger_than_the_budget_is_staged_a_row_at_a_time(tmp_path, monkeypatch):
    """A destination of flattened ranges whose one row exceeds a batch is read a row a block
    (it raised ``range() arg 3 must not be zero``)."""
    full = torch.arange(48 * 40, dtype=torch.float32).reshape(48, 40)
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(48, 20), global_offset=(0, 20 * r)) for r in range(2)])
    monkeypatch.setattr(load, "_STAGE_BYTES", 2 * 20 * 4)  # 20 elements a batch: a row is 30
    monkeypatch.setattr(load, "_MIN_STAGE_BYTES", 0)
    staged: list[int] = []
    real = load.execute_reads
    monkeypatch.setattr(load, "execute_reads", lambda storage, jobs, **kw: (staged.extend(j.dest.numel() for j in jobs), real(storage, jobs, **kw))[1])
    piece, expected = Piece(flat=((65, 1415),)), full.reshape(-1)[65:1415].reshape(45, 30)
    dest = torch.full((30, 45), -1.0).t()
    _staged_fill(storage, piece, dest, full)
    assert torch.equal(dest, expected)
    assert staged == [30] * 45, staged


def test_a_strided_destination_adds_at_most_the_memory_bound(tmp_path):
    """Peak extra RSS while a 160 MiB tensor loads into a transposed destination stays within
    10% of its bytes + 64 MiB (it was the whole tensor again)."""
    full = torch.arange(8192 * 5120, dtype=torch.float32).reshape(8192, 5120)
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(8192, 5120), global_offset=(0, 0))])
    dest = torch.zeros(5120, 8192).t()
    piece = Piece(flat=((0, full.numel()),))
    _, extra_mib = peak_extra_mib(lambda: _staged_fill(storage, piece, dest, full))
    assert torch.equal(dest, full)
    assert extra_mib <= 0.1 * 160 + 64, extra_mib



# ---------------------------------------------------------------------------------------------
# Two-stage loads in one process: staged blocks, units, and checksums as the bytes arrive
# ---------------------------------------------------------------------------------------------


def _flip_element(path: str, key: str, element: int, itemsize: int) -> None:
    """Flip one bit of element ``element`` (local index) of ``key``'s piece in a rank file."""
    import json
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + json.loads(f.read(n))[key]["data_offsets"][0] + element * itemsize)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def _two_stage(storage: LocalStorage, dest, verify: bool = False):
    from checkpointer.engine.two_stage import load_two_stage

    metadata = parse_metadata(storage.read(METADATA_FILENAME, 0, storage.size(METADATA_FILENAME)), where="m")
    return load_two_stage(storage, {"w": dest}, metadata, verify=verify)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_two_stage_loads_against_the_oracle_and_verify_catches_any_flipped_element(tmp_path_factory, data, monkeypatch):
    """Any saved layout into a contiguous, a transposed (staged) or a partial flat destination,
    with staged blocks, batches and checksum chunks of a few elements: every element lands, and
    with verify, a bit flipped in an element the load needs (in every file holding it) is caught."""
    from checkpointer import FlatShardedTensor
    from checkpointer.engine import two_stage

    shape = data.draw(shapes(max_ndim=3))
    saved = data.draw(layouts(shape))
    if not _tiling_layout(saved, shape) or math.prod(shape) == 0:
        return
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    full = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape).to(dtype)
    chunk_bytes = data.draw(st.sampled_from([8, 24, 72, CHUNK_BYTES]))
    path = str(tmp_path_factory.mktemp("ckpt"))
    storage = write_checkpoint(path, full, saved, chunk_bytes=chunk_bytes)
    monkeypatch.setattr(two_stage, "_STAGED_BYTES", data.draw(st.sampled_from([8, 24, 64, 1 << 20])))
    monkeypatch.setattr(two_stage, "_BATCH_BYTES", data.draw(st.sampled_from([16, 48, 1 << 20])))
    kind = data.draw(st.sampled_from(["contiguous", "transposed", "flat"] if len(shape) > 1 else ["contiguous", "flat"]))
    numel = math.prod(shape)
    lo = data.draw(st.integers(0, numel - 1)) if kind == "flat" else 0
    hi = data.draw(st.integers(lo + 1, numel)) if kind == "flat" else numel

    def fresh():
        if kind == "flat":
            return FlatShardedTensor(torch.zeros(hi - lo, dtype=dtype), shape, ((lo, hi),))
        if kind == "transposed":
            return torch.zeros(tuple(reversed(shape)), dtype=dtype).permute(*reversed(range(len(shape))))
        return torch.zeros(shape, dtype=dtype)

    dest = fresh()
    _two_stage(storage, dest, verify=data.draw(st.booleans()))
    got = dest.local if kind == "flat" else dest
    assert torch.equal(got, full.reshape(-1)[lo:hi] if kind == "flat" else full), (shape, saved, kind)
    flipped = data.draw(st.integers(lo, hi - 1))  # a flat index the load needs
    for rank, piece in enumerate(saved):
        indices = piece_indices(piece, shape)
        if flipped in indices and os.path.exists(os.path.join(path, rank_filename(rank))):
            _flip_element(os.path.join(path, rank_filename(rank)), "w", indices.index(flipped), full.element_size())
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'w'"):
        _two_stage(storage, fresh(), verify=True)


def test_a_verified_two_stage_load_hashes_what_arrives_and_rereads_only_partial_chunks(tmp_path, monkeypatch):
    """Staged in blocks smaller than a checksum chunk, a verified load read every chunk again for
    each block it touched (four times the tensor); the bytes are now hashed as they arrive, and
    only the two chunks a partial load touches in part are read again."""
    from checkpointer import FlatShardedTensor
    from checkpointer.engine import checks, two_stage

    full = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(1024, 256), global_offset=(0, 0))], chunk_bytes=64 << 10)
    monkeypatch.setattr(two_stage, "_STAGED_BYTES", 16 << 10)
    rereads: list[int] = []
    real = checks._check_stored
    monkeypatch.setattr(checks, "_check_stored", lambda storage, where, *args: (rereads.append(where[2]), real(storage, where, *args))[1])
    dest = torch.zeros(256, 1024).t()
    _two_stage(storage, dest, verify=True)
    assert torch.equal(dest, full) and rereads == []
    partial = FlatShardedTensor(torch.zeros(200_000 - 1000), (1024, 256), ((1000, 200_000),))
    _two_stage(storage, partial, verify=True)
    assert torch.equal(partial.local, full.reshape(-1)[1000:200_000])
    assert sorted(rereads) == [0, 200_000 * 4 // (64 << 10)], rereads


@pytest.mark.parametrize("stored", ["boxes", "interleaved"])
def test_narrow_column_pieces_open_a_few_staged_blocks_at_once(tmp_path, monkeypatch, stored):
    """32 column pieces loaded into a destination staged in blocks of 2 rows: a unit of a narrow
    piece spanned 64 rows, so every file's first unit opened 32 blocks together; units now span
    the rows of two blocks of the full tensor. The same for pieces of two column runs a row,
    stored as flattened ranges."""
    from checkpointer.engine import two_stage

    full = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    if stored == "boxes":
        pieces = [Piece(local_shape=(256, 16), global_offset=(0, 16 * r)) for r in range(32)]
    else:
        placements = [Shard(1), _StridedShard(1, split_factor=2)]
        pieces = [runs_piece((256, 512), dtensor_index_runs((256, 512), placements, (16, 2), (i, j))) for i in range(16) for j in range(2)]
        assert all(p.flat is not None and len(p.flat) == 512 for p in pieces)
    storage = write_checkpoint(str(tmp_path), full, pieces)
    monkeypatch.setattr(two_stage, "_STAGED_BYTES", 4096)
    held, most = [0], [0]
    real_take, real_give = StagingBlocks.take, StagingBlocks.give

    def take(self, nbytes):
        held[0] += 1
        most[0] = max(most[0], held[0])
        return real_take(self, nbytes)

    def give(self, buf):
        held[0] -= 1
        real_give(self, buf)

    monkeypatch.setattr(StagingBlocks, "take", take)
    monkeypatch.setattr(StagingBlocks, "give", give)
    dest = torch.zeros(512, 256).t()
    _two_stage(storage, dest)
    assert torch.equal(dest, full)
    assert held[0] == 0 and most[0] <= 4, most



def test_staging_blocks_take_a_free_one_that_fits_and_keep_no_more_than_were_held():
    """Both loads' staging (strided reads, two-stage staged blocks) share one pool: a free buffer
    that fits is taken, wherever it is in the list; when none fits, one is let go for the new one."""
    blocks = StagingBlocks(16)
    large, small = blocks.take(64), blocks.take(8)
    assert small.numel() == 16
    blocks.give(large)
    blocks.give(small)
    assert blocks.take(32) is large  # the last one given (small) does not fit
    bigger = blocks.take(128)  # none fits: small is let go
    blocks.give(large)
    blocks.give(bigger)
    assert len(blocks._free) == 2


def test_two_stage_makes_each_arena_once_at_its_largest_batch(tmp_path, monkeypatch):
    """Batches of 16, 60 and 60 KiB: the first arena took 16 KiB, then grew to 60 KiB for the third
    batch, the smaller one left in the allocator's heap (three batches' memory at the peak: 71 MiB
    extra in `tp_compare --strategy two_stage`'s first `mix_swapped` load, against 48 MiB). Each
    arena is now made once, at the size of the largest batch it takes. (Column pieces: each is a
    box of the full destination, copied from an arena; row pieces would be read in place.)"""
    from checkpointer.engine import two_stage

    cols = [32, 32, 240, 240]
    full = torch.randn(64, sum(cols), generator=torch.Generator().manual_seed(7))
    starts = [0, *torch.tensor(cols).cumsum(0).tolist()[:-1]]
    storage = write_checkpoint(str(tmp_path), full, [Piece(local_shape=(64, n), global_offset=(0, c)) for n, c in zip(cols, starts)])
    made: list[int] = []

    class CountingTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, *args, **kwargs):
            made.append(args[0])
            return torch.empty(*args, **kwargs)

    monkeypatch.setattr(two_stage, "_BATCH_BYTES", 64 << 10)
    monkeypatch.setattr(two_stage, "torch", CountingTorch())
    dest = torch.zeros(64, sum(cols))
    _two_stage(storage, dest)
    assert torch.equal(dest, full)
    assert made == [240 * 64 * 4] * 2, made  # before: [16 KiB, 60 KiB, 60 KiB]


def test_two_stage_copies_destinations_that_overlap_in_order(tmp_path):
    """Destinations that share memory (not one tensor twice) are not read in place: a unit of one
    read there would land under another's bytes before those were checked or sent (review: a
    false checksum mismatch with verify, every time; wrong values on another rank)."""
    g = torch.Generator().manual_seed(0)
    saved = {"a": torch.randn(8, generator=g), "b": torch.randn(8, generator=g)}
    Checkpointer().save(str(tmp_path), saved)
    storage = LocalStorage(str(tmp_path))
    metadata = parse_metadata(storage.read(METADATA_FILENAME, 0, storage.size(METADATA_FILENAME)), where="m")
    from checkpointer.engine.two_stage import load_two_stage

    base = torch.zeros(12)
    stats = load_two_stage(storage, {"a": base[0:8], "b": base[4:12]}, metadata, verify=True)
    assert torch.equal(base, torch.cat([saved["a"][:4], saved["b"]])) and stats.bytes_staged == stats.bytes_read == 64, stats


@pytest.mark.parametrize("verify", [False, True])
def test_two_stage_reads_whole_runs_straight_into_the_destination(tmp_path, verify):
    """A unit that falls whole in one contiguous run of a destination is read there: no batch
    buffer holds it and nothing copies it again (before: every byte went through an arena). A
    piece that is a box of the destination (a column block) still goes through one."""
    rows = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))
    (tmp_path / "rows").mkdir()
    (tmp_path / "cols").mkdir()
    by_rows = write_checkpoint(str(tmp_path / "rows"), rows, [Piece(local_shape=(32, 64), global_offset=(r, 0)) for r in (0, 32, 64)])
    dest = torch.zeros(96, 64)
    stats = _two_stage(by_rows, dest, verify=verify)
    assert torch.equal(dest, rows)
    assert stats.bytes_read == rows.numel() * 4 and stats.bytes_staged == 0, stats
    by_cols = write_checkpoint(str(tmp_path / "cols"), rows, [Piece(local_shape=(96, 32), global_offset=(0, c)) for c in (0, 32)])
    dest = torch.zeros(96, 64)
    stats = _two_stage(by_cols, dest, verify=verify)
    assert torch.equal(dest, rows)
    assert stats.bytes_staged == rows.numel() * 4, stats


@given(sizes=st.lists(st.integers(1, 5000), max_size=40), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_two_stage_batches_never_pass_their_size_as_placed_in_the_arena(sizes, itemsize):
    """A batch closed only once it had passed its size: up to twice it, with a large last unit.
    Now a batch holds at most its size, counted with each unit's 64-byte alignment in the arena,
    or one unit alone; the units keep their order."""
    from checkpointer.engine import two_stage
    from checkpointer.planning.readers import ReadUnit

    units, at = [], 0
    for n in sizes:
        units.append(ReadUnit("rank_0.safetensors", "w", at, at + n, 0, (0,)))
        at += n
    limit, two_stage._BATCH_BYTES = two_stage._BATCH_BYTES, 16 << 10
    try:
        batches = two_stage._batches(units, {"w": itemsize})
    finally:
        two_stage._BATCH_BYTES = limit
    assert [u for b in batches for u in b] == units
    for batch in batches:
        placed = sum(-(-(u.end - u.start) * itemsize // 64) * 64 for u in batch)
        assert len(batch) == 1 or placed <= 16 << 10, [u.end - u.start for u in batch]
