"""Usage the command line refuses: options that do not apply to a ``convert`` target are usage
errors (exit 2)."""

from __future__ import annotations

import os

import pytest
import torch

from checkpointer import Checkpointer
from cli_helpers import cli


@pytest.fixture
def small(tmp_path) -> str:
    path = str(tmp_path / "small")
    Checkpointer().save(path, {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)})
    return path


@pytest.mark.parametrize("to", ["checkpointer", "dcp"])
@pytest.mark.parametrize(
    "options, named",
    [
        (["--dtype", "bf16"], "--dtype"),
        (["--max-shard-size", "1GB"], "--max-shard-size"),
        (["--max-shard-size", "5GB"], "--max-shard-size"),  # the default, given: still not for this target
        (["--dtype", "bf16", "--max-shard-size", "1GB"], "--dtype and --max-shard-size"),
    ],
)
def test_hf_only_options_are_usage_errors_for_other_targets(small, tmp_path, capsys, to, options, named):
    dst = str(tmp_path / "dst")
    code, out, err = cli(capsys, "convert", small, dst, "--to", to, *options)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == (
        f"checkpointer convert: error: {named} apply only to --to hf (Hugging Face safetensors output); "
        f"--to {to} writes every tensor in its own dtype, with no output shards"
    )
    assert not os.path.exists(dst)


def test_hf_only_options_still_work_for_hf(small, tmp_path, capsys):
    out = str(tmp_path / "out.safetensors")
    code, _, err = cli(capsys, "convert", small, out, "--to", "hf", "--dtype", "bf16", "--max-shard-size", "1GB", "-q")
    assert (code, err) == (0, "")
    from safetensors.torch import load_file

    assert load_file(out)["w"].dtype == torch.bfloat16


def test_convert_without_the_options_is_unchanged(small, tmp_path, capsys):
    for to in ("checkpointer", "dcp"):
        assert cli(capsys, "convert", small, str(tmp_path / to), "--to", to, "-q")[0] == 0

