"""``hf://`` through cached-path against a hub on 127.0.0.1 (``HF_ENDPOINT``), cached under a
temporary ``HF_HOME``.

Each load runs in a fresh process (``huggingface_hub`` reads the settings when imported): the
first downloads the index and only the shards holding keys the model takes (``HF_TOKEN`` sent); a second load,
``lazy_load`` and the command line download nothing more (the server sees ``HEAD`` requests only,
and no ``GET`` of a file already cached); the result is the transformers model's tensors bit for bit, alone and at
2 ranks under FSDP2. A missing repository is a ``FileNotFoundError`` naming the URL. The tests of
one launch start theirs together with the module's first, whose launches follow one another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from hf_helpers import hf_gpt2, hf_gpt2_names, save_hf
from hub_server import HubServer
from launches import Launches

pytest.importorskip("transformers", reason="transformers is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(ROOT, "tests", "support")
REPO = "tiny-org/tiny-gpt2"


def _hub(tmp_path: Path) -> tuple[HubServer, torch.nn.Module, str]:
    model = hf_gpt2(seed=8)
    folder = save_hf(model, str(tmp_path / "repo"), sharded=True)
    return HubServer({REPO: folder}), model, folder


@pytest.fixture
def hub(tmp_path):
    server, model, folder = _hub(tmp_path)
    yield server, model, folder
    server.close()


@pytest.fixture(scope="module", autouse=True)
def one_launch_tests(tmp_path_factory) -> Iterator[tuple[Launches, dict[str, tuple[HubServer, torch.nn.Module, Path]]]]:
    """The tests of one launch each, started before the module's first test, each with a hub of its
    own: they run beside the first test's launches, which must follow one another."""
    launches = Launches(tmp_path_factory.mktemp("launches"))
    hubs: dict[str, tuple[HubServer, torch.nn.Module, Path]] = {}
    for name, mode, url, extra in (("offline", "error", f"hf://{REPO}", {"HF_HUB_OFFLINE": "1"}),
                                   ("revision", "load_then_missing", f"hf://{REPO}@v1.0", {"HF_TOKEN": "hf_test_token"}),
                                   ("broken", "error", f"hf://{REPO}", {}),
                                   ("signed", "error", f"hf://{REPO}", {})):
        work = tmp_path_factory.mktemp(name)
        server, model, folder = _hub(work)
        if name == "broken":  # the index names a shard the repository lacks
            os.remove(os.path.join(folder, _last_shard(folder)))
        if name == "signed":  # the last shard's signed download URL has expired
            server.expired.add(_last_shard(folder))
        hubs[name] = (server, model, work)
        launches.start(name, _argv(mode, url, str(work / "out.pt")), _env(server, str(work / "hf_home"), **extra))
    yield launches, hubs
    launches.close()
    for server, _, _ in hubs.values():
        server.close()


def _env(server: HubServer, home: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=server.url, HF_HOME=home, HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost",
               PYTHONPATH=os.pathsep.join([ROOT, SUPPORT]), HF_HUB_DISABLE_XET="1")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(var, None)
    env.update(extra)
    return env


def _argv(mode: str, url: str, out: str, world: int = 1) -> list[str]:
    return [sys.executable, os.path.join(SUPPORT, "hub_workers.py"), mode, url, out, str(world)]


def _run(server: HubServer, home: str, mode: str, url: str, out: str, world: int = 1, **env: str) -> dict:
    proc = subprocess.run(_argv(mode, url, out, world), env=_env(server, home, **env), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def _result(one_launch_tests: tuple[Launches, dict], name: str) -> tuple[HubServer, torch.nn.Module, dict]:
    """Test ``name``'s hub, model, and what its launch wrote."""
    launches, hubs = one_launch_tests
    server, model, work = hubs[name]
    proc = launches.result(name, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return server, model, torch.load(work / "out.pt")


def _last_shard(folder: str) -> str:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return sorted(set(json.load(f)["weight_map"].values()))[-1]


def _shards_with(folder: str, wanted) -> set[str]:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    return {name for key, name in weight_map.items() if wanted(key)}


def test_hf_url_fetches_what_the_model_needs_once(hub, tmp_path):
    server, model, folder = hub
    home = str(tmp_path / "hf_home")
    expected = {k: v for k, v in model.state_dict().items() if k in hf_gpt2_names()}
    resolve = f"/{REPO}/resolve/main/"

    # Block 1 skipped: only the index and the shards holding other keys are downloaded.
    got = _run(server, home, "load_skip", f"hf://{REPO}", str(tmp_path / "skip.pt"))
    needed = _shards_with(folder, lambda k: ".h.1." not in k)
    assert needed != _shards_with(folder, lambda k: True)  # some shard holds block 1 only
    assert sorted(server.gets()) == sorted([resolve + "model.safetensors.index.json"] + [resolve + n for n in needed])
    assert got["missing"] and all(k.startswith("blocks.1.") for k in got["missing"])
    for key, tensor in expected.items():
        if ".h.1." not in key:
            assert torch.equal(got["tensors"][key], tensor), key

    # The whole model at 2 ranks: only the shards not fetched yet are downloaded, once.
    server.clear()
    got = _run(server, home, "load", f"hf://{REPO}", str(tmp_path / "all.pt"), world=2)
    rest = _shards_with(folder, lambda k: True) - needed
    assert sorted(server.gets()) == sorted(resolve + n for n in rest)
    assert all(torch.equal(got["tensors"][k], v) for k, v in expected.items())

    # Everything cached: a load, lazy_load, and the command line's inspect and convert (one
    # process) download nothing.
    server.clear()
    got = _run(server, home, "cached", f"hf://{REPO}", str(tmp_path / "cached.pt"))
    assert server.gets() == []
    for step in ("load", "lazy"):
        assert all(torch.equal(got[step]["tensors"][k], v) for k, v in expected.items()), step
    assert os.path.isdir(os.path.join(home, "hub", "models--tiny-org--tiny-gpt2", "blobs"))  # the standard cache
    code, inspected = got["inspect"]
    assert code == 0
    info = json.loads(inspected)
    assert info["num_tensors"] == len(expected) and info["format"] == "hf"
    assert got["convert"] == 0
    from checkpointer import lazy_load

    back = dict(lazy_load(str(tmp_path / "cached.pt.converted")))
    assert all(torch.equal(back[k], v) for k, v in expected.items())


def test_offline_without_the_files_cached_says_the_hub_cannot_be_reached(one_launch_tests):
    """Offline, a repository that exists was reported as "no Hugging Face checkpoint there
    (neither ... nor ... not found)" (found by a review)."""
    server, _, got = _result(one_launch_tests, "offline")
    assert got["type"] == "NotInCacheError" and got["message"].startswith(f"hf://{REPO}: "), got
    assert "neither model.safetensors.index.json nor model.safetensors is in the local cache, and the Hugging Face hub cannot be reached" in got["message"], got
    assert server.gets() == []


def test_hf_url_at_a_revision_and_missing_repositories(one_launch_tests):
    server, model, got = _result(one_launch_tests, "revision")
    assert all(p.startswith(f"/{REPO}/resolve/v1.0/") for p in server.gets())
    assert server.tokens and set(server.tokens) == {"Bearer hf_test_token"}  # the token setting is sent
    state = model.state_dict()
    assert all(torch.equal(got["tensors"][k], state[k]) for k in hf_gpt2_names())
    assert got["missing_repository"] is not None and got["missing_repository"].startswith("hf://nobody/nothing")


def test_a_single_file_repository_loads_offline_from_the_cache(tmp_path):
    """Found by a review: offline, a repository without an index failed on the index before its
    cached ``model.safetensors`` was tried."""
    model = hf_gpt2(seed=9)
    server = HubServer({"org/single": save_hf(model, str(tmp_path / "single"), sharded=False)})
    try:
        home = str(tmp_path / "hf_home")
        expected = {k: v for k, v in model.state_dict().items() if k in hf_gpt2_names()}
        for offline in ("0", "1"):
            server.clear()
            got = _run(server, home, "load", "hf://org/single", str(tmp_path / f"{offline}.pt"), HF_HUB_OFFLINE=offline)
            assert all(torch.equal(got["tensors"][k], v) for k, v in expected.items()), offline
        assert server.requests == []  # offline: nothing asked of the hub
    finally:
        server.close()


def test_an_index_naming_a_missing_shard_is_corrupt(one_launch_tests):
    """As the same local directory is (found by a review: a ``FileNotFoundError``)."""
    server, _, got = _result(one_launch_tests, "broken")
    _, _, work = one_launch_tests[1]["broken"]
    shard = _last_shard(str(work / "repo"))
    assert got["type"] == "CorruptCheckpointError", got
    assert got["message"] == f"hf://{REPO}: model.safetensors.index.json lists the shard {shard}, which the repository does not hold"


def test_an_expired_signed_download_url_is_never_shown(one_launch_tests):
    """The hub redirects a shard to a signed CDN URL, which answers 403. Found by a review: the
    error's message, and the chain a traceback prints, quoted the URL with its signature."""
    server, _, got = _result(one_launch_tests, "signed")
    assert got["type"] in ("OSError", "NotInCacheError"), got
    assert server.SIGNATURE not in got["message"] and server.SIGNATURE not in got["traceback"], got["traceback"]
    assert f"hf://{REPO}" in got["message"] and "403" in got["message"], got["message"]
