"""Unsharding onto a device: full tensors allocated there and filled through bounded host
batches (run here with the CPU as the device; tests/gpu runs it onto a GPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from checkpointer import Checkpointer, CorruptCheckpointError
from checkpointer.engine.load import read_metadata
from checkpointer.engine.reader import CheckpointReader
from checkpointer.engine.load import read_full_onto
from checkpointer.storage.local import LocalStorage


@pytest.fixture(params=["verbose", "compact"])
def saved(tmp_path, request, monkeypatch):
    """Saved in both forms."""
    return _save(tmp_path, monkeypatch, request.param == "compact")


@pytest.fixture()
def saved_verbose(tmp_path, monkeypatch):
    """Saved in format 1, whose listed pieces the tests edit."""
    return _save(tmp_path, monkeypatch, False)


def _save(tmp_path, monkeypatch, compact: bool):
    from checkpointer.engine import save as engine_save

    monkeypatch.setattr(engine_save, "COMPACT_METADATA", compact)
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
    plain = CheckpointReader(storage, metadata).full_tensors(list(metadata.tensors))
    assert all(torch.equal(plain[k], onto[k]) for k in state)


@pytest.mark.parametrize("offsets_too", [False, True], ids=["pieces-do-not-cover-it", "files-do-not-hold-it"])
def test_a_shape_the_files_do_not_hold_is_refused_before_allocating(saved_verbose, monkeypatch, offsets_too):
    saved = saved_verbose
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
    # Either the header's entry disagrees with the piece, or the pieces hold too few elements.
    want = "is F32 x 407 in the file but F32 x" if offsets_too else f"gives it {huge[0] * huge[1]} elements but its files"
    assert want in str(raised.value) and (offsets_too or str(raised.value).endswith(f"hold {37 * 11}"))
    assert allocated == []


def test_headers_are_checked_before_a_box_is_expanded(saved_verbose, monkeypatch):
    saved = saved_verbose
    """A box of 2**20 rows that the file does not hold is refused before its ranges (one per row)
    are listed: the old order built a million ranges, and for 2**24 rows took 50 s and 5 GiB."""
    import checkpointer.planning.pieces as plan  # where pieces are expanded into ranges

    path, _ = saved
    rows = 1 << 20
    meta_file = os.path.join(path, "metadata.json")
    with open(meta_file) as f:
        doc = json.load(f)
    entry = doc["tensors"]["w"]
    entry["shape"] = [rows, 2]
    for spec in entry["shard_spec_per_file"].values():
        spec.update(flattened_offsets=None, local_shape=[rows, 1], global_offset=[0, 0], checksums=None)
    with open(meta_file, "w") as f:
        json.dump(doc, f)
    expanded = []
    real_box_ranges = plan.box_ranges
    monkeypatch.setattr(plan, "box_ranges", lambda *a: expanded.append(len(r := real_box_ranges(*a))) or r)
    storage = LocalStorage(path)
    metadata = read_metadata(storage, no_dist=True)
    for unshard in (read_full_onto, lambda device, s, m: CheckpointReader(s, m).full_tensors(["w"])):
        with pytest.raises(CorruptCheckpointError, match=f"'w' is F32 x 407 in the file but F32 x {rows} in metadata"):
            unshard(torch.device("cpu"), storage, metadata)
    assert expanded == []
