"""``max_shard_size`` is checked whatever the output: a bad value is an error for one
``.safetensors`` file too (where it does not apply), not accepted silently; nothing is written."""

from __future__ import annotations

import json
import os

import pytest
import torch

from checkpointer import Checkpointer, export_safetensors
from checkpointer.cli import main

BAD_SIZES = [("lots", "cannot read 'lots' as a size"), ("0", "must be positive"), (-1, "must be positive"),
             (0, "must be positive"), ("-5GB", "cannot read '-5GB' as a size")]


@pytest.fixture
def ckpt(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)})
    return path


@pytest.mark.parametrize("out_name", ["one.safetensors", "shards"])
@pytest.mark.parametrize("size, message", BAD_SIZES)
def test_bad_max_shard_size_is_refused_for_every_output(ckpt, tmp_path, out_name, size, message):
    out = str(tmp_path / out_name)
    with pytest.raises(ValueError, match=message):
        export_safetensors(ckpt, out, max_shard_size=size)
    assert not os.path.exists(out)


@pytest.mark.parametrize("out_name", ["one.safetensors", "shards"])
def test_bad_max_shard_size_on_the_command_line(ckpt, tmp_path, capsys, out_name):
    out = str(tmp_path / out_name)
    for command in (["unshard", ckpt, out], ["convert", ckpt, out, "--to", "hf"]):
        code = main([*command, "--max-shard-size", "0", "--quiet"])
        _, err = capsys.readouterr()
        assert code == 1 and err == "checkpointer: error: max shard size must be positive, got '0'\n"
        assert not os.path.exists(out)


def test_good_sizes_still_work_for_one_file(ckpt, tmp_path):
    for size in ("1KB", 10, "2GiB"):
        out = str(tmp_path / f"one-{size}.safetensors")
        assert export_safetensors(ckpt, out, max_shard_size=size) == [out]


def test_a_shard_may_hold_exactly_max_shard_size_bytes(ckpt, tmp_path):
    # b (12 bytes) and w (24 bytes), in metadata order, fill 36 bytes exactly: one shard; a byte less splits them.
    for size, shards in ((36, [["b", "w"]]), (35, [["b"], ["w"]])):
        out = str(tmp_path / f"hf-{size}")
        export_safetensors(ckpt, out, max_shard_size=size)
        index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
        n = len(shards)
        names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert sorted(os.listdir(out)) == names + ["model.safetensors.index.json"]
        assert [sorted(k for k, v in index["weight_map"].items() if v == name) for name in names] == shards
        assert index["metadata"]["total_size"] == 36
