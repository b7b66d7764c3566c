"""FSDP2 resharding: save at world size {1,2,3,4}, load at {1,2,3,4}; world size 1 is a plain module.

Each save world size writes one checkpoint (after real AdamW / SGD-with-momentum steps);
every load world size then loads it into a fresh model and optimizer, and the unsharded
parameters, buffers, optimizer state and param groups must equal the saved ones exactly.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import (
    assert_same,
    build_model,
    build_optim,
    local_data_ptrs,
    model_full_state,
    optim_full_state,
    train,
)
from torch.distributed.tensor import DTensor

from checkpointer import load_model_and_optim_state, save_model_and_optim_state

WORLD_SIZES = [1, 2, 3, 4]


def _save(rank, world_size, ckpt, optim_kind):
    model = build_model(world_size)
    optim = build_optim(model, optim_kind)
    train(model, optim, range(2))
    expected_model = model_full_state(model)
    expected_optim = optim_full_state(model, optim)
    files = save_model_and_optim_state(ckpt, model, optim)
    assert_same(expected_model, model_full_state(model), "model after save")
    assert_same(expected_optim, optim_full_state(model, optim), "optimizer after save")
    return {"model": expected_model, "optim": expected_optim, "files": files}


def _load(rank, world_size, ckpt, optim_kind, expected_model, expected_optim, strategy="default"):
    model = build_model(world_size, seed=1)
    model.scale.fill_(-1.0)
    optim = build_optim(model, optim_kind, fresh=True)
    ptrs = local_data_ptrs(model)
    if strategy == "default":
        load_model_and_optim_state(ckpt, model, optim)
    else:
        load_model_and_optim_state(ckpt, model, optim, strategy=strategy)
    assert local_data_ptrs(model) == ptrs, "load replaced tensors instead of filling them in place"
    assert_same(expected_model, model_full_state(model), f"model on rank {rank}")
    assert_same(expected_optim, optim_full_state(model, optim), f"optimizer on rank {rank}")
    # Optimizer state must be sharded like its parameter, so that training can go on.
    for p, state in optim.state.items():
        for key, value in state.items():
            if value.dim() == 0:
                continue
            assert isinstance(value, DTensor) == isinstance(p, DTensor), f"{key}: {type(value)} for {type(p)}"
            if isinstance(p, DTensor):
                assert value.placements == p.placements and value.device_mesh == p.device_mesh, key
                assert value.to_local().shape == p.to_local().shape, key
    train(model, optim, range(2, 3))
    return True


@pytest.fixture(scope="module")
def saved(run_distributed, tmp_path_factory):
    cache = {}

    def get(world_size, optim_kind):
        key = (world_size, optim_kind)
        if key not in cache:
            ckpt = str(tmp_path_factory.mktemp(f"fsdp-ws{world_size}-{optim_kind}") / "ckpt")
            cache[key] = (ckpt, run_distributed(_save, world_size, ckpt, optim_kind)[0])
        return cache[key]

    return get


@pytest.mark.parametrize("optim_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("load_ws", WORLD_SIZES)
@pytest.mark.parametrize("save_ws", WORLD_SIZES)
def test_reshard(run_distributed, saved, save_ws, load_ws, optim_kind):
    ckpt, ref = saved(save_ws, optim_kind)
    assert ref["optim"], "the optimizer has state after training"
    out = run_distributed(_load, load_ws, ckpt, optim_kind, ref["model"], ref["optim"])
    assert out == [True] * load_ws


@pytest.mark.parametrize("save_ws,load_ws", [(1, 2), (2, 4), (4, 3), (3, 3)])
def test_reshard_two_stage(run_distributed, saved, save_ws, load_ws):
    ckpt, ref = saved(save_ws, "adamw")
    out = run_distributed(_load, load_ws, ckpt, "adamw", ref["model"], ref["optim"], "two_stage")
    assert out == [True] * load_ws


def _load_model_only(rank, world_size, ckpt, expected_model, validate):
    model = build_model(world_size, seed=1)
    load_model_and_optim_state(ckpt, model, validate=validate)
    assert_same(expected_model, model_full_state(model), f"model on rank {rank}")
    return True


@pytest.mark.parametrize("validate", [True, False])
def test_load_model_without_optimizer(run_distributed, saved, validate):
    ckpt, ref = saved(3, "adamw")
    assert run_distributed(_load_model_only, 2, ckpt, ref["model"], validate) == [True, True]


# HSDP (2-D mesh: replicate x shard) and DDP are further topologies to save from and load into.


def _build_topology(world_size, topology, seed):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from dist_helpers import TinyModel, mesh

    if topology == "ddp":
        torch.manual_seed(seed)
        return DistributedDataParallel(TinyModel())
    if topology == "hsdp":
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(seed)
        model = TinyModel()
        m = mesh((2, 2), ("replicate", "shard"))
        for module in (model.embed, model.proj, model):
            fully_shard(module, mesh=m)
        return model
    return build_model(world_size, seed=seed)


def _save_topology(rank, world_size, ckpt, topology):
    model = _build_topology(world_size, topology, 0)
    optim = build_optim(model, "adamw")
    train(model, optim, range(2))
    save_model_and_optim_state(ckpt, model, optim)
    inner = getattr(model, "module", model)
    return {"model": model_full_state(inner), "optim": optim_full_state(inner, optim)}


def _load_topology(rank, world_size, ckpt, topology, expected_model, expected_optim):
    model = _build_topology(world_size, topology, 1)
    optim = build_optim(model, "adamw", fresh=True)
    load_model_and_optim_state(ckpt, model, optim)
    inner = getattr(model, "module", model)
    assert_same(expected_model, model_full_state(inner), f"model on rank {rank}")
    assert_same(expected_optim, optim_full_state(inner, optim), f"optimizer on rank {rank}")
    train(model, optim, range(2, 3))
    return True


TOPOLOGY_WS = {"ddp": 2, "hsdp": 4, "fsdp3": 3}


@pytest.mark.parametrize(
    "save_topology,load_topology",
    [("hsdp", "fsdp3"), ("fsdp3", "hsdp"), ("hsdp", "ddp"), ("ddp", "hsdp"), ("fsdp3", "ddp")],
)
def test_hsdp_and_ddp(run_distributed, tmp_path, save_topology, load_topology):
    ckpt = str(tmp_path / "ckpt")
    ref = run_distributed(_save_topology, TOPOLOGY_WS[save_topology], ckpt, save_topology)[0]
    ws = TOPOLOGY_WS[load_topology]
    assert run_distributed(_load_topology, ws, ckpt, load_topology, ref["model"], ref["optim"]) == [True] * ws


# Optimizers shaped less simply: two param groups, a frozen parameter, AdamW with amsgrad, and a
# target optimizer that already has state (which must be overwritten in place).


def _grouped_optim(model, fresh):
    named = dict(model.named_parameters())
    named["embed.weight"].requires_grad_(False)  # frozen: no optimizer state at all
    decay = [named["proj.weight"]]
    no_decay = [named["proj.bias"], named["bias"]]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}],
        lr=0.3 if fresh else 1e-2,
        amsgrad=True,
    )


def _state_ptrs(optim):
    return {
        (i, k): (v.to_local() if isinstance(v, DTensor) else v).data_ptr()
        for i, p in enumerate(optim.state)
        for k, v in optim.state[p].items()
    }


def _save_grouped(rank, world_size, ckpt):
    model = build_model(world_size)
    optim = _grouped_optim(model, fresh=False)
    train(model, optim, range(3))
    save_model_and_optim_state(ckpt, model, optim)
    return model_full_state(model), optim_full_state(model, optim)


def _load_grouped(rank, world_size, ckpt, expected_model, expected_optim):
    model = build_model(world_size, seed=1)
    optim = _grouped_optim(model, fresh=True)
    train(model, optim, range(7, 8))  # the target already has state
    ptrs = _state_ptrs(optim)
    load_model_and_optim_state(ckpt, model, optim)
    assert_same(expected_model, model_full_state(model), f"model on rank {rank}")
    assert_same(expected_optim, optim_full_state(model, optim), f"optimizer on rank {rank}")
    assert _state_ptrs(optim) == ptrs, "existing optimizer state was replaced instead of filled in place"
    train(model, optim, range(3, 4))
    return True


@pytest.mark.parametrize("save_ws,load_ws", [(2, 3), (3, 1), (1, 4)])
def test_param_groups_frozen_params_amsgrad(run_distributed, tmp_path, save_ws, load_ws):
    ckpt = str(tmp_path / "ckpt")
    expected_model, expected_optim = run_distributed(_save_grouped, save_ws, ckpt)[0]
    assert "state:proj.weight.max_exp_avg_sq" in expected_optim
    assert not any(k.startswith("state:embed.") for k in expected_optim)
    out = run_distributed(_load_grouped, load_ws, ckpt, expected_model, expected_optim)
    assert out == [True] * load_ws
