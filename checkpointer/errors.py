"""The library's exceptions. Everything raised on purpose derives from :class:`CheckpointError`."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "CheckpointMismatchError",
    "RankFailedError",
    "ReplicaMismatchError",
]


class CheckpointError(Exception):
    """Base class of every error this library raises on purpose."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint on storage is damaged, inconsistent or hostile."""


class IncompleteCheckpointError(CorruptCheckpointError):
    """The checkpoint directory has no ``metadata.json``: its save never finished."""


class CheckpointMismatchError(CheckpointError):
    """The state dict to load into disagrees with the checkpoint (keys, shapes, dtypes)."""


class RankFailedError(CheckpointError):
    """Another rank of the job failed; the message names it and its error."""


class ReplicaMismatchError(CheckpointError):
    """Ranks holding copies of one tensor hold different bytes: the save is refused, nothing committed."""
