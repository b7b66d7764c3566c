"""Round trips through S3 (moto) and GCS (the emulator): save at one world size, load at another,
unshard, and the command line, all taking ``s3://bucket/prefix`` and ``gs://bucket/prefix``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dist_helpers import assert_same, build_model, build_optim, model_full_state, optim_full_state
from remote_workers import load_model, optim_as_flat, save_model, unshard_everywhere
from safetensors.torch import load_file

from checkpointer import (
    Checkpointer,
    latest_checkpoint,
    lazy_load,
    load_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)
from checkpointer.cli import main as cli_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def layout(world_size: int) -> list[str]:
    ranks = [f"rank_{r}.safetensors" for r in range(world_size)]
    return sorted(f"{part}/{name}" for part in ("model", "optim") for name in ["metadata.json", *ranks])


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_round_trip_2_to_3_and_unshard(backend, run_distributed, capsys, tmp_path):
    url = backend.url("step100")
    env = backend.env()
    saved = run_distributed(save_model, 2, env, url)
    assert backend.names(url) == layout(2)
    for rank, result in enumerate(saved):
        assert sorted(result["files"]) == sorted(
            [f"{url}/{part}/rank_{rank}.safetensors" for part in ("model", "optim")]
            + ([f"{url}/{part}/metadata.json" for part in ("model", "optim")] if rank == 0 else [])
        )
    want_model, want_optim, names = saved[0]["model"], saved[0]["optim"], saved[0]["names"]

    assert run_distributed(load_model, 3, env, url, want_model, want_optim) == [True] * 3
    assert run_distributed(unshard_everywhere, 3, env, url, want_model, want_optim, names) == [True] * 3

    # Here, with no process group.
    assert_same(want_model, unshard_model_state(url))
    assert_same(want_optim, optim_as_flat(unshard_optim_state(url), names))
    assert_same(want_model, Checkpointer().unshard(f"{url}/model", no_dist=True))

    # The command line.
    code, out, err = cli(capsys, "inspect", url, "--json")
    assert (code, err) == (0, ""), err
    assert "embed.weight" in out and "rank_1.safetensors" in out
    code, out, err = cli(capsys, "verify", url)
    assert (code, err) == (0, ""), err
    assert out.startswith(f"ok: {url}/model, {url}/optim")
    local_out = str(tmp_path / "model.safetensors")
    assert cli(capsys, "unshard", url, local_out)[0] == 0
    assert_same(want_model, load_file(local_out))
    remote_out = backend.url("export")
    code, out, err = cli(capsys, "unshard", url, remote_out, "--max-shard-size", "400B")
    assert (code, err) == (0, ""), err
    exported = backend.names(remote_out)
    assert out == f"wrote {len(exported)} files to {remote_out}\n"  # no size: it is not on this disk
    assert "model.safetensors.index.json" in exported and len(exported) > 2, exported
    assert_same(want_model, dict(lazy_load(remote_out)))  # the HF-style export, read back from the store


def test_round_trip_4_to_1_and_unshard(backend, run_distributed, capsys):
    url = backend.url("step7")
    env = backend.env()
    saved = run_distributed(save_model, 4, env, url, False, True)  # async_save_model_and_optim_state
    assert backend.names(url) == layout(4)
    assert all(len(r["files"]) == (4 if rank == 0 else 2) for rank, r in enumerate(saved))
    want_model, want_optim, names = saved[0]["model"], saved[0]["optim"], saved[0]["names"]

    # World size 1: a plain module in this process (no process group at all).
    model = build_model(1, seed=1)
    optim = build_optim(model, "adamw", fresh=True)
    load_model_and_optim_state(url, model, optim)
    assert_same(want_model, model_full_state(model))
    assert_same(want_optim, optim_full_state(model, optim))
    assert_same(want_model, unshard_model_state(url, no_dist=True))
    assert_same(want_optim, optim_as_flat(unshard_optim_state(url, no_dist=True), names))
    assert latest_checkpoint(url.rsplit("/", 1)[0]) == url
    metadata = Checkpointer().get_metadata(f"{url}/model")
    assert sorted(metadata.tensors) == sorted(want_model)
    assert sorted(metadata.tensors["embed.weight"].shard_spec_per_file) == [f"rank_{r}.safetensors" for r in range(4)]

    if backend.kind != "s3":
        return
    # The console script as a user runs it: the store comes from the standard setting.
    env_vars = {k: v for k, v in os.environ.items()}
    env_vars["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, "-m", "checkpointer", "inspect", f"{url}/optim", "--json"],
                          capture_output=True, text=True, env=env_vars, cwd=REPO, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "state.embed.weight.__exp_avg" in json.dumps(json.loads(proc.stdout))


def test_lazy_load_of_one_file_whose_key_holds_url_delimiters(backend, tmp_path):
    """An object key is the URL's path as it is: ``#``, ``?`` and ``%`` are part of the file's
    name, not a fragment, a query or an escape."""
    import torch
    from safetensors.torch import save_file

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    url = backend.url("dir")
    for name in ("a#1.safetensors", "b?v=2.safetensors", "c%20d.safetensors"):
        backend.put(url, name, (tmp_path / "w.safetensors").read_bytes())
        got = dict(lazy_load(f"{url}/{name}"))
        assert list(got) == ["w"] and torch.equal(got["w"], w), name
