"""A model's state by parameter name: wrapper prefixes dropped, FSDP1's flat parameters as
their original parameters' local pieces, tied parameters kept under every name."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..sharding import fsdp1_flat_views

__all__ = ["model_state_dict", "clean_name", "param_names"]

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
