"""``checkpointer convert SRC DST --to olmo``: a format-2 checkpoint written in format 1's verbose
form, which ai2-olmo-core 0.1.0 loads (with :func:`cli_workers.patch_olmo_for_torch` on current
torch) and this library still loads and verifies. Skipped, as tests/cli/test_cli_olmo.py is, only
when that release cannot be imported.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from cli_helpers import assert_same_tensors, cli
from cli_workers import olmo_or_skip, build, full_state, olmo_load_ws3, patch_olmo_for_torch
from safetensors import safe_open

from checkpointer import (
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)
from checkpointer.format.layout import CHECKSUMS_KEY, FILE_ID_KEY

olmo = olmo_or_skip()


@pytest.fixture(autouse=True)
def _olmo_shim():
    patch_olmo_for_torch()


def _metadata(dir: str) -> dict:
    with open(os.path.join(dir, "metadata.json"), "rb") as f:
        return json.load(f)


def _unnamed(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "param_names"} for g in groups]


def _assert_verbose(meta: dict, files: int) -> None:
    """Format 1: every piece listed per file with its checksums, every file's id listed."""
    assert meta["format_version"] == 1 and not meta.get("checksums_in_files") and not meta.get("file_id")
    assert len(meta["file_ids"]) == files and len(set(meta["file_ids"].values())) == 1
    for key, tensor in meta["tensors"].items():
        specs = tensor["shard_spec_per_file"]
        assert "shard_rule" not in tensor and type(specs) is dict and specs, key
        assert all(type(spec["checksums"]) is list and spec["checksums"] for spec in specs.values()), key


def test_convert_to_olmo_of_a_format2_ws3_checkpoint_loads_in_olmo_and_here(ckpts, tmp_path, capsys, run_distributed):
    src, dst = ckpts.untied3, str(tmp_path / "olmo")
    source = _metadata(os.path.join(src, "model"))
    assert source["format_version"] == 2 and any("shard_rule" in t for t in source["tensors"].values())
    assert cli(capsys, "convert", src, dst, "--to", "olmo", "-q") == (0, "", "")
    for part in ("model", "optim"):
        _assert_verbose(_metadata(os.path.join(dst, part)), files=3)
        for r in range(3):
            with open(os.path.join(src, part, f"rank_{r}.safetensors"), "rb") as a, open(
                os.path.join(dst, part, f"rank_{r}.safetensors"), "rb"
            ) as b:
                assert a.read() == b.read()

    # OLMo-core 0.1.0: unshard, load in one process and at world size 3.
    assert_same_tensors(olmo.unshard_model_state(dst, no_dist=True), ckpts.untied3_full)
    want_optim = unshard_optim_state(src, no_dist=True)
    got_optim = olmo.unshard_optim_state(dst, no_dist=True)
    assert _unnamed(got_optim["param_groups"]) == _unnamed(want_optim["param_groups"])
    for pid, state in want_optim["state"].items():
        assert_same_tensors(got_optim["state"][pid], state)
    model, optim = build(8, tied=False)
    olmo.load_model_and_optim_state(dst, model, optim)
    assert_same_tensors(full_state(model), ckpts.untied3_full)
    for rank_full in run_distributed(olmo_load_ws3, 3, dst, timeout=300):
        assert_same_tensors(rank_full, ckpts.untied3_full)

    # This library: loads, unshards, verifies (the listed checksums are checked).
    model, optim = build(9, tied=False)
    load_model_and_optim_state(dst, model, optim)
    assert_same_tensors(full_state(model), ckpts.untied3_full)
    assert_same_tensors(unshard_model_state(dst, no_dist=True), ckpts.untied3_full)
    assert cli(capsys, "verify", dst, "-q") == (0, "", "")
    path = os.path.join(dst, "model", "rank_1.safetensors")
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        # The last byte of the file's last piece (not of its checksums tensor).
        f.seek(8 + size + max(v["data_offsets"][1] for k, v in header.items() if k not in ("__metadata__", CHECKSUMS_KEY)) - 1)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x40]))
    code, out, _ = cli(capsys, "verify", dst)
    assert code == 1 and "checksum" in out.lower(), out

    # DST now holds a checkpoint: refused without --overwrite, replaced with it.
    code, _, err = cli(capsys, "convert", src, dst, "--to", "olmo", "-q")
    assert code != 0 and "overwrite" in err, err
    assert cli(capsys, "convert", src, dst, "--to", "olmo", "-q", "--overwrite") == (0, "", "")
    assert cli(capsys, "verify", dst, "-q") == (0, "", "")


def test_convert_to_olmo_of_one_part_with_train_state_and_of_format1(tmp_path, capsys):
    src = str(tmp_path / "ours")
    model, optim = build(11, tied=False)
    save_model_and_optim_state(src, model, optim, train_state={"step": 7})
    assert _metadata(os.path.join(src, "train"))["format_version"] == 2

    # The top-level directory: train/ too, each part in format 1.
    top = str(tmp_path / "top")
    assert cli(capsys, "convert", src, top, "--to", "olmo", "-q") == (0, "", "")
    assert sorted(os.listdir(top)) == ["model", "optim", "train"]
    for part in ("model", "optim", "train"):
        _assert_verbose(_metadata(os.path.join(top, part)), files=1)
    fresh, fresh_optim = build(12, tied=False)
    state: dict = {"step": 0}
    load_model_and_optim_state(top, fresh, fresh_optim, train_state=state)
    assert_same_tensors(full_state(fresh), full_state(model)) and state == {"step": 7}
    fresh, fresh_optim = build(13, tied=False)
    olmo.load_model_and_optim_state(top, fresh, fresh_optim)
    assert_same_tensors(full_state(fresh), full_state(model))

    # One part directory alone.
    one = str(tmp_path / "one")
    assert cli(capsys, "convert", os.path.join(src, "model"), one, "--to", "olmo", "-q") == (0, "", "")
    _assert_verbose(_metadata(one), files=1)
    assert cli(capsys, "verify", one, "-q") == (0, "", "")

    # A format-1 source (OLMo-core's own) is copied, its pieces listed as they were.
    theirs, again = str(tmp_path / "theirs"), str(tmp_path / "again")
    olmo.save_model_and_optim_state(theirs, model, optim)
    assert cli(capsys, "convert", theirs, again, "--to", "olmo", "-q") == (0, "", "")
    for part in ("model", "optim"):
        got, want = _metadata(os.path.join(again, part)), _metadata(os.path.join(theirs, part))
        for tensor in got["tensors"].values():
            for spec in tensor["shard_spec_per_file"].values():
                assert spec.pop("checksums") is None
        assert got["tensors"] == want["tensors"] and got["format_version"] is None
    assert_same_tensors(olmo.unshard_model_state(again, no_dist=True), full_state(model))


def test_convert_to_olmo_refuses_other_sources_and_itself(tmp_path, capsys):
    from safetensors.torch import save_file

    hf = str(tmp_path / "m.safetensors")
    save_file({"w": torch.ones(2)}, hf)
    code, _, err = cli(capsys, "convert", hf, str(tmp_path / "out"), "--to", "olmo")
    assert code == 1 and "--to olmo converts checkpoints of this library" in err and "--to checkpointer first" in err, err
    assert not os.path.exists(tmp_path / "out")

    src = str(tmp_path / "ours")
    model, optim = build(14, tied=False)
    save_model_and_optim_state(src, model, optim)
    code, _, err = cli(capsys, "convert", src, src, "--to", "olmo", "--overwrite")
    assert code == 1 and "is the source itself" in err, err
    fresh, fresh_optim = build(15, tied=False)
    load_model_and_optim_state(src, fresh, fresh_optim)
    assert_same_tensors(full_state(fresh), full_state(model))


def test_convert_to_olmo_into_a_checkpoint_refuses_every_part_before_writing_one(tmp_path, capsys):
    """A top-level destination whose ``model/`` holds a checkpoint: without ``--overwrite`` the
    conversion is refused before ``train/`` (converted first) is written."""
    src, dst = str(tmp_path / "ours"), str(tmp_path / "dst")
    model, optim = build(16, tied=False)
    save_model_and_optim_state(src, model, optim, train_state={"step": 3})
    assert cli(capsys, "convert", os.path.join(src, "model"), os.path.join(dst, "model"), "--to", "olmo", "-q") == (0, "", "")
    code, _, err = cli(capsys, "convert", src, dst, "--to", "olmo", "-q")
    assert code == 1 and "model" in err and "exists" in err, err
    assert sorted(os.listdir(dst)) == ["model"], "a refused conversion wrote a part"
    assert cli(capsys, "convert", src, dst, "--to", "olmo", "-q", "--overwrite") == (0, "", "")
    assert sorted(os.listdir(dst)) == ["model", "optim", "train"]
    fresh, fresh_optim = build(17, tied=False)
    state: dict = {"step": 0}
    load_model_and_optim_state(dst, fresh, fresh_optim, train_state=state)
    assert_same_tensors(full_state(fresh), full_state(model)) and state == {"step": 3}


def test_convert_to_olmo_refuses_a_damaged_source_before_writing_anything(tmp_path, capsys):
    """The copy moves bytes unread and OLMo-core checks no checksum, so the source is verified
    first (found by a review: a flipped bit was copied, and OLMo-core loaded it)."""
    src, dst = str(tmp_path / "ours"), str(tmp_path / "dst")
    model, optim = build(18, tied=False)
    save_model_and_optim_state(src, model, optim, train_state={"step": 3})
    rank_file = os.path.join(src, "optim", "rank_0.safetensors")  # the last part converted
    with open(rank_file, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    code, _, err = cli(capsys, "convert", src, dst, "--to", "olmo", "-q")
    assert code == 1 and f"{src}/optim is damaged, nothing was written" in err and "checksum mismatch" in err, err
    assert not os.path.exists(dst)

    layout = str(tmp_path / "format1")  # format 1 (OLMo-core's), whose metadata.json the copy keeps
    os.makedirs(layout)
    from safetensors.torch import save_file

    w = torch.arange(60.0).reshape(6, 10)
    save_file({"w": w[:3].reshape(-1).contiguous()}, os.path.join(layout, "rank_0.safetensors"))
    save_file({"w": w[3:].reshape(-1).contiguous()}, os.path.join(layout, "rank_1.safetensors"))
    specs = {f"rank_{r}.safetensors": {"flattened_offsets": None, "local_shape": [3, 10], "global_offset": [2 * r, 0]}
             for r in range(2)}  # rank 1's rows start at 2, not 3: row 2 twice, row 5 in no file
    with open(os.path.join(layout, "metadata.json"), "w") as f:
        json.dump({"tensors": {"w": {"shape": [6, 10], "is_sharded": True, "dtype": "F32", "shard_spec_per_file": specs}}}, f)
    code, _, err = cli(capsys, "convert", layout, dst, "--to", "olmo", "-q")
    assert code == 1 and "is damaged, nothing was written" in err and "'w'" in err, err
    assert not os.path.exists(dst)


def test_convert_to_olmo_of_tied_checkpoints_loads_in_olmo(ckpts, tmp_path, capsys):
    """A tied head is saved once (an alias of the embedding); the conversion gives it a copy of
    its own, in a .tied file beside each rank file, which OLMo-core reads by its name."""
    for src, want, ranks in ((ckpts.ws1, ckpts.ws1_full, 1), (ckpts.ws3, ckpts.ws3_full, 3)):
        assert _metadata(os.path.join(src, "model")).get("aliases"), "the fixture's head is not tied"
        dst = str(tmp_path / f"olmo{ranks}")
        assert cli(capsys, "convert", src, dst, "--to", "olmo", "-q") == (0, "", "")
        meta = _metadata(os.path.join(dst, "model"))
        assert not meta.get("aliases")
        tied = sorted(n for n in os.listdir(os.path.join(dst, "model")) if n.endswith(".tied.safetensors"))
        assert tied and set(tied) <= {f"rank_{r}.tied.safetensors" for r in range(ranks)}, tied
        assert_same_tensors(olmo.unshard_model_state(dst, no_dist=True), want)
        model, optim = build(20 + ranks)  # tied, as saved
        olmo.load_model_and_optim_state(dst, model, optim)
        assert_same_tensors(full_state(model), want)
        model, optim = build(30 + ranks)
        load_model_and_optim_state(dst, model, optim)
        assert_same_tensors(full_state(model), want)
        assert cli(capsys, "verify", dst, "-q") == (0, "", "")


def test_convert_to_olmo_gives_each_tied_file_the_id_of_the_file_beside_it(ckpts, tmp_path, capsys):
    """A ``.tied`` file is listed in ``file_ids``, and its header carries, the id of the rank file it
    sits beside: a ``.tied`` file of another save then reads as one."""
    dst = str(tmp_path / "olmo")
    assert cli(capsys, "convert", ckpts.ws3, dst, "--to", "olmo", "-q") == (0, "", "")
    part = os.path.join(dst, "model")
    ids = _metadata(part)["file_ids"]
    tied = sorted(n for n in os.listdir(part) if n.endswith(".tied.safetensors"))
    assert tied and sorted(ids) == sorted(n for n in os.listdir(part) if n.endswith(".safetensors"))
    for name in tied:
        beside = name.replace(".tied.safetensors", ".safetensors")
        assert ids[name] == ids[beside], name
        with safe_open(os.path.join(part, name), "pt") as f:
            assert f.metadata()[FILE_ID_KEY] == ids[beside], name


def test_convert_to_olmo_over_a_tied_conversion_leaves_no_tied_file_behind(tmp_path, capsys):
    """``--overwrite`` leaves only the new checkpoint's files (found by a review: the old
    ``rank_0.tied.safetensors`` stayed)."""
    from checkpointer import Checkpointer

    tied, plain, dst = (str(tmp_path / name) for name in ("tied", "plain", "dst"))
    emb = torch.arange(8.0).reshape(2, 4)
    Checkpointer().save(tied, {"emb": emb, "head": emb})
    Checkpointer().save(plain, {"emb": emb})
    assert cli(capsys, "convert", tied, dst, "--to", "olmo", "-q") == (0, "", "")
    assert sorted(os.listdir(dst)) == ["metadata.json", "rank_0.safetensors", "rank_0.tied.safetensors"]
    assert cli(capsys, "convert", plain, dst, "--to", "olmo", "-q", "--overwrite") == (0, "", "")
    assert sorted(os.listdir(dst)) == ["metadata.json", "rank_0.safetensors"]
    assert cli(capsys, "convert", tied, dst, "--to", "olmo", "-q", "--overwrite") == (0, "", "")
    assert sorted(os.listdir(dst)) == ["metadata.json", "rank_0.safetensors", "rank_0.tied.safetensors"]
    assert torch.equal(Checkpointer().unshard(dst)["head"], emb)
