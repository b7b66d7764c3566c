"""Retention: which checkpoints of a run directory :func:`checkpointer.prune` deletes, and how.

In order (rank 0 alone; :func:`checkpointer.prune` gives the outcome to every rank):

1. :func:`list_steps` lists the run directory's sub-directories that carry a step number
   (:func:`~checkpointer.engine.locate.step_of`) and judges each complete or not
   (:func:`~checkpointer.engine.locate.is_complete`).
2. :func:`choose` (a pure function) picks what to delete: complete checkpoints beyond the newest
   ``keep_last`` steps whose step is not a multiple of ``keep_every``, and incomplete ones older than
   the newest complete one (a newer one may be a save still writing). The newest complete
   checkpoint is never chosen, nor one an async save of this process is writing, nor any of the
   same step as one kept (a link named for the step it leads to, say).
3. :func:`delete_checkpoint` deletes each: ``metadata.json`` files first (the directory's own,
   then each part's), so a half-deleted checkpoint reads as incomplete, never as complete but
   damaged; then everything under it.

An incomplete directory is deleted only when it holds nothing but what a save leaves (rank
files, temporary files, the save lock, and ``model/``, ``optim/``, ``train/`` holding only those
and ``metadata.json``): a directory of
other files whose name happens to carry a number is not a checkpoint, and is left alone; so is
a committed ``model/`` without ``optim/`` (a model saved alone, such as torchtitan's last step
with ``last_save_model_only``: a model and optimizer save creates ``optim/`` before it commits
``model/``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .. import dist
from ..engine.async_save import writing_under
from ..engine.locate import COMMITTED_PARTS, is_complete, step_of
from ..errors import CheckpointError
from ..format.layout import METADATA_FILENAME, is_save_file
from ..storage import open_storage
from ..storage.base import Storage, is_valid_name

__all__ = [
    "Step", "list_steps", "choose", "plan_prune", "delete_checkpoint", "check_counts", "prune_run", "check_run_directory",
]


@dataclass(frozen=True)
class Step:
    """One sub-directory of a run directory: its name, step number, and whether it is complete."""

    name: str
    step: int
    complete: bool
    save_leftovers: bool = True
    """For an incomplete one: whether it holds only what a save leaves (it may be deleted)."""


def check_counts(keep_last: object, keep_every: object) -> None:
    """``ValueError`` (or ``TypeError``) unless ``keep_last`` is an int >= 0 and ``keep_every``
    None or an int >= 1."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int):
        raise TypeError(f"keep_last must be an int, not {type(keep_last).__name__}: {keep_last!r}")
    if keep_last < 0:
        raise ValueError(f"keep_last must be 0 or more (the newest complete checkpoint is always kept), not {keep_last}")
    if keep_every is not None:
        if isinstance(keep_every, bool) or not isinstance(keep_every, int):
            raise TypeError(f"keep_every must be an int or None, not {type(keep_every).__name__}: {keep_every!r}")
        if keep_every < 1:
            raise ValueError(f"keep_every must be 1 or more (or None), not {keep_every}")


def _only_save_files(storage: Storage) -> bool:
    names = storage.list()
    if "optim" not in names and "model" in names and storage.part("model").exists(METADATA_FILENAME):
        return False  # a model saved alone: a model + optimizer save locks optim/ before it commits model/
    return bool(names) and all(is_save_file(n) or (n in COMMITTED_PARTS and _part_of_a_save(storage.part(n))) for n in names)


def _part_of_a_save(part: Storage) -> bool:
    """``model/``, ``optim/`` or ``train/`` as a save leaves it: its files and ``metadata.json``."""
    return all(is_save_file(n) or n == METADATA_FILENAME for n in part.list())


def list_steps(run: Storage) -> list[Step]:
    """Every sub-directory of ``run`` with a step number, in listing order."""
    steps = []
    for name in run.list():
        step = step_of(name) if is_valid_name(name) else None  # another tool's object key (backup\step9)
        if step is None:
            continue
        child = run.child(name)
        complete = is_complete(child)
        steps.append(Step(name, step, complete, save_leftovers=complete or _only_save_files(child)))
    return steps


def choose(steps: list[Step], keep_last: int, keep_every: int | None, busy: set[str] = frozenset()) -> list[str]:
    """The names to delete (oldest first), as the module docstring says; ``busy`` names are
    never chosen (an async save of this process is writing there).

    Example: complete steps 100..500, ``keep_last=2``, ``keep_every=200`` -> ``["step100", "step300"]``.
    """
    complete = sorted((s for s in steps if s.complete), key=lambda s: (-s.step, s.name))
    if not complete:
        return []
    newest = complete[0]
    # by step: a link named for the step it leads to (final_step300 -> step300) keeps its target
    kept = set(sorted({s.step for s in complete}, reverse=True)[: max(1, keep_last)])
    if keep_every is not None:
        kept |= {s.step for s in complete if s.step % keep_every == 0}
    doomed = [s for s in complete if s.step not in kept]
    doomed += [s for s in steps if not s.complete and s.save_leftovers and s.step < newest.step]
    return [s.name for s in sorted(doomed, key=lambda s: (s.step, s.name)) if s.name not in busy]


def plan_prune(run: Storage, keep_last: int, keep_every: int | None) -> list[str]:
    """What :func:`checkpointer.prune` would delete in ``run`` now (names, oldest first)."""
    check_counts(keep_last, keep_every)
    steps = list_steps(run)
    busy = {s.name for s in steps if writing_under(run.child(s.name))}
    return choose(steps, keep_last, keep_every, busy)


def delete_checkpoint(run: Storage, name: str) -> None:
    """Delete the checkpoint ``name`` in ``run``: its ``metadata.json`` files first, then the rest."""
    checkpoint = run.part(name)
    try:
        checkpoint.delete(METADATA_FILENAME)
        for part in COMMITTED_PARTS:
            checkpoint.part(part).delete(METADATA_FILENAME)
    except PermissionError:
        pass  # a local link leading out of the run directory: the link goes, what it leads to stays
    run.delete_tree(name)


def check_run_directory(run: Storage) -> None:
    """What the command line checks before it prunes (a library call takes a missing directory
    as one without checkpoints): ``run`` is an existing directory (where local), and not
    itself a checkpoint, whose parts prune would never look at.

    Raises:
        FileNotFoundError, NotADirectoryError: a local path that is missing or a file.
        CheckpointError: ``run`` is a checkpoint directory.
    """
    if run.is_local() and not os.path.isdir(run.url):
        if os.path.exists(run.url):
            raise NotADirectoryError(f"{run.url} is a file, not a run directory holding checkpoints")
        raise FileNotFoundError(f"{run.url}: no such run directory")
    if run.exists(METADATA_FILENAME) or any(run.part(part).exists(METADATA_FILENAME) for part in COMMITTED_PARTS):
        raise CheckpointError(
            f"{run.url} is a checkpoint; prune takes the run directory holding one sub-directory per checkpoint"
        )


def prune_run(run_dir: str, keep_last: int, keep_every: int | None) -> list[str]:
    """:func:`~checkpointer.prune` on every rank: rank 0 deletes, every rank gets the list."""

    def work() -> bytes:
        run = open_storage(run_dir)
        deleted = []
        for name in plan_prune(run, keep_last, keep_every):
            delete_checkpoint(run, name)
            deleted.append(f"{run_dir}/{name}")
        return json.dumps(deleted).encode()

    # Every rank first: one rank alone (under ``if rank == 0:``) fails here having deleted nothing;
    # the broadcast alone would not wait for the others, and would leave them a collective behind.
    dist.agree(None, "prune")
    return json.loads(dist.share_from(0, work, "prune"))
