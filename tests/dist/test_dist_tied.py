"""Tied weights: ``lm_head.weight = embed.weight`` saves, loads into both names and stays tied."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from dist_helpers import assert_same, mesh, model_full_state, optim_full_state

from checkpointer import load_model_and_optim_state, save_model_and_optim_state, unshard_model_state


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, 6)
        self.mid = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.mid(self.embed(ids))))


def _build(world_size, seed, vocab=11):
    torch.manual_seed(seed)
    model = TiedLM(vocab)
    if world_size > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh((world_size,)))
    assert model.lm_head.weight is model.embed.weight
    return model


def _step(model, optim, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, model.vocab, (3, 4), generator=g)
    loss = nn.functional.cross_entropy(model(ids).reshape(-1, model.vocab), ids.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _save(rank, world_size, ckpt, vocab=11):
    model = _build(world_size, 0, vocab)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optim, 0)
    save_model_and_optim_state(ckpt, model, optim)
    assert model.lm_head.weight is model.embed.weight
    return model_full_state(model), optim_full_state(model, optim)


def _load(rank, world_size, ckpt, expected_model, expected_optim, vocab=11):
    model = _build(world_size, 1, vocab)
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


def test_tied_weight_with_an_empty_shard(run_distributed, tmp_path):
    """A vocabulary of 2 over 3 ranks: rank 2's shard of the tied weight is empty (0 x 6)."""
    ckpt = str(tmp_path / "ckpt")
    expected_model, expected_optim = run_distributed(_save, 3, ckpt, 2)[0]
    for load_ws in (1, 3):
        assert run_distributed(_load, load_ws, ckpt, expected_model, expected_optim, 2) == [True] * load_ws
    assert run_distributed(_unshard, 2, ckpt, expected_model) == [True, True]
