"""Names of the files in a checkpoint directory."""

from __future__ import annotations

import re
import uuid

from ..errors import CorruptCheckpointError

__all__ = [
    "METADATA_FILENAME",
    "LOCK_FILENAME",
    "FORMAT_VERSION",
    "rank_filename",
    "temp_name",
    "is_rank_filename",
    "check_filename",
]

METADATA_FILENAME = "metadata.json"
LOCK_FILENAME = ".checkpointer-save.lock"
"""Held by rank 0 from planning until commit, so two jobs never save into one directory at once."""
FORMAT_VERSION = 1
_RANK_FILE = re.compile(r"rank_(\d+)\.safetensors")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def rank_filename(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def is_rank_filename(name: str) -> bool:
    return _RANK_FILE.fullmatch(name) is not None


def temp_name(name: str) -> str:
    """A unique sibling name to write ``name`` under before renaming it into place."""
    return f".{name}.tmp-{uuid.uuid4().hex[:12]}"


def check_filename(name: str) -> str:
    """Refuse any file name from metadata that could leave the checkpoint directory."""
    if (
        not isinstance(name, str)
        or not _SAFE_NAME.fullmatch(name)
        or name in (".", "..")
        or name.startswith(".")
        or name == METADATA_FILENAME
    ):
        raise CorruptCheckpointError(f"file name {name!r} in metadata is not a plain file inside the checkpoint")
    return name
