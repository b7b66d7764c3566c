"""Usage the command line refuses or words for itself: options that do not apply to a
``convert`` target are usage errors (exit 2), and messages about replacing a checkpoint say
``--overwrite`` on the command line and ``save_overwrite=True`` in Python, never the other."""

from __future__ import annotations

import os

import pytest
import torch

import checkpointer
from checkpointer import Checkpointer
from checkpointer.format.layout import LOCK_FILENAME
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


# ---------------------------------------------------------------------------------------------
# --overwrite on the command line, save_overwrite=True in Python
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("to", ["checkpointer", "dcp"])
def test_convert_over_a_checkpoint_says_overwrite_the_command_line_way(small, tmp_path, capsys, to):
    dst = str(tmp_path / "dst")
    assert cli(capsys, "convert", small, dst, "--to", to, "-q")[0] == 0
    code, _, err = cli(capsys, "convert", small, dst, "--to", to)
    assert code == 1
    assert "pass --overwrite to replace it" in err and "save_overwrite" not in err
    assert err.count("overwrite") == 1, err
    assert cli(capsys, "convert", small, dst, "--to", to, "--overwrite", "-q")[0] == 0


def test_convert_over_a_lock_says_overwrite_the_command_line_way(small, tmp_path, capsys):
    dst = tmp_path / "locked"
    dst.mkdir()
    (dst / LOCK_FILENAME).write_text("{}")
    code, _, err = cli(capsys, "convert", small, str(dst), "--to", "checkpointer")
    assert code == 1
    assert "(remove it, or pass --overwrite)" in err and "save_overwrite" not in err


def test_python_says_save_overwrite(small, tmp_path):
    with pytest.raises(FileExistsError) as ex:
        Checkpointer().save(small, {"w": torch.zeros(2, 3)})
    assert "(pass save_overwrite=True to replace it)" in str(ex.value) and "--overwrite" not in str(ex.value)

    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    top = str(tmp_path / "top")
    checkpointer.save_model_and_optim_state(top, model, optim)
    for save in (checkpointer.save_model_and_optim_state, lambda *a: checkpointer.async_save_model_and_optim_state(*a).result()):
        with pytest.raises(FileExistsError) as ex:
            save(top, model, optim)
        assert "(pass save_overwrite=True to replace it)" in str(ex.value) and "--overwrite" not in str(ex.value)


def test_no_message_in_the_library_names_overwrite_another_way():
    """Every message of the package that tells the user to overwrite names ``save_overwrite=True``
    (the Python argument); only cli.py says ``--overwrite``."""
    root = os.path.join(os.path.dirname(checkpointer.__file__))
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            text = open(path, encoding="utf-8").read()
            for line in text.splitlines():
                if "pass " in line and "overwrite" in line and ('"' in line or "'" in line):
                    if name == "cli.py" and path.endswith(os.path.join("checkpointer", "cli.py")):
                        continue
                    assert "save_overwrite=True" in line or "overwrite" not in line.split("pass ", 1)[1], (path, line)
