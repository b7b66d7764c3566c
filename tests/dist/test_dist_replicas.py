"""Replicas must agree before a commit: a piece several ranks hold is written once, and a save
whose copies differ (a flipped bit, a per-rank value under one key) is refused on every rank
with a ReplicaMismatchError naming the key and ranks, committing nothing."""

from __future__ import annotations

import os

import pytest
import torch
from dist_helpers import (
    assert_local_same,
    assert_same,
    barrier,
    build_model,
    build_optim,
    catch,
    collectives_called,
    mesh,
    model_full_state,
    optim_full_state,
    to_layout,
    train,
)
from torch.distributed.tensor import DTensor, Replicate

from checkpointer import (
    Checkpointer,
    async_save_model_and_optim_state,
    latest_checkpoint,
    load_model_and_optim_state,
    save_model_and_optim_state,
)
from checkpointer.engine import rankfile
from checkpointer.engine.rankfile import VERIFY_ENV


def _flip_bit(t: torch.Tensor, index: int = 3, bit: int = 7) -> None:
    """Flip one bit of ``t``'s memory in place (a local tensor, or a DTensor's local piece)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    local.detach().view(-1).view(torch.uint8)[index] ^= 1 << bit


def _state(world_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    full = {"w": torch.randn(9, 5, generator=g), "s": torch.randn(8, 3, generator=g),
            "r": torch.randn(6, generator=g).to(torch.bfloat16)}
    return {
        "w": full["w"].clone(),  # a plain tensor: every rank holds it whole
        "s": to_layout(full["s"], f"shard0@{world_size}"),  # sharded: nothing to compare
        "r": DTensor.from_local(full["r"].clone(), mesh((world_size,)), [Replicate()], run_check=False),
    }


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                        run_check=False, shape=v.shape, stride=v.stride())
        else:
            out[k] = torch.zeros_like(v)
    return out


def _full(state):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}


def _flat_saves(rank, world_size, run):
    state = _state(world_size)
    expected = _full(state)
    ckpt = Checkpointer()
    # Clean: committed, and loads exactly.
    ckpt.save(f"{run}/step1", state)
    loaded = _zeros(state)
    Checkpointer().load(f"{run}/step1", loaded)
    assert_local_same(expected, loaded)
    results = {}
    # One bit flipped in the last rank's copy of a plain tensor, then of a Replicate DTensor.
    for key, step in (("w", 2), ("r", 3)):
        bad = _state(world_size)
        if rank == world_size - 1:
            _flip_bit(bad[key])
        results[key] = catch(ckpt.save, f"{run}/step{step}", bad)
        barrier()
        results[key]["metadata"] = os.path.exists(f"{run}/step{step}/metadata.json")
        results[key]["load"] = catch(Checkpointer().load, f"{run}/step{step}", _zeros(state))
    # A plain tensor that differs per rank, saved under one key.
    results["per_rank"] = catch(ckpt.save, f"{run}/step4", {"seed": torch.full((4,), float(rank))})
    barrier()
    results["per_rank"]["metadata"] = os.path.exists(f"{run}/step4/metadata.json")
    # The earlier checkpoint is untouched, and is still the newest complete one.
    loaded = _zeros(state)
    Checkpointer().load(f"{run}/step1", loaded)
    assert_local_same(expected, loaded)
    assert latest_checkpoint(run) == f"{run}/step1"
    # Turned off: the same save commits (one rank's copy is kept, as before the check).
    os.environ[VERIFY_ENV] = "0"
    try:
        off = catch(ckpt.save, f"{run}/step5", {"seed": torch.full((4,), float(rank))})
    finally:
        del os.environ[VERIFY_ENV]
    barrier()
    # Hashing its copies fails on one rank, on the hashing thread: the save fails on every rank
    # and commits nothing.
    real, inline = rankfile.hash_pieces, rankfile._INLINE_BYTES
    if rank == world_size - 1:
        rankfile.hash_pieces = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("hashing broke"))
        rankfile._INLINE_BYTES = 0
    try:
        results["hashing"] = catch(ckpt.save, f"{run}/step6", _state(world_size))
    finally:
        rankfile.hash_pieces, rankfile._INLINE_BYTES = real, inline
    barrier()
    results["hashing"]["metadata"] = os.path.exists(f"{run}/step6/metadata.json")
    return results, off, os.path.exists(f"{run}/step5/metadata.json")


@pytest.mark.parametrize("world_size", [2, 3])
def test_flipped_bit_or_per_rank_value_refuses_the_save(run_distributed, tmp_path, world_size):
    flipped = world_size - 1
    for rank, (results, off, committed_off) in enumerate(run_distributed(_flat_saves, world_size, str(tmp_path))):
        for key in ("w", "r"):
            r = results[key]
            assert r["type"] == "ReplicaMismatchError" and "CheckpointError" in r["mro"], (rank, key, r)
            others = [x for x in range(world_size) if x != flipped]
            agree = f"rank {others[0]}" if len(others) == 1 else f"ranks {', '.join(map(str, others))}"
            assert f"tensor {key!r}" in r["msg"], r["msg"]
            assert f"rank {flipped}" in r["msg"] and agree in r["msg"], r["msg"]
            assert not r["metadata"], f"rank {rank}: the refused save of {key!r} committed"
            assert r["load"] is not None and "IncompleteCheckpointError" in r["load"]["mro"], r["load"]
        r = results["per_rank"]
        assert r["type"] == "ReplicaMismatchError" and "'seed'" in r["msg"], r
        assert "per-rank keys" in r["msg"] and "PerRank" in r["msg"], r["msg"]  # what to do instead
        assert all(f"rank {x}" in r["msg"] or f", {x}" in r["msg"] for x in range(world_size)), r["msg"]
        assert not r["metadata"]
        assert off is None and committed_off, (rank, off)
        r = results["hashing"]
        assert r is not None and "hashing broke" in r["msg"] and not r["metadata"], (rank, r)


def _model_and_optim(rank, world_size, run):
    model = build_model(world_size, fsdp=False)  # replicated on every rank, as under DDP
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    saved = (model_full_state(model), optim_full_state(model, optim))
    save_model_and_optim_state(f"{run}/step1", model, optim)
    if rank == 1:
        _flip_bit(model.proj.weight, index=10, bit=30 % 8)
    error = catch(save_model_and_optim_state, f"{run}/step2", model, optim)
    barrier()
    parts = [os.path.exists(f"{run}/step2/{p}/metadata.json") for p in ("model", "optim")]
    fresh = build_model(world_size, seed=1, fsdp=False)
    fresh_optim = build_optim(fresh, "adamw", fresh=True)
    assert latest_checkpoint(run) == f"{run}/step1"
    load_model_and_optim_state(f"{run}/step1", fresh, fresh_optim)
    assert_same(saved[0], model_full_state(fresh), "model")
    assert_same(saved[1], optim_full_state(fresh, fresh_optim), "optimizer")
    return error, parts


def test_model_and_optimizer_save_with_a_differing_parameter(run_distributed, tmp_path):
    for rank, (error, parts) in enumerate(run_distributed(_model_and_optim, 2, str(tmp_path))):
        assert error is not None and error["type"] == "ReplicaMismatchError", (rank, error)
        assert "'proj.weight'" in error["msg"] and "rank 0 (rank 0's copy was written) / rank 1" in error["msg"], error["msg"]
        assert parts == [False, False], f"rank {rank}: committed {parts}"


def _async(rank, world_size, run):
    ckpt = Checkpointer()
    out = {}
    # A per-rank value under one key: the error comes from .result() on every rank.
    fut = ckpt.async_save(f"{run}/flat", {"seed": torch.full((4,), float(rank)), "ok": torch.ones(3)})
    out["flat"] = catch(fut.result, timeout=60)
    barrier()
    out["flat_metadata"] = os.path.exists(f"{run}/flat/metadata.json")
    # Changed on one rank after the call returned: the copies were hashed at the call, so no mismatch.
    state = {"w": torch.arange(40.0)}
    expected = {"w": state["w"].clone()}
    fut = ckpt.async_save(f"{run}/later", state)
    if rank == world_size - 1:
        state["w"].add_(1)
    fut.result(timeout=60)
    loaded = {"w": torch.zeros(40)}
    Checkpointer().load(f"{run}/later", loaded)
    assert_local_same(expected, loaded)
    # Model and optimizer, a bit flipped in one replica's parameter.
    model = build_model(world_size, fsdp=False)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    if rank == 0:
        _flip_bit(model.embed.weight, index=5)
    out["model"] = catch(async_save_model_and_optim_state(f"{run}/step1", model, optim).result, timeout=60)
    barrier()
    out["parts"] = [os.path.exists(f"{run}/step1/{p}/metadata.json") for p in ("model", "optim")]
    return out


def test_async_save_refuses_differing_replicas(run_distributed, tmp_path):
    for rank, out in enumerate(run_distributed(_async, 2, str(tmp_path))):
        flat = out["flat"]
        assert flat is not None and flat["type"] == "ReplicaMismatchError", (rank, flat)
        assert "'seed'" in flat["msg"] and "'ok'" not in flat["msg"], flat["msg"]
        assert not out["flat_metadata"]
        model = out["model"]
        assert model is not None and model["type"] == "ReplicaMismatchError", (rank, model)
        assert "'embed.weight'" in model["msg"], model["msg"]
        assert out["parts"] == [False, False], (rank, out["parts"])


def _hsdp(rank, world_size, run):
    full = torch.arange(48.0).reshape(8, 6)
    state = {"m": to_layout(full, "rep_shard0@2x2")}  # ranks 0, 2 hold rows 0-3; ranks 1, 3 rows 4-7
    Checkpointer().save(f"{run}/clean", state)
    loaded = {"m": to_layout(torch.zeros(8, 6), "rep_shard0@2x2")}
    Checkpointer().load(f"{run}/clean", loaded)
    assert_local_same({"m": full}, loaded)
    if rank == 3:
        _flip_bit(state["m"], index=17, bit=0)
    error = catch(Checkpointer().save, f"{run}/flipped", state)
    barrier()
    return error, os.path.exists(f"{run}/flipped/metadata.json")


def test_hsdp_shard_differing_within_its_replica_group(run_distributed, tmp_path):
    for rank, (error, committed) in enumerate(run_distributed(_hsdp, 4, str(tmp_path))):
        assert error is not None and error["type"] == "ReplicaMismatchError", (rank, error)
        detail = error["msg"].split("tensor 'm' differs between ", 1)[1].split(", first in", 1)[0]
        assert "rank 1" in detail and "rank 3" in detail and "0" not in detail and "2" not in detail, detail
        assert not committed


def _collectives(rank, world_size, run):
    state = {"w": torch.arange(30.0), "s": to_layout(torch.arange(12.0).reshape(6, 2), f"shard0@{world_size}")}
    ckpt = Checkpointer()
    ckpt.save(f"{run}/warm", state)  # the plan is cached from here on
    calls = {}
    for on in ("1", "0"):
        os.environ[VERIFY_ENV] = on
        try:
            with collectives_called() as called:
                ckpt.save(f"{run}/check{on}", state)
        finally:
            del os.environ[VERIFY_ENV]
        calls[on] = called
    return calls


def test_the_check_adds_no_collective(run_distributed, tmp_path):
    """The copies' checksums ride the commit's existing gather of every rank's status."""
    for rank, calls in enumerate(run_distributed(_collectives, 2, str(tmp_path))):
        assert calls["1"] == calls["0"], f"rank {rank}: {calls}"
