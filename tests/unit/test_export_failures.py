"""A sharded export that fails part-way leaves nothing that reads as a model: not the new shards
beside an earlier export's index (a mix of two checkpoints), nor some shards without the others
(a model missing tensors). Both found by a review."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import checkpointer
from checkpointer import Checkpointer, CorruptCheckpointError, IncompleteCheckpointError, export_safetensors

INDEX = "model.safetensors.index.json"


def _flip_a_byte_of(path: str, key: str) -> None:
    data = bytearray(open(path, "rb").read())
    n = int.from_bytes(data[:8], "little")
    data[8 + n + json.loads(data[8 : 8 + n])[key]["data_offsets"][0] + 10] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.fixture
def steps(tmp_path):
    for step in (1, 2):
        Checkpointer().save(str(tmp_path / f"step{step}"), {"a": torch.full((1000,), float(step)), "b": torch.full((1000,), float(step))})
    _flip_a_byte_of(str(tmp_path / "step2" / "rank_0.safetensors"), "b")  # step 2's b fails its checksum
    return tmp_path


def test_a_failed_export_over_an_earlier_one_leaves_no_index_to_mix_them(steps):
    out = str(steps / "hf")
    export_safetensors(str(steps / "step1"), out, max_shard_size=4000)
    assert sorted(os.listdir(out)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    with pytest.raises(CorruptCheckpointError, match="b"):
        export_safetensors(str(steps / "step2"), out, max_shard_size=4000)  # a (shard 1) written, then b fails
    assert sorted(os.listdir(out)) == ["model-00002-of-00002.safetensors"]  # the old index went first
    with pytest.raises(IncompleteCheckpointError, match=r"model-00001-of-00002\.safetensors is missing"):
        dict(checkpointer.lazy_load(out))


def test_a_failed_export_into_a_new_directory_leaves_no_shards(steps):
    out = str(steps / "fresh")
    with pytest.raises(CorruptCheckpointError, match="b"):
        export_safetensors(str(steps / "step2"), out, max_shard_size=4000)
    assert os.listdir(out) == []


def test_numbered_shards_without_an_index_must_all_be_there(tmp_path):
    for i in (1, 3):
        save_file({f"t{i}": torch.ones(2)}, str(tmp_path / f"model-{i:05d}-of-00003.safetensors"))
    with pytest.raises(IncompleteCheckpointError, match=r"model-00002-of-00003\.safetensors is missing \(1 of the 3"):
        dict(checkpointer.lazy_load(str(tmp_path)))
    save_file({"t2": torch.ones(2)}, str(tmp_path / "model-00002-of-00003.safetensors"))
    assert sorted(dict(checkpointer.lazy_load(str(tmp_path)))) == ["t1", "t2", "t3"]


def test_numbered_shards_without_an_index_must_include_the_last(tmp_path):
    for i in (1, 2):
        save_file({f"t{i}": torch.ones(2)}, str(tmp_path / f"model-{i:05d}-of-00003.safetensors"))
    with pytest.raises(IncompleteCheckpointError, match=r"model-00003-of-00003\.safetensors is missing \(1 of the 3"):
        dict(checkpointer.lazy_load(str(tmp_path)))
