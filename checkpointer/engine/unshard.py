"""Full tensors from a checkpoint, on one rank or all, never through a sharded model."""

from __future__ import annotations

import torch

from .. import dist
from ..format.dtypes import dtype_from_code
from ..format.metadata import StorageMetadata
from ..storage.base import Storage
from .load import fill_in_place, plan_local_loads, read_metadata
from .reader import CheckpointReader

__all__ = ["unshard_state_dict", "read_full_onto"]


def unshard_state_dict(
    storage: Storage,
    *,
    device: torch.device | str | None = None,
    rank0_only: bool = False,
    no_dist: bool = False,
    num_threads: int | None = None,
    verify: bool = False,
) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    if rank0_only and no_dist and rank != 0:
        raise ValueError(f"unshard with rank0_only=True and no_dist=True is undefined on rank {rank}")
    if rank0_only and rank != 0:
        return {}
    metadata = read_metadata(storage, no_dist=no_dist or rank0_only)
    device = torch.device(device) if device is not None else torch.device("cpu")
    with dist.phase("unshard", no_dist=no_dist or rank0_only):
        if device.type == "cpu":
            reader = CheckpointReader(storage, metadata, num_threads=num_threads)
            out = reader.full_tensors(list(metadata.tensors), verify=verify)
        else:
            out = read_full_onto(device, storage, metadata, num_threads=num_threads, verify=verify)
    for alias, target in (metadata.aliases or {}).items():
        out[alias] = out[target]
    return out


def read_full_onto(
    device: torch.device,
    storage: Storage,
    metadata: StorageMetadata,
    *,
    num_threads: int | None = None,
    verify: bool = False,
) -> dict[str, torch.Tensor]:
    """Every full tensor, allocated on ``device`` and filled as a load fills its tensors: through
    host buffers of bounded size, never the whole checkpoint in host memory at once."""
    reader = CheckpointReader(storage, metadata, num_threads=num_threads)
    for key, meta in metadata.tensors.items():
        reader.check_whole(key, meta)
    out = {
        key: torch.empty(meta.shape, dtype=dtype_from_code(meta.dtype), device=device)
        for key, meta in metadata.tensors.items()
    }
    chunk = metadata.checksum_chunk_bytes if verify else None
    with torch.no_grad():
        loads = plan_local_loads(storage, metadata, out)
        fill_in_place(storage, loads, num_threads=num_threads, verify_chunk_bytes=chunk, headers=reader.headers)
    return out
