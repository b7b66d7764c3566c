"""Hostile ``train/`` directories: whatever a training state's files say, loading it raises a
:class:`~checkpointer.CorruptCheckpointError` naming the file or key; nothing is run (no pickle)
and nothing larger than the files is allocated. Each case is a checkpoint with valid checksums,
written through the engine, whose content lies."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist_helpers import build_model, build_optim

import checkpointer
from checkpointer import Checkpointer, CorruptCheckpointError, RNGState


def _text(obj) -> torch.Tensor:
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


GOOD_MANIFEST = {"format": 1, "world_size": 1, "job": ["x"], "per_rank": []}

CASES = {
    "no manifest": {"job.x": _text(1)},
    "manifest not JSON": {"manifest": _text(b"\x80not json"), "job.x": _text(1)},
    "manifest not a dict": {"manifest": _text([1, 2]), "job.x": _text(1)},
    "manifest of another format": {"manifest": _text({**GOOD_MANIFEST, "format": 99}), "job.x": _text(1)},
    "manifest keys not strings": {"manifest": _text({**GOOD_MANIFEST, "job": [1]}), "job.x": _text(1)},
    "manifest names a value not there": {"manifest": _text({**GOOD_MANIFEST, "job": ["x", "y"]}), "job.x": _text(1)},
    "manifest a float tensor": {"manifest": torch.zeros(4), "job.x": _text(1)},
    "value with a pickle tag": {"manifest": _text(GOOD_MANIFEST), "job.x": _text({"$pickle": "cos\nsystem\n"})},
    "value naming another key's tensor": {"manifest": _text(GOOD_MANIFEST), "job.x": _text({"$tensor": "manifest"}),},
    "value nested without end": {"manifest": _text(GOOD_MANIFEST), "job.x": _text(b"[" * 50_000 + b"]" * 50_000)},
    "value a NaN literal": {"manifest": _text(GOOD_MANIFEST), "job.x": _text(b"NaN")},
}


@pytest.fixture
def model_and_optim():
    model = build_model(1, seed=1)
    return model, build_optim(model, "adamw")


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_train_state_is_a_corrupt_checkpoint(tmp_path, model_and_optim, case):
    model, optim = model_and_optim
    top = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(top, model, optim)
    Checkpointer().save(os.path.join(top, "train"), CASES[case])
    with pytest.raises(CorruptCheckpointError, match="train"):
        checkpointer.load_model_and_optim_state(top, model, optim)


def test_a_flipped_byte_in_the_train_state_fails_its_checksum(tmp_path, model_and_optim):
    model, optim = model_and_optim
    top = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(top, model, optim, train_state={"step": 123456789, "t": torch.arange(100)})
    path = tmp_path / "step1" / "train" / "rank_0.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="train"):
        checkpointer.load_model_and_optim_state(top, model, optim)


def test_a_train_state_that_never_committed_is_incomplete(tmp_path, model_and_optim):
    """model/ and optim/ committed, train/ holds its rank file but no metadata.json (a copy cut
    short): the load returned an empty training state, so the run restarted its schedule and
    RNG silently (found by a review). An empty train/ is still a save without training state."""
    model, optim = model_and_optim
    top = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(top, model, optim, train_state={"step": 7})
    os.remove(os.path.join(top, "train", "metadata.json"))
    for asked in (None, {"step": 0}):
        with pytest.raises(checkpointer.IncompleteCheckpointError, match=r"train/metadata\.json"):
            checkpointer.load_model_and_optim_state(top, model, optim, train_state=asked)
    for name in os.listdir(os.path.join(top, "train")):
        os.remove(os.path.join(top, "train", name))
    assert checkpointer.load_model_and_optim_state(top, model, optim).train_state == {}


class Picky:
    """A stateful object whose ``load_state_dict`` rejects what the file says."""

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        if not isinstance(state["n"], int):
            raise TypeError("n must be an int")


def test_saved_values_that_do_not_load_into_their_objects_are_named(tmp_path, model_and_optim):
    model, optim = model_and_optim
    top = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(top, model, optim)
    manifest = {"format": 1, "world_size": 1, "job": ["picky"], "per_rank": ["rng"]}
    Checkpointer().save(os.path.join(top, "train"), {
        "manifest": _text(manifest), "job.picky": _text({"n": "one"}), "rank0.rng": _text({"python": 5}),
    })
    with pytest.raises(CorruptCheckpointError, match="picky"):
        checkpointer.load_model_and_optim_state(top, model, optim, train_state={"picky": Picky()})
    with pytest.raises(CorruptCheckpointError, match=r"train.*rng.*RNGState"):
        checkpointer.load_model_and_optim_state(top, model, optim, train_state={"rng": RNGState()})
