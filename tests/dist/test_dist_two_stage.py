"""Two-stage loading reads each replicated piece from storage once in the whole job."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from checkpointer import Checkpointer
from checkpointer.storage.local import LocalStorage

BIG = (256, 1024)  # 1 MiB of float32, replicated on every rank


def full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"big": torch.randn(*BIG, generator=g), "small": torch.randn(7, 13, generator=g)}


def _save(rank, world_size, ckpt):
    Checkpointer().save(ckpt, full())
    return True


def _load_counting(rank, world_size, ckpt, strategy):
    read_bytes = [0]
    real_read_into = LocalStorage.read_into

    def read_into(self, name, requests):
        if name.endswith(".safetensors"):
            read_bytes[0] += sum(len(buf) for _, buf in requests)
        return real_read_into(self, name, requests)

    state = {k: torch.zeros_like(v) for k, v in full().items()}
    with mock.patch.object(LocalStorage, "read_into", read_into):
        Checkpointer().load(ckpt, state, strategy=strategy)
    expected = full()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    total = torch.tensor([read_bytes[0]], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item())


def test_two_stage_reads_replicated_data_once(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save, 1, ckpt)
    data_bytes = sum(t.numel() * t.element_size() for t in full().values())
    default_total = run_distributed(_load_counting, 4, ckpt, "default")[0]
    two_stage_total = run_distributed(_load_counting, 4, ckpt, "two_stage")[0]
    assert default_total >= 4 * data_bytes * 0.99, default_total  # every rank reads it all
    assert data_bytes * 0.99 <= two_stage_total <= data_bytes * 1.1, (two_stage_total, data_bytes)


def _load_with_small_batches(rank, world_size, ckpt, batch_bytes):
    from checkpointer import dist as ckpt_dist
    from checkpointer.engine import two_stage

    shared: list[int] = []
    real_share = ckpt_dist.share_tensor

    def share_tensor(buf, reader, ranks, tag):
        shared.append(buf.numel())
        return real_share(buf, reader, ranks, tag)

    state = {k: torch.zeros_like(v) for k, v in full().items()}
    with mock.patch.object(two_stage, "_BATCH_BYTES", batch_bytes), mock.patch.object(ckpt_dist, "share_tensor", share_tensor):
        Checkpointer().load(ckpt, state, strategy="two_stage")
    expected = full()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    return max(shared)


def test_two_stage_buffers_stay_within_a_batch(run_distributed, tmp_path):
    """A replicated tensor larger than a batch goes in batch-sized parts: a 1 MiB tensor must
    not be staged whole (a 1 GiB embedding would cost 1 GiB, twice with the read-ahead)."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save, 1, ckpt)
    largest = run_distributed(_load_with_small_batches, 2, ckpt, 64 << 10)
    assert max(largest) <= 64 << 10, largest
