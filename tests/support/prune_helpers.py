"""A run directory of small real checkpoints, for the tests of ``checkpointer.prune`` (local, S3, GCS)."""

from __future__ import annotations

import torch
import torch.nn as nn

import checkpointer
from checkpointer.storage import open_storage

__all__ = ["make_run", "KEPT", "DELETED"]

DELETED = ["step50", "step100", "step250", "step300"]
"""What ``prune(run, keep_last=2, keep_every=200)`` deletes in :func:`make_run`'s directory."""
KEPT = ["notes_step150", "step200", "step400", "step500", "step600"]
"""What it leaves: a directory of other files, the multiple of 200, the newest two complete
checkpoints, and an incomplete one newer than the newest complete one (a save still writing)."""


def _flat(url: str, value: float) -> None:
    checkpointer.Checkpointer().save(url, {"w": torch.full((4,), value)})


def _model_and_optim(url: str) -> None:
    model = nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    checkpointer.save_model_and_optim_state(url, model, optim)


def make_run(run: str) -> None:
    """Complete checkpoints at steps 100-500 (400 and 500 as model + optimizer), incomplete ones
    at 50 (flat), 250 (its optimizer uncommitted) and 600, and a directory of notes."""
    for step in (50, 100, 200, 300, 600):
        _flat(f"{run}/step{step}", step)
    for step in (250, 400, 500):
        _model_and_optim(f"{run}/step{step}")
    storage = open_storage(run)
    storage.child("step50").delete("metadata.json")
    storage.child("step600").delete("metadata.json")
    storage.child("step250").child("optim").delete("metadata.json")
    notes = storage.child("notes_step150")
    notes.prepare()
    notes.write("notes.txt", b"not a checkpoint: prune leaves it")
