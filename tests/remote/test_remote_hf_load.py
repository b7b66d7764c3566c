"""A Hugging Face checkpoint on S3 (moto_server) and GCS (the emulator) loads into an FSDP2 model
fetching only each rank's byte ranges: at most 1.05 times the bytes of its local pieces, plus the
headers of the files it reads (each in one exact read). Rank 0 also describes the checkpoint for every rank:
it reads the index and a 64 KiB prefix of each shard (a header is read whole in one request
where it fits there).

Each rank talks to the store through its own loopback proxy, which counts every byte it sends
back (status lines and HTTP headers included).
"""

from __future__ import annotations

import os
import struct

import pytest
import torch
from dist_helpers import full, mesh
from hf_helpers import LARGER, OwnGPT2, gpt2_key_map, hf_gpt2, hf_gpt2_names, own_to_hf, save_hf, zero_
from remote_workers import remote_env

from checkpointer import IncompleteCheckpointError, load_model_and_optim_state
from checkpointer.sharding import local_data

pytest.importorskip("transformers", reason="transformers is not installed")

SLACK = 1.05


def load_fsdp_from_store(rank, world_size, envs, url, strategy):
    """Our GPT-2 under FSDP2 filled from ``url``: this rank's share in bytes, and the full state."""
    from torch.distributed.fsdp import fully_shard

    model = zero_(OwnGPT2(LARGER))
    m = mesh((world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=m)
    fully_shard(model, mesh=m)
    with remote_env(envs, rank):
        load_model_and_optim_state(url, model, key_map=gpt2_key_map, strategy=strategy)
    seen, share = set(), 0
    for value in model.state_dict().values():
        local = local_data(value)
        if local.data_ptr() not in seen:  # the tied head counts once
            seen.add(local.data_ptr())
            share += local.numel() * local.element_size()
    return share, own_to_hf({k: full(v) for k, v in model.state_dict().items()}, LARGER)


def _header_bytes(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("backend", ["s3", "gcs"], indirect=True)
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_bytes_fetched_per_rank(backend, run_distributed, proxies, tmp_path, sharded):
    model = hf_gpt2(seed=4, dims=LARGER)
    local = save_hf(model, str(tmp_path / "hf"), sharded=sharded, max_shard_size="1MB")
    url = backend.url("hf")
    names = sorted(n for n in os.listdir(local) if n.endswith((".safetensors", ".json")))
    for name in names:
        with open(os.path.join(local, name), "rb") as f:
            backend.put(url, name, f.read())
    files = [n for n in names if n.endswith(".safetensors")]
    assert len(files) == (1 if not sharded else len(files)) and (not sharded or len(files) > 2)
    headers = sum(_header_bytes(os.path.join(local, n)) for n in files)
    prefixes = sum(min(64 << 10, os.path.getsize(os.path.join(local, n))) for n in files)
    index = os.path.getsize(os.path.join(local, "model.safetensors.index.json")) if sharded else 0
    state = model.state_dict()
    expected = {k: state[k] for k in hf_gpt2_names(LARGER)}
    full_bytes = sum(t.numel() * t.element_size() for t in expected.values())

    world_size = 3
    for strategy in ("default", "two_stage"):
        per_rank = [proxies(backend.endpoint) for _ in range(world_size)]
        envs = [backend.env(p.url) for p in per_rank]
        results = run_distributed(load_fsdp_from_store, world_size, envs, url, strategy, timeout=240)
        for share, loaded in results:
            assert all(torch.equal(loaded[k], v) for k, v in expected.items())
        shares = [share for share, _ in results]
        fetched = [p.bytes_out for p in per_rank]
        report = ", ".join(f"rank {r}: {f:,} B for a share of {s:,} B ({f / s:.3f}x)"
                           for r, (f, s) in enumerate(zip(fetched, shares)))
        print(f"\n{strategy}: checkpoint {full_bytes:,} B in {len(files)} files, headers {headers:,} B; {report}")
        for rank, (got, share) in enumerate(zip(fetched, shares)):
            assert share < full_bytes / 2
            described = prefixes + index if rank == 0 else 0  # rank 0 describes the checkpoint for all
            limit = SLACK * share + headers + described
            assert got <= limit, f"{strategy}: rank {rank} fetched {got:,} bytes, over {limit:,.0f}: {report}"


def load_replicated_from_store(rank, world_size, envs, url, strategy):
    """Our GPT-2 unsharded on every rank (every rank needs every byte): the full state."""
    model = zero_(OwnGPT2(LARGER))
    with remote_env(envs, rank):
        load_model_and_optim_state(url, model, key_map=gpt2_key_map, strategy=strategy)
    return own_to_hf({k: v.detach().clone() for k, v in model.state_dict().items()}, LARGER)


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_two_stage_reads_each_byte_once(backend, run_distributed, proxies, tmp_path):
    """A replicated model at 3 ranks: the default strategy fetches the checkpoint 3 times, two_stage
    once in all (each piece read by one rank and broadcast), headers and rank 0's description aside."""
    model = hf_gpt2(seed=5, dims=LARGER)
    local = save_hf(model, str(tmp_path / "hf"), sharded=True, max_shard_size="1MB")
    url = backend.url("hf")
    for name in os.listdir(local):
        with open(os.path.join(local, name), "rb") as f:
            backend.put(url, name, f.read())
    files = [n for n in os.listdir(local) if n.endswith(".safetensors")]
    overhead = sum(min(64 << 10, os.path.getsize(os.path.join(local, n))) for n in files) * 4 + (64 << 10)
    state = model.state_dict()
    full_bytes = sum(state[k].numel() * state[k].element_size() for k in hf_gpt2_names(LARGER))
    fetched = {}
    for strategy in ("default", "two_stage"):
        per_rank = [proxies(backend.endpoint) for _ in range(3)]
        results = run_distributed(load_replicated_from_store, 3, [backend.env(p.url) for p in per_rank], url, strategy,
                                  timeout=240)
        for loaded in results:
            assert all(torch.equal(loaded[k], state[k]) for k in hf_gpt2_names(LARGER))
        fetched[strategy] = sum(p.bytes_out for p in per_rank)
    print(f"\nreplicated at 3 ranks, checkpoint {full_bytes:,} B: fetched {fetched}")
    assert fetched["default"] >= 3 * full_bytes
    assert full_bytes <= fetched["two_stage"] <= SLACK * full_bytes + overhead, fetched


def load_fsdp_from_url(rank, world_size, url):
    from torch.distributed.fsdp import fully_shard

    model = zero_(OwnGPT2())
    m = mesh((world_size,))
    fully_shard(model, mesh=m)
    load_model_and_optim_state(url, model, key_map=gpt2_key_map)
    return own_to_hf({k: full(v) for k, v in model.state_dict().items()})


def test_over_http(run_distributed, file_server, proxies, tmp_path, loopback_env):
    """http(s) cannot list a directory: the index is found by name, a single file by its URL."""
    model = hf_gpt2(seed=6)
    save_hf(model, str(tmp_path / "served" / "sharded"), sharded=True)
    save_hf(model, str(tmp_path / "served" / "one"), sharded=False)
    server = file_server(str(tmp_path / "served"))
    state = model.state_dict()
    for url in (f"{server.url}/sharded", f"{server.url}/one", f"{server.url}/one/model.safetensors"):
        for loaded in run_distributed(load_fsdp_from_url, 2, url):
            assert all(torch.equal(loaded[k], state[k]) for k in hf_gpt2_names()), url
    # ranged reads only: no rank fetches a whole shard
    proxy = proxies(server.url)
    run_distributed(load_fsdp_from_url, 2, f"{proxy.url}/one")
    gets = [s for s in proxy.seen if s.method == "GET" and s.path.endswith(".safetensors")]
    assert gets and all(s.headers.get("Range", "").startswith("bytes=") for s in gets)


def test_an_http_directory_whose_one_file_has_another_name_says_to_name_the_file(file_server, tmp_path, loopback_env):
    """Neither this library's checkpoint nor one whose files have the Hugging Face names: the
    refusal says so (http(s) cannot list the directory), and naming the file loads it."""
    model = hf_gpt2(seed=6)
    save_hf(model, str(tmp_path / "served" / "one"), sharded=False)
    os.rename(tmp_path / "served" / "one" / "model.safetensors", tmp_path / "served" / "one" / "weights.safetensors")
    server = file_server(str(tmp_path / "served"))
    target = zero_(OwnGPT2())
    for url in (f"{server.url}/one", str(tmp_path / "nothing-here")):
        with pytest.raises(IncompleteCheckpointError, match="neither this library's") as info:
            load_model_and_optim_state(url, target, key_map=gpt2_key_map)
        assert url in str(info.value)
    load_model_and_optim_state(f"{server.url}/one/weights.safetensors", target, key_map=gpt2_key_map)
    state = own_to_hf(target.state_dict())
    assert all(torch.equal(state[k], model.state_dict()[k]) for k in hf_gpt2_names())
