"""Hostile input in the other formats lazy_load reads: torch pickles (``.pt``) and Hugging Face
directories (``model.safetensors.index.json``). The rule is the one of test_hostile_files.py:
a CheckpointError naming the file, never another exception, never a hang or a huge allocation.
"""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest
import torch
from rel_helpers import assert_rule, lazy_all, run_loaders

from safetensors.torch import save_file

import checkpointer
from checkpointer.tools.export import INDEX_NAME
from checkpointer.tools.hf import read_hf_index
from checkpointer.tools.torch_files import MAX_NESTING
from checkpointer.engine.load import read_metadata
from checkpointer.tools.detect import open_source
from checkpointer.storage.local import LocalStorage


def _nested(depth: int) -> dict:
    """A state dict whose tensor sits under ``depth`` nested mappings (the outer one included)."""
    d: dict = {"w": torch.ones(2)}
    for _ in range(depth - 1):
        d = {"a": d}
    return d


def _save_deep(path: str, depth: int) -> None:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 4 * depth + 1000))  # the pickler recurses too
    try:
        torch.save(_nested(depth), path)
    finally:
        sys.setrecursionlimit(old)


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 5000])
def test_torch_pickle_nested_too_deeply(tmp_path, depth):
    """5000 levels made the flattening recurse out of stack (RecursionError)."""
    path = str(tmp_path / "ckpt" / "model.pt")
    os.makedirs(os.path.dirname(path))
    _save_deep(path, depth)
    outcomes = run_loaders({"lazy_load": lambda: lazy_all(path)}, os.path.dirname(path), (str(tmp_path),))
    assert_rule(outcomes, must_raise={"lazy_load"}, needles=("model.pt",), cls=checkpointer.CorruptCheckpointError)
    assert "nests mappings more than" in str(outcomes["lazy_load"].error)


def test_torch_pickle_nested_to_the_limit_loads(tmp_path):
    path = str(tmp_path / "model.pt")
    _save_deep(path, MAX_NESTING)
    (key, tensor), = checkpointer.lazy_load(path)
    assert key == "a." * (MAX_NESTING - 1) + "w"
    assert torch.equal(tensor, torch.ones(2))


# ---------------------------------------------------------------------------------------
# metadata.json and model.safetensors.index.json: read [0, size) of the size as stat'ed
# ---------------------------------------------------------------------------------------


class GrowingStorage(LocalStorage):
    """Local storage where a writer appends ``grow`` bytes to a file right after each stat of it
    (whitespace: the JSON stays valid); records the length of every read."""

    def __init__(self, root: str, grow: int = 4 << 20):
        super().__init__(root)
        self.grow = grow
        self.reads: list[tuple[str, int]] = []

    def size(self, name: str) -> int:
        size = super().size(name)
        with open(self._path(name), "ab") as f:
            f.write(b" " * self.grow)
        return size

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        data = super().read(name, start, end)
        self.reads.append((name, len(data)))
        return data


def _hf_dir(path: str) -> str:
    os.makedirs(path)
    save_file({"a": torch.ones(3)}, os.path.join(path, "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(2)}, os.path.join(path, "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump(index, f)
    return path


def test_metadata_json_that_grows_is_read_to_its_stat_size(tmp_path):
    """The old read went on to the end of the file, however far that had moved since the stat."""
    path = str(tmp_path / "ckpt")
    checkpointer.Checkpointer().save(path, {"w": torch.ones(3)})
    size = os.path.getsize(os.path.join(path, "metadata.json"))
    storage = GrowingStorage(path)
    metadata = read_metadata(storage, no_dist=True)
    assert list(metadata.tensors) == ["w"]
    assert [n for name, n in storage.reads if name == "metadata.json"] == [size]


@pytest.mark.parametrize("reader", ["read_hf_index", "HFSource"])
def test_hf_index_that_grows_is_read_to_its_stat_size(tmp_path, reader):
    path = _hf_dir(str(tmp_path / "hf"))
    size = os.path.getsize(os.path.join(path, INDEX_NAME))
    storage = GrowingStorage(path)
    if reader == "read_hf_index":
        assert sorted(read_hf_index(storage, INDEX_NAME)) == sorted(
            ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        )
    else:
        assert [key for key, _, _ in open_source(storage).entries()] == ["a", "b"]
    assert [n for name, n in storage.reads if name == INDEX_NAME] == [size]


def _stat_before_a_truncation(storage: LocalStorage) -> LocalStorage:
    """Sizes reported 10 bytes larger than the file: as if it were cut short after the stat."""
    real_size = storage.size
    storage.size = lambda name: real_size(name) + 10  # type: ignore[method-assign]
    return storage


def test_file_that_shrinks_while_read_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpointer.Checkpointer().save(path, {"w": torch.ones(3)})
    with pytest.raises(checkpointer.CorruptCheckpointError, match="changed while it was read"):
        read_metadata(_stat_before_a_truncation(LocalStorage(path)), no_dist=True)
    hf = _hf_dir(str(tmp_path / "hf"))
    with pytest.raises(checkpointer.CorruptCheckpointError, match="changed while it was read"):
        read_hf_index(_stat_before_a_truncation(LocalStorage(hf)), INDEX_NAME)


@pytest.mark.parametrize("special", ["fifo", "directory"])
def test_hf_index_that_is_not_a_regular_file(tmp_path, special):
    path = _hf_dir(str(tmp_path / "hf"))
    index = os.path.join(path, INDEX_NAME)
    os.remove(index)
    os.mkfifo(index) if special == "fifo" else os.mkdir(index)
    outcomes = run_loaders(
        {"lazy_load": lambda: lazy_all(path), "HFSource": lambda: open_source(path).entries()}, path, (str(tmp_path),), hang_s=4
    )
    assert_rule(outcomes, must_raise=set(outcomes), needles=(INDEX_NAME,), cls=checkpointer.CorruptCheckpointError)


@pytest.mark.parametrize("weight_map", ["[" * 100_000 + "]" * 100_000, '{"a": ' * 100_000 + "1" + "}" * 100_000])
def test_hf_index_nested_too_deeply(tmp_path, weight_map):
    path = _hf_dir(str(tmp_path / "hf"))
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        f.write('{"weight_map": ' + weight_map + "}")
    outcomes = run_loaders(
        {"lazy_load": lambda: lazy_all(path), "HFSource": lambda: open_source(path).entries()}, path, (str(tmp_path),)
    )
    assert_rule(outcomes, must_raise=set(outcomes), needles=(INDEX_NAME,), cls=checkpointer.CorruptCheckpointError)


# ---------------------------------------------------------------------------------------
# Dimensions past MAX_NUMEL: products of dimensions would overflow int64 in torch
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**62, 2**62]], ids=["dim-past-int64", "strides-overflow"])
def test_huge_dims_of_an_empty_tensor_in_a_safetensors_file(tmp_path, shape):
    """No element and no byte: torch.empty raised TypeError or RuntimeError for these."""
    path = str(tmp_path / "hf" / "model.safetensors")
    os.makedirs(os.path.dirname(path))
    header = json.dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
    outcomes = run_loaders(
        {"lazy_load": lambda: lazy_all(path), "HFSource": lambda: open_source(path).fetch("a")},
        os.path.dirname(path),
        (str(tmp_path),),
    )
    assert_rule(outcomes, must_raise=set(outcomes), needles=("model.safetensors",), cls=checkpointer.CorruptCheckpointError)


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**62, 2**62]], ids=["dim-past-int64", "strides-overflow"])
def test_huge_dims_of_an_empty_tensor_in_metadata(tmp_path, shape):
    path = str(tmp_path / "ckpt")
    checkpointer.Checkpointer().save(path, {"w": torch.ones(3)})
    meta_file = os.path.join(path, "metadata.json")
    with open(meta_file) as f:
        doc = json.load(f)
    doc["tensors"]["e"] = {"shape": shape, "is_sharded": False, "dtype": "F32", "shard_spec_per_file": {}}
    with open(meta_file, "w") as f:
        json.dump(doc, f)
    c = checkpointer.Checkpointer()
    outcomes = run_loaders(
        {
            "unshard": lambda: c.unshard(path, no_dist=True),
            "get_metadata": lambda: c.get_metadata(path, no_dist=True),
            "lazy_load": lambda: lazy_all(path),
        },
        path,
        (str(tmp_path),),
    )
    assert_rule(outcomes, must_raise=set(outcomes), needles=("metadata.json",), cls=checkpointer.CorruptCheckpointError)
