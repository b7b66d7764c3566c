"""Two jobs saving to one s3:// or gs:// prefix at once: one wins, the other gets FileExistsError,
and the prefix never holds a mix of both. A load while another job overwrites the checkpoint
fails naming the file it found replaced; it never returns a mix of both saves.

The jobs are two threads of this process (no process group: each is a world of one), saving
different values and keys. The save lock is a conditional create (S3 ``If-None-Match: *``, GCS
``ifGenerationMatch=0``); the stores go through a proxy that makes the condition atomic as the
real services do (moto checks and stores in two steps; gcp-storage-emulator ignores
``ifGenerationMatch``), see ``FaultProxy(conditional=True)``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from remote_workers import flat_full

import checkpointer.engine.save as save_engine
from checkpointer import Checkpointer, CorruptCheckpointError, lazy_load
from checkpointer.engine.checks import HeaderCache
from checkpointer.format.layout import LOCK_FILENAME
from checkpointer.storage.gcs import GCSStorage
from checkpointer.storage.s3 import S3Storage


def job_state(job: int) -> dict[str, torch.Tensor]:
    state = {k: (v + 10 * (job + 1)).to(v.dtype) for k, v in flat_full().items()}
    state[f"only_in_job{job}"] = torch.full((64, 33), float(job))
    return state


def _run_jobs(url: str, start_second) -> list[object]:
    """Both jobs' outcomes: "saved" or the exception; ``start_second()`` returns when job 1 may start."""
    results: list[object] = [None, None]

    def job(i: int) -> None:
        if i == 1:
            start_second()
        try:
            Checkpointer().save(url, job_state(i))
            results[i] = "saved"
        except Exception as e:  # noqa: BLE001 - the test looks at it
            results[i] = e

    threads = [threading.Thread(target=job, args=(i,), name=f"job{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a save hung"
    return results


@pytest.mark.parametrize("when", ["together", "while_the_first_writes"])
def test_two_jobs_saving_to_one_prefix(backend, proxies, monkeypatch, when):
    proxy = proxies(backend.endpoint, conditional=True)
    monkeypatch.setenv(backend.endpoint_var, proxy.url)
    url = backend.url("ckpt")
    storage_cls = S3Storage if backend.kind == "s3" else GCSStorage
    real_create = storage_cls.create_exclusive
    gate = threading.Barrier(2)
    go = threading.Event()

    if when == "together":
        # Both reach the lock in the same instant: the store's condition decides.
        def create_exclusive(self, name, data):
            if name == LOCK_FILENAME:
                gate.wait(30)
            return real_create(self, name, data)

        monkeypatch.setattr(storage_cls, "create_exclusive", create_exclusive)
        start_second = lambda: None  # noqa: E731
    else:
        # Job 0 holds the lock and is slow to write its file; job 1 starts meanwhile.
        real_write = save_engine.write_rank_file

        def write_rank_file(*args, **kwargs):
            if threading.current_thread().name == "job0":
                go.set()
                time.sleep(1.0)
            return real_write(*args, **kwargs)

        monkeypatch.setattr(save_engine, "write_rank_file", write_rank_file)
        start_second = lambda: go.wait(60)  # noqa: E731

    results = _run_jobs(url, start_second)
    won = [i for i, r in enumerate(results) if r == "saved"]
    refused = [i for i, r in enumerate(results) if isinstance(r, FileExistsError)]
    assert len(won) == 1 and len(refused) == 1, f"expected one winner and one FileExistsError: {results}"
    if when == "while_the_first_writes":
        assert won == [0]
    winner = won[0]

    assert backend.names(url) == ["metadata.json", "rank_0.safetensors"]  # no lock, no part, nothing of the loser
    expected = job_state(winner)
    monkeypatch.setenv(backend.endpoint_var, backend.endpoint)
    assert Checkpointer().get_metadata(url).tensors.keys() == expected.keys()
    got = {k: torch.zeros_like(v) for k, v in expected.items()}
    Checkpointer().load(url, got, verify=True)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    locks = [e for e in proxy.seen if LOCK_FILENAME in e.path and e.method in ("PUT", "POST")]
    created = [e for e in locks if ("If-None-Match" in e.headers) or ("ifGenerationMatch=0" in e.path)]
    # A lock is created conditionally; a later unconditional write may be the winner's heartbeat
    # refreshing its own lock (a loop another test started can beat within this one).
    assert created and locks[0] is created[0], locks


def overwritten(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same keys, shapes and dtypes, other values: a rank file with the same layout."""
    return {k: (v + 1).to(v.dtype) for k, v in state.items()}


@pytest.mark.parametrize("reader", ["load", "unshard", "lazy_load"])
def test_a_load_while_another_job_overwrites_the_checkpoint(backend, proxies, monkeypatch, reader):
    """Right after a load reads the rank file's header, another job saves over the checkpoint
    (``save_overwrite``) the same keys and shapes with other values. Before: the load returned
    the second save's values, read at the offsets of the first save's header (a mix of two saves
    for a model of several files). Now the reads are conditional on the object first read (S3
    ``If-Match``, GCS ``ifGenerationMatch``), as a local load reads the file it opened."""
    proxy = proxies(backend.endpoint, conditional=True)
    monkeypatch.setenv(backend.endpoint_var, proxy.url)
    url = backend.url("ckpt")
    first = job_state(0)
    Checkpointer().save(url, first)
    real_get = HeaderCache.get
    overwrites: list[str] = []

    def get_then_overwrite(self, name):
        header = real_get(self, name)
        if name == "rank_0.safetensors" and not overwrites:
            overwrites.append(name)
            Checkpointer().save(url, overwritten(first), save_overwrite=True)
        return header

    monkeypatch.setattr(HeaderCache, "get", get_then_overwrite)
    with pytest.raises(CorruptCheckpointError, match="rank_0.safetensors") as err:
        if reader == "load":
            Checkpointer().load(url, {k: torch.zeros_like(v) for k, v in first.items()})
        elif reader == "unshard":
            Checkpointer().unshard(url)
        else:
            dict(lazy_load(url))
    assert overwrites and "replaced while it was read" in str(err.value)
    monkeypatch.setattr(HeaderCache, "get", real_get)
    got = {k: torch.zeros_like(v) for k, v in first.items()}
    Checkpointer().load(url, got)  # a new load reads the second save whole
    assert all(torch.equal(got[k], v) for k, v in overwritten(first).items())
