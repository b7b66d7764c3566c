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
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "state": {i: {k: full(v) for k, v in st.items()} for i, st in sd["state"].items()},
        "param_groups": sd["param_groups"],
        "param_names": [[names[id(p)] for p in g["params"]] for g in optim.param_groups],
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
    for e, g, names in zip(expected["param_groups"], got["param_groups"], expected["param_names"], strict=True):
        extra = set(g) - set(e) - {"param_names"}
        assert not extra, f"unexpected param group keys {extra}"
        assert g["param_names"] == names and len(g["params"]) == len(names), (g["param_names"], names)
        assert_same(e, {k: g[k] for k in e if k in g}, "param group")
    return True


def _load_unsharded_into_plain_optimizer(rank, world_size, ckpt, optim_kind, expected_by_name):
    model = build_model(1)
    optim = build_optim(model, optim_kind, fresh=True)
    optim.load_state_dict(unshard_optim_state(ckpt, no_dist=True))
    got = optim_full_state(model, optim)
    # torch gives an unnamed optimizer the names of the state dict it loads.
    assert got.pop("group0:param_names") == got["group0:params"]
    assert_same(expected_by_name, got, "optimizer loaded from unshard_optim_state")
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


# One state tensor shared by two parameters (an optimizer that keeps one moment for a pair).


class _Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(6, 4))
        self.b = torch.nn.Parameter(torch.randn(6, 4))


def _pair(world_size, fsdp, seed):
    from dist_helpers import mesh

    torch.manual_seed(seed)
    model = _Pair()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh((world_size,)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.5 if seed else 1e-2)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _shares_memory(x, y):
    x, y = _local(x), _local(y)
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() and x.data_ptr() == y.data_ptr()


def _save_shared_state(rank, world_size, ckpt, fsdp):
    model, optim = _pair(world_size, fsdp, 0)
    shared = model.a.detach() * 0.5 + 3.0
    optim.state[model.a] = {"step": torch.tensor(3.0), "exp_avg": shared, "exp_avg_sq": model.a.detach() ** 2}
    optim.state[model.b] = {"step": torch.tensor(5.0), "exp_avg": shared, "exp_avg_sq": model.b.detach() ** 2 + 1}
    save_model_and_optim_state(ckpt, model, optim)
    return optim_full_state(model, optim)


def _load_shared_state(rank, world_size, ckpt, fsdp, existing, expected):
    model, optim = _pair(world_size, fsdp, 1)
    if existing:  # separate state tensors already there, to be filled in place
        for p in (model.a, model.b):
            optim.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    load_model_and_optim_state(ckpt, model, optim)
    assert_same(expected, optim_full_state(model, optim), f"optimizer state on rank {rank}")
    a, b = optim.state[model.a], optim.state[model.b]
    assert _shares_memory(a["exp_avg"], b["exp_avg"]), "the shared exp_avg is two tensors after the load"
    assert not _shares_memory(a["exp_avg_sq"], b["exp_avg_sq"])
    return True


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp2"])
def test_state_tensor_shared_by_two_parameters(run_distributed, tmp_path, fsdp):
    """The checkpoint stores the shared tensor once (the second name is an alias); a load fills
    both parameters' state and they share one tensor again."""
    ckpt = str(tmp_path / "ckpt")
    save_ws = 2 if fsdp else 1
    expected = run_distributed(_save_shared_state, save_ws, ckpt, fsdp)[0]
    assert torch.equal(expected["state:a.exp_avg"], expected["state:b.exp_avg"])
    for load_ws, load_fsdp in ((1, False), (3, True), (save_ws, fsdp)):
        for existing in (False, True):
            assert run_distributed(_load_shared_state, load_ws, ckpt, load_fsdp, existing, expected) == [True] * load_ws
