"""Commit last on object stores, overwrite rules, and what counts as a complete checkpoint.

* ``metadata.json`` is uploaded only after every rank's file is complete (seen by a proxy
  that timestamps every exchange, with the last rank slowed down by 503s);
* without ``save_overwrite`` a save over a checkpoint is ``FileExistsError`` on every rank
  and changes nothing; with it, rank files the new checkpoint does not use are removed;
* a prefix without ``metadata.json`` is incomplete: loading it is ``IncompleteCheckpointError``
  and ``latest_checkpoint`` skips it;
* an async save whose parts are still uploading when the process exits is finished first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from urllib.parse import unquote

import pytest
import torch
from dist_helpers import build_model, build_optim, train
from remote_workers import caught, flat_full, flat_state, load_flat, save_flat

from checkpointer import (
    Checkpointer,
    IncompleteCheckpointError,
    latest_checkpoint,
    load_model_and_optim_state,
    save_model_and_optim_state,
)
from checkpointer.cli import main as cli_main

WRITES = ("PUT", "POST")


def test_metadata_is_uploaded_after_every_rank_file(backend, run_distributed, proxies):
    url = backend.url("ckpt")
    proxy = proxies(backend.endpoint)
    late = proxy.fail(3, "503", path="rank_2.safetensors")  # rank 2's upload finishes last
    run_distributed(save_flat, 3, backend.env(proxy.url), url)
    assert late.fired == 3

    def writes_of(name: str):
        return [e for e in proxy.exchanges if e.method in WRITES and name in unquote(e.path)]

    commits = [e for e in writes_of("metadata.json") if e.status in (200, 201)]
    assert len(commits) == 1, [(e.method, e.path, e.status) for e in writes_of("metadata.json")]
    for rank in range(3):
        done = [e for e in writes_of(f"rank_{rank}.safetensors") if e.status in (200, 201)]
        assert done, f"no successful upload of rank_{rank}.safetensors seen"
        assert max(e.finished for e in done) <= commits[0].started, f"metadata.json was uploaded before rank {rank}'s file"
    # nothing of this checkpoint was written after its commit
    assert all(e.started <= commits[0].started for e in proxy.exchanges if e.method in WRITES)
    assert backend.names(url) == ["metadata.json"] + [f"rank_{r}.safetensors" for r in range(3)]


def test_overwrite_rules_and_stale_rank_files(backend, run_distributed, proxies):
    url = backend.url("ckpt")
    env = backend.env()
    run_distributed(save_flat, 4, env, url)
    before = backend.etags(url)
    assert sorted(before) == ["metadata.json"] + [f"rank_{r}.safetensors" for r in range(4)]

    # Without save_overwrite: FileExistsError on every rank, nothing touched.
    results = run_distributed(caught, 2, env, "save_flat", url, "small", 1)
    for rank, r in enumerate(results):
        assert r is not None and "FileExistsError" in r["mro"], f"rank {rank}: {r}"
    assert backend.etags(url) == before

    # With it, after shrinking from 4 ranks to 2: rank_2 and rank_3 are removed.
    run_distributed(save_flat, 2, env, url, "small", 1, True)
    assert backend.names(url) == ["metadata.json", "rank_0.safetensors", "rank_1.safetensors"]
    run_distributed(load_flat, 3, env, url, "small", 1)

    # An overwrite that fails (rank 1 cannot upload) leaves an incomplete checkpoint, never
    # the old metadata.json over a mix of old and new rank files.
    down = proxies(backend.endpoint)
    down.fail(10**6, "503")
    envs = [backend.env(CHECKPOINTER_IO_RETRIES="1") for _ in range(3)]
    envs[1] = backend.env(down.url, CHECKPOINTER_IO_RETRIES="1")
    results = run_distributed(caught, 3, envs, "save_flat", url, "small", 2, True)
    assert all(r is not None for r in results), results
    assert "metadata.json" not in backend.names(url)
    with pytest.raises(IncompleteCheckpointError):
        Checkpointer().load(url, flat_state(flat_full(seed=2), 1))


def _tiny(seed: int):
    model = build_model(1, seed=seed)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    return model, optim


def test_incomplete_checkpoints(backend, capsys):
    """In this process (world size 1): which prefixes are complete checkpoints."""
    run = backend.url("run")
    model, optim = _tiny(0)
    save_model_and_optim_state(f"{run}/step10", model, optim)
    Checkpointer().save(f"{run}/step20", flat_state(flat_full(), 1))
    save_model_and_optim_state(f"{run}/step30", model, optim)
    backend.delete(f"{run}/step30", "optim/metadata.json")  # its optimizer part never committed
    Checkpointer().save(f"{run}/step40", flat_state(flat_full(), 1))
    backend.delete(f"{run}/step40", "metadata.json")  # rank files only
    backend.put(f"{run}/notes", "readme.txt", b"not a checkpoint")

    assert latest_checkpoint(run) == f"{run}/step20"
    assert latest_checkpoint(f"{run}/") == f"{run}/step20"
    for step in ("step30", "step40"):
        with pytest.raises(IncompleteCheckpointError, match="metadata.json"):
            load_model_and_optim_state(f"{run}/{step}", *_tiny(1))
    with pytest.raises(IncompleteCheckpointError, match="metadata.json"):
        Checkpointer().load(f"{run}/step40", flat_state(flat_full(), 1))
    with pytest.raises(IncompleteCheckpointError):
        Checkpointer().load(backend.url("nothing-here"), flat_state(flat_full(), 1))
    capsys.readouterr()
    assert cli_main(["verify", f"{run}/step40"]) == 1
    out, err = capsys.readouterr()
    assert "metadata.json is missing" in out and "1 problem found" in err

    # Saving over an incomplete checkpoint needs no save_overwrite; a complete one does.
    Checkpointer().save(f"{run}/step40", flat_state(flat_full(seed=2), 1))
    with pytest.raises(FileExistsError):
        Checkpointer().save(f"{run}/step40", flat_state(flat_full(seed=2), 1))
    backend.delete(f"{run}/step20", "metadata.json")
    assert latest_checkpoint(run) == f"{run}/step40"


def test_a_dead_parallel_upload_leaves_parts_that_prune_and_the_next_commit_remove(backend):
    """GCS uploads a rank file as hidden part objects, composed at commit. A save killed while
    they uploaded leaves them: the incomplete step is still a save's (prune deletes it once a
    newer checkpoint is complete), and a save that takes the step over removes them at its commit."""
    if backend.kind != "gcs":
        pytest.skip("only GCS uploads parts as objects (S3's multipart parts are not listed)")
    from checkpointer import prune
    from checkpointer.storage.gcs import GCSStorage

    run = backend.url("run")
    for step in ("step10", "step20"):
        dead = GCSStorage(f"{run}/{step}", part_size=256 * 1024)
        writer = dead.open_writer("rank_0.safetensors")
        writer.write([memoryview(bytes(600 * 1024))])  # two whole parts uploaded, then the process "dies"
        for part in writer._futures:
            part.result()
        assert sum(".part-" in n for n in backend.names(f"{run}/{step}")) == 2
    Checkpointer().save(f"{run}/step30", flat_state(flat_full(), 1))
    Checkpointer().save(f"{run}/step20", flat_state(flat_full(seed=2), 1))  # no checkpoint there yet
    assert backend.names(f"{run}/step20") == ["metadata.json", "rank_0.safetensors"]
    assert prune(run, keep_last=2) == [f"{run}/step10"]
    assert sorted({n.split("/")[0] for n in backend.names(run)}) == ["step20", "step30"]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_JOB = r"""
import sys, time
import torch
import checkpointer
from checkpointer.storage import parallel

torch.manual_seed(0)
model = torch.nn.Linear(2048, 2048)
optim = torch.optim.AdamW(model.parameters())
model(torch.ones(2, 2048)).sum().backward()
optim.step()
submit = parallel.Workers.submit  # every upload takes a while: the exit starts mid-save
parallel.Workers.submit = lambda self, fn, *a: submit(self, lambda *b: (time.sleep(0.3), fn(*b))[1], *a)
checkpointer.async_save_model_and_optim_state(sys.argv[1], model, optim)
"""


def test_an_async_save_still_uploading_parts_at_exit_is_finished(backend):
    run = backend.url("run")
    url = f"{run}/step1"
    env = {k: v for k, v in {**os.environ, **backend.env(), "PYTHONPATH": REPO}.items() if v is not None}
    done = subprocess.run([sys.executable, "-c", EXIT_JOB, url], env=env, capture_output=True, text=True, timeout=240)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert latest_checkpoint(run) == url
    torch.manual_seed(0)
    expected = torch.nn.Linear(2048, 2048)
    expected_optim = torch.optim.AdamW(expected.parameters())
    expected(torch.ones(2, 2048)).sum().backward()
    expected_optim.step()
    model = torch.nn.Linear(2048, 2048)
    load_model_and_optim_state(url, model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
