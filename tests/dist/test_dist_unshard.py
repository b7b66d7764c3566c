"""unshard_model_state / Checkpointer.unshard: all ranks, rank0_only, no_dist, device="cpu"."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import assert_same, build_model, build_optim, model_full_state, train

from checkpointer import Checkpointer, save_model_and_optim_state, unshard_model_state


def _save(rank, world_size, ckpt):
    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(2))
    save_model_and_optim_state(ckpt, model, optim)
    return model_full_state(model)


@pytest.fixture(scope="module")
def saved(run_distributed, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("unshard") / "ckpt")
    return ckpt, run_distributed(_save, 3, ckpt)[0]


def _plain_cpu(state):
    from torch.distributed.tensor import DTensor

    for k, v in state.items():
        assert type(v) is torch.Tensor and not isinstance(v, DTensor), f"{k}: {type(v)}"
        assert v.device.type == "cpu", f"{k} on {v.device}"


def _unshard(rank, world_size, ckpt, expected, how, rank0_only, device):
    if how == "model":
        got = unshard_model_state(ckpt, device=device, rank0_only=rank0_only)
    else:
        got = Checkpointer().unshard(f"{ckpt}/model", device=device, rank0_only=rank0_only)
    if rank0_only and rank != 0:
        assert got == {}, f"rank {rank} got keys {sorted(got)}"
        return True
    _plain_cpu(got)
    assert_same(expected, got, f"unsharded on rank {rank}")
    return True


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")], ids=["default", "cpu-str", "cpu-device"])
@pytest.mark.parametrize("rank0_only", [False, True])
@pytest.mark.parametrize("how", ["model", "checkpointer"])
def test_unshard_everywhere(run_distributed, saved, how, rank0_only, device):
    ckpt, expected = saved
    assert run_distributed(_unshard, 2, ckpt, expected, how, rank0_only, device) == [True, True]


def test_unshard_rank0_only_at_larger_world(run_distributed, saved):
    ckpt, expected = saved
    assert run_distributed(_unshard, 4, ckpt, expected, "model", True, None) == [True] * 4


def _no_dist_on_one_rank(rank, world_size, ckpt, expected):
    """Only rank 1 calls it: with no_dist no collective may be issued (or this hangs)."""
    if rank == 1:
        _plain_cpu(got := unshard_model_state(ckpt, no_dist=True))
        assert_same(expected, got, "model (no_dist)")
        got = Checkpointer().unshard(f"{ckpt}/model", no_dist=True, device="cpu")
        assert_same(expected, got, "Checkpointer.unshard (no_dist)")
    return True


def test_unshard_no_dist_on_a_single_rank(run_distributed, saved):
    ckpt, expected = saved
    assert run_distributed(_no_dist_on_one_rank, 2, ckpt, expected, timeout=60) == [True, True]


def _no_process_group(rank, world_size, ckpt, expected):
    for kwargs in ({}, {"no_dist": True}, {"rank0_only": True}):
        got = unshard_model_state(ckpt, **kwargs)
        _plain_cpu(got)
        assert_same(expected, got, f"unshard without a process group {kwargs}")
    return True


def test_unshard_without_process_group(run_distributed, saved):
    ckpt, expected = saved
    assert run_distributed(_no_process_group, 1, ckpt, expected, init_pg=False) == [True]
