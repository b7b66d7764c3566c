"""Which checkpoint directories a user's ``DIR`` names: one checkpoint, or ``model/`` and ``optim/``."""

from __future__ import annotations

import io
import os

from ..errors import IncompleteCheckpointError
from ..format.layout import METADATA_FILENAME, is_rank_filename
from ..storage.base import Storage

__all__ = ["checkpoint_parts", "model_checkpoint"]

PARTS = ("model", "optim")


def checkpoint_parts(storage: Storage) -> list[tuple[str, Storage]]:
    """``[("", storage)]`` for a checkpoint directory (it holds ``metadata.json``); for the
    top-level directory of ``save_model_and_optim_state``, its ``model/`` and ``optim/`` parts
    (each listed when present, complete or not).

    Raises:
        IncompleteCheckpointError: neither ``metadata.json`` nor ``model/`` or ``optim/`` is there.
    """
    if storage.exists(METADATA_FILENAME):
        return [("", storage)]
    try:
        names = set(storage.list())
    except io.UnsupportedOperation:  # read-only storage (http): look for the parts by name
        names = {name for name in PARTS if storage.child(name).exists(METADATA_FILENAME)}
    parts = [(name, storage.child(name)) for name in PARTS if name in names]
    if not names:
        if storage.is_local() and os.path.isfile(storage.url):
            raise IncompleteCheckpointError(
                f"{storage.url} is a file, not a checkpoint directory (one holding {METADATA_FILENAME}, or model/ and optim/)"
            )
        raise IncompleteCheckpointError(f"{storage.url} does not exist or is empty: no checkpoint there")
    if not parts and any(is_rank_filename(n) for n in names):
        raise IncompleteCheckpointError(
            f"{storage.join(METADATA_FILENAME)} is missing: {storage.url} is not a complete checkpoint "
            "(its save never finished)"
        )
    if not parts:
        raise IncompleteCheckpointError(
            f"{storage.url} is not a checkpoint: it holds no {METADATA_FILENAME} (missing, or its save "
            "never finished) and no model/ or optim/ sub-directory"
        )
    return parts


def model_checkpoint(storage: Storage) -> Storage:
    """The checkpoint directory holding model weights: ``storage`` itself, or its ``model/``."""
    for name, part in checkpoint_parts(storage):
        if name in ("", "model"):
            return part
    raise IncompleteCheckpointError(f"{storage.url} holds optim/ but no model/ checkpoint")
