"""``lazy_load`` on every format: exact slices for every TP rank, lazy reads, detection by content."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from lazy_helpers import CountingStorage, expected_slice, reference_state, slice_span_bytes, write_hf_index
from safetensors.torch import save_file

from checkpointer import Checkpointer, CorruptCheckpointError, lazy_load

DIMS_A = {"embed.weight": 0, "proj.weight": 1, "proj.bias": 0, "tiny": 0, "ids": 2, "mask": 1, "empty": 0}
DIMS_B = {"embed.weight": 1, "proj.weight": 0, "tiny": 1, "ids": -2, "mask": 0, "empty": 1}
FORMATS = ["checkpoint", "top_level", "safetensors", "safetensors_unnamed", "hf_index", "hf_single", "pt", "bin", "bin_index"]


def write_format(fmt: str, root: str, state: dict[str, torch.Tensor]) -> str:
    """Write ``state`` in format ``fmt`` under ``root``; the path to give ``lazy_load``."""
    if fmt == "checkpoint":
        Checkpointer().save(os.path.join(root, "ck"), state)
        return os.path.join(root, "ck")
    if fmt == "top_level":
        Checkpointer().save(os.path.join(root, "step10", "model"), state)
        return os.path.join(root, "step10")
    if fmt == "safetensors":
        save_file(state, os.path.join(root, "w.safetensors"))
        return os.path.join(root, "w.safetensors")
    if fmt == "safetensors_unnamed":
        save_file(state, os.path.join(root, "weights.data"))
        return os.path.join(root, "weights.data")
    if fmt == "hf_index":
        write_hf_index(os.path.join(root, "hf"), state)
        return os.path.join(root, "hf")
    if fmt == "hf_single":
        os.makedirs(os.path.join(root, "hf1"))
        save_file(state, os.path.join(root, "hf1", "model.safetensors"))
        return os.path.join(root, "hf1")
    if fmt == "pt":
        torch.save(state, os.path.join(root, "m.pt"))
        return os.path.join(root, "m.pt")
    if fmt == "bin":
        torch.save(state, os.path.join(root, "pytorch_model.bin"))
        return os.path.join(root, "pytorch_model.bin")
    if fmt == "bin_index":
        write_hf_index(os.path.join(root, "hfbin"), state, binary=True)
        return os.path.join(root, "hfbin")
    raise ValueError(fmt)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("formats"))
    state = reference_state()
    return state, {fmt: write_format(fmt, root, state) for fmt in FORMATS}


def check_all(state, got: list, dims, tp_rank: int, tp_size: int) -> None:
    keys = [k for k, _ in got]
    assert sorted(keys) == sorted(state) and len(keys) == len(set(keys))
    for key, tensor in got:
        want = expected_slice(state[key], dims.get(key) if dims else None, tp_rank, tp_size)
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, (key, tensor.shape, want.shape)
        assert torch.equal(tensor, want), key
        assert tensor.device.type == "cpu"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp_size", [1, 2, 3])
@pytest.mark.parametrize("dims", [DIMS_A, DIMS_B, None], ids=["dimsA", "dimsB", "nodims"])
def test_every_format_every_rank(written, fmt, tp_size, dims):
    state, paths = written
    for tp_rank in range(tp_size):
        got = list(lazy_load(paths[fmt], dims, tp_rank=tp_rank, tp_size=tp_size))
        check_all(state, got, dims, tp_rank, tp_size)


@pytest.mark.parametrize("fmt", FORMATS)
def test_slices_reassemble_the_full_tensor(written, fmt):
    state, paths = written
    parts = [dict(lazy_load(paths[fmt], DIMS_A, tp_rank=r, tp_size=2)) for r in range(2)]
    for key, dim in DIMS_A.items():
        assert torch.equal(torch.cat([p[key] for p in parts], dim), state[key])


@pytest.mark.parametrize("fmt", ["pt", "bin"])
def test_mmap_torch_file(written, fmt):
    state, paths = written
    got = list(lazy_load(paths[fmt], DIMS_A, tp_rank=1, tp_size=2, mmap=True))
    check_all(state, got, DIMS_A, 1, 2)


def test_file_url_and_pathlike(written, tmp_path):
    state, paths = written
    import pathlib

    check_all(state, list(lazy_load("file://" + paths["safetensors"])), None, 0, 1)
    check_all(state, list(lazy_load(pathlib.Path(paths["checkpoint"]), DIMS_A, tp_rank=0, tp_size=2)), DIMS_A, 0, 2)


# ---------------------------------------------------------------------------------------
# Laziness: the first tensor comes before the rest is read, and only a slice's bytes are read
# ---------------------------------------------------------------------------------------


def big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"layer{i}.weight": torch.randn(256, 64, generator=g) for i in range(6)}  # 64 KiB each


@pytest.mark.parametrize("fmt", ["checkpoint", "hf_index", "hf_single"])
def test_first_item_before_the_rest_is_read(tmp_path, fmt):
    state = big_state()
    path = write_format(fmt, str(tmp_path), state)
    storage = CountingStorage(path)
    it = lazy_load(storage)
    assert storage.data_bytes() == 0  # detection and metadata only
    key, first = next(it)
    assert torch.equal(first, state[key])
    one = first.numel() * first.element_size()
    assert storage.data_bytes() == one
    rest = list(it)
    assert len(rest) == len(state) - 1
    assert storage.data_bytes() == one * len(state)


@pytest.mark.parametrize("fmt", ["checkpoint", "hf_index", "hf_single"])
@pytest.mark.parametrize("dim, rows", [(0, 256), (1, 64), (1, 256)])
def test_reads_only_the_slice(tmp_path, fmt, dim, rows):
    """Dim 0: one range, exactly the slice. Dim 1 (runs of 64 bytes, gaps of 192): one read of
    the slice's span per tensor, through a staging buffer (never more than the tensor), not a
    request per row."""
    g = torch.Generator().manual_seed(1)
    state = {f"layer{i}.weight": torch.randn(rows, 64, generator=g) for i in range(6)}
    path = write_format(fmt, str(tmp_path), state)
    storage = CountingStorage(path)
    dims = {k: dim for k in state}
    got = dict(lazy_load(storage, dims, tp_rank=1, tp_size=4))
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert storage.data_bytes() == sum(slice_span_bytes(t, dim, 1, 4) for t in state.values())
    if dim == 0:
        assert storage.data_bytes() == total // 4
    else:
        assert len(storage.data_reads) == len(state)
    for key in state:
        assert torch.equal(got[key], state[key].chunk(4, dim)[1])


def test_sharded_checkpoint_across_rank_files(tmp_path):
    """Pieces in several rank files (a box per file), sliced across file boundaries."""
    from checkpointer import FlatShardedTensor

    full = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)
    # Two "ranks" written by hand, in one process: each file holds a flat piece.
    d = str(tmp_path / "ck")
    halves = [FlatShardedTensor(full.view(-1)[:27].clone(), (10, 6), ((0, 27),)),
              FlatShardedTensor(full.view(-1)[27:].clone(), (10, 6), ((27, 60),))]
    _save_two_ranks(d, "w", halves)
    for dim in (0, 1):
        for r in range(3):
            got = dict(lazy_load(d, {"w": dim}, tp_rank=r, tp_size=3))
            assert torch.equal(got["w"], expected_slice(full, dim, r, 3))


def _save_two_ranks(d: str, key: str, pieces) -> None:
    """Write a two-file checkpoint from one process, as two ranks would."""
    from checkpointer.engine.rankfile import write_rank_file
    from checkpointer.planning.plan import PieceDesc, build_save_plan
    from checkpointer.sharding import describe
    from checkpointer.storage.local import LocalStorage

    storage = LocalStorage(d)
    storage.prepare()
    descs = []
    for piece in pieces:
        lt = describe(piece)
        descs.append([PieceDesc(key, lt.shape, lt.dtype, lt.is_sharded, lt.piece)])
    plan = build_save_plan(descs)
    for rank, piece in enumerate(pieces):
        write_rank_file(storage, f"rank_{rank}.safetensors", [(key, describe(piece))], checksums=False)
    storage.write("metadata.json", plan.metadata.to_json_bytes())


def test_tied_keys_come_under_both_names(tmp_path):
    w = torch.randn(8, 4)
    Checkpointer().save(str(tmp_path / "ck"), {"embed.weight": w, "lm_head.weight": w, "b": torch.ones(3)})
    got = dict(lazy_load(str(tmp_path / "ck"), {"embed.weight": 0, "lm_head.weight": 1}, tp_rank=1, tp_size=2))
    assert torch.equal(got["embed.weight"], w.chunk(2, 0)[1])
    assert torch.equal(got["lm_head.weight"], w.chunk(2, 1)[1])
    assert torch.equal(got["b"], torch.ones(3))


def test_hf_cache_symlinks_into_blobs(tmp_path):
    """The Hugging Face cache links snapshots/<rev>/* to ../../blobs/<hash>: followed on purpose."""
    state = big_state()
    blobs = tmp_path / "blobs"
    src = tmp_path / "src"
    write_hf_index(str(src), state, files=2)
    blobs.mkdir()
    snap = tmp_path / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(src))):
        shutil.move(str(src / name), str(blobs / f"hash{i}"))
        os.symlink(os.path.join("..", "..", "blobs", f"hash{i}"), snap / name)
    got = dict(lazy_load(str(snap), {k: 1 for k in state}, tp_rank=0, tp_size=2))
    assert all(torch.equal(got[k], state[k].chunk(2, 1)[0]) for k in state)
    single = tmp_path / "single.safetensors"
    os.symlink(blobs / "hash0", single)
    assert len(list(lazy_load(str(single)))) > 0


# ---------------------------------------------------------------------------------------
# Remote: over http(s), the same formats, few ranged requests for trailing-dim slices
# ---------------------------------------------------------------------------------------


@pytest.fixture
def http_root(tmp_path, monkeypatch):
    from storage_servers import RangeFileServer

    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    server = RangeFileServer(str(tmp_path))
    yield str(tmp_path), server
    server.close()


@pytest.mark.parametrize("fmt", ["checkpoint", "top_level", "safetensors", "safetensors_unnamed", "hf_index", "pt"])
def test_over_http(http_root, fmt):
    root, server = http_root
    state = reference_state()
    local = write_format(fmt, root, state)
    url = server.url + "/" + os.path.relpath(local, root)
    for r in range(2):
        check_all(state, list(lazy_load(url, DIMS_A, tp_rank=r, tp_size=2)), DIMS_A, r, 2)


def test_trailing_dim_slice_over_http_is_few_requests(http_root):
    root, server = http_root
    w = torch.randn(64, 256)  # 64 ranges of 512 B, 512 B apart: fetched as one range
    save_file({"w": w}, os.path.join(root, "w.safetensors"))
    server.ranges_seen.clear()
    got = dict(lazy_load(server.url + "/w.safetensors", {"w": 1}, tp_rank=1, tp_size=2))
    assert torch.equal(got["w"], w.chunk(2, 1)[1])
    assert len([r for r in server.ranges_seen if r]) <= 4


def test_gathered_reads_merges_near_ranges(tmp_path):
    from checkpointer.tools.gathered import GatheredReads

    data = os.urandom(1 << 16)
    (tmp_path / "f").write_bytes(data)
    inner = CountingStorage(str(tmp_path))
    storage = GatheredReads(inner, gap=100, span=4096)
    offsets = [0, 10, 50, 120, 300, 5000, 5010, 9000]  # 10-byte reads
    bufs = [bytearray(10) for _ in offsets]
    storage.read_into("f", [(o, memoryview(b)) for o, b in zip(offsets, bufs)][::-1])
    assert [bytes(b) for b in bufs] == [data[o : o + 10] for o in offsets]
    # [0..130) merged; 300 is 170 past 130: alone; 5000 and 5010 merged; 9000 alone.
    assert sorted((off, n) for _, off, n in inner.data_reads) == [(0, 130), (300, 10), (5000, 20), (9000, 10)]
    inner.data_reads.clear()
    wide = GatheredReads(inner, gap=1 << 20, span=64)
    bufs = [bytearray(10) for _ in offsets]
    wide.read_into("f", [(o, memoryview(b)) for o, b in zip(offsets, bufs)])
    assert [bytes(b) for b in bufs] == [data[o : o + 10] for o in offsets]
    assert all(n <= 64 for _, _, n in inner.data_reads)  # the span limit holds


def test_over_http_a_file_whose_name_is_percent_encoded(http_root):
    """The URL of a file named ``my model+v2%.safetensors`` is percent-encoded; lazy_load must
    ask for that file, not for one whose name is the encoded text (encoded twice)."""
    from urllib.parse import quote

    root, server = http_root
    w = torch.randn(4, 6)
    save_file({"w": w}, os.path.join(root, "my model+v2%.safetensors"))
    got = dict(lazy_load(server.url + "/" + quote("my model+v2%.safetensors")))
    assert list(got) == ["w"] and torch.equal(got["w"], w)


def test_hf_source_over_http_a_file_whose_name_is_percent_encoded(http_root):
    """``checkpointer convert``'s Hugging Face source takes a file URL the same way."""
    from urllib.parse import quote

    from checkpointer.tools.detect import open_source

    root, server = http_root
    w = torch.randn(4, 6)
    save_file({"w": w}, os.path.join(root, "my model+v2%.safetensors"))
    src = open_source(server.url + "/" + quote("my model+v2%.safetensors"))
    assert [key for key, _, _ in src.entries()] == ["w"] and torch.equal(src.fetch("w"), w)


# ---------------------------------------------------------------------------------------
# Dtypes other safetensors writers use (not this library's own format)
# ---------------------------------------------------------------------------------------


def test_safetensors_dtypes_beyond_our_format(tmp_path):
    """uint16/32/64 and complex64 are valid safetensors (safetensors.torch writes them); a
    lazy load must read them, exactly, as it reads the same tensors from a .pt file."""
    g = torch.Generator().manual_seed(4)
    state = {
        "u16": torch.randint(0, 1 << 16, (6, 5), generator=g).to(torch.uint16),
        "u32": torch.randint(0, 1 << 31, (7, 3), generator=g).to(torch.uint32),
        "u64": torch.randint(0, 1 << 62, (5,), generator=g).to(torch.uint64),
        "c64": torch.randn(4, 6, generator=g, dtype=torch.complex64),
    }
    dims = {"u16": 1, "u32": 0, "u64": 0, "c64": 1}
    save_file(state, str(tmp_path / "q.safetensors"))
    write_hf_index(str(tmp_path / "hf"), state, files=2)
    for path in (str(tmp_path / "q.safetensors"), str(tmp_path / "hf")):
        for tp_rank in range(2):
            got = dict(lazy_load(path, dims, tp_rank=tp_rank, tp_size=2))
            for key, full in state.items():
                want = expected_slice(full, dims[key], tp_rank, 2)
                assert got[key].dtype == full.dtype, key
                assert torch.equal(got[key].view(torch.uint8), want.contiguous().view(torch.uint8)), key


def test_safetensors_dtype_we_cannot_read_is_named(tmp_path):
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}).encode()
    (tmp_path / "f4.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(CorruptCheckpointError, match=r"f4.safetensors.*'w'.*dtype 'F4'"):
        list(lazy_load(str(tmp_path / "f4.safetensors")))


def test_convert_of_a_dtype_our_format_cannot_hold_writes_nothing(tmp_path):
    from checkpointer import CheckpointError
    from checkpointer.tools.convert import convert

    q = torch.arange(6, dtype=torch.int32).to(torch.uint32)
    save_file({"w": torch.ones(2), "q": q}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'q'.*U32"):
        convert(str(tmp_path / "model.safetensors"), str(tmp_path / "ck"), to="checkpointer")
    assert not os.path.exists(tmp_path / "ck") or not os.listdir(tmp_path / "ck")
    convert(str(tmp_path / "model.safetensors"), str(tmp_path / "out.safetensors"), to="hf")
    got = dict(lazy_load(str(tmp_path / "out.safetensors")))
    assert torch.equal(got["q"], q)


def test_torch_file_whose_nested_keys_collide_is_refused(tmp_path):
    """``{"a.b": x, "a": {"b": y}}`` flattens both to ``a.b``: one used to replace the other silently."""
    path = str(tmp_path / "collide.pt")
    torch.save({"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}, "c": torch.ones(1)}, path)
    with pytest.raises(CorruptCheckpointError, match=r"collide\.pt: two tensors flatten to the key 'a\.b'"):
        dict(lazy_load(path))
    torch.save({"a": {"b": torch.ones(2)}, "a.c": torch.zeros(1)}, path)  # nested and dotted, no clash
    got = dict(lazy_load(path))
    assert sorted(got) == ["a.b", "a.c"] and torch.equal(got["a.b"], torch.ones(2))


def test_torch_file_entries_that_are_not_tensors_are_named_in_a_warning(tmp_path):
    """A training checkpoint's ``epoch`` or config values were dropped without a word."""
    path = str(tmp_path / "train.pt")
    torch.save({"model": {"w": torch.arange(3.0)}, "epoch": 3, "cfg": {"lr": 0.1, "names": ["a"]}}, path)
    with pytest.warns(UserWarning, match=r"train\.pt: 3 entries are not tensors and are skipped: \['epoch', 'cfg\.lr', 'cfg\.names'\]"):
        got = dict(lazy_load(path))
    assert list(got) == ["model.w"] and torch.equal(got["model.w"], torch.arange(3.0))
