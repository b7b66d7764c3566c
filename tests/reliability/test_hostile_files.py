"""Hostile input, part 1: where files are. Metadata naming files outside the checkpoint,
symlinks leading out of it, special files where rank files or metadata.json should be.

The rule (issue 6): every loader (Checkpointer.load with and without verify, unshard,
get_metadata, lazy_load, load_model_and_optim_state, unshard_*_state, latest_checkpoint)
returns or raises a CheckpointError naming the file, never another exception, never hangs,
never allocates more than the files justify, never opens a file outside the checkpoint.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hostile import check_part, edit_metadata, meta_path, run_part
from rel_helpers import assert_rule, rule_violations, run_loaders

import checkpointer

BUG_SYMLINK = ()  # was an expected failure; fixed
BUG_FIFO = ()  # was an expected failure; fixed
BUG_DIRECTORY = ()  # was an expected failure; fixed
BUG_LATEST = ()  # was an expected failure; fixed

FIFO_HANG_S = 4.0  # a loader that waits this long on a FIFO is stuck for good


def decoy(tmp_path, copy, part="model", name="rank_0.safetensors") -> str:
    """A valid copy of a rank file outside the checkpoint: reading it would "work"."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    dst = outside / name
    shutil.copyfile(os.path.join(copy.part(part), name), dst)
    return str(dst)


def rename_file_in_metadata(copy, part: str, key: str, old: str, new: str) -> None:
    def edit(meta):
        specs = meta["tensors"][key]["shard_spec_per_file"]
        specs[new] = specs.pop(old)

    edit_metadata(copy, part, edit)


def test_the_guard_catches_what_the_rule_forbids(ckpt, tmp_path):
    """The checks behind the rule work: an outside read, a hang, a huge allocation, a stray exception."""
    import time

    secret = tmp_path / "outside" / "secret"
    secret.parent.mkdir()
    secret.write_text("x")
    link = os.path.join(ckpt.top, "link")
    os.symlink(secret, link)

    def spin():
        while True:
            time.sleep(0.01)

    calls = {
        "outside_read": lambda: open(link).read(),
        "inside_read": lambda: open(meta_path(ckpt, "model")).read(),
        "hang": spin,
        "allocation": lambda: torch.empty(1 << 40, dtype=torch.uint8),
        "stray": lambda: {}["missing"],
        "fine": lambda: checkpointer.Checkpointer().get_metadata(ckpt.part("model")),
    }
    outcomes = run_loaders(calls, ckpt.top, (str(tmp_path),), hang_s=0.5)
    problems = "\n".join(rule_violations(outcomes))
    assert "outside_read: read outside" in problems and "secret" in problems
    assert "hang: HANG" in problems
    assert "allocation: raised RuntimeError" in problems or "allocation: raised MemoryError" in problems
    assert "stray: raised KeyError" in problems
    assert "inside_read" not in problems and "fine" not in problems
    assert torch.empty(1 << 30, dtype=torch.uint8).numel() == 1 << 30  # the limit is lifted afterwards


def test_intact_copy_loads_everywhere(ckpt, tmp_path):
    """The baseline: on the undamaged copy every loader returns, with the saved values."""
    for part in ("model", "optim", "flat"):
        outcomes = run_part(ckpt, part, tmp_path)
        assert_rule(outcomes, must_raise=set())
        assert all(o.ok for o in outcomes.values()), [o.describe() for o in outcomes.values() if not o.ok]
        for name in ("load", "load_verify", "unshard", "lazy_load"):
            got = outcomes[name].value
            for key, want in ckpt.expected[part].items():
                assert torch.equal(got[key], want), (part, name, key)
        assert outcomes["latest_checkpoint"].value == ckpt.top
    assert outcomes["get_metadata"].value.tensors.keys() == ckpt.expected["flat"].keys()


# --------------------------------------------------------------------------------------
# File names in metadata.json
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "../../../outside/rank_0.safetensors",
        "../optim/rank_0.safetensors",
        "sub/../rank_0.safetensors",
        "./rank_0.safetensors",
        "..",
        "..\\..\\..\\outside\\rank_0.safetensors",
    ],
)
def test_path_traversal_in_metadata_filename(ckpt, tmp_path, name):
    decoy(tmp_path, ckpt)
    rename_file_in_metadata(ckpt, "model", "proj.weight", "rank_0.safetensors", name)
    check_part(ckpt, "model", tmp_path, name, repr(name)[1:-1])


@pytest.mark.parametrize("kind", ["etc_passwd", "decoy", "double_slash", "file_url", "home"])
def test_absolute_path_in_metadata_filename(ckpt, tmp_path, kind):
    name = {
        "etc_passwd": "/etc/passwd",
        "decoy": decoy(tmp_path, ckpt),
        "double_slash": "//etc/passwd",
        "file_url": "file:///etc/passwd",
        "home": "~/rank_0.safetensors",
    }[kind]
    rename_file_in_metadata(ckpt, "model", "proj.weight", "rank_0.safetensors", name)
    check_part(ckpt, "model", tmp_path, name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "metadata.json",
        ".checkpointer-save.lock",
        ".rank_0.safetensors.tmp-0123456789ab",
        "rank_0.safetensors\x00",
        "rank_0.safetensors/",
        " rank_0.safetensors",
        "rank_7.safetensors",
    ],
)
def test_odd_filename_in_metadata(ckpt, tmp_path, name):
    """Names that are no file, or not a rank file of this checkpoint, or one that is missing."""
    rename_file_in_metadata(ckpt, "model", "proj.weight", "rank_0.safetensors", name)
    check_part(ckpt, "model", tmp_path, repr(name), "rank_7.safetensors", scope="all" if name != "rank_7.safetensors" else "data")


# --------------------------------------------------------------------------------------
# Symlinks leading out of the checkpoint directory
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["decoy", "dev_zero", "etc_passwd"])
def test_rank_file_symlink_leaving_the_directory(ckpt, tmp_path, target):
    path = os.path.join(ckpt.part("model"), "rank_1.safetensors")
    dst = {"decoy": decoy(tmp_path, ckpt, name="rank_1.safetensors"), "dev_zero": "/dev/zero", "etc_passwd": "/etc/passwd"}[target]
    os.remove(path)
    os.symlink(dst, path)
    check_part(ckpt, "model", tmp_path, "rank_1.safetensors", scope="data")


def test_metadata_symlink_leaving_the_directory(ckpt, tmp_path):
    outside = decoy(tmp_path, ckpt, name="metadata.json")
    os.remove(meta_path(ckpt, "model"))
    os.symlink(outside, meta_path(ckpt, "model"))
    check_part(ckpt, "model", tmp_path, "metadata.json")


def test_rank_file_symlink_inside_the_directory_is_fine(ckpt, tmp_path):
    """Not hostile: a link to a file that stays inside the checkpoint loads normally."""
    d = ckpt.part("model")
    os.makedirs(os.path.join(d, "blobs"))
    os.rename(os.path.join(d, "rank_1.safetensors"), os.path.join(d, "blobs", "r1"))
    os.symlink(os.path.join("blobs", "r1"), os.path.join(d, "rank_1.safetensors"))
    outcomes = run_part(ckpt, "model", tmp_path)
    assert_rule(outcomes, must_raise=set())
    assert all(o.ok for o in outcomes.values()), [o.describe() for o in outcomes.values() if not o.ok]


# --------------------------------------------------------------------------------------
# Special files where a rank file or metadata.json should be
# --------------------------------------------------------------------------------------


@pytest.fixture
def release_fifos():
    """Open each FIFO for writing at the end, so a reader stuck in open() gets EOF and returns."""
    fifos: list[str] = []
    yield fifos
    for path in fifos:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


def test_rank_file_is_a_fifo(ckpt, tmp_path, release_fifos):
    """One loader only (all share the open path), with a short hang limit, to keep it quick."""
    path = os.path.join(ckpt.part("model"), "rank_1.safetensors")
    os.remove(path)
    os.mkfifo(path)
    release_fifos.append(path)
    check_part(ckpt, "model", tmp_path, "rank_1.safetensors", scope="data", only={"load"}, hang_s=FIFO_HANG_S)


def test_metadata_is_a_fifo(ckpt, tmp_path, release_fifos):
    path = meta_path(ckpt, "model")
    os.remove(path)
    os.mkfifo(path)
    release_fifos.append(path)
    check_part(ckpt, "model", tmp_path, "metadata.json", only={"get_metadata"}, hang_s=FIFO_HANG_S)


def test_rank_file_is_a_directory(ckpt, tmp_path):
    path = os.path.join(ckpt.part("model"), "rank_1.safetensors")
    os.remove(path)
    os.mkdir(path)
    check_part(ckpt, "model", tmp_path, "rank_1.safetensors", scope="data")


def test_metadata_is_a_directory(ckpt, tmp_path):
    path = meta_path(ckpt, "model")
    os.remove(path)
    os.mkdir(path)
    check_part(ckpt, "model", tmp_path, "metadata.json")


# --------------------------------------------------------------------------------------
# latest_checkpoint among odd neighbours
# --------------------------------------------------------------------------------------


def _file(run, name):
    with open(os.path.join(run, name), "w") as f:
        f.write("not a checkpoint")


def _fifo(run, name):
    os.mkfifo(os.path.join(run, name))


def _broken_link(run, name):
    os.symlink(os.path.join(run, "nowhere"), os.path.join(run, name))


def _file_for_model(run, name):
    os.makedirs(os.path.join(run, name))
    _file(os.path.join(run, name), "model")


def _incomplete(run, name):
    os.makedirs(os.path.join(run, name, "model"))
    os.makedirs(os.path.join(run, name, "optim"))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_file, marks=BUG_LATEST, id="file"),
        pytest.param(_fifo, marks=BUG_LATEST, id="fifo"),
        pytest.param(_broken_link, id="broken_link"),
        pytest.param(_file_for_model, id="file_named_model"),
        pytest.param(_incomplete, id="empty_model_and_optim"),
    ],
)
def test_latest_checkpoint_skips_odd_entries(ckpt, tmp_path, make):
    """Files, links and half-made directories beside checkpoints (newer by number) are skipped."""
    make(ckpt.run_dir, "step99")
    outcomes = run_loaders(
        {"latest_checkpoint": lambda: checkpointer.latest_checkpoint(ckpt.run_dir)}, ckpt.top, (str(tmp_path),)
    )
    assert_rule(outcomes, must_raise=set())
    assert outcomes["latest_checkpoint"].value == ckpt.top
