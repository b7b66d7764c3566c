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


STAGED = {f"w{i}": (64, 64) for i in range(8)}  # 16 KiB each


def _staged_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    return {k: torch.randn(*shape, generator=g) for k, shape in STAGED.items()}


def _save_flat_halves(rank, world_size, ckpt):
    from checkpointer import FlatShardedTensor

    state = {}
    for key, t in _staged_full().items():
        n = t.numel()
        lo, hi = rank * n // world_size, (rank + 1) * n // world_size
        state[key] = FlatShardedTensor(t.reshape(-1)[lo:hi].clone(), tuple(t.shape), ((lo, hi),))
    Checkpointer().save(ckpt, state)
    return True


def _load_strided_measuring_staging(rank, world_size, ckpt):
    """Load into transposed (non-contiguous) tensors, as device tensors load: through host
    memory. Returns the most float32 host memory two-stage held at once."""
    import weakref

    live, peak = [0], [0]
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype == torch.float32:
            live[0] += t.numel() * 4
            peak[0] = max(peak[0], live[0])
            weakref.finalize(t, lambda n=t.numel() * 4: live.__setitem__(0, live[0] - n))
        return t

    state = {k: torch.zeros(shape[1], shape[0]).t() for k, shape in STAGED.items()}
    with mock.patch.object(torch, "empty", empty):
        Checkpointer().load(ckpt, state, strategy="two_stage", verify=True)
    expected = _staged_full()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    return peak[0]


def test_two_stage_stages_one_tensor_at_a_time(run_distributed, tmp_path):
    """A model on a GPU (or with strided tensors) is loaded through host memory; two-stage held a
    host copy of every such tensor until the end: a whole replicated model on every rank."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_flat_halves, 2, ckpt)
    peaks = run_distributed(_load_strided_measuring_staging, 2, ckpt)
    one = 64 * 64 * 4
    assert max(peaks) <= 2 * one, (peaks, one)


def _load_with_a_slow_reader(rank, world_size, ckpt):
    """Rank 0's reads take 2 s, so rank 1 waits in the broadcasts of what rank 0 reads; then
    what rank 1 recorded in the store, if anything."""
    import time

    from checkpointer.dist import arrivals

    real_read_into = LocalStorage.read_into

    def slow_read_into(self, name, requests):
        if name.endswith(".safetensors") and rank == 0:
            time.sleep(2.0)
        return real_read_into(self, name, requests)

    state = {k: torch.zeros_like(v) for k, v in full().items()}
    with mock.patch.object(LocalStorage, "read_into", slow_read_into):
        Checkpointer().load(ckpt, state, strategy="two_stage")
    assert all(torch.equal(state[k], v) for k, v in full().items())
    dist.barrier()
    store, key = arrivals._store(), f"{arrivals._ARRIVALS}/{dist.group.WORLD.group_name}/{rank}"
    return bytes(store.get(key)).decode() if store.check([key]) else ""


def test_two_stage_data_broadcasts_leave_the_store_alone_when_they_wait(run_distributed, tmp_path):
    """A data broadcast waits on a read every batch (seconds, from remote storage): a rank late in
    each one must not write its arrival to the rendezvous store each time (thousands of ranks,
    one store server). It records only if the broadcast fails, and a rank that died is named
    all the same (tests/reliability/test_rank_failures.py)."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save, 1, ckpt)
    recorded = run_distributed(_load_with_a_slow_reader, 2, ckpt)
    assert not any("two-stage broadcast" in r for r in recorded), recorded
