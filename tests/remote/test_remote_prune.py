"""``checkpointer.prune`` on S3 (moto) and GCS (the emulator): the same run directory as the local
test, and a checkpoint an async save of this process is writing (held at a proxy) is skipped."""

from __future__ import annotations

import time

import torch
from prune_helpers import DELETED, KEPT, make_run

import checkpointer


def test_prune_on_object_stores(backend):
    run = backend.url("run")
    make_run(run)
    assert checkpointer.prune(run, keep_last=2, keep_every=200) == [f"{run}/{name}" for name in DELETED]
    assert sorted({name.split("/")[0] for name in backend.names(run)}) == KEPT
    assert checkpointer.latest_checkpoint(run) == f"{run}/step500"
    assert checkpointer.prune(run, keep_last=2, keep_every=200) == []


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def test_prune_skips_a_checkpoint_an_async_save_is_writing(backend, proxies, monkeypatch):
    run = backend.url("run")
    for step in (1, 2, 3):
        checkpointer.Checkpointer().save(f"{run}/step{step}", {"w": torch.full((4,), float(step))})
    proxy = proxies(backend.endpoint)
    held = proxy.fail(1, "hold", path="rank_0.safetensors")
    monkeypatch.setenv(backend.endpoint_var, proxy.url)
    saver = checkpointer.Checkpointer()
    future = saver.async_save(f"{run}/step1", {"w": torch.full((4,), 10.0)}, save_overwrite=True)
    try:
        _wait_for(lambda: held.fired, "the async save's upload to reach the proxy")
        # step1 is incomplete (its old metadata.json retired) and older than step3: prune would
        # delete it, but this process is still writing it.
        assert "metadata.json" not in [n for n in backend.names(f"{run}/step1")]
        assert checkpointer.prune(run, keep_last=1) == [f"{run}/step2"]
    finally:
        held.released.set()
    future.result()
    assert torch.equal(saver.unshard(f"{run}/step1")["w"], torch.full((4,), 10.0))
    assert checkpointer.prune(run, keep_last=1) == [f"{run}/step1"]
    assert sorted({name.split("/")[0] for name in backend.names(run)}) == ["step3"]
