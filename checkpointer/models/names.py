"""A model's state by parameter name: wrapper prefixes dropped, FSDP1's flat parameters as
their original parameters' local pieces, tied parameters kept under every name.

A model whose ``state_dict`` hooks make new tensors (torchtitan's fused QKV projection saves its
``wqkv`` as ``wq``/``wk``/``wv``) is loaded into those copies, which
:func:`load_hook_copies` then hands to ``model.load_state_dict``, whose load hooks put them back.
:func:`load_targets` makes the copies without their values: the hooks run on meta stand-ins of
the parameters (torchtitan's would otherwise gather every ``wqkv`` whose values the load replaces)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..errors import CheckpointMismatchError
from ..sharding import fsdp1_flat_views

__all__ = ["model_state_dict", "load_targets", "clean_name", "param_names", "load_hook_copies"]

_WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def clean_name(name: str) -> str:
    """``name`` without the modules that FSDP1, activation checkpointing and ``torch.compile``
    wrap around a module: whole parts of the name only (``x_orig_mod.w`` is kept as it is)."""
    if not any(wrapper in name for wrapper in _WRAPPERS):
        return name
    *modules, last = name.split(".")
    return ".".join([*(m for m in modules if m not in _WRAPPERS), last])


def _unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def _is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's parameters and persistent buffers by clean name, as views of their memory.

    FSDP2 and DTensor parameters come as DTensors; FSDP1 (``use_orig_params=True``) ones as
    :class:`~checkpointer.FlatShardedTensor`. Tied parameters appear under every name.
    """
    model = _unwrap(model)
    if _is_fsdp1(model):
        flat = fsdp1_flat_views(model)
        state: dict[str, Any] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            state[clean_name(name)] = flat.get(param, param.detach())
        for name, buf in model.named_buffers():
            state[clean_name(name)] = buf.detach()
        return state
    return {clean_name(k): v for k, v in model.state_dict().items()}


def load_targets(model: nn.Module, *, strict: bool) -> dict[str, Any]:
    """The state dict a load fills. A strict load fills every entry: the same views of the model's
    memory as :func:`model_state_dict`, and, for each tensor the model's ``state_dict`` hooks make,
    a new uninitialised tensor of its shape, dtype and placement. The hooks see meta stand-ins of
    the parameters and buffers, so they compute nothing and exchange nothing. A partial load keeps
    the values of what it does not load, and hooks that cannot run on stand-ins (or give a value
    that is not a tensor) need the real ones: there, this is :func:`model_state_dict`."""
    model = _unwrap(model)
    if not strict or _is_fsdp1(model) or not _has_state_dict_hooks(model):
        return model_state_dict(model)
    device = next((t.device for t in _tensors(model) if not t.is_meta), None)
    stand_ins: dict[int, Any] = {}  # one per tensor: tied parameters stay one object
    swapped: list[tuple[dict[str, Any], str, Any, Any]] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    stand_in = stand_ins.get(id(tensor))
                    if stand_in is None:
                        stand_in = stand_ins[id(tensor)] = _alike(tensor, "meta")
                    swapped.append((table, name, tensor, stand_in))
                    table[name] = stand_in
        state = model.state_dict(keep_vars=True)
    except Exception:  # noqa: BLE001 - a hook that needs values: the ordinary state dict
        state = None
    finally:
        for table, name, tensor, stand_in in swapped:
            if table.get(name) is stand_in:  # FSDP2's pre-hook may have put its sharded parameter there
                table[name] = tensor
    if state is None or device is None:
        return model_state_dict(model)
    real = {id(stand_in): tensor for _, _, tensor, stand_in in swapped}
    stand_in_locals = {id(_local(stand_in)) for stand_in in stand_ins.values()}
    made: dict[int, torch.Tensor] = {}  # one new tensor per hook-made one: a tensor under two keys stays one
    out: dict[str, Any] = {}
    for key, value in state.items():
        value = real.get(id(value), value)
        if not isinstance(value, torch.Tensor) or (value.is_meta and id(_local(value)._base) in stand_in_locals):
            return model_state_dict(model)  # a view of a parameter: loaded in place by the ordinary path
        if value.is_meta:
            if id(value) not in made:
                made[id(value)] = _alike(value, device)
            out[clean_name(key)] = made[id(value)]
        else:
            out[clean_name(key)] = value.detach()
    return out


def _has_state_dict_hooks(model: nn.Module) -> bool:
    return any(m._state_dict_hooks for m in model.modules())


def _tensors(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _alike(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """An uninitialised tensor on ``device`` with ``tensor``'s shape, strides, dtype and placement."""
    from torch.distributed.tensor import DTensor

    local = _local(tensor)
    new = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device=device)
    if isinstance(tensor, DTensor):
        return DTensor.from_local(new, tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())
    return new


def param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): clean_name(n) for n, p in _unwrap(model).named_parameters()}


def _storage_of(tensor: Any) -> int:
    return _local(tensor).untyped_storage().data_ptr()


def load_hook_copies(model: nn.Module, state: dict[str, Any]) -> None:
    """Copy the entries of ``state`` (from :func:`model_state_dict`, now loaded) that are not the
    model's own memory into the model through ``load_state_dict``; nothing when there are none."""
    model = _unwrap(model)
    if _is_fsdp1(model):
        return
    own = {_storage_of(t) for t in model.parameters()} | {_storage_of(t) for t in model.buffers()}
    copies = {k: v for k, v in state.items() if hasattr(v, "untyped_storage") and _storage_of(v) not in own}
    if not copies:
        return
    # The names are clean ones; a wrapper that adds a prefix back on load takes them as they are.
    result = model.load_state_dict(copies, strict=False)
    unexpected = set(result.unexpected_keys)
    if unexpected:
        raw = {clean_name(k): k for k in model.state_dict(keep_vars=True)}
        result = model.load_state_dict({raw.get(k, k): copies[k] for k in unexpected}, strict=False)
    if result.unexpected_keys:
        raise CheckpointMismatchError(
            f"loaded {sorted(result.unexpected_keys)} into copies the model's state_dict made, "
            "but its load_state_dict does not take them back"
        )
