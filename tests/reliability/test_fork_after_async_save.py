"""A process forked after an async save (a data loader's worker, a forked test job) saves on its
own: its parent's writer thread is not in it, so it must not wait for that thread. Likewise it
loads with read threads of its own, not the parent's pool that loads reuse."""

from __future__ import annotations

import os
import threading

import rel_helpers
import torch

from checkpointer import Checkpointer


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(60.0).reshape(6, 10) + seed, "b": torch.full((5,), float(seed))}


def _async_save_and_load(saver: Checkpointer, path: str, seed: int) -> bool:
    saver.async_save(path, _state(seed)).result(timeout=30)
    target = {k: torch.zeros_like(v) for k, v in _state(seed).items()}
    Checkpointer().load(path, target)
    return all(torch.equal(target[k], v) for k, v in _state(seed).items())


def test_a_forked_child_saves_with_a_saver_its_parent_used(tmp_path):
    saver = Checkpointer()
    assert _async_save_and_load(saver, str(tmp_path / "parent"), 1)  # the writer thread now runs here
    for seed in (2, 3):  # planned afresh, then from the plan cache the child inherited
        child = rel_helpers.run_forked(_async_save_and_load, saver, str(tmp_path / f"child{seed}"), seed, timeout=60)
        assert child.exitcode == 0 and child.value is True, child
    assert _async_save_and_load(saver, str(tmp_path / "parent_again"), 4), "the parent's saver stopped working"
    assert sorted(os.listdir(tmp_path)) == ["child2", "child3", "parent", "parent_again"]


def _big() -> torch.Tensor:
    return torch.arange(10 << 20, dtype=torch.float32)  # 40 MiB: two reads of at most 32 MiB, two pool threads


def _load_big(path: str) -> tuple[bool, list[str]]:
    target = torch.zeros(10 << 20)
    Checkpointer().load(path, {"big": target})
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("checkpointer-io"))
    return torch.equal(target, _big()), names


def test_a_forked_child_loads_with_read_threads_of_its_own(tmp_path):
    path = str(tmp_path / "big")
    Checkpointer().save(path, {"big": _big()})
    ok, threads = _load_big(path)
    # The shared pool's threads, still alive after the load (earlier loads in this process may
    # have started more of them than this one needs).
    assert ok and threads, threads
    child = rel_helpers.run_forked(_load_big, path, timeout=60)  # the parent's pool would never run its reads
    assert child.exitcode == 0 and child.value[0] is True and child.value[1], child
    assert _load_big(path) == (True, threads), "the parent's pool stopped working, or another was started"
