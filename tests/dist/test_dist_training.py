"""Training continuation: train N steps, save, go on M steps; reload elsewhere and go on M steps."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import build_model, build_optim, model_full_state, train

from checkpointer import load_model_and_optim_state, save_model_and_optim_state

N, M = 3, 3


def _reference(rank, world_size, ckpt, optim_kind):
    model = build_model(world_size)
    optim = build_optim(model, optim_kind)
    train(model, optim, range(N))
    save_model_and_optim_state(ckpt, model, optim)
    losses = train(model, optim, range(N, N + M))
    return losses, model_full_state(model)


def _resume(rank, world_size, ckpt, optim_kind):
    model = build_model(world_size, seed=123)
    optim = build_optim(model, optim_kind, fresh=True)
    load_model_and_optim_state(ckpt, model, optim)
    losses = train(model, optim, range(N, N + M))
    return losses, model_full_state(model)


@pytest.fixture(scope="module")
def reference(run_distributed, tmp_path_factory):
    cache = {}

    def get(world_size, optim_kind):
        key = (world_size, optim_kind)
        if key not in cache:
            ckpt = str(tmp_path_factory.mktemp(f"train-ws{world_size}-{optim_kind}") / "ckpt")
            cache[key] = (ckpt, run_distributed(_reference, world_size, ckpt, optim_kind)[0])
        return cache[key]

    return get


@pytest.mark.parametrize(
    "save_ws,load_ws,optim_kind",
    [
        (1, 1, "adamw"),
        (2, 2, "adamw"),
        (3, 3, "sgd"),
        (4, 4, "adamw"),
        (4, 2, "adamw"),
        (2, 3, "adamw"),
        (1, 4, "adamw"),
        (3, 1, "adamw"),
        (2, 4, "sgd"),
        (4, 1, "sgd"),
    ],
)
def test_resume_training(run_distributed, reference, save_ws, load_ws, optim_kind):
    ckpt, (ref_losses, ref_model) = reference(save_ws, optim_kind)
    results = run_distributed(_resume, load_ws, ckpt, optim_kind)
    for rank, (losses, final_model) in enumerate(results):
        if save_ws == load_ws:
            assert losses == ref_losses, f"rank {rank}"
            for k, v in ref_model.items():
                assert torch.equal(final_model[k], v), f"rank {rank}: {k}"
        else:  # reductions run in another order at another world size
            assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), f"rank {rank}"
            for k, v in ref_model.items():
                assert torch.allclose(final_model[k], v, rtol=1e-5, atol=1e-6), f"rank {rank}: {k}"
