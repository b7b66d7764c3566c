"""``reshard_tensor`` against torch.cat / torch.chunk by hand, ``tp_bounds``, and ``get_shard_dims``."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
from lazy_helpers import expected_slice

from checkpointer import get_shard_dims, reshard_tensor
from checkpointer.planning.reshard import tp_bounds


def splits_of(full: torch.Tensor, tp: int, dp: int, dim: int | None) -> list[list[torch.Tensor]]:
    """What a (tp, dp) job saved: TP shards along ``dim`` (replicas when None), each cut in DP splits along
    dim 0. Uneven sizes are cut like ``torch.tensor_split`` (any source layout must work)."""
    shards = [full] * tp if dim is None else list(torch.tensor_split(full, tp, dim))
    return [[s.clone() for s in torch.tensor_split(shard, dp, 0)] for shard in shards]


def by_hand(splits, dim, tgt_tp, rank) -> torch.Tensor:
    """fairseq2's recipe without any care for memory: cat DP on dim 0, cat TP on dim, chunk
    (or the source shard itself when the TP sizes match)."""
    shards = [torch.cat(dp, 0) for dp in splits]
    if len(shards) == tgt_tp:
        return shards[rank]
    if dim is None:
        return shards[0]
    return expected_slice(torch.cat(shards, dim), dim, rank, tgt_tp)


def test_seed_example_2_way_to_4_way():
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    tensor_tp0_dp0, tensor_tp1_dp0 = full.chunk(2, 0)
    source_splits = [[tensor_tp0_dp0], [tensor_tp1_dp0]]
    resharded = reshard_tensor("model.weight", source_splits, (2, 1), (4, 1), (2, 0), shard_dims={"model.weight": 0})
    assert torch.equal(resharded, full[4:6])
    assert torch.equal(resharded, torch.cat(source_splits[0] + source_splits[1], 0).chunk(4, 0)[2])


@pytest.mark.parametrize("src_tp, tgt_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (2, 3), (3, 2), (4, 3), (3, 3), (1, 1), (3, 5)])
@pytest.mark.parametrize("src_dp", [1, 2, 3])
@pytest.mark.parametrize("dim", [0, 1, 2, None])
@pytest.mark.parametrize("shape", [(12, 10, 3), (7, 5, 11)])
def test_against_cat_and_chunk(src_tp, tgt_tp, src_dp, dim, shape):
    full = torch.randn(*shape)
    splits = splits_of(full, src_tp, src_dp, dim)
    dims = {} if dim is None else {"w": dim}
    for rank in range(tgt_tp):
        got = reshard_tensor("w", splits, (src_tp, src_dp), (tgt_tp, 2), (rank, 1), dims)
        want = by_hand(splits, dim, tgt_tp, rank)
        assert got.shape == want.shape and torch.equal(got, want), (rank, got.shape, want.shape)


def test_uneven_sources_and_targets():
    """Source TP shards of unequal sizes (torch.chunk of 7 in 3: 3, 3, 1), re-cut in 2 and 4."""
    full = torch.randn(5, 7)
    splits = [[s] for s in torch.chunk(full, 3, 1)]
    assert [s[0].shape[1] for s in splits] == [3, 3, 1]
    for tgt in (2, 4, 5, 8):
        parts = [reshard_tensor("w", splits, (3, 1), (tgt, 1), (r, 0), {"w": 1}) for r in range(tgt)]
        for r, part in enumerate(parts):
            assert torch.equal(part, expected_slice(full, 1, r, tgt))
        assert torch.equal(torch.cat(parts, 1), full)


def test_replicated_dp_splits_are_concatenated_on_dim0():
    full = torch.randn(9, 4)
    splits = [[s.clone() for s in full.chunk(3, 0)]] * 2  # 2 TP replicas, 3 DP splits each
    for tgt_tp in (1, 2, 4):
        for rank in range(tgt_tp):
            assert torch.equal(reshard_tensor("b", splits, (2, 3), (tgt_tp, 1), (rank, 0), {"w": 0}), full)
    assert torch.equal(reshard_tensor("b", splits, (2, 3), (2, 1), (1, 0), None), full)


def test_shard_dim1_with_dp_splits_copies_only_the_target():
    full = torch.arange(6 * 8.0).view(6, 8)
    splits = splits_of(full, 2, 3, 1)  # 2 TP shards of 6x4, each in 3 DP splits of 2x4
    got = reshard_tensor("w", splits, (2, 3), (4, 1), (1, 0), {"w": 1})
    assert torch.equal(got, full[:, 2:4])
    got = reshard_tensor("w", splits, (2, 3), (1, 1), (0, 0), {"w": 1})
    assert torch.equal(got, full)


def test_same_tp_size_returns_the_source_without_copy():
    shard = torch.randn(4, 4)
    splits = [[torch.randn(4, 4)], [shard]]
    assert reshard_tensor("w", splits, (2, 1), (2, 8), (1, 5), {"w": 0}) is shard


def test_a_target_inside_one_source_is_a_view():
    full = torch.randn(8, 3)
    splits = [[s.clone()] for s in full.chunk(2, 0)]
    got = reshard_tensor("w", splits, (2, 1), (4, 1), (3, 0), {"w": 0})
    assert got.data_ptr() == splits[1][0][2:].data_ptr() and torch.equal(got, full[6:])


def test_negative_shard_dim():
    full = torch.randn(4, 6)
    splits = [[s.clone()] for s in full.chunk(2, -1)]
    assert torch.equal(reshard_tensor("w", splits, (2, 1), (3, 1), (2, 0), {"w": -1}), full[:, 4:])


@pytest.mark.parametrize(
    "splits, sizes, ranks, match",
    [
        ([[torch.ones(2)]], (2, 1), (0, 0), "expected 2 x 1"),
        ([[torch.ones(2)], [torch.ones(2)]], (2, 1), (4, 0), "tp_rank 4"),
        ([[torch.ones(2, 3)], [torch.ones(2, 4)]], (2, 1), (0, 0), "do not line up"),
        ([[torch.ones(2, 3)], [torch.ones(2, 3, dtype=torch.int64)]], (2, 1), (0, 0), "do not line up"),
        ([[torch.ones(2, 3)], [torch.ones(2, 3)]], (2, 1), (0, 0), "shard dim 5"),
    ],
)
def test_bad_arguments_name_the_key(splits, sizes, ranks, match):
    dim = 5 if "shard dim" in match else 0
    with pytest.raises(ValueError, match=match) as info:
        reshard_tensor("layer.w", splits, sizes, (3, 1), ranks, {"layer.w": dim})
    assert "layer.w" in str(info.value)


@pytest.mark.parametrize("size, n", list(itertools.product(range(0, 13), range(1, 7))))
def test_tp_bounds_is_torch_chunk(size, n):
    full = torch.arange(size)
    for r in range(n):
        start, end = tp_bounds(size, n, r)
        assert torch.equal(full[start:end], expected_slice(full, 0, r, n))


# ---------------------------------------------------------------------------------------
# get_shard_dims
# ---------------------------------------------------------------------------------------


class Declared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 8)
        self.o = nn.Linear(8, 4)

    def get_shard_dims(self):
        return {"q.weight": 0, "q.bias": 0, "o.weight": 1}


class Pairs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2, 2))

    def get_shard_dims(self):
        return [("w", 1)]


def test_get_shard_dims_of_declaring_modules():
    model = nn.Sequential(Declared(), nn.LayerNorm(4), nn.ModuleDict({"p": Pairs()}))
    assert get_shard_dims(model) == {"0.q.weight": 0, "0.q.bias": 0, "0.o.weight": 1, "2.p.w": 1}
    assert get_shard_dims(nn.Linear(2, 2)) == {}


def _tp_model(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8))
    mesh = init_device_mesh("cpu", (world_size,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def _shard_dims_tp(rank, world_size):
    return get_shard_dims(_tp_model(rank, world_size))


def _shard_dims_fsdp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return get_shard_dims(model)


def _shard_dims_fsdp_tp_and_hsdp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model[0], mesh=mesh["dp"])
    fully_shard(model[1], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    hsdp = nn.Sequential(nn.Linear(8, 16))
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    return get_shard_dims(model), get_shard_dims(hsdp)


def test_get_shard_dims_tensor_parallel(run_distributed):
    want = {"0.weight": 0, "0.bias": 0, "2.weight": 1}
    assert run_distributed(_shard_dims_tp, 2) == [want, want]


def test_get_shard_dims_fsdp_is_not_tensor_parallel(run_distributed):
    assert run_distributed(_shard_dims_fsdp, 2) == [{}, {}]


def test_get_shard_dims_fsdp_with_tp_and_hsdp(run_distributed):
    want = ({"0.weight": 0, "0.bias": 0, "1.weight": 1}, {})
    assert run_distributed(_shard_dims_fsdp_tp_and_hsdp, 4, timeout=180) == [want] * 4


def test_tp_dim_skips_fsdps_strided_shard():
    """FSDP2 over TP puts ``_StridedShard`` (its own type, not a ``Shard``) on the DP mesh dim."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from checkpointer.sharding import _tp_dim

    assert not isinstance(_StridedShard(0, split_factor=2), Shard)
    strided = _StridedShard(0, split_factor=2)
    assert _tp_dim((strided, Shard(0)), skip_fsdp=True) == 0  # Colwise TP under FSDP
    assert _tp_dim((Replicate(), strided, Shard(0)), skip_fsdp=True) == 0  # HSDP
    assert _tp_dim((Shard(0), Shard(1)), skip_fsdp=True) == 1  # Rowwise TP under FSDP
    assert _tp_dim((strided, Shard(0), Shard(1)), skip_fsdp=True) == 1  # 2-D TP under FSDP
    assert _tp_dim((Shard(0),), skip_fsdp=True) is None  # FSDP alone
    assert _tp_dim((strided,), skip_fsdp=False) is None  # a strided split is not a torch.chunk TP split
    assert _tp_dim((Replicate(), Shard(1)), skip_fsdp=False) == 1
