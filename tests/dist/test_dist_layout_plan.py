"""A first save plans without exchanging pieces when every value's layout is the same on every
rank (DTensors over all ranks, plain tensors): one all-reduce, no all-gather, and the checkpoint
round-trips exactly. A value without such a layout (a flat-sharded piece) falls back to the
exchange, and so does a key only some ranks hold."""

from __future__ import annotations

import math

import torch
from dist_helpers import collectives_called, mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from checkpointer import Checkpointer, FlatShardedTensor
from checkpointer.sharding import dtensor_index_runs

# name -> (shape, placements on the 2x2 mesh); None: a plain tensor, whole on every rank
TENSORS = {
    "hsdp.w": ((9, 5), (Replicate(), Shard(0))),  # HSDP: uneven rows
    "hsdp.b": ((3,), (Replicate(), Shard(0))),
    "tp_fsdp.col": ((8, 6), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP2 over column-parallel TP
    "tp_fsdp.row": ((6, 10), (Shard(0), Shard(1))),  # FSDP2 over row-parallel TP
    "tp_fsdp.norm": ((7,), (Shard(0), Replicate())),
    "plain": ((4, 3), None),
    "step": ((), None),
}


def _full(key: str) -> torch.Tensor:
    shape, _ = TENSORS[key]
    base = sum(map(ord, key)) * 100
    return (torch.arange(math.prod(shape), dtype=torch.float32) + base).reshape(shape)


def _value(key: str, *, zeros: bool) -> torch.Tensor:
    full = _full(key)
    if zeros:
        full = torch.zeros_like(full)
    shape, placements = TENSORS[key]
    if placements is None:
        return full.clone()
    m = mesh((2, 2))
    runs = dtensor_index_runs(shape, placements, (2, 2), m.get_coordinate())
    local = full
    for d, dim_runs in enumerate(runs):
        index = torch.tensor([i for s, e in dim_runs for i in range(s, e)], dtype=torch.long)
        local = local.index_select(d, index)
    return DTensor.from_local(local.contiguous(), m, list(placements), run_check=False, shape=full.shape,
                              stride=full.stride())


def _state(*, zeros: bool = False) -> dict:
    return {key: _value(key, zeros=zeros) for key in TENSORS}


def _local(value) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _save_and_load(rank, world_size, root):
    out = {}
    with collectives_called() as called:
        Checkpointer().save(f"{root}/layouts", _state())
    out["layouts"] = list(called)
    loaded = _state(zeros=True)
    Checkpointer().load(f"{root}/layouts", loaded)
    expected = _state()
    for key in TENSORS:
        assert torch.equal(_local(loaded[key]), _local(expected[key])), key

    # A flat-sharded value has no layout: the pieces are exchanged, and it still round-trips.
    flat = _state()
    n = 12
    flat["flat"] = FlatShardedTensor(torch.arange(rank * 3, rank * 3 + 3, dtype=torch.float32), (n,),
                                     ((rank * 3, rank * 3 + 3),))
    with collectives_called() as called:
        Checkpointer().save(f"{root}/flat", flat)
    out["flat"] = list(called)
    target = {"flat": FlatShardedTensor(torch.zeros(3), (n,), ((rank * 3, rank * 3 + 3),))}
    Checkpointer().load(f"{root}/flat", target)
    assert torch.equal(target["flat"].local, torch.arange(rank * 3, rank * 3 + 3, dtype=torch.float32))

    # A key only rank 0 holds: the descriptions differ, so the pieces are exchanged.
    some = _state()
    if rank == 0:
        some["only0"] = torch.ones(2)
    with collectives_called() as called:
        Checkpointer().save(f"{root}/some", some)
    out["some"] = list(called)
    return out


def test_first_save_plans_from_layouts_without_exchanging_pieces(run_distributed, tmp_path):
    results = run_distributed(_save_and_load, 4, str(tmp_path))
    for rank, calls in enumerate(results):
        # Planning is what comes before the commit's gather of every rank's status (and the
        # all-reduce of its longest length): one all-reduce for the plan cache, one for the
        # layouts, one to agree; the fallbacks all-gather every rank's pieces.
        planning = {what: c[: c.index("gather") - 1] for what, c in calls.items()}
        assert set(planning["layouts"]) == {"all_reduce"}, f"rank {rank}: {calls['layouts']}"
        assert "all_gather" in planning["flat"], f"rank {rank}: {calls['flat']}"
        assert "all_gather" in planning["some"], f"rank {rank}: {calls['some']}"
