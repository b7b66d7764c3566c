"""The files a save returns, and that each piece of a replicated tensor is written once per job."""

from __future__ import annotations

import os

import pytest
import torch
from dist_helpers import (
    build_model,
    build_optim,
    files_under,
    normalize_created,
    read_metadata_json,
    read_metadata_listed,
    stored_numel_per_key,
    to_layout,
    train,
)

from checkpointer import Checkpointer, save_model_and_optim_state


def _save_model(rank, world_size, ckpt):
    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    return [str(f) for f in save_model_and_optim_state(ckpt, model, optim)]


def check_created(per_rank: list[list[str]], top: str) -> None:
    on_disk = files_under(top)
    seen: dict[str, int] = {}
    for rank, created in enumerate(per_rank):
        names = normalize_created(created, top)
        assert len(names) == len(created), f"rank {rank} returned duplicates: {created}"
        for n in names:
            assert n in on_disk, f"rank {rank} returned {n!r}, which is not on disk ({sorted(on_disk)})"
            assert n not in seen, f"{n!r} returned by ranks {seen[n]} and {rank}"
            seen[n] = rank
    assert set(seen) == on_disk, f"files nobody returned: {sorted(on_disk - set(seen))}"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_save_returns_the_files_each_rank_created(run_distributed, tmp_path, world_size):
    ckpt = str(tmp_path / "ckpt")
    per_rank = run_distributed(_save_model, world_size, ckpt)
    check_created(per_rank, ckpt)
    on_disk = files_under(ckpt)
    assert {"model/metadata.json", "optim/metadata.json"} <= on_disk
    for sub in ("model", "optim"):
        assert os.path.isfile(os.path.join(ckpt, sub, "rank_0.safetensors"))
    # Each tensor's elements are stored exactly once across all rank files.
    for sub in ("model", "optim"):
        meta = read_metadata_json(os.path.join(ckpt, sub))["tensors"]
        stored = stored_numel_per_key(os.path.join(ckpt, sub))
        for key, m in meta.items():
            numel = 1
            for d in m["shape"]:
                numel *= d
            assert stored.get(key, 0) == numel, f"{sub}/{key}: {stored.get(key, 0)} elements stored for {numel}"
    # The replicated buffer is held by one file only.
    assert len(read_metadata_listed(os.path.join(ckpt, "model"))["tensors"]["scale"]["shard_spec_per_file"]) == 1
    # metadata.json names the save's file id once; every rank file of the save has it in its header.
    from safetensors import safe_open

    save_ids = set()
    for sub in ("model", "optim"):
        meta = read_metadata_json(os.path.join(ckpt, sub))
        assert meta.get("file_ids") is None and len(meta["file_id"]) == 16
        save_ids.add(meta["file_id"])
        for name in sorted(n for n in os.listdir(os.path.join(ckpt, sub)) if n.startswith("rank_")):
            with safe_open(os.path.join(ckpt, sub, name), "pt") as f:
                assert f.metadata() == {"checkpointer_file_id": meta["file_id"]}


def _save_replicated(rank, world_size, ckpt):
    g = torch.Generator().manual_seed(0)
    full = {"rep_plain": torch.randn(6, 5, generator=g), "rep_shard0": torch.randn(7, 3, generator=g)}
    state = {
        "rep_plain": full["rep_plain"].clone(),
        "rep_shard0": to_layout(full["rep_shard0"], "rep_shard0@2x2"),
        "sharded": to_layout(torch.arange(40.0).reshape(8, 5), "shard0_shard1@2x2"),
        "int_scalar": torch.tensor(rank * 0 + 5),
    }
    _, created = Checkpointer().save(ckpt, state)
    return [str(f) for f in created]


def test_replicated_tensors_written_once(run_distributed, tmp_path):
    ckpt = str(tmp_path / "flat")
    per_rank = run_distributed(_save_replicated, 4, ckpt)
    check_created(per_rank, ckpt)
    meta = read_metadata_listed(ckpt)["tensors"]
    stored = stored_numel_per_key(ckpt)
    assert stored == {"rep_plain": 30, "rep_shard0": 21, "sharded": 40, "int_scalar": 1}, stored
    assert len(meta["rep_plain"]["shard_spec_per_file"]) == 1
    assert len(meta["int_scalar"]["shard_spec_per_file"]) == 1
    # (Replicate(), Shard(0)) on 2x2: two distinct halves, each written by one rank.
    assert len(meta["rep_shard0"]["shard_spec_per_file"]) == 2
