"""The library's exceptions. Everything raised on purpose derives from :class:`CheckpointError`."""

from __future__ import annotations

import json
import traceback as _traceback
from dataclasses import asdict, dataclass
from typing import Sequence

__all__ = [
    "RankError",
    "remote_error",
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "CheckpointMismatchError",
    "RankFailedError",
    "ReplicaMismatchError",
]


@dataclass(frozen=True)
class RankError:
    """One rank's failure as it travels to the other ranks: the one wire format of errors."""

    rank: int
    type: str
    message: str
    traceback: str = ""
    file_exists: bool = False

    @staticmethod
    def of(rank: int, error: BaseException) -> RankError:
        text = "".join(_traceback.format_exception(type(error), error, error.__traceback__))
        return RankError(rank, type(error).__name__, str(error), text, isinstance(error, FileExistsError))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def from_json(data: bytes | str) -> RankError:
        raw = json.loads(data)
        return RankError(int(raw["rank"]), str(raw["type"]), str(raw["message"]), str(raw.get("traceback", "")),
                         bool(raw.get("file_exists", False)))


class CheckpointError(Exception):
    """Base class of every error this library raises on purpose."""

    failures: dict[int, RankError] = {}
    """Raised because other ranks failed: each failing rank's error, by rank (else empty)."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint on storage is damaged, inconsistent or hostile."""


class IncompleteCheckpointError(CorruptCheckpointError):
    """The checkpoint directory has no ``metadata.json``: its save never finished."""


class CheckpointMismatchError(CheckpointError):
    """The state dict to load into disagrees with the checkpoint (keys, shapes, dtypes)."""


class RankFailedError(CheckpointError):
    """Other ranks of the job failed: the message names the first and shows its traceback;
    ``failures`` holds every failing rank's :class:`RankError`."""

    def __init__(self, message: str, failures: dict[int, RankError] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


class ReplicaMismatchError(CheckpointError):
    """Ranks holding copies of one tensor hold different bytes: the save is refused, nothing committed."""


_KNOWN: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, CheckpointMismatchError,
                ReplicaMismatchError)
}


def remote_error(failures: Sequence[RankError], what: str) -> BaseException:
    """The error a rank raises for other ranks' failures: the first's class where the library
    knows it (or :class:`RankFailedError`), its message and traceback, and every failure."""
    first = failures[0]
    message = f"{what} failed on rank {first.rank}: {first.type}: {first.message}"
    others = [f.rank for f in failures[1:]]
    if others:
        message += f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})"
    if first.traceback:
        message += f"\n\nrank {first.rank}'s traceback:\n{first.traceback.rstrip()}"
    by_rank = {f.rank: f for f in failures}
    if first.file_exists:
        error: BaseException = FileExistsError(message)
    else:
        cls = _KNOWN.get(first.type, RankFailedError)
        error = cls(message, by_rank) if cls is RankFailedError else cls(message)
    error.failures = by_rank  # type: ignore[attr-defined]
    return error


