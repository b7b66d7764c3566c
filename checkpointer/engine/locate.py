"""Which checkpoint directories a user's ``DIR`` names: one checkpoint, or ``model/`` and ``optim/``."""

from __future__ import annotations

import io
import json
import os
import re

from .. import settings
from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ..format.layout import METADATA_FILENAME, is_rank_filename, is_save_file
from ..storage import open_storage
from ..storage.base import Storage, is_valid_name
from ..storage.urls import parent_url

__all__ = [
    "checkpoint_parts",
    "model_checkpoint",
    "newest_checkpoint",
    "step_of",
    "is_complete",
    "metadata_bytes",
    "holds_anything",
    "wrong_directory_hint",
    "run_directory_hint",
    "missing_metadata_message",
    "unfinished_save_message",
]

PARTS = ("model", "optim")
COMMITTED_PARTS = (*PARTS, "train")
"""The parts of a step directory that each commit a ``metadata.json`` of their own."""
_NUMBER = re.compile(r"(\d+)")
_STEP = re.compile(r"step[-_]?(\d+)", re.IGNORECASE)


def step_of(name: str) -> int | None:
    """The number after ``step`` in the name (``epoch2-step900``), else its last number."""
    step = _STEP.search(name)
    numbers = [step.group(1)] if step else _NUMBER.findall(name)
    return int(numbers[-1]) if numbers else None


def _lists(storage: Storage) -> list[str]:
    try:
        return storage.list()
    except (OSError, io.UnsupportedOperation, NotImplementedError):
        return []


def holds_anything(storage: Storage) -> bool:
    """Whether a part directory lists anything: a save began writing it (unlistable storage: no)."""
    return bool(_lists(storage))


def is_complete(storage: Storage) -> bool:
    """A top-level directory holding ``model/`` and ``optim/`` in which every part present
    (``model/``, ``optim/``, ``train/``) committed its ``metadata.json``: a save killed between
    parts never leaves a step that looks complete, whatever else the directory holds. Any other
    directory: one whose ``metadata.json`` is a checkpoint's (:func:`_is_checkpoint_metadata`).
    An empty ``train/`` (a save without training state over one with it) counts as absent."""
    names = set(_lists(storage))
    if not all(part in names for part in PARTS):
        return _is_checkpoint_metadata(storage)
    return all(
        storage.part(part).exists(METADATA_FILENAME) or (part not in PARTS and not holds_anything(storage.part(part)))
        for part in COMMITTED_PARTS
        if part in names
    )


def _is_checkpoint_metadata(storage: Storage) -> bool:
    """Whether ``metadata.json`` is there and is a checkpoint's, a JSON object holding a ``tensors``
    object (this library's, OLMo-core's): another tool's ``metadata.json`` (an evaluation's
    results, say) does not make its directory a checkpoint, nor one too large to load."""
    if not storage.exists(METADATA_FILENAME):
        return False  # before reading: a file named like a step, say, is not read through
    try:
        document = json.loads(metadata_bytes(storage))
    except (CheckpointError, ValueError, RecursionError):
        return False
    return isinstance(document, dict) and isinstance(document.get("tensors"), dict)


def newest_checkpoint(run: Storage) -> str | None:
    """The name of the newest complete checkpoint among the sub-directories of ``run``: the
    highest step (:func:`step_of`), incomplete ones skipped; None when there is none.

    Raises:
        OSError: ``run`` cannot be listed (a missing directory lists as empty).
    """
    steps = [(step, i, name) for i, name in enumerate(run.list())
             if is_valid_name(name) and (step := step_of(name)) is not None]
    for _, _, name in sorted(steps, key=lambda s: (-s[0], s[1])):
        if is_complete(run.child(name)):
            return name
    return None


def _parent(storage: Storage) -> Storage | None:
    """The directory above ``storage`` (local, s3://, gs://), or None at a root or for http(s)."""
    parent = parent_url(storage.url)
    return None if parent is None else open_storage(parent)


def _name(storage: Storage) -> str:
    return storage.url.rstrip("/").rpartition("/")[2]


def run_directory_hint(run: Storage) -> str | None:
    """When ``run`` holds complete checkpoints in sub-directories: a sentence naming the newest."""
    try:
        newest = newest_checkpoint(run)
    except (OSError, io.UnsupportedOperation, NotImplementedError):
        return None
    if newest is None:
        return None
    return (
        f"{run.url} holds checkpoints, it is not one itself: the newest complete one in it is "
        f"{run.join(newest)} (latest_checkpoint({run.url!r}) returns it)"
    )


def unfinished_save_message(storage: Storage) -> str:
    """The message for a directory holding a save's files (rank files, its lock) but no ``metadata.json``."""
    return (
        f"{storage.join(METADATA_FILENAME)} is missing: {storage.url} is not a complete checkpoint "
        "(its save never finished)"
    )


def missing_metadata_message(storage: Storage) -> str:
    """The message for a checkpoint directory without ``metadata.json``: a save that never
    finished, or a directory that was not meant (:func:`wrong_directory_hint`)."""
    if any(is_save_file(n) for n in _lists(storage)):
        return unfinished_save_message(storage)
    try:
        hint = wrong_directory_hint(storage)
    except OSError:  # the hint probes storage; its failure must not hide the error it explains
        hint = f"{storage.url} does not exist or is empty"
    return f"no checkpoint at {storage.url}: {hint}"


def wrong_directory_hint(storage: Storage) -> str:
    """Why ``storage``, expected to be a checkpoint directory, holds no ``metadata.json``, and which
    directory was probably meant: one holding ``model/`` and ``optim/`` (one level too shallow), a
    run directory of checkpoints (naming the newest complete one), a directory that does not exist
    inside a checkpoint (one level too deep), or one that does not exist at all. For error messages
    only: it lists and probes storage."""
    names = set(_lists(storage))
    if names:
        parts = [p for p in PARTS if p in names and storage.part(p).exists(METADATA_FILENAME)]
        if parts:
            joined = " and ".join(f"{p}/" for p in parts)
            return (
                f"{storage.url} holds {joined} (the layout of save_model_and_optim_state): pass "
                f"{' or '.join(storage.join(p) for p in parts)} here, or pass {storage.url} to "
                "load_model_and_optim_state / unshard_model_state"
            )
        run = run_directory_hint(storage)
        if run is not None:
            return run
        if any(step_of(n) is not None for n in names):
            return f"{storage.url} holds no complete checkpoint (sub-directories without {METADATA_FILENAME}: saves that never finished?)"
        return f"{storage.url} holds no {METADATA_FILENAME}: it is not a checkpoint directory"
    parent = _parent(storage)
    if parent is None:
        return f"{storage.url} does not exist or is empty"
    if parent.exists(METADATA_FILENAME):
        if _name(storage) in PARTS and _name(parent) in PARTS and (above := _parent(parent)) is not None:
            return (
                f"{storage.url} does not exist: {parent.url} is itself a checkpoint (one level too deep?); "
                f"pass {above.url}, the directory holding model/ and optim/"
            )
        return f"{storage.url} does not exist: {parent.url} is itself a checkpoint (one level too deep?); pass {parent.url}"
    if _name(storage) in PARTS:
        run = run_directory_hint(parent)
        if run is not None:
            return run
        parent_names = _lists(parent)
        if not parent_names:
            return f"{parent.url} does not exist or is empty"
        if any(is_save_file(n) for n in parent_names):
            return unfinished_save_message(parent)
        pickles = sorted(n for n in parent_names if n in _TORCH_WEIGHTS)
        if pickles:
            return (f"{parent.url} holds {pickles[0]}, a Hugging Face checkpoint as torch pickles: models load in "
                    "place from safetensors only (lazy_load reads these files)")
    return f"{storage.url} does not exist or is empty"


_TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def checkpoint_parts(storage: Storage, *, train: bool = False) -> list[tuple[str, Storage]]:
    """``[("", storage)]`` for a checkpoint directory (it holds ``metadata.json``); for the
    top-level directory of ``save_model_and_optim_state``, its ``model/`` and ``optim/`` parts,
    with ``train`` its ``train/`` too where it holds anything (each listed when present,
    complete or not).

    Raises:
        IncompleteCheckpointError: neither ``metadata.json`` nor ``model/`` or ``optim/`` is there.
    """
    if storage.exists(METADATA_FILENAME):
        return [("", storage)]
    wanted = COMMITTED_PARTS if train else PARTS
    try:
        names = set(storage.list())
        listed = True
    except io.UnsupportedOperation:  # read-only storage (http): look for the parts by name
        names = {name for name in wanted if storage.part(name).exists(METADATA_FILENAME)}
        listed = False
    parts = [(name, storage.part(name)) for name in PARTS if name in names]
    if train and "train" in names and (not listed or holds_anything(storage.part("train"))):
        parts.append(("train", storage.part("train")))  # an empty train/ counts as absent
    if not names:
        if storage.is_local() and os.path.isfile(storage.url):
            raise IncompleteCheckpointError(
                f"{storage.url} is a file, not a checkpoint directory (one holding {METADATA_FILENAME}, or model/ and optim/)"
            )
        raise IncompleteCheckpointError(f"{storage.url} does not exist or is empty: no checkpoint there")
    if not parts and any(is_rank_filename(n) for n in names):
        raise IncompleteCheckpointError(unfinished_save_message(storage))
    if not parts:
        run = run_directory_hint(storage)
        raise IncompleteCheckpointError(
            f"{storage.url} is not a checkpoint: it holds no {METADATA_FILENAME} (missing, or its save "
            "never finished) and no model/ or optim/ sub-directory" + (f"; {run}" if run else "")
        )
    return parts


def model_checkpoint(storage: Storage) -> Storage:
    """The checkpoint directory holding model weights: ``storage`` itself, or its ``model/``."""
    for name, part in checkpoint_parts(storage):
        if name in ("", "model"):
            return part
    raise IncompleteCheckpointError(f"{storage.url} holds optim/ but no model/ checkpoint")


def metadata_bytes(storage: Storage) -> bytes:
    """The bytes of ``storage``'s ``metadata.json``, at most ``CHECKPOINTER_MAX_METADATA_MIB``.

    Raises:
        IncompleteCheckpointError: there is none.
        CorruptCheckpointError: it is too large, not a regular file, or changed while read.
    """
    try:
        size = storage.size(METADATA_FILENAME)
    except FileNotFoundError:
        raise IncompleteCheckpointError(missing_metadata_message(storage)) from None
    except (PermissionError, IsADirectoryError, NotADirectoryError) as ex:
        raise CorruptCheckpointError(f"{storage.join(METADATA_FILENAME)}: not a readable file ({ex})") from ex
    except OSError as ex:
        if not storage.is_local():
            raise
        raise CorruptCheckpointError(f"{storage.join(METADATA_FILENAME)}: not a regular file ({ex})") from ex
    limit_mib = settings.max_metadata_mib()
    if size > limit_mib * (1 << 20):
        raise CorruptCheckpointError(
            f"{storage.join(METADATA_FILENAME)} is {size} bytes, over the limit of {limit_mib:g} MiB "
            "(set CHECKPOINTER_MAX_METADATA_MIB to read larger metadata from a source you trust; "
            "parsing takes about 2x the file's size in memory on every rank)"
        )
    # Bytes [0, size) of the size just checked: a file that grows meanwhile is not read on.
    try:
        data = storage.read(METADATA_FILENAME, 0, size)
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as ex:  # replaced since
        if not storage.is_local():
            raise
        raise CorruptCheckpointError(f"{storage.join(METADATA_FILENAME)}: changed while it was read ({ex})") from ex
    if len(data) != size:
        raise CorruptCheckpointError(
            f"{storage.join(METADATA_FILENAME)}: read {len(data)} bytes of {size}: the file changed while it was read"
        )
    return data
