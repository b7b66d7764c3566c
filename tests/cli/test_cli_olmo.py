"""OLMo-core interop: checkpoints written by ai2-olmo-core 0.1.0's ``olmo_core.distributed.checkpoint``
load here, and ours load there, at world sizes 1 and 3.

That release needs one shim on current torch (``Shard._local_shard_size_on_dim`` was renamed);
:func:`cli_workers.patch_olmo_for_torch` adds it. The module is skipped only when it cannot import.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from cli_helpers import assert_same_tensors, cli
from dist_helpers import metadata_form
from cli_workers import olmo_or_skip, build, full_state, olmo_load_ws3, olmo_save_ws3, patch_olmo_for_torch
from safetensors.torch import load_file

from checkpointer import (
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)

olmo = olmo_or_skip()


@pytest.fixture(autouse=True)
def _olmo_shim():
    patch_olmo_for_torch()


def _unnamed(groups: list[dict]) -> list[dict]:
    """Param groups without ``param_names``, which this library's ``unshard_optim_state`` adds
    (aligned with ``params``) and OLMo-core's does not."""
    for g in groups:
        assert len(g.get("param_names", g["params"])) == len(g["params"]), g
    return [{k: v for k, v in g.items() if k != "param_names"} for g in groups]


def assert_same_optim(got: dict, want: dict) -> None:
    assert _unnamed(got["param_groups"]) == _unnamed(want["param_groups"])
    assert sorted(got["state"]) == sorted(want["state"])
    for pid, state in want["state"].items():
        assert_same_tensors(got["state"][pid], state)


def test_olmo_ws1_checkpoint_loads_here(tmp_path, capsys):
    dir = str(tmp_path / "olmo")
    model, optim = build(3, tied=False)
    olmo.save_model_and_optim_state(dir, model, optim)
    fresh, fresh_optim = build(4, tied=False)
    load_model_and_optim_state(dir, fresh, fresh_optim)
    assert_same_tensors(full_state(fresh), full_state(model))
    assert_same_optim(fresh_optim.state_dict(), optim.state_dict())
    assert_same_tensors(unshard_model_state(dir, no_dist=True), olmo.unshard_model_state(dir, no_dist=True))
    assert cli(capsys, "verify", dir, "-q") == (0, "", "")
    code, out, _ = cli(capsys, "inspect", os.path.join(dir, "model"), "--json")
    info = json.loads(out)
    assert (code, info["format_version"], info["world_size"], info["num_tensors"]) == (0, None, None, 7)
    assert cli(capsys, "unshard", dir, str(tmp_path / "m.safetensors"), "-q")[0] == 0
    assert_same_tensors(load_file(str(tmp_path / "m.safetensors")), full_state(model))


def test_olmo_ws3_checkpoint_loads_here(tmp_path, capsys, run_distributed):
    dir = str(tmp_path / "olmo3")
    full = run_distributed(olmo_save_ws3, 3, dir, timeout=300)[0]
    assert_same_tensors(unshard_model_state(dir, no_dist=True), full)
    assert_same_optim(unshard_optim_state(dir, no_dist=True), olmo.unshard_optim_state(dir, no_dist=True))
    model, optim = build(5, tied=False)
    load_model_and_optim_state(dir, model, optim)
    assert_same_tensors(full_state(model), full)
    assert cli(capsys, "verify", dir, "-q") == (0, "", "")
    code, out, _ = cli(capsys, "inspect", os.path.join(dir, "model"), "--json")
    pieces = {t["key"]: t["pieces"] for t in json.loads(out)["tensors"]}
    assert code == 0 and pieces["up.weight"] == 3 and pieces["scale"] == 1


def test_our_ws1_checkpoint_loads_in_olmo(tmp_path):
    """Format 1, the per-file form that release reads, written directly (format 2 reaches it
    through ``convert --to olmo``: tests/cli/test_cli_olmo_convert.py)."""
    dir = str(tmp_path / "ours")
    model, optim = build(6, tied=False)
    with metadata_form(compact=False):
        save_model_and_optim_state(dir, model, optim)
    fresh, fresh_optim = build(7, tied=False)
    olmo.load_model_and_optim_state(dir, fresh, fresh_optim)
    assert_same_tensors(full_state(fresh), full_state(model))
    assert_same_optim(fresh_optim.state_dict(), optim.state_dict())
    assert_same_tensors(olmo.unshard_model_state(dir, no_dist=True), full_state(model))


def test_our_rank_file_written_from_tensor_memory_loads_in_olmo(tmp_path, monkeypatch, takes_o_direct):
    """Pieces of 16 MiB at chosen address remainders: a local O_DIRECT save reorders the rank file
    (the pieces sharing the most common remainder first) and pads its header. That release
    reads the file all the same."""
    monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", "1")
    if not takes_o_direct(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT: rank files keep the state dict's order")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(3)], torch.nn.LayerNorm(2048))
    arena = torch.empty(52 << 20, dtype=torch.uint8)
    page = -arena.data_ptr() % 4096
    with torch.no_grad():
        for i, remainder in enumerate([128, 64, 64]):  # layer 0 alone at its remainder
            start = page + i * (17 << 20) + remainder
            slot = arena[start : start + (16 << 20)].view(torch.float32).view(2048, 2048)
            slot.copy_(model[i].weight)
            model[i].weight.data = slot
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 2048)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    dir = str(tmp_path / "ours")
    with metadata_form(compact=False):
        save_model_and_optim_state(dir, model, optim)
    with open(os.path.join(dir, "model", "rank_0.safetensors"), "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    order = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    assert [k for _, k in order][:2] == ["1.weight", "2.weight"], order
    assert (8 + size) % 512 == 64 % 512 and header["1.weight"]["data_offsets"][0] == 0
    fresh = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(3)], torch.nn.LayerNorm(2048))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh(torch.randn(4, 2048)).square().mean().backward()
    fresh_optim.step()
    olmo.load_model_and_optim_state(dir, fresh, fresh_optim)
    assert_same_tensors(fresh.state_dict(), model.state_dict())
    assert_same_optim(fresh_optim.state_dict(), optim.state_dict())


def test_our_ws3_checkpoint_loads_in_olmo(ckpts, run_distributed, tmp_path, capsys):
    """The session's format-2 checkpoint of 3 ranks, through ``convert --to olmo``."""
    dir = str(tmp_path / "olmo")
    assert cli(capsys, "convert", ckpts.untied3, dir, "--to", "olmo", "-q") == (0, "", "")
    assert_same_tensors(olmo.unshard_model_state(dir, no_dist=True), ckpts.untied3_full)
    assert_same_optim(olmo.unshard_optim_state(dir, no_dist=True), unshard_optim_state(ckpts.untied3, no_dist=True))
    model, optim = build(8, tied=False)
    olmo.load_model_and_optim_state(dir, model, optim)
    assert_same_tensors(full_state(model), ckpts.untied3_full)
    full = run_distributed(olmo_load_ws3, 3, dir, timeout=300)
    for rank_full in full:
        assert_same_tensors(rank_full, ckpts.untied3_full)


def test_shim_matches_torch_chunking():
    from torch.distributed.tensor.placement_types import Shard

    got = [Shard._local_shard_size_on_dim(11, 3, r, return_offset=True) for r in range(3)]
    assert got == [(4, 0), (4, 4), (3, 8)]
    assert [len(c) for c in torch.arange(11).chunk(3)] == [4, 4, 3]
