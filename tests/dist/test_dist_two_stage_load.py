"""Two-stage load (``strategy="two_stage"``): the same result as the default strategy, each
replicated byte read from storage once across the ranks, and printable per-phase stats."""

from __future__ import annotations

import pytest
import torch

SAVE_LAYOUTS = ["plain", "shard0", "fsdp2"]
LOAD_LAYOUTS = ["plain", "shard0", "shard1", "flat"]
_MESHES: dict = {}


def _mesh(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    if world_size not in _MESHES:
        _MESHES[world_size] = init_device_mesh("cpu", (world_size,))
    return _MESHES[world_size]


def reference(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(37, 11, generator=g),
        "b": torch.randn(64, 5, generator=g).to(torch.bfloat16),
        "c": torch.randint(-9, 9, (5, 7, 3), generator=g),
        "d": torch.randn(2, 3, generator=g),
        "e": torch.randn(9, generator=g),
    }


def _fsdp2_model(world_size: int, seed: int):
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 13), nn.Linear(13, 5))
    for layer in model:
        fully_shard(layer, mesh=_mesh(world_size))
    fully_shard(model, mesh=_mesh(world_size))
    return model


def _lay_out(full: dict[str, torch.Tensor], layout: str, rank: int, world_size: int) -> dict:
    """Destinations (zero-filled) or sources in a layout, from full tensors."""
    from torch.distributed.tensor import DTensor, Shard

    from checkpointer import FlatShardedTensor
    from checkpointer.planning.reshard import tp_bounds

    out: dict = {}
    for key, t in full.items():
        if layout == "plain":
            out[key] = t.clone()
        elif layout in ("shard0", "shard1"):
            dim = min(int(layout[-1]), t.dim() - 1)
            start, end = tp_bounds(t.shape[dim], world_size, rank)
            local = t.narrow(dim, start, end - start).clone()
            out[key] = DTensor.from_local(local, _mesh(world_size), [Shard(dim)], shape=t.shape, stride=t.stride())
        elif layout == "flat":
            n = t.numel()  # uneven flat pieces: rank r holds a range of its own length
            cuts = [0] + [min(n, (i * (i + 1) // 2) * n // (world_size * (world_size + 1) // 2)) for i in range(1, world_size)] + [n]
            lo, hi = cuts[rank], cuts[rank + 1]
            out[key] = FlatShardedTensor(t.reshape(-1)[lo:hi].clone(), tuple(t.shape), ((lo, hi),))
        else:
            raise ValueError(layout)
    return out


def _local(value) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    from checkpointer import FlatShardedTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, FlatShardedTensor):
        return value.local
    return value


def _zero(state: dict) -> None:
    for v in state.values():
        _local(v).zero_()


def _save(rank: int, world_size: int, directory: str, layout: str) -> dict[str, torch.Tensor]:
    from checkpointer import Checkpointer

    if layout == "fsdp2":
        model = _fsdp2_model(world_size, seed=3)
        state = model.state_dict()
        full = {k: v.full_tensor().clone() for k, v in state.items()}
    else:
        full = reference()
        state = _lay_out(full, layout, rank, world_size)
    Checkpointer().save(directory, state)
    return full


def _roundtrip(rank: int, world_size: int, directory: str, save_layout: str) -> list[str]:
    """Save in one layout, load into every layout with both strategies: all equal the saved values."""
    from checkpointer import Checkpointer

    full = _save(rank, world_size, directory, save_layout)
    stats = []
    for layout in LOAD_LAYOUTS:
        expected = _lay_out(full, layout, rank, world_size)
        results = {}
        for strategy in ("default", "two_stage"):
            ckpt = Checkpointer()
            dest = _lay_out(full, layout, rank, world_size)
            _zero(dest)
            ckpt.load(directory, dest, strategy=strategy)
            results[strategy] = dest
            if strategy == "two_stage":
                stats.append(str(ckpt.last_load_stats))
        for key in full:
            want = _local(expected[key])
            for strategy, dest in results.items():
                got = _local(dest[key])
                assert got.dtype == want.dtype and torch.equal(got, want), (save_layout, layout, strategy, key)
    return stats


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("save_layout", SAVE_LAYOUTS)
def test_two_stage_equals_default(run_distributed, tmp_path, world_size, save_layout):
    stats = run_distributed(_roundtrip, world_size, str(tmp_path / "ck"), save_layout, timeout=240)
    for per_rank in stats:
        assert len(per_rank) == len(LOAD_LAYOUTS)
        for line in per_rank:
            assert "planning" in line and "broadcasts" in line and "read" in line


def _save_only(rank: int, world_size: int, directory: str, layout: str) -> None:
    _save(rank, world_size, directory, layout)


def _load_all_layouts(rank: int, world_size: int, directory: str, save_layout: str) -> None:
    from checkpointer import Checkpointer

    full = reference() if save_layout != "fsdp2" else None
    if full is None:
        full = Checkpointer().unshard(directory)
    for layout in LOAD_LAYOUTS:
        expected = _lay_out(full, layout, rank, world_size)
        for strategy in ("default", "two_stage"):
            dest = _lay_out(full, layout, rank, world_size)
            _zero(dest)
            Checkpointer().load(directory, dest, strategy=strategy)
            for key in full:
                assert torch.equal(_local(dest[key]), _local(expected[key])), (layout, strategy, key)


@pytest.mark.parametrize("save_ws, load_ws", [(2, 3), (3, 2)])
@pytest.mark.parametrize("save_layout", ["shard0", "fsdp2"])
def test_two_stage_across_world_sizes(run_distributed, tmp_path, save_ws, load_ws, save_layout):
    run_distributed(_save_only, save_ws, str(tmp_path / "ck"), save_layout, timeout=240)
    run_distributed(_load_all_layouts, load_ws, str(tmp_path / "ck"), save_layout, timeout=240)


def _bytes_read(rank: int, world_size: int, directory: str) -> dict:
    from lazy_helpers import CountingStorage

    from checkpointer import Checkpointer

    full = _save(rank, world_size, directory, "plain")
    out = {}
    for strategy in ("default", "two_stage"):
        storage = CountingStorage(directory)
        ckpt = Checkpointer()
        dest = _lay_out(full, "plain", rank, world_size)
        _zero(dest)
        ckpt.load(storage, dest, strategy=strategy)
        assert all(torch.equal(dest[k], full[k]) for k in full)
        out[strategy] = storage.data_bytes()
        if strategy == "two_stage":
            stats = ckpt.last_load_stats
            out["stats"] = str(stats)
            out["stats_read"] = stats.bytes_read
            out["stats_received"] = stats.bytes_received
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicated_bytes_read_once(run_distributed, tmp_path, world_size):
    per_rank = run_distributed(_bytes_read, world_size, str(tmp_path / "ck"), timeout=240)
    total = sum(t.numel() * t.element_size() for t in reference().values())
    assert sum(r["default"] for r in per_rank) == world_size * total
    assert sum(r["two_stage"] for r in per_rank) == total
    assert sum(r["stats_read"] for r in per_rank) == total
    assert sum(r["stats_received"] for r in per_rank) == (world_size - 1) * total
    print("\n".join(f"rank {i}: {r['stats']}" for i, r in enumerate(per_rank)))


def _a_damaged_optimizer_leaves_the_model_alone(rank: int, world_size: int, directory: str) -> dict:
    import json
    import os

    import torch.distributed as dist
    from dist_helpers import catch, model_full_state
    from resume_helpers import build_job, run

    import checkpointer

    job = build_job(world_size, seed=0)
    run(job, 1)
    checkpointer.save_model_and_optim_state(directory, job.model, job.optim)
    dist.barrier()
    if rank == 0:  # the optimizer's metadata.json disagrees with a rank file's header: found when planning
        path = os.path.join(directory, "optim", "metadata.json")
        meta = json.load(open(path))
        key = next(k for k in meta["tensors"] if k.endswith("__exp_avg"))
        meta["tensors"][key]["dtype"] = "F64"
        json.dump(meta, open(path, "w"))
    dist.barrier()
    out = {}
    for strategy in ("default", "two_stage"):
        fresh = build_job(world_size, seed=1)
        before = model_full_state(fresh.model)
        error = catch(checkpointer.load_model_and_optim_state, directory, fresh.model, fresh.optim, strategy=strategy)
        after = model_full_state(fresh.model)
        out[strategy] = (error and error["type"], [k for k in before if not torch.equal(before[k], after[k])])
    return out


def test_a_load_that_fails_planning_the_optimizer_writes_no_model_tensor(run_distributed, tmp_path):
    """Both strategies plan the model's and the optimizer's reads before writing any tensor:
    two_stage filled the model first, then failed on the optimizer (found by a review)."""
    for out in run_distributed(_a_damaged_optimizer_leaves_the_model_alone, 2, str(tmp_path / "ck"), timeout=240):
        assert out == {"default": ("CorruptCheckpointError", []), "two_stage": ("CorruptCheckpointError", [])}, out


def _an_unknown_checksum_algorithm(rank: int, world_size: int, directory: str) -> dict:
    import json
    import os

    import torch.distributed as dist
    from dist_helpers import catch

    from checkpointer import Checkpointer

    full = _save(rank, world_size, directory, "shard0")
    dist.barrier()
    if rank == 0:
        path = os.path.join(directory, "metadata.json")
        meta = json.load(open(path))
        meta["checksum_algorithm"] = "xxh3"  # the stored values are still crc32c: only the name says otherwise
        json.dump(meta, open(path, "w"))
    dist.barrier()
    out = {}
    for strategy in ("default", "two_stage"):
        dest = _lay_out(full, "shard0", rank, world_size)
        _zero(dest)
        error = catch(Checkpointer().load, directory, dest, strategy=strategy, verify=True)
        untouched = all(not _local(v).any() for v in dest.values())
        Checkpointer().load(directory, dest, strategy=strategy)
        loaded = all(torch.equal(_local(dest[k]), _local(v)) for k, v in _lay_out(full, "shard0", rank, world_size).items())
        out[strategy] = (error and error["type"], error and "'xxh3'" in error["msg"], untouched, loaded)
    return out


def test_verify_refuses_checksums_it_cannot_compute(run_distributed, tmp_path):
    """verify=True checked an unknown algorithm's checksums as CRC32C: a false mismatch, or, as
    here, a pass. Now refused by name before anything is written; without verify it loads."""
    for out in run_distributed(_an_unknown_checksum_algorithm, 2, str(tmp_path / "ck"), timeout=240):
        assert out == {s: ("CorruptCheckpointError", True, True, True) for s in ("default", "two_stage")}, out


def _staged_memory(rank: int, world_size: int, directory: str, layout: str) -> dict:
    """A two-stage load into a destination it cannot read into (a transposed view): peak memory
    it adds, and whether every element came back."""
    import torch.distributed as dist
    from peak_memory import peak_extra_mib
    from torch.distributed.tensor import Shard, distribute_tensor

    from checkpointer import Checkpointer

    full = torch.arange(4096 * 8192, dtype=torch.float32).reshape(4096, 8192)
    saved = full if layout == "replicated" else distribute_tensor(full, _mesh(world_size), [Shard(1)])
    Checkpointer().save(directory, {"w": saved})
    del saved
    dest = torch.zeros(8192, 4096).t()  # strided: filled through host blocks
    dist.barrier()
    _, extra = peak_extra_mib(lambda: Checkpointer().load(directory, {"w": dest}, strategy="two_stage"))
    return {"equal": torch.equal(dest, full), "extra_mib": extra}


@pytest.mark.parametrize("layout", ["replicated", "shard1"])
def test_a_strided_destination_adds_at_most_the_memory_bound(run_distributed, tmp_path, layout):
    """128 MiB per rank, the bound 10% of it + 64 MiB: the staged destination is filled a few row
    blocks at a time (it was one buffer of the whole tensor: 256 MiB with the batches). Saved as
    ``Shard(1)``, each row block needs both files: units go by where they start in the tensor,
    so both files' units for a block follow each other."""
    per_rank = run_distributed(_staged_memory, 2, str(tmp_path / "ck"), layout, timeout=240)
    assert all(r["equal"] for r in per_rank)
    assert max(r["extra_mib"] for r in per_rank) <= 128 * 0.1 + 64, per_rank
    print("two-stage, strided destination, peak extra MiB per rank:", [round(r["extra_mib"], 1) for r in per_rank])
