"""Models and the functions the command-line tests run on every rank of a gloo process pool.

The pool (``tests/support/harness.py``) calls ``fn(rank, world_size, *args)``; everything here is
module level so that the workers can import it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn


class CliModel(nn.Module):
    """Uneven shapes for 3 ranks (11, 13 and 6 rows), a tied output head and a buffer."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 13)
        self.down = nn.Linear(13, 6)
        self.head = nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.down(torch.relu(self.up(h))) * self.scale
        return self.head(h)


def build(seed: int, *, tied: bool = True, world_size: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, sharded with FSDP2 over every rank when ``world_size > 1``, after one AdamW step."""
    torch.manual_seed(seed)
    model = CliModel(tied=tied)
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    ids = torch.arange(8) % 11
    model(ids).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole, by name (tied names included)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in model.state_dict().items():
        out[key] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    return out


def flat_sharded_state(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A state dict of flat-sharded tensors, several ranges per rank, and its full values."""
    from checkpointer import FlatShardedTensor

    torch.manual_seed(7)
    full = {"w": torch.randn(5, 8), "b": torch.arange(20, dtype=torch.int32)}
    state: dict[str, Any] = {}
    for key, t in full.items():
        n = t.numel()
        # Round-robin blocks of 3 elements: rank r holds blocks r, r + ws, ...
        ranges = [(s, min(s + 3, n)) for s in range(3 * rank, n, 3 * world_size)]
        flat = t.reshape(-1)
        local = torch.cat([flat[s:e] for s, e in ranges]) if ranges else flat[:0].clone()
        state[key] = FlatShardedTensor(local.clone(), tuple(t.shape), tuple(ranges))
    return state, full


def save_ws3(rank: int, world_size: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """The world-size-3 checkpoints of the tests; returns their full values."""
    import torch.distributed.checkpoint as dcp

    from checkpointer import Checkpointer, save_model_and_optim_state

    model, optim = build(0, world_size=world_size)
    save_model_and_optim_state(os.path.join(root, "fsdp"), model, optim)
    state, flat_full = flat_sharded_state(rank, world_size)
    Checkpointer().save(os.path.join(root, "flat"), state)
    untied, untied_optim = build(1, tied=False, world_size=world_size)
    save_model_and_optim_state(os.path.join(root, "untied"), untied, untied_optim)
    dcp.save(dict(model.state_dict()), checkpoint_id=os.path.join(root, "dcp"))
    return {"fsdp": full_state(model), "flat": flat_full, "untied": full_state(untied)}


def export_ws(rank: int, world_size: int, dir: str, out: str, max_shard_size: str) -> list[str]:
    from checkpointer import export_safetensors

    return export_safetensors(dir, out, max_shard_size=max_shard_size)


def olmo_or_skip() -> Any:
    """``olmo_core.distributed.checkpoint`` of ai2-olmo-core 0.1.0 (the release whose layout this
    library keeps), patched for this torch; the calling test module is skipped without it."""
    import pytest

    try:
        from olmo_core.distributed import checkpoint as olmo
        from olmo_core.version import VERSION
    except Exception as ex:  # noqa: BLE001 - any import failure is the reason to skip
        pytest.skip(f"ai2-olmo-core 0.1.0 cannot be imported: {type(ex).__name__}: {ex}", allow_module_level=True)
    if VERSION != "0.1.0":
        pytest.skip(f"these tests pin ai2-olmo-core 0.1.0, not {VERSION}", allow_module_level=True)
    patch_olmo_for_torch()
    return olmo


def patch_olmo_for_torch() -> None:
    """ai2-olmo-core 0.1.0 calls ``Shard._local_shard_size_on_dim(size, n, rank, return_offset=True)``,
    which torch renamed to ``Shard.local_shard_size_and_offset(size, n, rank)`` (it always returns
    the offset too). Alias the old name when it is missing."""
    from torch.distributed.tensor.placement_types import Shard

    if hasattr(Shard, "_local_shard_size_on_dim"):
        return

    def _local_shard_size_on_dim(size: int, num_chunks: int, rank: int, return_offset: bool = False) -> tuple[int, int]:
        shard_size, offset = Shard.local_shard_size_and_offset(size, num_chunks, rank)
        return int(shard_size), int(offset) if return_offset else -1

    Shard._local_shard_size_on_dim = staticmethod(_local_shard_size_on_dim)  # type: ignore[attr-defined]


def olmo_save_ws3(rank: int, world_size: int, dir: str) -> dict[str, torch.Tensor]:
    """OLMo-core 0.1.0 saves an FSDP2 model; returns its full values."""
    patch_olmo_for_torch()
    from olmo_core.distributed.checkpoint import save_model_and_optim_state as olmo_save

    model, optim = build(2, tied=False, world_size=world_size)
    olmo_save(dir, model, optim)
    return full_state(model)


def olmo_load_ws3(rank: int, world_size: int, dir: str) -> dict[str, torch.Tensor]:
    """OLMo-core 0.1.0 loads one of our checkpoints into an FSDP2 model; returns its full values."""
    patch_olmo_for_torch()
    from olmo_core.distributed.checkpoint import load_model_and_optim_state as olmo_load

    model, optim = build(99, tied=False, world_size=world_size)
    olmo_load(dir, model, optim)
    return full_state(model)


def slow_convert(rank: int, world_size: int, src: str, dst: str, to: str, seconds: float, timeout_s: str) -> dict | None:
    """``convert`` on every rank, with rank 0's conversion taking ``seconds`` longer than the
    collectives' timeout ``CHECKPOINTER_TIMEOUT_S``: what it raised on this rank, or None."""
    import importlib
    import time

    module = importlib.import_module("checkpointer.tools.convert")  # the package's `convert` is the function

    real = module._convert_alone

    def slow(*args: Any) -> list[str]:
        time.sleep(seconds)
        return real(*args)

    before = os.environ.get("CHECKPOINTER_TIMEOUT_S")
    os.environ["CHECKPOINTER_TIMEOUT_S"] = timeout_s
    module._convert_alone = slow
    try:
        module.convert(src, dst, to=to)
    except Exception as ex:  # noqa: BLE001 - reported to the test
        return {"type": type(ex).__name__, "msg": str(ex)}
    finally:
        module._convert_alone = real
        if before is None:
            del os.environ["CHECKPOINTER_TIMEOUT_S"]
        else:
            os.environ["CHECKPOINTER_TIMEOUT_S"] = before
    return None


def export_one_file_slowly(rank: int, world_size: int, dir: str, out: str, timeout_s: str, delay_s: float) -> list[str]:
    """A one-file export (rank 0 writes it all) that takes longer than CHECKPOINTER_TIMEOUT_S."""
    import time
    from unittest import mock

    from checkpointer import export_safetensors
    from checkpointer.tools import export

    real = export._write_tensor

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(delay_s)
        real(*args, **kwargs)

    with mock.patch.dict(os.environ, {"CHECKPOINTER_TIMEOUT_S": timeout_s}), mock.patch.object(export, "_write_tensor", slow):
        return export_safetensors(dir, out)
