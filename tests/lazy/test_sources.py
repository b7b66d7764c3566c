"""The tools' tensor sources: one class per format, picked by ``supports``; every source reads
the same tensors, whole and by box; the Hugging Face source names each tensor's bytes."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from lazy_helpers import reference_state, write_hf_index
from safetensors.torch import save_file

from checkpointer import Checkpointer, CorruptCheckpointError, lazy_load
from checkpointer.tools.checkpoint_tensors import OursSource
from checkpointer.tools.dcp import DCPSource
from checkpointer.tools.detect import SOURCES, open_source
from checkpointer.tools.hf import HFSource
from checkpointer.tools.torch_files import TorchSource


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The same state in every format the sources read: ``{name: (path, source class)}``."""
    root = tmp_path_factory.mktemp("formats")
    state = reference_state(3)
    Checkpointer().save(str(root / "ours"), state)
    write_hf_index(str(root / "hf"), state)
    save_file(state, str(root / "single.safetensors"))
    os.makedirs(root / "named")
    save_file(state, str(root / "named" / "weights.safetensors"))  # not model.safetensors
    torch.save(state, str(root / "state.pt"))
    write_hf_index(str(root / "bin"), state, binary=True)
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
    return state, {
        "ours": (str(root / "ours"), OursSource),
        "hf": (str(root / "hf"), HFSource),
        "single": (str(root / "single.safetensors"), HFSource),
        "named": (str(root / "named"), HFSource),
        "pt": (str(root / "state.pt"), TorchSource),
        "bin": (str(root / "bin"), TorchSource),
        "dcp": (str(root / "dcp"), DCPSource),
    }


def test_each_format_is_read_by_its_source_whole_and_by_box(formats):
    state, paths = formats
    for name, (path, cls) in paths.items():
        source = open_source(path, allow_pickle=True)
        assert type(source) is cls, name
        assert sorted(k for k, _, _ in source.entries()) == sorted(state), name
        for key, shape, _ in source.entries():
            assert tuple(shape) == tuple(state[key].shape), (name, key)
            assert _as_bytes(source.fetch(key)) == _as_bytes(state[key]), (name, key)
        for lazy in source.tensors():
            full = state[lazy.key]
            assert lazy.dtype == full.dtype, (name, lazy.key)
            if full.dim() and full.shape[0] > 1:  # the second half of dim 0
                half = full.shape[0] // 2
                box = ((full.shape[0] - half, *full.shape[1:]), (half,) + (0,) * (full.dim() - 1))
                assert _as_bytes(lazy.read(box)) == _as_bytes(full[half:]), (name, lazy.key)


def test_lazy_load_reads_a_directory_holding_any_safetensors_file(formats):
    state, paths = formats
    got = dict(lazy_load(paths["named"][0]))
    assert sorted(got) == sorted(state)
    assert all(_as_bytes(got[k]) == _as_bytes(state[k]) for k in state)


def test_hf_source_names_the_file_and_bytes_of_each_tensor(formats):
    """What a range reader needs: the shard and ``[start, end)`` of the tensor's data in it."""
    state, paths = formats
    path = paths["hf"][0]
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    source = open_source(path)
    assert source.files == sorted({os.path.join(path, n) for n in weight_map.values()})
    for key, full in state.items():
        stored = source.locate(key)
        assert stored.file == weight_map[key] and stored.url == os.path.join(path, weight_map[key])
        assert stored.end - stored.start == full.numel() * full.element_size()
        with open(stored.url, "rb") as f:
            f.seek(stored.start)
            assert f.read(stored.end - stored.start) == _as_bytes(full), key


def test_no_format_fits_lists_what_was_looked_for(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CorruptCheckpointError) as info:
        open_source(str(tmp_path))
    message = str(info.value)
    assert message.startswith(f"cannot tell the format of {tmp_path}: expected ")
    for cls in SOURCES:
        assert cls.looks_for in message


def test_a_key_in_two_safetensors_files_is_refused(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CorruptCheckpointError, match=r"b\.safetensors: tensor 'w' is also in .*a\.safetensors"):
        open_source(str(tmp_path))


@pytest.mark.parametrize(
    "chunks, match",
    [
        ([((0, 0), (2, 6))], r"leave elements \[12, 24\) out"),  # DCP's load would leave rows 2-3 as they were
        ([((0, 0), (4, 3)), ((0, 2), (4, 4))], "overlap"),
        ([((0, 0), (4, 6)), ((3, 0), (2, 6))], "lies outside its shape"),
    ],
)
def test_a_dcp_tensor_its_chunks_do_not_tile_is_refused(tmp_path, chunks, match):
    """Found by a review: a DCP tensor whose chunks covered half of it converted with the other
    half uninitialised."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(24.0).reshape(4, 6)}, checkpoint_id=str(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata["w"].chunks = [
        ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks
    ]
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CorruptCheckpointError, match=rf"{tmp_path}: .*'w'.*{match}"):
        open_source(str(tmp_path), allow_pickle=True)
