"""Tensors in a training state, in one process: each is copied when the save is called (an async
save that stages in the background included), and one tensor under several names comes back
under each, from a checkpoint saved before the copies (aliases) too."""

from __future__ import annotations

import json
import os

import torch
from dist_helpers import build_model, build_optim

import checkpointer
from checkpointer import Checkpointer


class Counter:
    """A stateful object whose ``state_dict`` hands out its own tensor, as many do."""

    def __init__(self) -> None:
        self.t = torch.zeros(4)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, state) -> None:
        self.t.copy_(state["t"])


def test_one_tensor_under_several_names_comes_back_under_each(tmp_path):
    """Adam with a tensor lr and SequentialLR: the schedulers' ``_last_lr`` all hold the optimizer's
    lr tensor. A save stores one tensor object once (an alias); the training state's loader read
    only the stored names, so such a checkpoint saved and never loaded (found by a review)."""
    model = build_model(1, seed=1)
    optim = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    first = torch.optim.lr_scheduler.LinearLR(optim, start_factor=0.5, total_iters=2)
    sched = torch.optim.lr_scheduler.SequentialLR(optim, [first, torch.optim.lr_scheduler.ConstantLR(optim)], milestones=[2])
    t = torch.arange(3.0)
    step = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(step, model, optim, train_state={"sched": sched, "x": [t, t], "y": t})
    loaded = checkpointer.load_model_and_optim_state(step, model, optim).train_state
    assert [torch.equal(v, t) for v in [*loaded["x"], loaded["y"]]] == [True] * 3
    assert loaded["sched"]["_last_lr"] == sched.state_dict()["_last_lr"]


def test_a_train_state_saved_with_aliases_loads(tmp_path):
    """What saves before the copies wrote: two names of one value, one stored, one an alias."""
    model = build_model(1, seed=1)
    optim = build_optim(model, "adamw")
    step = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(step, model, optim)
    t = torch.arange(5.0)
    text = {"manifest": {"format": 1, "world_size": 1, "job": ["x"], "per_rank": []}, "job.x": [{"$tensor": "job.x/0"}, {"$tensor": "job.x/1"}]}
    flat = {k: torch.frombuffer(bytearray(json.dumps(v).encode()), dtype=torch.uint8) for k, v in text.items()}
    Checkpointer().save(os.path.join(step, "train"), {**flat, "job.x/0": t, "job.x/1": t})
    assert json.load(open(os.path.join(step, "train", "metadata.json")))["aliases"] == {"job.x/1": "job.x/0"}
    x = checkpointer.load_model_and_optim_state(step, model, optim).train_state["x"]
    assert torch.equal(x[0], t) and torch.equal(x[1], t)


def test_an_async_save_takes_the_train_state_when_called(tmp_path):
    """``stage_in_background`` defers the model's and optimizer's copy, not the training state's:
    its tensors, changed right after the call, are saved as they were at it (found by a review)."""
    model = build_model(1, seed=1)
    optim = build_optim(model, "adamw")
    for background in (True, False):
        counter, job, mine = Counter(), torch.zeros(4), torch.zeros(4)
        step = str(tmp_path / f"step{int(background)}")
        future = checkpointer.async_save_model_and_optim_state(
            step, model, optim, stage_in_background=background,
            train_state={"c": counter, "t": job, "p": checkpointer.PerRank(mine)})
        for t in (counter.t, job, mine):
            t.add_(1)
        future.result()
        saved = checkpointer.load_model_and_optim_state(step, model, optim).train_state
        assert [saved["c"]["t"].sum().item(), saved["t"].sum().item(), saved["p"].sum().item()] == [0, 0, 0], background
