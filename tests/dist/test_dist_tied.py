"""Tied weights: ``lm_head.weight = embed.weight`` saves, loads into both names and stays tied."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from dist_helpers import assert_same, mesh, model_full_state, optim_full_state

from checkpointer import load_model_and_optim_state, save_model_and_optim_state, unshard_model_state


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.mid(self.embed(ids))))


def _build(world_size, seed):
    torch.manual_seed(seed)
    model = TiedLM()
    if world_size > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh((world_size,)))
    assert model.lm_head.weight is model.embed.weight
    return model


def _step(model, optim, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 11, (3, 4), generator=g)
    loss = nn.functional.cross_entropy(model(ids).reshape(-1, 11), ids.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _save(rank, world_size, ckpt):
    model = _build(world_size, 0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optim, 0)
    save_model_and_optim_state(ckpt, model, optim)
    assert model.lm_head.weight is model.embed.weight
    return model_full_state(model), optim_full_state(model, optim)


def _load(rank, world_size, ckpt, expected_model, expected_optim):
    model = _build(world_size, 1)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_model_and_optim_state(ckpt, model, optim)
    assert model.lm_head.weight is model.embed.weight, "load untied lm_head.weight from embed.weight"
    got = model_full_state(model)
    assert_same(expected_model, got, f"model on rank {rank}")
    assert torch.equal(got["lm_head.weight"], got["embed.weight"])
    assert_same(expected_optim, optim_full_state(model, optim), f"optimizer on rank {rank}")
    _step(model, optim, 1)
    assert model.lm_head.weight is model.embed.weight
    return True


def _unshard(rank, world_size, ckpt, expected_model):
    got = unshard_model_state(ckpt)
    assert {"embed.weight", "lm_head.weight"} <= set(got), sorted(got)
    assert torch.equal(got["embed.weight"], got["lm_head.weight"])
    assert_same(expected_model, got, "unsharded model")
    return True


@pytest.mark.parametrize("save_ws", [1, 2])
def test_tied_embeddings(run_distributed, tmp_path, save_ws):
    ckpt = str(tmp_path / "ckpt")
    expected_model, expected_optim = run_distributed(_save, save_ws, ckpt)[0]
    assert "lm_head.weight" in expected_model and "embed.weight" in expected_model
    for load_ws in (1, 2, 3):
        assert run_distributed(_load, load_ws, ckpt, expected_model, expected_optim) == [True] * load_ws
    assert run_distributed(_unshard, 2, ckpt, expected_model) == [True, True]
