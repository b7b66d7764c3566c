"""Hostile input in the other formats lazy_load reads: torch pickles (``.pt``) and Hugging Face
directories (``model.safetensors.index.json``). The rule is the one of test_hostile_files.py:
a CheckpointError naming the file, never another exception, never a hang or a huge allocation.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from rel_helpers import assert_rule, lazy_all, run_loaders

import checkpointer
from checkpointer.engine.lazy_sources import MAX_NESTING


def _nested(depth: int) -> dict:
    """A state dict whose tensor sits under ``depth`` nested mappings (the outer one included)."""
    d: dict = {"w": torch.ones(2)}
    for _ in range(depth - 1):
        d = {"a": d}
    return d


def _save_deep(path: str, depth: int) -> None:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 4 * depth + 1000))  # the pickler recurses too
    try:
        torch.save(_nested(depth), path)
    finally:
        sys.setrecursionlimit(old)


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 5000])
def test_torch_pickle_nested_too_deeply(tmp_path, depth):
    """5000 levels made the flattening recurse out of stack (RecursionError)."""
    path = str(tmp_path / "ckpt" / "model.pt")
    os.makedirs(os.path.dirname(path))
    _save_deep(path, depth)
    outcomes = run_loaders({"lazy_load": lambda: lazy_all(path)}, os.path.dirname(path), (str(tmp_path),))
    assert_rule(outcomes, must_raise={"lazy_load"}, needles=("model.pt",), cls=checkpointer.CorruptCheckpointError)
    assert "nests mappings more than" in str(outcomes["lazy_load"].error)


def test_torch_pickle_nested_to_the_limit_loads(tmp_path):
    path = str(tmp_path / "model.pt")
    _save_deep(path, MAX_NESTING)
    (key, tensor), = checkpointer.lazy_load(path)
    assert key == "a." * (MAX_NESTING - 1) + "w"
    assert torch.equal(tensor, torch.ones(2))
