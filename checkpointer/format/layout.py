"""Names of the files in a checkpoint directory."""

from __future__ import annotations

import re
import uuid

from ..errors import CorruptCheckpointError

__all__ = [
    "METADATA_FILENAME",
    "LOCK_FILENAME",
    "LOCK_TAKEOVER_PREFIX",
    "LOCK_BEAT_PREFIX",
    "FORMAT_VERSION",
    "LEGACY_FORMAT_VERSION",
    "rank_filename",
    "temp_name",
    "part_prefix",
    "is_rank_filename",
    "is_rank_temp_file",
    "is_save_file",
    "check_filename",
    "FILE_ID_KEY",
    "CHECKSUMS_KEY",
    "new_file_id",
]

METADATA_FILENAME = "metadata.json"
LOCK_FILENAME = ".checkpointer-save.lock"
"""Held by rank 0 from planning until commit, so two jobs never save into one directory at once."""
LOCK_TAKEOVER_PREFIX = f"{LOCK_FILENAME}.taken-"
"""Followed by a digest of a stale lock: created exclusively by the one save that takes it over."""
LOCK_BEAT_PREFIX = f"{LOCK_FILENAME}.beat-"
"""Followed by a lock's token: the heartbeat of the save holding that lock, written beside it."""
FORMAT_VERSION = 2
"""Format 2: regular layouts as shard rules, checksums in the rank files, one file id per save."""
LEGACY_FORMAT_VERSION = 1
"""Format 1: every piece listed file by file, with its checksums and each file's id."""
CHECKSUMS_KEY = "__checkpointer_crc32c__"
"""Format 2: the tensor, last in each rank file, of its pieces' CRC32C checksums: little-endian
uint32 values (U8 bytes), the pieces in order of their keys, ``ceil(bytes / chunk)`` each."""
FILE_ID_KEY = "checkpointer_file_id"
"""The key, in a rank file's safetensors ``__metadata__``, of the id ``metadata.json`` lists for it."""
_RANK_FILE = re.compile(r"rank_(\d+)\.safetensors")
_TEMP_FILE = re.compile(r"\.(.+)\.tmp-[0-9a-f]+")
_PART_FILE = re.compile(r"\.(.+)\.part-[0-9a-f]+-c?[0-9]+")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def rank_filename(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def is_rank_filename(name: str) -> bool:
    return _RANK_FILE.fullmatch(name) is not None


def _unfinished(name: str) -> re.Match[str] | None:
    return _TEMP_FILE.fullmatch(name) or _PART_FILE.fullmatch(name)


def is_rank_temp_file(name: str) -> bool:
    """The temp file (see :func:`temp_name`) or an uploaded part (see :func:`part_prefix`) of a
    rank file: one a save that died left behind."""
    temp = _unfinished(name)
    return temp is not None and is_rank_filename(temp.group(1))


def is_save_file(name: str) -> bool:
    """A file only a save of this library leaves: a rank file, the save lock (or a takeover
    marker or the heartbeat of one), or the temp file (see :func:`temp_name`) or an uploaded part (see
    :func:`part_prefix`) of either or of ``metadata.json``."""
    temp = _unfinished(name)
    base = temp.group(1) if temp else name
    return (
        is_rank_filename(base)
        or base == LOCK_FILENAME
        or base.startswith(LOCK_TAKEOVER_PREFIX)
        or base.startswith(LOCK_BEAT_PREFIX)
        or (temp is not None and base == METADATA_FILENAME)
    )


def new_file_id() -> str:
    """A random id for one rank file of one save (64 bits: no two files ever share one)."""
    return uuid.uuid4().hex[:16]


def temp_name(name: str) -> str:
    """A unique sibling name to write ``name`` under before renaming it into place."""
    return f".{name}.tmp-{uuid.uuid4().hex[:12]}"


def part_prefix(name: str) -> str:
    """A unique prefix for the hidden objects a parallel upload of ``name`` stores its parts in,
    each named by the prefix and a number (``c`` and a number for a partial join of them)."""
    return f".{name}.part-{uuid.uuid4().hex[:12]}-"


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
