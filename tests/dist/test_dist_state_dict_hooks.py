"""A model whose ``state_dict`` hooks make new tensors (torchtitan's fused QKV saves ``wqkv`` as
``wq``/``wk``/``wv``) loads through its ``load_state_dict`` hooks: its parameters really change."""

from __future__ import annotations

import torch
import torch.nn as nn
from dist_helpers import assert_same, mesh, optim_full_state

from checkpointer import load_model_and_optim_state, save_model_and_optim_state, unshard_model_state


SPLIT_SAW: list[str] = []  # the device of each tensor the split hook was given, in this process


class FusedQKV(nn.Module):
    """One ``wqkv`` parameter, saved and loaded as three (a simplified torchtitan ``FusedQKVLinear``)."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    def forward(self, x):
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        return self.out(q * k + v)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        fused = state_dict.pop(f"{prefix}wqkv.weight")
        SPLIT_SAW.append((fused.to_local() if isinstance(fused, DTensor) else fused).device.type)
        if isinstance(fused, DTensor):
            fused = fused.redistribute(fused.device_mesh, [Replicate()] * fused.device_mesh.ndim)
        for name, piece in zip("qkv", fused.chunk(3, dim=0)):
            state_dict[f"{prefix}w{name}.weight"] = piece.contiguous()

    @staticmethod
    def _merge(module, state_dict, prefix, *args) -> None:
        names = [f"{prefix}w{n}.weight" for n in "qkv"]
        if all(n in state_dict for n in names):
            state_dict[f"{prefix}wqkv.weight"] = torch.cat([state_dict.pop(n) for n in names], dim=0)


def _build(world_size: int, seed: int, cls: type[FusedQKV] | None = None) -> FusedQKV:
    torch.manual_seed(seed)
    model = (cls or FusedQKV)()
    if world_size > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh((world_size,)))
    return model


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _save(rank, world_size, ckpt):
    model = _build(world_size, 0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    save_model_and_optim_state(ckpt, model, optim)
    return _params(model), optim_full_state(model, optim)


def _load(rank, world_size, ckpt, expected_params, expected_optim):
    for strict in (True, False):
        model = _build(world_size, 1)
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        assert not torch.equal(_params(model)["wqkv.weight"], expected_params["wqkv.weight"])
        SPLIT_SAW.clear()
        load_model_and_optim_state(ckpt, model, optim, strict=strict)
        # A strict load fills every copy: the hook runs on meta stand-ins (no gather of wqkv's
        # values). Unsharded, its pieces are views of wqkv, loaded in place: it runs again on the
        # parameter. A partial load keeps the values of what it does not load.
        expected = {(True, True): ["meta"], (True, False): ["meta", "cpu"]}.get((strict, world_size > 1), ["cpu"])
        assert SPLIT_SAW == expected, (strict, world_size, SPLIT_SAW)
        assert_same(expected_params, _params(model), f"parameters on rank {rank}")
        assert_same(expected_optim, optim_full_state(model, optim), f"optimizer on rank {rank}")
    return True


def test_hook_made_copies_load_into_the_parameters(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    expected_params, expected_optim = run_distributed(_save, 2, ckpt)[0]
    names = set(unshard_model_state(ckpt, no_dist=True))
    assert names == {"wq.weight", "wk.weight", "wv.weight", "out.weight", "out.bias"}, names
    for load_ws in (1, 2):
        assert run_distributed(_load, load_ws, ckpt, expected_params, expected_optim) == [True] * load_ws


def _load_hf(rank, world_size, src, expected_params):
    model = _build(world_size, 1)
    assert not torch.equal(_params(model)["wqkv.weight"], expected_params["wqkv.weight"])
    SPLIT_SAW.clear()
    load_model_and_optim_state(src, model, key_map=lambda k: k.removeprefix("model."))
    assert SPLIT_SAW == (["meta"] if world_size > 1 else ["meta", "cpu"]), (world_size, SPLIT_SAW)
    assert_same(expected_params, _params(model), f"parameters on rank {rank}")
    return True


def test_hook_made_copies_load_from_a_hugging_face_checkpoint(run_distributed, tmp_path):
    """The same model filled from Hugging Face safetensors (names through ``key_map``)."""
    from safetensors.torch import save_file

    model = _build(1, 0)
    expected = _params(model)
    save_file({f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    for load_ws in (1, 2):
        assert run_distributed(_load_hf, load_ws, str(tmp_path / "m.safetensors"), expected) == [True] * load_ws


class FlatView(nn.Module):
    """A ``state_dict`` hook that hands out a view of a parameter under another name, with no
    load hook: it loads in place, as it did before stand-ins were used for hook-made copies."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(3, 2, bias=False)
        self.register_state_dict_post_hook(self._flatten)

    @staticmethod
    def _flatten(module, state_dict, prefix, local_metadata) -> None:
        state_dict[f"{prefix}flat"] = state_dict.pop(f"{prefix}w.weight").view(-1)


def _save_and_load_view(rank, world_size, ckpt):
    torch.manual_seed(0)
    saved = FlatView()
    save_model_and_optim_state(ckpt, saved, torch.optim.SGD(saved.parameters(), lr=0.1))
    torch.manual_seed(1)
    model = FlatView()
    assert not torch.equal(model.w.weight, saved.w.weight)
    load_model_and_optim_state(ckpt, model)
    assert torch.equal(model.w.weight, saved.w.weight)
    return True


def test_a_hook_made_view_of_a_parameter_loads_in_place(run_distributed, tmp_path):
    assert run_distributed(_save_and_load_view, 1, str(tmp_path / "ckpt")) == [True]


TIED_SAW: list[bool] = []  # whether the tied-weights hook saw head and embedding as one tensor


class TiedWithHook(FusedQKV):
    """The fused model plus an embedding tied to a head, and a hook that sees whether the two are
    one tensor: on the stand-ins too, tied parameters stay one object."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_state_dict_post_hook(self._see_tied)

    @staticmethod
    def _see_tied(module, state_dict, prefix, local_metadata) -> None:
        TIED_SAW.append(module.head.weight is module.emb.weight)


def _round_trip(world_size: int, ckpt: str, cls: type[FusedQKV]) -> tuple[FusedQKV, FusedQKV]:
    """A model of ``cls`` saved, and a fresh one (other values) loaded from it, the split hook's
    sightings of the load in ``SPLIT_SAW``."""
    saved = _build(world_size, 0, cls)
    save_model_and_optim_state(ckpt, saved, torch.optim.SGD(saved.parameters(), lr=0.1))
    model = _build(world_size, 1, cls)
    SPLIT_SAW.clear()
    load_model_and_optim_state(ckpt, model)
    return saved, model


def _save_and_load_tied(rank, world_size, ckpt):
    TIED_SAW.clear()
    saved, model = _round_trip(world_size, ckpt, TiedWithHook)
    assert TIED_SAW and all(TIED_SAW), TIED_SAW
    # Sharded, the split makes copies: only meta stand-ins; unsharded, views of wqkv (loaded in place).
    assert SPLIT_SAW == (["meta"] if world_size > 1 else ["meta", "cpu"]), SPLIT_SAW
    assert model.head.weight is model.emb.weight
    assert_same(_params(saved), _params(model), f"parameters on rank {rank}")
    return True


def test_tied_parameters_under_state_dict_hooks_stay_tied(run_distributed, tmp_path):
    for world_size in (1, 2):
        ckpt = str(tmp_path / f"ckpt{world_size}")
        assert run_distributed(_save_and_load_tied, world_size, ckpt) == [True] * world_size


class NeedsValues(FusedQKV):
    """A ``state_dict`` hook that reads a value (meta tensors have none): the load falls back to
    the ordinary state dict instead of failing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_state_dict_post_hook(self._norm)

    @staticmethod
    def _norm(module, state_dict, prefix, local_metadata) -> None:
        weight = state_dict[f"{prefix}out.weight"]
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        float(local.abs().sum())  # raises on a meta tensor


def _save_and_load_needs_values(rank, world_size, ckpt):
    saved, model = _round_trip(world_size, ckpt, NeedsValues)
    assert SPLIT_SAW[-1] == "cpu", SPLIT_SAW  # the ordinary state dict, after the stand-ins failed
    assert_same(_params(saved), _params(model), f"parameters on rank {rank}")
    return True


def test_a_hook_that_needs_values_falls_back_to_the_ordinary_state_dict(run_distributed, tmp_path):
    assert run_distributed(_save_and_load_needs_values, 2, str(tmp_path / "ckpt")) == [True, True]
