"""Loading (read-only) over http(s):// from a loopback file server that honours ``Range``."""

from __future__ import annotations

import io
import os

import pytest
import torch
from dist_helpers import assert_same, build_model, build_optim, model_full_state, optim_full_state
from remote_workers import flat_full, flat_state, load_flat, load_model, optim_as_flat, save_flat, save_model
from safetensors.torch import load_file

from checkpointer import (
    CheckpointError,
    Checkpointer,
    lazy_load,
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)
from checkpointer.cli import main as cli_main

SLACK = 1.1


def load_into_fresh_model(url: str, want_model: dict, want_optim: dict):
    """Load ``url`` into a new plain model and optimizer, check them, and return them."""
    model = build_model(1, seed=1)
    optim = build_optim(model, "adamw", fresh=True)
    load_model_and_optim_state(url, model, optim)
    assert_same(want_model, model_full_state(model))
    assert_same(want_optim, optim_full_state(model, optim))
    return model, optim


def test_load_over_http(run_distributed, file_server, proxies, tmp_path, capsys, loopback_env):
    root = tmp_path / "served"
    saved = run_distributed(save_model, 2, None, str(root / "step5"))
    run_distributed(save_flat, 2, None, str(root / "flat"), "big", timeout=180)
    want_model, want_optim, names = saved[0]["model"], saved[0]["optim"], saved[0]["names"]
    server = file_server(str(root))
    url = f"{server.url}/step5"

    run_distributed(load_model, 3, None, url, want_model, want_optim)
    # Each rank through its own counting proxy: ranged reads only, about its share of bytes.
    per_rank = [proxies(server.url) for _ in range(3)]
    shares = run_distributed(load_flat, 3, None, [f"{p.url}/flat" for p in per_rank], "big", timeout=180)
    metadata_bytes = os.path.getsize(root / "flat" / "metadata.json")
    for rank, (proxy, share) in enumerate(zip(per_rank, shares)):
        rank_file_gets = [s for s in proxy.seen if s.method == "GET" and "rank_" in s.path]
        assert rank_file_gets and all(s.headers.get("Range", "").startswith("bytes=") for s in rank_file_gets)
        assert share <= proxy.bytes_out <= SLACK * share + metadata_bytes, (rank, proxy.bytes_out, share)

    load_into_fresh_model(url, want_model, want_optim)
    assert_same(want_model, unshard_model_state(url))
    assert_same(want_optim, optim_as_flat(unshard_optim_state(url), names))
    assert_same(want_model, dict(lazy_load(url)))
    full = flat_full("big")
    assert torch.equal(dict(lazy_load(f"{server.url}/flat", {"w": 0}, tp_rank=1, tp_size=2))["w"],
                       torch.chunk(full["w"], 2)[1])

    # The command line reads one checkpoint directory (see the xfail test below for the rest).
    out = str(tmp_path / "model.safetensors")
    capsys.readouterr()
    assert cli_main(["inspect", f"{url}/model"]) == 0, capsys.readouterr().err
    assert cli_main(["unshard", f"{url}/model", out]) == 0, capsys.readouterr().err
    assert_same(want_model, load_file(out))

    # Read-only: a save is refused with an OSError, nothing is sent.
    with pytest.raises((OSError, io.UnsupportedOperation)):
        Checkpointer().save(f"{server.url}/new", flat_state(flat_full(), 1))
    assert not os.path.exists(root / "new")


def test_load_over_http_from_a_server_answering_403_for_missing_files(file_server, tmp_path):
    """A public S3 bucket without list permission answers 403, not 404, for a key that is not
    there, and a top-level checkpoint is found by probing: ``metadata.json`` first (missing),
    then ``model/`` and ``optim/``. A probe that meets 403 finds nothing; reading a file the
    load needs still fails, naming it and saying access was denied."""
    model = build_model(1)
    optim = build_optim(model, "adamw")
    save_model_and_optim_state(str(tmp_path / "step5"), model, optim)
    want_model, want_optim = model_full_state(model), optim_full_state(model, optim)
    url = f"{file_server(str(tmp_path), missing_status=403).url}/step5"

    fresh, fresh_optim = load_into_fresh_model(url, want_model, want_optim)
    assert_same(want_model, unshard_model_state(url))
    assert_same(want_model, dict(lazy_load(url)))

    os.remove(tmp_path / "step5" / "model" / "rank_0.safetensors")
    with pytest.raises((OSError, CheckpointError)) as err:
        load_model_and_optim_state(url, fresh, fresh_optim)
    assert f"{url}/model/rank_0.safetensors" in str(err.value) and "access denied" in str(err.value)


@pytest.mark.parametrize("command", ["verify model/", "verify top", "inspect top", "unshard top"])
def test_cli_over_http(command, file_server, tmp_path, capsys):
    model = build_model(1)
    optim = build_optim(model, "adamw")
    save_model_and_optim_state(str(tmp_path / "step5"), model, optim)
    url = f"{file_server(str(tmp_path)).url}/step5"
    verb, which = command.split()
    target = f"{url}/model" if which == "model/" else url
    argv = [verb, target] + ([str(tmp_path / "out.safetensors")] if verb == "unshard" else [])
    capsys.readouterr()
    code = cli_main(argv)
    assert code == 0, capsys.readouterr().err
