"""Unsharding onto a device: full tensors allocated there and filled through bounded host
batches (run here with the CPU as the device; tests/gpu runs it onto a GPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from checkpointer import Checkpointer, CorruptCheckpointError
from checkpointer.engine.load import read_metadata
from checkpointer.engine.unshard import read_full, read_full_onto
from checkpointer.storage.local import LocalStorage


@pytest.fixture()
def saved(tmp_path):
    gen = torch.Generator().manual_seed(2)
    state = {
        "w": torch.randn(37, 11, generator=gen),
        "half": torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(9, dtype=torch.int64),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
    }
    Checkpointer().save(str(tmp_path / "ckpt"), state)
    return str(tmp_path / "ckpt"), state


@pytest.mark.parametrize("verify", [False, True])
def test_full_tensors_onto_a_device_equal_the_saved_ones(saved, verify):
    path, state = saved
    storage = LocalStorage(path)
    metadata = read_metadata(storage, no_dist=True)
    onto = read_full_onto(torch.device("cpu"), storage, metadata, verify=verify)
    assert onto.keys() == state.keys()
    for key, value in state.items():
        assert onto[key].dtype == value.dtype and torch.equal(onto[key], value), key
    plain = read_full(storage, metadata, list(metadata.tensors))
    assert all(torch.equal(plain[k], onto[k]) for k in state)


@pytest.mark.parametrize("offsets_too", [False, True], ids=["pieces-do-not-cover-it", "files-do-not-hold-it"])
def test_a_shape_the_files_do_not_hold_is_refused_before_allocating(saved, monkeypatch, offsets_too):
    path, _ = saved
    huge = [1 << 40, 11]
    meta_file = os.path.join(path, "metadata.json")
    with open(meta_file) as f:
        doc = json.load(f)
    entry = doc["tensors"]["w"]
    entry["shape"] = huge
    if offsets_too:
        for spec in entry["shard_spec_per_file"].values():
            spec["flattened_offsets"] = [[0, huge[0] * huge[1]]]
    with open(meta_file, "w") as f:
        json.dump(doc, f)
    storage = LocalStorage(path)
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    with pytest.raises(CorruptCheckpointError, match="'w'") as raised:
        read_full_onto(torch.device("cpu"), storage, read_metadata(storage, no_dist=True))
    assert ("in the file but" if offsets_too else "the files hold") in str(raised.value)
    assert allocated == []
