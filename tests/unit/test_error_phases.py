"""Cross-rank phases end one way (``dist.phase`` / ``dist.agree``, with ``dist.attempt`` for a step
whose error travels in an exchange of its own): the package catches ``BaseException`` only in
``dist.py`` and in background threads that hand an error to whoever waits for it."""

from __future__ import annotations

import re
from pathlib import Path

from checkpointer.errors import RankError, RankFailedError

ROOT = Path(__file__).resolve().parents[2] / "checkpointer"
ALLOWED = {
    "dist/__init__.py": 2,  # attempt, agree_after's worker thread
    "storage/parallel.py": 1,  # on_idle_thread's future (the store requests of dist/arrivals.py)
    "engine/async_save.py": 1,
    "engine/reads.py": 1,  # a second interrupt while the read threads stop: raised once they have  # the background writer: its error goes to the save's future
    "engine/reader.py": 1,  # the streaming read thread (an export): its error goes to the consumer
    "tools/dcp.py": 1,  # DCP's own CheckpointException derives from BaseException
}


def test_base_exception_is_caught_only_where_allowed():
    found = {}
    for path in ROOT.rglob("*.py"):
        n = len(re.findall(r"except BaseException\b", path.read_text()))
        if n:
            found[str(path.relative_to(ROOT))] = n
    assert found == ALLOWED
    assert sum(found.values()) <= 8


def test_a_rank_error_round_trips_with_its_traceback():
    try:
        raise FileExistsError("step 5 holds a checkpoint")
    except FileExistsError as ex:
        error = RankError.of(3, ex)
    assert error.rank == 3 and error.type == "FileExistsError" and error.file_exists
    assert error.traceback.startswith("Traceback") and "step 5 holds a checkpoint" in error.traceback
    assert RankError.from_json(error.to_json()) == error
    failed = RankFailedError("load failed on rank 3", {3: error})
    assert failed.failures == {3: error}


def test_only_the_default_groups_destruction_waits_for_the_saves(monkeypatch):
    """A subgroup, which only some ranks may destroy, must not make them meet the other ranks at
    the async savers' barrier (rank 0 alone waited 30 s, then left the savers' group alone)."""
    import torch.distributed as torch_dist

    from checkpointer import dist

    destroyed: list[object] = []
    waits: list[int] = []
    monkeypatch.setattr(torch_dist, "destroy_process_group", lambda group=None: destroyed.append(group))
    dist.wait_before_destroy(lambda: waits.append(1))
    sub = object()
    torch_dist.destroy_process_group(sub)
    assert (destroyed, waits) == ([sub], [])
    torch_dist.destroy_process_group()
    assert (destroyed, waits) == ([sub, None], [1])
