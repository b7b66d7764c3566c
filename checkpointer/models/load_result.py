"""What :func:`~checkpointer.load_model_and_optim_state` reports back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoadResult"]


@dataclass
class LoadResult:
    """The keys a load skipped, and the training state it read.

    ``missing_keys``: model or optimizer keys the checkpoint lacks (left untouched); with
    ``strict=True`` a load that would skip any raises instead. ``unexpected_keys``: checkpoint keys
    the model or optimizer lacks (not read). ``train_state``: the saved training state by key
    (for a ``PerRank`` value, this rank's own), as JSON gives it back; tensors stay tensors.
    """

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    train_state: dict[str, Any] = field(default_factory=dict)
