"""``lazy_load``: per-tensor converters, and the errors for unknown, damaged or hostile inputs."""

from __future__ import annotations

import collections
import json
import os
import struct

import pytest
import torch
from lazy_helpers import CountingStorage, expected_slice, slice_span_bytes, write_hf_index
from safetensors.torch import save_file

from checkpointer import Checkpointer, CorruptCheckpointError, IncompleteCheckpointError, lazy_load


def hf_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {
        "model.embed_tokens.weight": torch.randn(10, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
        "lm_head.weight": torch.randn(10, 8, generator=g),
    }


RENAMES = {
    "model.embed_tokens.": "decoder_frontend.embed.",
    "model.layers.": "decoder.layers.",
    ".self_attn.": ".attn.",
    ".mlp.up_proj.": ".ffn.inner_proj.",
    "model.norm.": "decoder.layer_norm.",
    "lm_head.": "final_proj.",
}
FS2_DIMS = {
    "decoder_frontend.embed.weight": 0,
    "decoder.layers.0.attn.q_proj.weight": 0,
    "decoder.layers.0.attn.o_proj.weight": 1,
    "decoder.layers.0.ffn.inner_proj.weight": 0,
    "final_proj.weight": 0,
}


def rename(key: str) -> str:
    for old, new in RENAMES.items():
        key = key.replace(old, new)
    return key


def test_rename_converter_reads_only_slices(tmp_path):
    state = hf_state()
    write_hf_index(str(tmp_path / "hf"), state, files=2)
    storage = CountingStorage(str(tmp_path / "hf"))
    calls = collections.Counter()

    def convert(key, tensor):
        calls[tensor.device.type] += 1
        return rename(key), tensor

    got = dict(lazy_load(storage, FS2_DIMS, tp_rank=1, tp_size=2, state_dict_converter=convert))
    assert sorted(got) == sorted(rename(k) for k in state)
    for key, full in state.items():
        dim = FS2_DIMS.get(rename(key))
        want = full if dim is None else full.chunk(2, dim)[1]
        assert torch.equal(got[rename(key)], want), key
    assert storage.data_bytes() == sum(slice_span_bytes(full, FS2_DIMS.get(rename(k)), 1, 2) for k, full in state.items())
    assert calls["meta"] == len(state) and calls["cpu"] == 0  # probed only; renames need no data


def test_converter_without_tp_gets_real_tensors(tmp_path):
    state = hf_state()
    save_file(state, str(tmp_path / "m.safetensors"))
    got = dict(lazy_load(str(tmp_path / "m.safetensors"), state_dict_converter=lambda k, t: (rename(k), t)))
    assert {rename(k): v for k, v in state.items()}.keys() == got.keys()
    assert all(torch.equal(got[rename(k)], v) for k, v in state.items())


def test_transforming_converter_cuts_its_outputs(tmp_path):
    """A converter that changes data (split a fused QKV, transpose, cast) gets the full tensor; outputs are cut."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(12, 4, generator=g)
    w = torch.randn(6, 5, generator=g)
    torch.save({"qkv": qkv, "w": w, "drop": torch.ones(2)}, str(tmp_path / "m.pt"))

    def convert(key, tensor):
        if key == "qkv":
            q, k, v = tensor.chunk(3, 0)
            return [("q", q), ("k", k), ("v", v)]
        if key == "w":
            return {"wt": tensor.t().to(torch.float64)}
        return None

    dims = {"q": 0, "k": 1, "v": 0, "wt": 1}
    for r in range(3):
        got = dict(lazy_load(str(tmp_path / "m.pt"), dims, tp_rank=r, tp_size=3, state_dict_converter=convert))
        assert list(got) == ["q", "k", "v", "wt"]
        q, k, v = qkv.chunk(3, 0)
        assert torch.equal(got["q"], expected_slice(q, 0, r, 3))  # 4 rows in 3: rank 2 gets none
        assert torch.equal(got["k"], expected_slice(k, 1, r, 3))
        assert torch.equal(got["v"], expected_slice(v, 0, r, 3))
        assert torch.equal(got["wt"], expected_slice(w.t().double(), 1, r, 3))
        assert got["wt"].is_contiguous()


def test_converter_that_needs_data_is_not_fooled_by_the_probe(tmp_path):
    """Reads values (fails on meta): run on the real tensor, output cut afterwards."""
    w = torch.arange(24.0).view(6, 4)
    Checkpointer().save(str(tmp_path / "ck"), {"w": w})

    def convert(key, tensor):
        scale = float(tensor.abs().max())  # needs data: raises on a meta tensor
        return key, tensor / scale

    got = dict(lazy_load(str(tmp_path / "ck"), {"w": 0}, tp_rank=1, tp_size=2, state_dict_converter=convert))
    assert torch.equal(got["w"], (w / 23.0).chunk(2, 0)[1])


def test_converter_returning_garbage_is_a_type_error(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(TypeError, match="'w'"):
        list(lazy_load(str(tmp_path / "m.safetensors"), state_dict_converter=lambda k, t: [(k, 3)]))


def test_fairseq2_style_dict_converter_wrapped_per_key(tmp_path):
    state = hf_state()
    save_file(state, str(tmp_path / "m.safetensors"))

    def convert_state_dict(sd):  # whole-dict converter that works key by key
        return {rename(k): v for k, v in sd.items()}

    got = dict(lazy_load(str(tmp_path / "m.safetensors"), FS2_DIMS, tp_rank=0, tp_size=2,
                         state_dict_converter=lambda k, t: convert_state_dict({k: t})))
    assert torch.equal(got["decoder.layers.0.attn.o_proj.weight"], state["model.layers.0.self_attn.o_proj.weight"].chunk(2, 1)[0])


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


def test_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        lazy_load(str(tmp_path / "nothing-here"))


def test_bad_tp_arguments(tmp_path):
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match="tp_rank 2"):
        lazy_load(str(tmp_path / "m.safetensors"), tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="'w'.*shard dim 2"):
        list(lazy_load(str(tmp_path / "m.safetensors"), {"w": 2}, tp_rank=0, tp_size=2))


@pytest.mark.parametrize(
    "name, content",
    [
        ("weights.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"),
        ("weights.safetensors", struct.pack("<Q", 1 << 40) + b"{}"),
        ("weights.pt", b"this is not a zip or a pickle"),
        ("weights.bin", b""),
        ("weights.xyz", os.urandom(64)),
    ],
)
def test_unknown_or_damaged_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        list(lazy_load(str(path)))


def test_truncated_safetensors(tmp_path):
    save_file({"a": torch.randn(64, 64), "b": torch.randn(64)}, str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-100])
    with pytest.raises(CorruptCheckpointError, match="m.safetensors"):
        list(lazy_load(str(tmp_path / "m.safetensors")))


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_torch_file_is_corrupt_and_named(tmp_path, keep, mmap):
    path = tmp_path / "m.pt"
    torch.save({"a": torch.randn(64, 64), "b": torch.randn(64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CorruptCheckpointError, match=str(path)) as info:
        lazy_load(str(path), mmap=mmap)
    assert "weights_only" not in str(info.value)  # a damaged file, not a refused object


def test_empty_directory(tmp_path):
    with pytest.raises(CorruptCheckpointError, match=str(tmp_path)):
        lazy_load(str(tmp_path))


def test_checkpoint_without_metadata_is_incomplete(tmp_path):
    Checkpointer().save(str(tmp_path / "ck"), {"w": torch.ones(3)})
    os.remove(tmp_path / "ck" / "metadata.json")
    with pytest.raises(IncompleteCheckpointError, match="metadata.json"):
        lazy_load(str(tmp_path / "ck"))


def test_bad_metadata_json(tmp_path):
    Checkpointer().save(str(tmp_path / "ck"), {"w": torch.ones(3)})
    (tmp_path / "ck" / "metadata.json").write_text('{"tensors": {"w": {"shape": [-1]}}}')
    with pytest.raises(CorruptCheckpointError, match="metadata.json"):
        lazy_load(str(tmp_path / "ck"))


def test_rank_file_that_disagrees_with_metadata(tmp_path):
    Checkpointer().save(str(tmp_path / "ck"), {"w": torch.ones(3), "v": torch.ones(4)})
    save_file({"w": torch.ones(3)}, str(tmp_path / "ck" / "rank_0.safetensors"))  # "v" is gone
    with pytest.raises(CorruptCheckpointError, match="rank_0.safetensors"):
        list(lazy_load(str(tmp_path / "ck")))


@pytest.mark.parametrize(
    "weight_map, match",
    [
        ({"w": "../outside.safetensors"}, "not a plain file name"),
        ({"w": "/etc/passwd"}, "not a plain file name"),
        ({"w": "sub/dir.safetensors"}, "not a plain file name"),
        ({"w": 3}, "weight_map"),
        ({"w": "missing.safetensors"}, "missing"),
        ({"w": "model.safetensors", "nope": "model.safetensors"}, "nope"),
    ],
)
def test_bad_hf_index(tmp_path, weight_map, match):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        list(lazy_load(str(tmp_path)))
    assert str(tmp_path) in str(info.value)


def test_hf_index_not_json(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{weight_map: nope")
    with pytest.raises(CorruptCheckpointError, match="index.json"):
        lazy_load(str(tmp_path))


class Custom:
    def __init__(self) -> None:
        self.payload = torch.ones(2)


def test_restrict_refuses_pickled_classes(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "obj": Custom()}, str(path))
    with pytest.raises(CorruptCheckpointError, match=str(path)) as info:
        lazy_load(str(path))
    assert info.value.__cause__ is not None
    assert "weights_only=True refuses" in str(info.value)
    with pytest.warns(UserWarning, match=r"1 entry is not a tensor and is skipped: \['obj'\]"):
        got = dict(lazy_load(str(path), restrict=False))  # trusted: the object is unpickled, then skipped
    assert list(got) == ["w"]


def test_torch_file_that_is_not_a_state_dict(tmp_path):
    torch.save([torch.ones(2)], str(tmp_path / "list.pt"))
    with pytest.raises(CorruptCheckpointError, match="list.pt"):
        lazy_load(str(tmp_path / "list.pt"))


def test_nested_torch_file_is_flattened(tmp_path):
    torch.save({"model": {"a": torch.ones(2), "b": {"c": torch.zeros(3)}}, "step": 7}, str(tmp_path / "n.pt"))
    with pytest.warns(UserWarning, match=r"skipped: \['step'\]"):
        got = dict(lazy_load(str(tmp_path / "n.pt")))
    assert sorted(got) == ["model.a", "model.b.c"]


# ---------------------------------------------------------------------------------------
# The Hugging Face reader behind ``checkpointer convert``
# ---------------------------------------------------------------------------------------


def test_hf_source_shard_missing_names_the_index(tmp_path):
    from checkpointer.tools.detect import open_source

    write_hf_index(str(tmp_path / "hf"), hf_state())
    os.remove(tmp_path / "hf" / "model-00002-of-00003.safetensors")
    with pytest.raises(CorruptCheckpointError) as info:
        open_source(str(tmp_path / "hf"))
    message = str(info.value)
    assert "model-00002-of-00003.safetensors" in message and "model.safetensors.index.json" in message
    assert "metadata.json" not in message.replace("model.safetensors.index.json", "")


class _DroppedConnection(CountingStorage):
    def read_into(self, name, requests):
        raise ConnectionResetError(f"connection reset while reading {self.join(name)}")


def test_hf_source_io_failure_is_an_os_error_not_corruption(tmp_path):
    """A network failure says nothing about the file: it must not be called a damaged checkpoint."""
    from checkpointer.tools.detect import open_source

    save_file(hf_state(), str(tmp_path / "model.safetensors"))
    src = open_source(_DroppedConnection(str(tmp_path)))
    key = src.entries()[0][0]
    with pytest.raises(ConnectionResetError, match="model.safetensors"):
        src.fetch(key)


def test_dcp_directory_is_named_with_the_way_out(tmp_path):
    """A torch DCP directory is a checkpoint lazy_load does not read: say so, not 'no checkpoint found'."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(CorruptCheckpointError, match=r"dcp is a torch DCP checkpoint.*checkpointer convert"):
        lazy_load(str(tmp_path / "dcp"))


def test_a_torch_file_with_compressed_records_is_refused_before_it_is_inflated(tmp_path):
    """torch.load inflates deflated zip records, which torch.save never writes: 300 KB of file
    became 300 MB in memory (found by a review). Refused, naming the record, before loading."""
    import zipfile

    plain, bomb = tmp_path / "plain.pt", tmp_path / "bomb.pt"
    torch.save({"w": torch.zeros(4 << 20, dtype=torch.uint8)}, str(plain))
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    assert os.path.getsize(bomb) < 64 << 10
    with pytest.raises(CorruptCheckpointError, match=r"bomb\.pt: record 'plain/data.pkl' is compressed"):
        dict(lazy_load(str(bomb)))
    assert dict(lazy_load(str(plain)))["w"].numel() == 4 << 20
