"""Loading a sharded checkpoint from S3 / GCS fetches only what each rank needs.

Each rank talks to the store through its own loopback proxy, which counts every byte it
sends back (status lines and headers included). A rank may fetch at most 1.1 times its
share (the bytes of its local pieces) plus ``metadata.json``.
"""

from __future__ import annotations

import torch
from remote_workers import REPLICATED, flat_full, load_flat, save_flat

from checkpointer import lazy_load

SLACK = 1.1


def test_bytes_fetched_per_rank(backend, run_distributed, proxies, monkeypatch):
    url = backend.url("big")
    run_distributed(save_flat, 4, backend.env(), url, "big", timeout=180)
    assert backend.names(url) == ["metadata.json"] + [f"rank_{r}.safetensors" for r in range(4)]
    metadata_bytes = backend.size(url, "metadata.json")

    per_rank = [proxies(backend.endpoint) for _ in range(3)]
    envs = [backend.env(p.url) for p in per_rank]
    shares = run_distributed(load_flat, 3, envs, url, "big", timeout=180)
    fetched = [p.bytes_out for p in per_rank]
    full_bytes = sum(t.numel() * t.element_size() for t in flat_full("big").values())
    report = ", ".join(f"rank {r}: {f:,} B for a share of {s:,} B ({f / s:.3f}x)"
                       for r, (f, s) in enumerate(zip(fetched, shares)))
    print(f"\n{backend.kind}: checkpoint {full_bytes:,} B, metadata.json {metadata_bytes:,} B; {report}")
    for rank, (got, share) in enumerate(zip(fetched, shares)):
        assert share < full_bytes / 2  # a real share: the sharded tensors are cut three ways
        assert got >= share, f"rank {rank} fetched {got} bytes, less than its share of {share}"
        assert got <= SLACK * share + metadata_bytes, f"rank {rank} fetched {got} bytes for a share of {share}: {report}"
    assert all(p.exchanges for p in per_rank)  # every rank went through its proxy

    # lazy_load from the store (this process, no process group): one tensor at a time, already
    # cut for a tensor-parallel rank, fetching about the bytes of the slices along dim 0.
    full = flat_full("big")
    reader = proxies(backend.endpoint)
    monkeypatch.setenv(backend.endpoint_var, reader.url)
    got = dict(lazy_load(url, {"w": 0, "v": 0}, tp_rank=1, tp_size=2))
    assert sorted(got) == sorted(full)
    assert torch.equal(got["w"], torch.chunk(full["w"], 2, dim=0)[1])
    assert torch.equal(got["v"], torch.chunk(full["v"], 2, dim=0)[1])
    assert torch.equal(got["i"], full["i"]) and torch.equal(got[REPLICATED], full[REPLICATED])
    wanted = sum(t.numel() * t.element_size() for t in got.values())
    assert reader.bytes_out <= SLACK * wanted + metadata_bytes, (reader.bytes_out, wanted)
    # along a trailing dimension too (whole rows are fetched and cut: fewer requests)
    cut = dict(lazy_load(url, {"i": 1}, tp_rank=0, tp_size=3))
    assert torch.equal(cut["i"], torch.chunk(full["i"], 3, dim=1)[0])
