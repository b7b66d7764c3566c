"""A model's state by parameter name: wrapper prefixes dropped, FSDP1's flat parameters as
their original parameters' local pieces, tied parameters kept under every name.

A model whose ``state_dict`` hooks make new tensors (torchtitan's fused QKV projection saves its
``wqkv`` as ``wq``/``wk``/``wv``) is loaded into those copies, which
:func:`load_hook_copies` then hands to ``model.load_state_dict``, whose load hooks put them back."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..errors import CheckpointMismatchError
from ..sharding import fsdp1_flat_views

__all__ = ["model_state_dict", "clean_name", "param_names", "load_hook_copies"]

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


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


def param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): clean_name(n) for n, p in _unwrap(model).named_parameters()}


def _storage_of(tensor: Any) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return tensor.untyped_storage().data_ptr()


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
