"""Checkpointer.save / .load / .unshard on flat state dicts of every common dtype, plain and DTensor."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import assert_local_same, assert_same, read_metadata_json, to_layout, zeros_like_layout

from checkpointer import Checkpointer

CODES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor] = {}
    for dtype in CODES:
        name = str(dtype).removeprefix("torch.")
        if dtype is torch.bool:
            make = lambda *shape: torch.rand(*shape, generator=g) > 0.5  # noqa: E731
        elif dtype is torch.int64:
            make = lambda *shape: torch.randint(-(2**40), 2**40, shape, generator=g)  # noqa: E731
        elif not dtype.is_floating_point:
            info = torch.iinfo(dtype)
            make = lambda *shape, dt=dtype, lo=info.min, hi=info.max: torch.randint(  # noqa: E731
                lo, hi + 1, shape, generator=g
            ).to(dt)
        else:
            make = lambda *shape, dt=dtype: torch.randn(*shape, generator=g).to(dt)  # noqa: E731
        out[f"plain.{name}"] = make(4, 3)
        out[f"sharded.{name}"] = make(7, 3)
    out["empty"] = torch.empty(0, 4)
    out["empty.int64"] = torch.empty(0, dtype=torch.int64)
    out["scalar"] = torch.tensor(3.25)
    out["scalar.int64"] = torch.tensor(-7)
    out["scalar.bool"] = torch.tensor(True)
    out["sharded.special"] = torch.tensor([float("inf"), -0.0, float("-inf"), 1e-40, -1.5, 2.0, 65504.0])
    return out


def state_for(world_size: int) -> dict[str, torch.Tensor]:
    """``sharded.*`` keys are DTensors sharded on dim 0 over all ranks (plain at world size 1)."""
    layout = {1: "plain", 2: "shard0@2", 3: "shard0@3", 4: "shard0@4"}[world_size]
    return {k: to_layout(v, layout) if k.startswith("sharded.") else v.clone() for k, v in full_tensors().items()}


def _save(rank, world_size, ckpt):
    Checkpointer().save(ckpt, state_for(world_size))
    return True


def _load(rank, world_size, ckpt, no_dist, strategy="default", verify=False):
    state = zeros_like_layout(state_for(world_size))
    Checkpointer().load(ckpt, state, no_dist=no_dist, strategy=strategy, verify=verify)
    assert_local_same(full_tensors(), state, f"rank {rank}")
    return True


def _unshard(rank, world_size, ckpt):
    got = Checkpointer().unshard(ckpt, device="cpu")
    assert_same(full_tensors(), got, "unsharded")
    return True


@pytest.fixture(scope="module")
def saved(run_distributed, tmp_path_factory):
    cache = {}

    def get(world_size):
        if world_size not in cache:
            ckpt = str(tmp_path_factory.mktemp(f"dtypes-ws{world_size}") / "ckpt")
            run_distributed(_save, world_size, ckpt)
            cache[world_size] = ckpt
        return cache[world_size]

    return get


@pytest.mark.parametrize("load_ws", [1, 2, 4])
@pytest.mark.parametrize("save_ws", [1, 3])
def test_dtypes_round_trip(run_distributed, saved, save_ws, load_ws):
    assert run_distributed(_load, load_ws, saved(save_ws), False) == [True] * load_ws


@pytest.mark.parametrize("verify", [False, True], ids=["", "verify"])
@pytest.mark.parametrize("load_ws", [2, 4])
@pytest.mark.parametrize("save_ws", [1, 3])
def test_dtypes_two_stage(run_distributed, saved, save_ws, load_ws, verify):
    """The two-stage strategy gives the same result (API.md: "Either way the result is identical")."""
    assert run_distributed(_load, load_ws, saved(save_ws), False, "two_stage", verify) == [True] * load_ws


@pytest.mark.parametrize("save_ws", [1, 3])
def test_dtypes_load_without_process_group_and_unshard(run_distributed, saved, save_ws):
    ckpt = saved(save_ws)
    assert run_distributed(_load, 1, ckpt, True, init_pg=False) == [True]
    assert run_distributed(_unshard, 2, ckpt) == [True, True]


def test_dtype_codes_in_metadata(saved):
    meta = read_metadata_json(saved(3))["tensors"]
    for dtype, code in CODES.items():
        name = str(dtype).removeprefix("torch.")
        assert meta[f"plain.{name}"]["dtype"] == code
        assert meta[f"sharded.{name}"]["dtype"] == code
        assert meta[f"sharded.{name}"]["shape"] == [7, 3]
    assert meta["scalar"]["shape"] == [] and meta["empty"]["shape"] == [0, 4]
