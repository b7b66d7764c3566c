"""Hostile Hugging Face directories given to ``load_model_and_optim_state``: each is a
``CheckpointError`` naming the file, and no tensor of the model is written.

An index naming a file outside the directory (relative or absolute), a header whose sizes lie
(data offsets that do not hold the shape, or run past the file), a key in two shards, a key
the index lists but its shard lacks, an index that is not JSON or has a key twice.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_helpers import OwnGPT2, gpt2_key_map, hf_gpt2, save_hf
from hostile import edit_header, split_rank_file, write_rank_file

from checkpointer import CheckpointError, CorruptCheckpointError, load_model_and_optim_state

pytest.importorskip("transformers", reason="transformers is not installed")

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    top = tmp_path_factory.mktemp("hf")
    model = hf_gpt2(seed=1)
    return save_hf(model, str(top / "sharded"), sharded=True), save_hf(model, str(top / "one"), sharded=False)


@pytest.fixture
def sharded(pristine, tmp_path):
    return shutil.copytree(pristine[0], str(tmp_path / "copy"))


def _index(path: str) -> dict:
    with open(os.path.join(path, INDEX)) as f:
        return json.load(f)


def _write_index(path: str, index: dict | str) -> None:
    with open(os.path.join(path, INDEX), "w") as f:
        f.write(index if isinstance(index, str) else json.dumps(index))


def _refused(path: str, *words: str) -> str:
    model = OwnGPT2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_model_and_optim_state(path, model, key_map=gpt2_key_map)
    assert isinstance(info.value, CorruptCheckpointError), repr(info.value)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing written
    return str(info.value)


@pytest.mark.parametrize("outside", ["../elsewhere.safetensors", "/etc/passwd", "sub/model.safetensors"])
def test_index_naming_a_file_outside_the_directory(sharded, tmp_path, outside):
    index = _index(sharded)
    index["weight_map"]["transformer.wte.weight"] = outside
    _write_index(sharded, index)
    # a real safetensors file there, so only the name can be refused
    shutil.copy(os.path.join(sharded, sorted(set(index["weight_map"].values()) - {outside})[0]),
                str(tmp_path / "elsewhere.safetensors"))
    _refused(sharded, INDEX, repr(outside))


def test_header_lying_about_sizes(sharded):
    index = _index(sharded)
    name = index["weight_map"]["transformer.wte.weight"]
    path = os.path.join(sharded, name)

    def shrink(header):  # the offsets hold fewer bytes than the shape needs
        start, end = header["transformer.wte.weight"]["data_offsets"]
        header["transformer.wte.weight"]["data_offsets"] = [start, end - 4]

    edit_header(path, shrink)
    _refused(sharded, name)


def test_header_offsets_past_the_end_of_the_file(sharded):
    index = _index(sharded)
    name = index["weight_map"]["transformer.wte.weight"]
    path = os.path.join(sharded, name)
    header, data = split_rank_file(path)
    write_rank_file(path, header, data[: len(data) // 2])  # cut short: the header claims more
    _refused(sharded, name)


def test_header_length_lying(sharded):
    name = _index(sharded)["weight_map"]["transformer.wpe.weight"]
    path = os.path.join(sharded, name)
    header, data = split_rank_file(path)
    write_rank_file(path, header, data, length=10**9)
    _refused(sharded, name)


def test_key_in_two_shards(pristine, tmp_path):
    """No index: every .safetensors file of the directory is read; one key in two is refused."""
    one = pristine[1]
    dup = tmp_path / "dup"
    dup.mkdir()
    shutil.copy(os.path.join(one, "model.safetensors"), str(dup / "a.safetensors"))
    shutil.copy(os.path.join(one, "model.safetensors"), str(dup / "b.safetensors"))
    message = _refused(str(dup), "also in")
    assert "a.safetensors" in message and "b.safetensors" in message


def test_key_listed_in_the_index_but_not_in_its_shard(sharded):
    index = _index(sharded)
    wte = index["weight_map"]["transformer.wte.weight"]
    other = next(n for n in index["weight_map"].values() if n != wte)
    index["weight_map"]["transformer.wte.weight"] = other
    _write_index(sharded, index)
    _refused(sharded, other, "transformer.wte.weight")


def test_index_not_json_or_with_a_key_twice(sharded):
    _write_index(sharded, "{not json")
    _refused(sharded, INDEX)
    name = "model-00001-of-00007.safetensors"
    _write_index(sharded, '{"weight_map": {"transformer.wte.weight": "%s", "transformer.wte.weight": "%s"}}'
                 % (name, name))
    _refused(sharded, INDEX)


def test_shard_listed_but_missing(sharded):
    name = _index(sharded)["weight_map"]["transformer.ln_f.weight"]
    os.remove(os.path.join(sharded, name))
    _refused(sharded, name, "missing")
