"""Optimizer state: saving never steps the optimizer; an optimizer with no state round-trips."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import (
    assert_same,
    build_model,
    build_optim,
    full,
    model_full_state,
    optim_full_state,
    train,
)

from checkpointer import load_model_and_optim_state, save_model_and_optim_state, unshard_optim_state


def _save_changes_nothing(rank, world_size, ckpt, optim_kind, steps):
    model = build_model(world_size)
    optim = build_optim(model, optim_kind)
    twin = build_model(world_size)
    twin_optim = build_optim(twin, optim_kind)
    train(model, optim, range(steps))
    train(twin, twin_optim, range(steps))
    before_model = model_full_state(model)
    before_optim = optim_full_state(model, optim)
    save_model_and_optim_state(ckpt, model, optim)
    assert_same(before_model, model_full_state(model), "parameters after save")
    assert_same(before_optim, optim_full_state(model, optim), "optimizer state (incl. 'step') after save")
    if steps == 0:
        assert not optim.state, f"save created optimizer state: {list(optim.state.values())[:1]}"
    # Nothing hidden changed either: the saved copy and its twin go on identically.
    assert train(model, optim, range(steps, steps + 2)) == train(twin, twin_optim, range(steps, steps + 2))
    assert_same(model_full_state(twin), model_full_state(model), "model vs twin after more steps")
    return before_model


@pytest.mark.parametrize("steps", [0, 2], ids=["no-step-yet", "after-2-steps"])
@pytest.mark.parametrize("optim_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_save_does_not_touch_params_or_steps(run_distributed, tmp_path, world_size, optim_kind, steps):
    run_distributed(_save_changes_nothing, world_size, str(tmp_path / "ckpt"), optim_kind, steps)


def _load_stateless(rank, world_size, ckpt, optim_kind, expected_model):
    """A checkpoint of an optimizer that never stepped loads, and training then matches a fresh start."""
    model = build_model(world_size, seed=1)
    optim = build_optim(model, optim_kind, fresh=True)
    load_model_and_optim_state(ckpt, model, optim)
    assert_same(expected_model, model_full_state(model), "model")
    for p, st in optim.state.items():  # no state, or state equal to a fresh optimizer's
        assert not st or float(full(st.get("step", torch.tensor(0.0)))) == 0.0, st
    reference = build_model(world_size)
    reference_optim = build_optim(reference, optim_kind)
    assert_same(
        {k: v for k, v in optim_full_state(reference, reference_optim).items() if k.startswith("group")},
        {k: v for k, v in optim_full_state(model, optim).items() if k.startswith("group")},
        "param groups",
    )
    losses = train(model, optim, range(2))
    assert losses == train(reference, reference_optim, range(2))
    return True


@pytest.mark.parametrize("optim_kind", ["adamw", "sgd"])
def test_optimizer_without_state_round_trips(run_distributed, tmp_path, optim_kind):
    ckpt = str(tmp_path / "ckpt")
    expected_model = run_distributed(_save_changes_nothing, 2, ckpt, optim_kind, 0)[0]
    # The twin check above trained after saving; the checkpoint holds the initial state.
    for load_ws in (1, 3):
        assert run_distributed(_load_stateless, load_ws, ckpt, optim_kind, expected_model) == [True] * load_ws


def _save_for_unshard(rank, world_size, ckpt, optim_kind):
    model = build_model(world_size)
    optim = build_optim(model, optim_kind)
    train(model, optim, range(2))
    save_model_and_optim_state(ckpt, model, optim)
    sd = optim.state_dict()
    return {
        "state": {i: {k: full(v) for k, v in st.items()} for i, st in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }, optim_full_state(model, optim)


def _unshard_optim(rank, world_size, ckpt, expected, rank0_only):
    got = unshard_optim_state(ckpt, rank0_only=rank0_only)
    if rank0_only and rank != 0:
        assert got == {}, f"rank {rank} got {type(got)} {list(got)[:4]}"
        return True
    assert set(got) >= {"state", "param_groups"}, list(got)
    assert_same(
        {f"{i}.{k}": v for i, st in expected["state"].items() for k, v in st.items()},
        {f"{i}.{k}": v for i, st in got["state"].items() for k, v in st.items()},
        "unsharded optimizer state",
    )
    assert len(got["param_groups"]) == len(expected["param_groups"])
    for e, g in zip(expected["param_groups"], got["param_groups"]):
        extra = set(g) - set(e) - {"_param_names"}
        assert not extra, f"unexpected param group keys {extra}"
        assert_same(e, {k: g[k] for k in e if k in g}, "param group")
    return True


def _load_unsharded_into_plain_optimizer(rank, world_size, ckpt, optim_kind, expected_by_name):
    model = build_model(1)
    optim = build_optim(model, optim_kind, fresh=True)
    optim.load_state_dict(unshard_optim_state(ckpt, no_dist=True))
    assert_same(expected_by_name, optim_full_state(model, optim), "optimizer loaded from unshard_optim_state")
    return True


@pytest.mark.parametrize("optim_kind", ["adamw", "sgd"])
def test_unshard_optim_state(run_distributed, tmp_path, optim_kind):
    ckpt = str(tmp_path / "ckpt")
    expected, by_name = run_distributed(_save_for_unshard, 3, ckpt, optim_kind)[0]
    assert run_distributed(_unshard_optim, 2, ckpt, expected, False) == [True] * 2
    assert run_distributed(_unshard_optim, 3, ckpt, expected, True) == [True] * 3
    assert run_distributed(_unshard_optim, 1, ckpt, expected, False, init_pg=False) == [True]
    assert run_distributed(_load_unsharded_into_plain_optimizer, 1, ckpt, optim_kind, by_name, init_pg=False) == [
        True
    ]


def _tensor_lr(rank, world_size, ckpt):
    """An optimizer whose learning rate is a tensor (as compiled or capturable optimizers use) keeps a
    tensor after a load, holding the saved value; training then goes on as the saver's would."""
    model = build_model(world_size)
    optim = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
    train(model, optim, range(2))
    optim.param_groups[0]["lr"].fill_(0.003)  # as a scheduler moves it
    save_model_and_optim_state(ckpt, model, optim)
    expected = train(model, optim, range(2, 4))
    again = build_model(world_size, seed=1)
    again_optim = torch.optim.AdamW(again.parameters(), lr=torch.tensor(0.5))
    load_model_and_optim_state(ckpt, again, again_optim)
    lr = again_optim.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(0.003), repr(lr)
    assert train(again, again_optim, range(2, 4)) == expected
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_tensor_learning_rate_stays_a_tensor(run_distributed, tmp_path, world_size):
    assert run_distributed(_tensor_lr, world_size, str(tmp_path / "ckpt")) == [True] * world_size
