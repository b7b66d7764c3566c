"""Strict and non-strict loads under FSDP2 at 2 ranks: a refusal is raised on every rank and names
the difference only; fine-tuning with a new head (``strict=False``) keeps the saved body bit for
bit, leaves the new head alone, and the optimizer steps on; an optimizer of another kind is
refused on every rank. Both load strategies. One process: ``unit/test_strict_load.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from dist_helpers import catch, full, mesh

from checkpointer import (
    CheckpointMismatchError,
    LoadResult,
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_optim_state,
)


class Classifier(nn.Module):
    def __init__(self, head_name: str = "head", classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(20))
        self.head_name = head_name
        setattr(self, head_name, nn.Linear(6, classes))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return getattr(self, self.head_name)(h)


def _build(world_size: int, seed: int, head_name: str = "head", classes: int = 3) -> Classifier:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Classifier(head_name, classes)
    m = mesh((world_size,))
    fully_shard(model.embed, mesh=m)
    fully_shard(getattr(model, head_name), mesh=m)
    fully_shard(model, mesh=m)
    return model


def _step(model: Classifier, optim: torch.optim.Optimizer, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randint(0, 11, (4, 3), generator=g)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _full_model(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in model.state_dict().items()}


def _full_optim(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}.{k}": full(v) for p, st in optim.state.items() for k, v in st.items()}


def _save(rank, world_size, ckpt):
    model = _build(world_size, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for s in range(2):
        _step(model, optim, s)
    save_model_and_optim_state(ckpt, model, optim)
    return _full_model(model), _full_optim(model, optim)


def _load(rank, world_size, ckpt, saved_model, saved_optim, strategy):
    out = {}
    # Strict, a renamed head: every rank raises, naming the four keys of the difference only.
    renamed = _build(world_size, seed=1, head_name="classifier", classes=4)
    out["strict"] = catch(load_model_and_optim_state, ckpt, renamed, strategy=strategy)
    out["strict_optim"] = catch(
        load_model_and_optim_state, ckpt, _build(world_size, seed=1),
        torch.optim.AdamW(_build(world_size, seed=1).parameters()), strategy=strategy,
    )
    # Another kind of optimizer: refused on every rank, in both modes.
    plain = _build(world_size, seed=1)
    out["sgd"] = catch(load_model_and_optim_state, ckpt, plain, torch.optim.SGD(plain.parameters(), lr=0.1),
                       strict=False, strategy=strategy)
    # Fine-tuning: the saved body, a new head of another size, a new optimizer.
    tuned = _build(world_size, seed=2, head_name="classifier", classes=4)
    new_head = {k: v for k, v in _full_model(tuned).items() if k.startswith("classifier.")}
    optim = torch.optim.AdamW(tuned.parameters(), lr=0.5)
    result = load_model_and_optim_state(ckpt, tuned, optim, strict=False, strategy=strategy)
    got_model, got_optim = _full_model(tuned), _full_optim(tuned, optim)
    out["result"] = result
    out["body_equal"] = sorted(
        k for k, v in saved_model.items() if not k.startswith("head.") and torch.equal(got_model[k], v)
    )
    out["head_untouched"] = all(torch.equal(got_model[k], v) for k, v in new_head.items())
    out["optim_equal"] = sorted(k for k, v in got_optim.items() if k in saved_optim and torch.equal(v, saved_optim[k]))
    out["optim_keys"] = sorted(got_optim)
    out["lr"] = optim.param_groups[0]["lr"]
    out["loss"] = _step(tuned, optim, 7)
    out["steps_after"] = {k: float(v) for k, v in _full_optim(tuned, optim).items() if k.endswith(".step")}
    return out


@pytest.mark.parametrize("strategy", ["default", "two_stage"])
def test_strict_and_fine_tuning_under_fsdp2(run_distributed, tmp_path, strategy):
    ckpt = str(tmp_path / "ckpt")
    saved_model, saved_optim = run_distributed(_save, 2, ckpt)[0]
    results = run_distributed(_load, 2, ckpt, saved_model, saved_optim, strategy)
    body = sorted(k for k in saved_model if not k.startswith("head."))
    params = [k for k in saved_model]  # every key is a parameter
    for rank, r in enumerate(results):
        strict = r["strict"]
        assert strict and "CheckpointMismatchError" in strict["mro"], (rank, strict)
        msg = strict["msg"]
        assert "2 model keys the checkpoint lacks: ['classifier.weight', 'classifier.bias']" in msg, msg
        assert "2 checkpoint model keys the model lacks: ['head.bias', 'head.weight']" in msg, msg
        assert "layers.0.weight" not in msg and len(msg) < 400, msg
        # An optimizer over another model's parameters: refused in both modes.
        other = r["strict_optim"]
        assert other and "CheckpointMismatchError" in other["mro"], other
        assert "param group 0 holds tensors that are not parameters of the model" in other["msg"], other
        sgd = r["sgd"]
        assert sgd and "CheckpointMismatchError" in sgd["mro"], (rank, sgd)
        assert "the state of a AdamW optimizer" in sgd["msg"] and "kind, SGD:" in sgd["msg"], sgd["msg"]
        assert r["result"] == LoadResult(
            missing_keys=["classifier.weight", "classifier.bias", "optim:classifier.weight", "optim:classifier.bias"],
            unexpected_keys=["head.bias", "head.weight", "optim:head.weight", "optim:head.bias"],
        ), (rank, r["result"])
        assert r["body_equal"] == body, (rank, sorted(set(body) - set(r["body_equal"])))
        assert r["head_untouched"], rank
        want_optim = sorted(k for k in saved_optim if not k.startswith("head."))
        assert r["optim_keys"] == want_optim and r["optim_equal"] == want_optim, rank
        assert r["lr"] == 1e-2
        steps = r["steps_after"]
        assert steps["classifier.weight.step"] == 1.0 and steps["layers.0.weight.step"] == 3.0, steps
    assert len({r["loss"] for r in results}) == 1 and len(params) == 43
    names = unshard_optim_state(ckpt, no_dist=True)["param_groups"][0]["param_names"]
    assert names == params, names


def _strict_optimizer_difference(rank, world_size, ckpt):
    """The model matches; the optimizer holds only the layers: refused on every rank naming the
    saved parameters it lacks; non-strict loads the layers' state."""
    model = _build(world_size, seed=1)
    optim = torch.optim.AdamW(model.layers.parameters(), lr=0.3)
    err = catch(load_model_and_optim_state, ckpt, model, optim)
    result = load_model_and_optim_state(ckpt, model, optim, strict=False)
    return err, result, sorted({k.rsplit(".", 1)[0] for k in _full_optim(model, optim)})


def test_strict_optimizer_difference_under_fsdp2(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save, 2, ckpt)
    for err, result, loaded in run_distributed(_strict_optimizer_difference, 2, ckpt):
        assert err and "CheckpointMismatchError" in err["mro"], err
        msg = err["msg"]
        assert "3 checkpoint parameters the optimizer's param group 0 lacks: ['embed.weight', 'head.weight', 'head.bias']" in msg, msg
        assert "layers.0" not in msg and len(msg) < 400, msg
        assert result == LoadResult(unexpected_keys=["optim:embed.weight", "optim:head.weight", "optim:head.bias"])
        assert loaded == sorted(f"layers.{i}.{w}" for i in range(20) for w in ("bias", "weight"))
