"""The training state's contract in one process (:mod:`checkpointer.models.train_state`): RNGState
restores every generator it saves, a per-rank value a rank has no saved value of (another world
size) is named in ``missing_keys`` and a warning and leaves its object untouched, a rank reads its
own saved value, and values are taken, keyed and asked for as documented (found by mutation)."""

from __future__ import annotations

import json
import os
import random
import warnings

import numpy as np
import pytest
import torch
from dist_helpers import build_model, build_optim

import checkpointer
from checkpointer import Checkpointer, CheckpointMismatchError, RNGState
from checkpointer import dist as cdist


def _text(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


class Box:
    """A stateful object that records what it was given."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.loaded: list = []

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state) -> None:
        self.loaded.append(state)
        self.n = state["n"]


@pytest.fixture
def model_and_optim():
    model = build_model(1, seed=1)
    return model, build_optim(model, "adamw")


def _draws():
    return [random.random(), random.gauss(0, 1), float(np.random.rand()), np.random.standard_normal(), torch.rand(3).tolist()]


def test_rng_state_restores_python_numpy_and_torch(tmp_path, model_and_optim):
    model, optim = model_and_optim
    top = str(tmp_path / "step1")
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # a cached Gaussian in each
    checkpointer.save_model_and_optim_state(top, model, optim, train_state={"rng": RNGState()})
    expected = _draws()
    random.seed(10), np.random.seed(20), torch.manual_seed(30)
    result = checkpointer.load_model_and_optim_state(top, model, optim, train_state={"rng": RNGState()})
    assert _draws() == expected
    assert result.missing_keys == [] and "rng" in result.train_state


def _saved_by_two_ranks(top: str, model, optim, rank_values: dict[int, dict]) -> None:
    """A train/ as two ranks save it, with ``rank_values[r]`` the per-rank values rank ``r`` holds."""
    checkpointer.save_model_and_optim_state(top, model, optim)
    manifest = {"format": 1, "world_size": 2, "job": ["step"], "per_rank": ["mine", "box"]}
    flat = {"manifest": _text(manifest), "job.step": _text(3)}
    for r, values in rank_values.items():
        flat.update((f"rank{r}.{k}", _text(v)) for k, v in values.items())
    Checkpointer().save(os.path.join(top, "train"), flat)


def test_a_rank_without_a_saved_per_rank_value_is_told_and_left_untouched(tmp_path, model_and_optim):
    """Rank 0 loading what only rank 1 holds (as rank 2 of 3 loading a save of 2 ranks)."""
    model, optim = model_and_optim
    top = str(tmp_path / "step1")
    _saved_by_two_ranks(top, model, optim, {1: {"mine": {"r": 1}, "box": {"n": 1}}})
    box = Box(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = checkpointer.load_model_and_optim_state(top, model, optim, train_state={"box": box, "mine": None})
    assert result.train_state == {"step": 3}
    assert result.missing_keys == ["train_state.mine", "train_state.box"]
    assert box.n == 7 and box.loaded == []
    said = [str(w.message) for w in caught]
    assert any("saved by 2 ranks; rank 0 has no saved value of the per-rank train_state keys ['mine', 'box']" in s
               for s in said), said


def test_each_rank_reads_its_own_per_rank_value(tmp_path, model_and_optim, monkeypatch):
    model, optim = model_and_optim
    top = str(tmp_path / "step1")
    _saved_by_two_ranks(top, model, optim, {r: {"mine": {"r": r}, "box": {"n": 10 + r}} for r in (0, 1)})
    monkeypatch.setattr(cdist, "get_world_size", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(cdist, "get_rank", lambda rank=rank: rank)
        box = Box()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = checkpointer.load_model_and_optim_state(top, model, optim, train_state={"box": box})
        assert result.train_state == {"step": 3, "mine": {"r": rank}, "box": {"n": 10 + rank}}
        assert result.missing_keys == [] and box.loaded == [{"n": 10 + rank}]


@pytest.mark.parametrize("key", ["a/b", ""])
def test_keys_that_cannot_name_a_value_are_refused_before_anything_is_written(tmp_path, model_and_optim, key):
    model, optim = model_and_optim
    top = tmp_path / "step1"
    with pytest.raises(ValueError, match=f"train_state key {key!r}: keys are non-empty strings without '/'"):
        checkpointer.save_model_and_optim_state(str(top), model, optim, train_state={key: 1, "step": 2})
    assert not (top / "model" / "metadata.json").exists() and not (top / "train" / "metadata.json").exists()


def test_asking_a_checkpoint_without_training_state_for_keys_is_a_mismatch(tmp_path, model_and_optim):
    model, optim = model_and_optim
    top = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(top, model, optim)
    box = Box(4)
    with pytest.raises(CheckpointMismatchError, match=r"holds no training state, asked for \['box', 'step'\]"):
        checkpointer.load_model_and_optim_state(top, model, optim, train_state={"step": None, "box": box})
    assert box.loaded == []
    assert checkpointer.load_model_and_optim_state(top, model, optim).train_state == {}
