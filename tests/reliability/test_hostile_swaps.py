"""Hostile input, part 4: files that change while a load runs, and parts that lead out (issue 26).

The rule of ``test_hostile_files`` holds while files change under a load: a rank file replaced
by another file, cut short, or swapped for a link leading out between reading its header and
reading its bytes (or between two tensors of ``lazy_load``) gives the bytes of the file whose
header was checked, or a CheckpointError naming the file; never the other file's bytes, never
a raw OSError. A ``model/`` or ``optim/`` that is a link leading out of the checkpoint directory
is not followed. The Hugging Face cache's links from ``snapshots/`` to ``blobs/`` are the one
exception (``tests/lazy/test_lazy_formats.py::test_hf_cache_symlinks_into_blobs``).
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
import time

import pytest
import rel_helpers
import torch
from rel_helpers import assert_rule, run_loaders

import checkpointer
from checkpointer import CheckpointError
from checkpointer.engine import checks as rankfile_headers

RANK_FILE = "rank_1.safetensors"


def foreign_copy(path: str, dst: str) -> str:
    """``path`` with the same header (file id included) and other bytes: read, it would pass
    every check of the header and give wrong values."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    rel_helpers.rewrite(dst, raw[: 8 + n] + bytes(255 - b for b in raw[8 + n :]))
    return dst


def check_values(outcomes: dict, expected: dict) -> list[str]:
    """Loaders that returned: their tensors are the saved ones."""
    wrong = []
    for name, out in outcomes.items():
        value = out.value
        if out.ok and name in ("load", "load_verify", "unshard", "lazy_load"):
            bad = [k for k, want in expected.items() if k in value and not torch.equal(value[k], want)]
            if bad:
                wrong.append(f"{name} returned other bytes for {bad}")
    return wrong


# --------------------------------------------------------------------------------------
# A rank file that changes between its header and its bytes
# --------------------------------------------------------------------------------------


def _change(kind: str, path: str, spare: str, outside: str) -> None:
    if kind == "replaced":
        os.replace(spare, path)
    elif kind == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif kind == "removed":
        os.remove(path)
    elif kind == "link_out":
        os.remove(path)
        os.symlink(outside, path)
    else:
        raise ValueError(kind)


@pytest.mark.parametrize("kind", ["replaced", "truncated", "removed", "link_out"])
@pytest.mark.parametrize("part", ["model", "flat"])
def test_rank_file_changed_after_its_header_was_read(ckpt, tmp_path, monkeypatch, kind, part):
    """Right after a load reads the header of a rank file, the file changes. Before: the load
    read the other file's bytes (replaced), or raised a raw OSError (truncated) or a raw
    PermissionError (link_out)."""
    path = os.path.join(ckpt.part(part), RANK_FILE)
    pristine = str(tmp_path / "pristine")
    shutil.copyfile(path, pristine)
    outside = foreign_copy(path, str(tmp_path / "outside.safetensors"))
    spare = str(tmp_path / "spare")
    real_get = rankfile_headers.HeaderCache.get
    changed: list[str] = []

    def get_then_change(self, name):
        header = real_get(self, name)
        if name == RANK_FILE and not changed:
            changed.append(name)
            _change(kind, path, spare, outside)
        return header

    monkeypatch.setattr(rankfile_headers.HeaderCache, "get", get_then_change)
    calls = rel_helpers.part_loaders(ckpt, part)
    outcomes = {}
    for name in ("load", "load_verify", "unshard", "lazy_load"):
        changed.clear()
        if os.path.lexists(path):
            os.remove(path)
        shutil.copyfile(pristine, path)
        foreign_copy(pristine, spare)
        outcomes.update(run_loaders({name: calls[name]}, ckpt.top, (str(tmp_path),)))
        assert changed, f"{name} read no header of {RANK_FILE}"
    assert_rule(outcomes)
    for out in outcomes.values():
        assert out.ok or RANK_FILE in str(out.error), out.describe()
    assert not check_values(outcomes, ckpt.expected[part])
    if kind in ("replaced", "removed", "link_out"):  # the file opened is read on: the saved values
        assert all(out.ok for out in outcomes.values()), [out.describe() for out in outcomes.values() if not out.ok]


@pytest.mark.parametrize("kind", ["replaced", "truncated", "removed", "link_out"])
def test_rank_file_changed_between_two_tensors_of_lazy_load(ckpt, tmp_path, kind):
    """The iterator checked the file for the first tensor; the file changes before the next."""
    part = ckpt.part("flat")
    path = os.path.join(part, RANK_FILE)
    outside = foreign_copy(path, str(tmp_path / "outside.safetensors"))
    spare = foreign_copy(path, str(tmp_path / "spare"))
    expected = ckpt.expected["flat"]
    tensors = checkpointer.lazy_load(part)
    got = dict([next(tensors)])
    _change(kind, path, spare, outside)
    try:
        got.update(tensors)
    except CheckpointError as ex:
        assert kind == "truncated" and RANK_FILE in str(ex), ex
        return
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert torch.equal(got[key], want), f"{key}: another file's bytes after the file was {kind}"


# --------------------------------------------------------------------------------------
# A part directory that leads out of the checkpoint
# --------------------------------------------------------------------------------------


def top_loaders(top: str) -> dict:
    """Every loader given the directory that holds model/ and optim/."""
    from checkpointer.cli import main as cli_main

    return {
        "load_model_and_optim_state": lambda: rel_helpers.load_model_top(top),
        "unshard_model_state": lambda: checkpointer.unshard_model_state(top, no_dist=True),
        "unshard_optim_state": lambda: checkpointer.unshard_optim_state(top, no_dist=True),
        "lazy_load": lambda: rel_helpers.lazy_all(top),
        "cli_inspect": lambda: _cli(cli_main, "inspect", top),
        "cli_verify": lambda: _cli(cli_main, "verify", top),
    }


def _cli(cli_main, command: str, top: str) -> int:
    rc = cli_main([command, top])
    if rc != 0:
        raise checkpointer.CorruptCheckpointError(f"checkpointer {command} {top} exited with {rc}")
    return rc


@pytest.mark.parametrize("part", ["model", "optim"])
def test_part_directory_that_is_a_link_leading_out(ckpt, tmp_path, capsys, part):
    """``model/`` (or ``optim/``) moved out of the checkpoint and linked back: every loader
    given the top directory refuses it, naming it, and opens nothing there. Before, each of
    them read the outside directory as the checkpoint's."""
    outside = tmp_path / "outside" / part
    outside.parent.mkdir()
    os.rename(ckpt.part(part), outside)
    os.symlink(str(outside), ckpt.part(part))
    outcomes = run_loaders(top_loaders(ckpt.top), ckpt.top, (str(tmp_path),))
    must = {"load_model_and_optim_state"}
    must |= {"unshard_model_state", "lazy_load"} if part == "model" else {"unshard_optim_state"}
    assert_rule(outcomes, must_raise=must, needles=(f"{part}/",), cls=checkpointer.CorruptCheckpointError)
    assert not outcomes["cli_inspect"].ok and not outcomes["cli_verify"].ok
    said = "".join(capsys.readouterr())  # what the command line says (verify lists problems on stdout)
    assert said.count(f"{part}/metadata.json: not a readable file") == 2 and "outside" in said, said


def test_part_directory_linked_inside_the_checkpoint_is_fine(ckpt, tmp_path):
    """Not hostile: a link to a directory that stays inside the checkpoint loads normally."""
    os.rename(ckpt.part("model"), os.path.join(ckpt.top, "model.real"))
    os.symlink("model.real", ckpt.part("model"))
    outcomes = run_loaders(top_loaders(ckpt.top), ckpt.top, (str(tmp_path),))
    assert_rule(outcomes, must_raise=set())
    assert all(out.ok for out in outcomes.values()), [out.describe() for out in outcomes.values() if not out.ok]
    got = outcomes["unshard_model_state"].value
    assert all(torch.equal(got[k], v) for k, v in ckpt.expected["model"].items())


# --------------------------------------------------------------------------------------
# A link swapped between inside and outside while loads run
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_rank_file_link_swapped_while_loads_run(ckpt, tmp_path):
    """A thread swaps a rank file's link between its blob inside the checkpoint and a file
    outside with the same header and other bytes, while loads run. Before: in 500 unshards,
    5 returned the outside bytes and 42 raised a raw PermissionError."""
    part = ckpt.part("flat")
    link = os.path.join(part, RANK_FILE)
    os.makedirs(os.path.join(part, "blobs"))
    os.rename(link, os.path.join(part, "blobs", "r1"))
    outside = foreign_copy(os.path.join(part, "blobs", "r1"), str(tmp_path / "outside.safetensors"))
    os.symlink(os.path.join("blobs", "r1"), link)
    stop = threading.Event()

    def swap() -> None:
        i = 0
        while not stop.is_set():
            tmp = f"{link}.swap"
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink(os.path.join("blobs", "r1") if i % 2 else outside, tmp)
            os.replace(tmp, link)
            i += 1

    expected = ckpt.expected["flat"]
    loaders = {
        "unshard": lambda: checkpointer.Checkpointer().unshard(part, no_dist=True),
        "load": lambda: rel_helpers.load_part(part, expected),
        "lazy_load": lambda: rel_helpers.lazy_all(part),
    }
    seen: dict[str, int] = {}
    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    try:
        for n in range(300):
            if time.monotonic() > deadline:
                break
            name = list(loaders)[n % len(loaders)]
            try:
                got = loaders[name]()
            except CheckpointError as ex:
                assert RANK_FILE in str(ex), ex
                seen["refused"] = seen.get("refused", 0) + 1
                continue
            except OSError as ex:
                raise AssertionError(f"{name}: a raw {type(ex).__name__}: {ex}") from ex
            bad = [k for k, want in expected.items() if not torch.equal(got[k], want)]
            assert not bad, f"{name} returned the outside file's bytes for {bad} (load {n})"
            seen["loaded"] = seen.get("loaded", 0) + 1
    finally:
        stop.set()
        thread.join()
    assert seen.get("loaded") and seen.get("refused"), seen  # the race ran both ways


def test_foreign_copy_differs(ckpt, tmp_path):
    """The decoy of these tests: the same header, other bytes."""
    path = os.path.join(ckpt.part("flat"), RANK_FILE)
    copy = foreign_copy(path, str(tmp_path / "x"))
    with open(path, "rb") as a, open(copy, "rb") as b:
        raw_a, raw_b = a.read(), b.read()
    (n,) = struct.unpack("<Q", raw_a[:8])
    assert raw_a[: 8 + n] == raw_b[: 8 + n] and raw_a[8 + n :] != raw_b[8 + n :]
