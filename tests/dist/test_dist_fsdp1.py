"""FSDP1 with ``use_orig_params=True``: flat-sharded parameters and optimizer state.

FSDP1 runs on CPU with gloo when given ``device_id=cpu``, so these run everywhere; on a
GPU machine the same code paths run with NCCL.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard

import checkpointer


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5))


def _batch() -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(1))


def _save_fsdp1(rank: int, world_size: int, ckpt: str) -> dict:
    model = FSDP(_build(), use_orig_params=True, device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(_batch()).sum().backward()
        optim.step()
        optim.zero_grad()
    checkpointer.save_model_and_optim_state(ckpt, model, optim)
    with FSDP.summon_full_params(model):
        return {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in model.named_parameters()}


def _load_fsdp1(rank: int, world_size: int, ckpt: str) -> dict:
    torch.manual_seed(123)
    model = FSDP(nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5)), use_orig_params=True, device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    checkpointer.load_model_and_optim_state(ckpt, model, optim)
    with FSDP.summon_full_params(model):
        params = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in model.named_parameters()}
    model(_batch()).sum().backward()
    optim.step()  # the loaded state is usable
    return params


def _load_fsdp2(rank: int, world_size: int, ckpt: str) -> dict:
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    checkpointer.load_model_and_optim_state(ckpt, model, optim)
    return {k: v.full_tensor().clone() for k, v in model.named_parameters()}


def test_fsdp1_saves_and_loads_across_world_sizes_and_into_fsdp2(run_distributed, tmp_path):
    ckpt = str(tmp_path / "fsdp1")
    saved = run_distributed(_save_fsdp1, 2, ckpt)[0]
    full_optim = checkpointer.unshard_optim_state(ckpt, no_dist=True)
    assert sorted(full_optim["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]
    for loaded in run_distributed(_load_fsdp1, 3, ckpt) + run_distributed(_load_fsdp2, 2, ckpt):
        assert loaded.keys() == saved.keys()
        for key in saved:
            assert torch.equal(loaded[key], saved[key]), key
    full = checkpointer.unshard_model_state(ckpt, no_dist=True)
    for key in saved:
        assert torch.equal(full[key], saved[key]), key
