"""DTensor tensor parallelism: 1-D Shard(1) and 2x2 meshes, saved in one layout, loaded in another."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from dist_helpers import (
    LAYOUTS,
    assert_local_same,
    assert_same,
    full,
    lay_out,
    local_piece,
    mesh,
    optim_full_state,
    reference_tensors,
    saved_once,
    to_layout,
    zeros_like_layout,
)
from torch.distributed.tensor import DTensor, Shard

from checkpointer import Checkpointer, load_model_and_optim_state, save_model_and_optim_state

SAVE_LAYOUTS = ["plain", "shard1@2", "rep_shard0@2x2", "shard0_shard1@2x2"]
LOAD_LAYOUTS = ["plain", "shard1@2", "shard1@4", "rep_shard0@2x2", "shard0_shard1@2x2"]


def _save_flat(rank, world_size, ckpt, layout):
    state = lay_out(reference_tensors(), layout)
    Checkpointer().save(ckpt, state)
    return True


def _load_flat(rank, world_size, ckpt, layout):
    expected = reference_tensors()
    state = zeros_like_layout(lay_out(expected, layout))
    Checkpointer().load(ckpt, state)
    assert_local_same(expected, state, f"rank {rank} in {layout}")
    return True


@pytest.fixture(scope="module")
def saved_flat(run_distributed, tmp_path_factory):
    return saved_once(run_distributed, tmp_path_factory, _save_flat, lambda layout: LAYOUTS[layout][0], "tp")


@pytest.mark.parametrize("load_layout", LOAD_LAYOUTS)
@pytest.mark.parametrize("save_layout", SAVE_LAYOUTS)
def test_flat_state_dict_between_layouts(run_distributed, saved_flat, save_layout, load_layout):
    ckpt = saved_flat(save_layout)
    ws = LAYOUTS[load_layout][0]
    assert run_distributed(_load_flat, ws, ckpt, load_layout) == [True] * ws


# A model whose parameters are DTensors (tensor parallel), with AdamW state.


class TPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(13, 7))
        self.e = nn.Parameter(torch.randn(5, 9))


def _tp_model(layout, seed):
    torch.manual_seed(seed)
    model = TPModel()
    for name, p in list(model.named_parameters()):
        setattr(model, name, nn.Parameter(to_layout(p.detach(), layout)))
    return model


def _tp_steps(model, optim, layout, steps):
    for step in steps:
        g = torch.Generator().manual_seed(50 + step)
        for name, p in model.named_parameters():
            p.grad = to_layout(torch.randn(p.shape, generator=g), layout)
        optim.step()
        optim.zero_grad()


def _save_tp_model(rank, world_size, ckpt, layout):
    model = _tp_model(layout, 0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _tp_steps(model, optim, layout, range(2))
    save_model_and_optim_state(ckpt, model, optim)
    return {k: full(v) for k, v in model.state_dict().items()}, optim_full_state(model, optim)


def _load_tp_model(rank, world_size, ckpt, layout, expected_model, expected_optim):
    model = _tp_model(layout, 1)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.1)
    load_model_and_optim_state(ckpt, model, optim)
    assert_local_same(expected_model, dict(model.state_dict()), f"model on rank {rank}")
    names = {id(p): n for n, p in model.named_parameters()}
    got_state = {f"state:{names[id(p)]}.{k}": v for p, st in optim.state.items() for k, v in st.items()}
    expected_state = {k: v for k, v in expected_optim.items() if k.startswith("state:")}
    assert_local_same(expected_state, got_state, f"optimizer state on rank {rank}")
    expected_groups = {k: v for k, v in expected_optim.items() if not k.startswith("state:")}
    got_groups = {k: v for k, v in optim_full_state_groups(model, optim).items()}
    assert_same(expected_groups, got_groups, "param groups")
    for p, st in optim.state.items():
        if isinstance(p, DTensor):
            assert st["exp_avg"].placements == p.placements, "optimizer state not sharded like its parameter"
    return True


def optim_full_state_groups(model, optim):
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for i, g in enumerate(optim.param_groups):
        for k, v in g.items():
            out[f"group{i}:{k}"] = [names[id(p)] for p in v] if k == "params" else v
    return out


@pytest.mark.parametrize(
    "save_layout,load_layouts",
    [
        ("shard0_shard1@2x2", ["rep_shard0@2x2", "shard1@2", "plain"]),
        ("shard1@2", ["shard0_shard1@2x2", "plain"]),
        ("plain", ["rep_shard0@2x2"]),
    ],
)
def test_tp_model_and_optimizer(run_distributed, tmp_path, save_layout, load_layouts):
    ckpt = str(tmp_path / "ckpt")
    expected_model, expected_optim = run_distributed(_save_tp_model, LAYOUTS[save_layout][0], ckpt, save_layout)[0]
    assert any(k.endswith(".exp_avg") for k in expected_optim)
    for layout in load_layouts:
        ws = LAYOUTS[layout][0]
        assert run_distributed(_load_tp_model, ws, ckpt, layout, expected_model, expected_optim) == [True] * ws


def _check_local_piece_matches_distribute_tensor(rank, world_size):
    from torch.distributed.tensor import distribute_tensor

    t = reference_tensors()["w"]
    for layout in ("shard1@4", "rep_shard0@2x2", "shard0_shard1@2x2"):
        _, shape, placements = LAYOUTS[layout]
        d = distribute_tensor(t.clone(), mesh(shape), list(placements))
        assert torch.equal(d.to_local(), local_piece(t, mesh(shape), placements)), layout
    return True


def test_layout_helper_agrees_with_distribute_tensor(run_distributed):
    assert run_distributed(_check_local_piece_matches_distribute_tensor, 4) == [True] * 4


def _same_dim_twice(rank, world_size, ckpt):
    """(Shard(0), Shard(0)) on a 2x2 mesh: dim 0 split twice, unevenly (7 rows)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    t = torch.arange(35.0).reshape(7, 5)
    m = mesh((2, 2))
    Checkpointer().save(ckpt, {"t": distribute_tensor(t.clone(), m, [Shard(0), Shard(0)])})
    for placements in ([Shard(1), Shard(0)], [Shard(0), Shard(0)]):
        target = distribute_tensor(torch.zeros(7, 5), m, placements)
        Checkpointer().load(ckpt, {"t": target})
        assert torch.equal(target.full_tensor(), t), placements
    return True


def test_dim_sharded_twice(run_distributed, tmp_path):
    assert run_distributed(_same_dim_twice, 4, str(tmp_path / "ckpt")) == [True] * 4


# A 0-dim parameter replicated as a DTensor (``distribute_module``'s default for a learned scale).


class ScaledModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.w = nn.Parameter(torch.randn(5, 3))


def _scaled_model(world_size, seed):
    from torch.distributed.tensor import Replicate

    torch.manual_seed(seed)
    model = ScaledModel()
    m = mesh((world_size,))
    model.scale = nn.Parameter(DTensor.from_local(model.scale.detach().clone(), m, [Replicate()], run_check=False))
    model.w = nn.Parameter(to_layout(model.w.detach(), f"shard0@{world_size}"))
    return model


def _scaled_step(model, optim, world_size, step):
    from torch.distributed.tensor import Replicate

    g = torch.Generator().manual_seed(70 + step)
    model.scale.grad = DTensor.from_local(torch.randn((), generator=g), mesh((world_size,)), [Replicate()], run_check=False)
    model.w.grad = to_layout(torch.randn(5, 3, generator=g), f"shard0@{world_size}")
    optim.step()
    optim.zero_grad()
    return {k: full(v) for k, v in model.state_dict().items()}


def _save_scaled(rank, world_size, ckpt):
    model = _scaled_model(world_size, 0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        _scaled_step(model, optim, world_size, step)
    save_model_and_optim_state(ckpt, model, optim)
    expected_optim = optim_full_state(model, optim)
    return expected_optim, _scaled_step(model, optim, world_size, 2)


def _load_scaled(rank, world_size, ckpt, expected_optim, after_next_step):
    model = _scaled_model(world_size, 1)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.1)
    load_model_and_optim_state(ckpt, model, optim)
    assert_same(expected_optim, optim_full_state(model, optim), f"optimizer on rank {rank}")
    for p, state in optim.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor) and state[key].placements == p.placements, (key, type(state[key]))
    assert_same(after_next_step, _scaled_step(model, optim, world_size, 2), f"model after a step on rank {rank}")
    return True


def test_zero_dim_dtensor_parameter_with_fresh_optimizer(run_distributed, tmp_path):
    """Its AdamW state is 0-dim DTensors; a load into an optimizer without state must make them
    DTensors again (plain tensors make the next step fail: DTensor and Tensor mixed)."""
    ckpt = str(tmp_path / "ckpt")
    expected_optim, after_next_step = run_distributed(_save_scaled, 2, ckpt)[0]
    assert run_distributed(_load_scaled, 3, ckpt, expected_optim, after_next_step) == [True] * 3


# FSDP2 composed with tensor parallelism, and FSDP2 sharding on dim 1.


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 10)
        self.down = nn.Linear(10, 5)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _build_mlp(layout, seed):
    """``tp+fsdp``: 2x2 (dp, tp) mesh, Colwise/Rowwise TP then FSDP2 over dp (4 ranks);
    ``fsdp-shard1``: FSDP2 with Shard(1) placements (2 ranks); ``fsdp``: FSDP2 (3 ranks); ``plain``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(seed)
    model = MLP()
    if layout == "tp+fsdp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        m = mesh((2, 2), ("dp", "tp"))
        parallelize_module(model, m["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=m["dp"])
    elif layout == "fsdp-shard1":
        fully_shard(model, mesh=mesh((2,)), shard_placement_fn=lambda p: Shard(1) if p.ndim > 1 else None)
    elif layout == "fsdp":
        fully_shard(model, mesh=mesh((3,)))
    return model


MLP_WS = {"tp+fsdp": 4, "fsdp-shard1": 2, "fsdp": 3, "plain": 1}


def _save_mlp(rank, world_size, ckpt, layout):
    from dist_helpers import model_full_state

    model = _build_mlp(layout, 0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    save_model_and_optim_state(ckpt, model, optim)
    return model_full_state(model), optim_full_state(model, optim)


def _load_mlp(rank, world_size, ckpt, layout, expected_model, expected_optim):
    from dist_helpers import model_full_state

    model = _build_mlp(layout, 1)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.1)
    load_model_and_optim_state(ckpt, model, optim)
    assert_same(expected_model, model_full_state(model), f"model on rank {rank}")
    assert_same(expected_optim, optim_full_state(model, optim), f"optimizer on rank {rank}")
    return True


@pytest.mark.parametrize(
    "save_layout,load_layouts",
    [("tp+fsdp", ["tp+fsdp", "fsdp", "plain"]), ("fsdp", ["tp+fsdp"]), ("fsdp-shard1", ["fsdp", "plain", "fsdp-shard1"])],
)
def test_fsdp_composed_layouts(run_distributed, tmp_path, save_layout, load_layouts):
    """API.md: FSDP2 on "any mesh incl. 2-D HSDP / TP+FSDP" (TP+FSDP uses _StridedShard placements)."""
    ckpt = str(tmp_path / "ckpt")
    expected_model, expected_optim = run_distributed(_save_mlp, MLP_WS[save_layout], ckpt, save_layout)[0]
    for layout in load_layouts:
        ws = MLP_WS[layout]
        assert run_distributed(_load_mlp, ws, ckpt, layout, expected_model, expected_optim) == [True] * ws


# _StridedShard: FSDP2 over tensor parallelism on a 2-D (dp, tp) mesh. A rank's local rows are
# interleaved strided rows of the full tensor for some layouts, not a box of it.


def _strided_layouts():
    from torch.distributed.tensor.placement_types import _StridedShard

    # key -> (full shape, placements on the 2x2 mesh)
    return {
        "sf2_s0": ((11, 3), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP2 over 2-way TP: a box
        "sf4_s0": ((16, 3), (_StridedShard(0, split_factor=4), Shard(0))),  # FSDP over a 4-way TP split
        "sf3_s0": ((13, 2), (_StridedShard(0, split_factor=3), Shard(0))),  # uneven
        "s0_sf2": ((9, 4), (Shard(0), _StridedShard(0, split_factor=2))),
        "sf2_s1": ((10, 4), (_StridedShard(0, split_factor=2), Shard(1))),
    }


def _strided_full(key, shape):
    base = 1000.0 * sorted(_strided_layouts()).index(key)
    return (base + torch.arange(math.prod(shape), dtype=torch.float32)).reshape(shape)


def _strided_local(full_tensor, placements):
    """This rank's local tensor as torch defines it (``distribute_tensor`` splitting locally)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full_tensor.clone(), mesh((2, 2)), list(placements), src_data_rank=None).to_local()


def _rows_of(local, ncols, base):
    """The global rows of a local piece of an arange-filled tensor (whole rows only)."""
    return ((local[:, 0] - base) // ncols).long().tolist() if local.numel() else []


def _save_strided(rank, world_size, ckpt):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    state, not_a_box = {}, {}
    for key, (shape, placements) in _strided_layouts().items():
        full_tensor = _strided_full(key, shape)
        d = DTensor.from_local(
            _strided_local(full_tensor, placements), mesh((2, 2)), list(placements), run_check=False, shape=shape, stride=full_tensor.stride()
        )
        state[key] = d
        if all(p.dim == 0 for p in placements):  # whole rows: are they consecutive?
            rows = _rows_of(d.to_local(), shape[1], full_tensor[0, 0])
            not_a_box[key] = rows != list(range(rows[0], rows[0] + len(rows))) if rows else False
    # A real FSDP2 (dp) over ColwiseParallel (tp) parameter: (_StridedShard(0, sf=2), Shard(0)).
    torch.manual_seed(0)
    lin = nn.Linear(5, 11)
    full_weight = torch.arange(55.0).reshape(11, 5)
    lin.weight.data.copy_(full_weight)
    m = mesh((2, 2), ("dp", "tp"))
    parallelize_module(lin, m["tp"], ColwiseParallel())
    fully_shard(lin, mesh=m["dp"])
    assert type(lin.weight.placements[0]).__name__ == "_StridedShard", lin.weight.placements
    assert torch.equal(lin.weight.to_local(), _strided_local(full_weight, lin.weight.placements))
    state["fsdp_tp.weight"] = lin.weight
    Checkpointer().save(ckpt, state)
    return not_a_box


def _expected_strided():
    out = {key: _strided_full(key, shape) for key, (shape, _) in _strided_layouts().items()}
    out["fsdp_tp.weight"] = torch.arange(55.0).reshape(11, 5)
    return out


def _load_strided_plain(rank, world_size, ckpt):
    expected = _expected_strided()
    state = {k: torch.full_like(v, -1.0) for k, v in expected.items()}
    Checkpointer().load(ckpt, state)
    bad = [k for k in expected if not torch.equal(state[k], expected[k])]
    assert not bad, f"rank {rank}: wrong values for {bad}"
    return True


def _load_strided_sharded(rank, world_size, ckpt, rotate):
    """Into the strided layouts (each key in another key's placements when ``rotate``) and into
    plain (Shard(0), Shard(1)) and 1-D Shard(1) DTensors."""
    from torch.distributed.tensor import distribute_tensor

    expected = _expected_strided()
    layouts = _strided_layouts()
    names = sorted(layouts)
    placements_of = {k: layouts[names[(i + rotate) % len(names)]][1] for i, k in enumerate(names)}
    placements_of["fsdp_tp.weight"] = layouts["sf4_s0"][1] if rotate else layouts["sf2_s0"][1]
    targets: dict[str, dict] = {"strided": {}, "2d": {}, "1d": {}}
    wants: dict[str, dict] = {"strided": {}, "2d": {}, "1d": {}}
    for k, full_tensor in expected.items():
        local = _strided_local(full_tensor, placements_of[k])
        wants["strided"][k] = local
        targets["strided"][k] = DTensor.from_local(
            torch.full_like(local, -1.0), mesh((2, 2)), list(placements_of[k]), run_check=False, shape=full_tensor.shape, stride=full_tensor.stride()
        )
        wants["2d"][k] = local_piece(full_tensor, mesh((2, 2)), (Shard(0), Shard(1)))
        targets["2d"][k] = distribute_tensor(torch.full_like(full_tensor, -1.0), mesh((2, 2)), [Shard(0), Shard(1)])
        wants["1d"][k] = local_piece(full_tensor, mesh((4,)), (Shard(1),))
        targets["1d"][k] = distribute_tensor(torch.full_like(full_tensor, -1.0), mesh((4,)), [Shard(1)])
    for state in targets.values():
        Checkpointer().load(ckpt, state)
    bad = [(kind, k) for kind in wants for k in wants[kind] if not torch.equal(targets[kind][k].to_local(), wants[kind][k])]
    assert not bad, f"rank {rank} (rotate={rotate}): wrong values for {bad}"
    if not rotate:
        _strided_pieces_are_worked_out_once_per_layout(layouts["sf3_s0"][1])
    return True


def _strided_pieces_are_worked_out_once_per_layout(placements):
    """Torch's local-shape check of a _StridedShard piece costs a millisecond; a model's layers
    of one shape and placements (8 here) pay it once (64 such tensors took 72 ms of a 240 ms load)."""
    import torch.distributed.tensor._utils as dtensor_utils

    from checkpointer.sharding import describe

    shape = (17, 2)  # a shape no other test describes
    local = _strided_local(torch.zeros(shape), placements)
    calls, real = [], dtensor_utils.compute_local_shape_and_global_offset
    dtensor_utils.compute_local_shape_and_global_offset = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        layers = [DTensor.from_local(local.clone(), mesh((2, 2)), list(placements), run_check=False, shape=shape, stride=(2, 1)) for _ in range(8)]
        pieces = {describe(layer).piece for layer in layers}
    finally:
        dtensor_utils.compute_local_shape_and_global_offset = real
    assert len(pieces) == 1 and len(calls) == 1, (pieces, calls)
    # Placements it cannot read are refused by name (the cache must not hash them first).
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import Placement

    class Unhashable(Placement):
        __hash__ = None  # type: ignore[assignment]

    for odd, message in ((Partial(), "holds partial sums"), (Unhashable(), "is not supported in checkpoints")):
        value = DTensor.from_local(local.clone(), mesh((2, 2)), [odd, placements[1]], run_check=False, shape=shape, stride=(2, 1))
        with pytest.raises(TypeError, match=message):
            describe(value)


def _load_strided_shard0(rank, world_size, ckpt):
    from torch.distributed.tensor import distribute_tensor

    expected = _expected_strided()
    state = {k: distribute_tensor(torch.full_like(v, -1.0), mesh((world_size,)), [Shard(0)]) for k, v in expected.items()}
    Checkpointer().load(ckpt, state)
    bad = [k for k in expected if not torch.equal(state[k].to_local(), local_piece(expected[k], mesh((world_size,)), (Shard(0),)))]
    assert not bad, f"rank {rank}: wrong values for {bad}"
    return True


def test_strided_shard_layouts_that_are_not_boxes(run_distributed, tmp_path):
    """_StridedShard placements (FSDP2 over TP) save the rows each rank really holds, also
    where they are interleaved, and load into any other layout (and back into strided ones)."""
    ckpt = str(tmp_path / "ckpt")
    not_a_box = run_distributed(_save_strided, 4, ckpt)
    # The layouts do exercise interleaved rows (whole rows only; sf2_s1 is interleaved too).
    assert not any(r["sf2_s0"] for r in not_a_box)
    for key in ("sf4_s0", "sf3_s0", "s0_sf2"):
        assert any(r[key] for r in not_a_box), key
    assert run_distributed(_load_strided_plain, 1, ckpt) == [True]
    for rotate in (0, 1, 2):
        assert run_distributed(_load_strided_sharded, 4, ckpt, rotate) == [True] * 4
    assert run_distributed(_load_strided_shard0, 3, ckpt) == [True] * 3
