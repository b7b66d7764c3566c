"""Full tensors from a checkpoint, on one rank or all, never through a sharded model."""

from __future__ import annotations

from typing import Sequence

import torch

from .. import dist
from ..errors import CorruptCheckpointError
from ..format.dtypes import dtype_from_code
from ..format.metadata import StorageMetadata, TensorStorageMetadata
from ..planning.overlap import SourceIndex
from ..planning.plan import build_load_plan, spec_ranges, stored_cover_exactly, whole
from ..storage.base import Storage
from .load import fill_in_place, plan_local_loads, read_metadata
from .headers import HeaderCache, check_files_hold
from .reads import ReadJob, execute_reads

__all__ = ["unshard_state_dict", "read_full", "read_full_onto"]


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
    out: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    device = torch.device(device) if device is not None else torch.device("cpu")
    try:
        if device.type == "cpu":
            out = read_full(storage, metadata, list(metadata.tensors), num_threads=num_threads, verify=verify)
        else:
            out = read_full_onto(device, storage, metadata, num_threads=num_threads, verify=verify)
    except BaseException as ex:  # noqa: BLE001 - reported to every rank
        error = ex
    dist.agree(error, "unshard", no_dist=no_dist or rank0_only)
    for alias, target in (metadata.aliases or {}).items():
        out[alias] = out[target]
    return out


def read_full(
    storage: Storage,
    metadata: StorageMetadata,
    keys: Sequence[str],
    *,
    num_threads: int | None = None,
    verify: bool = False,
    headers: HeaderCache | None = None,
) -> dict[str, torch.Tensor]:
    """Full tensors of ``keys``, read by this process alone (no collectives).

    Every piece is checked against its file's header before anything is allocated, so a
    hostile ``metadata.json`` cannot make this allocate more than the files hold.
    """
    headers = headers or HeaderCache(storage, metadata.file_ids)
    out: dict[str, torch.Tensor] = {}
    jobs = []
    for key in keys:
        meta = metadata.tensors[key]
        specs = meta.shard_spec_per_file
        _check_whole(headers, key, meta)
        full = torch.empty(meta.shape, dtype=dtype_from_code(meta.dtype))
        out[key] = full
        if meta.numel:
            plan = build_load_plan(key, meta, whole(meta.shape))
            numels = {f: s.local_numel for f, s in specs.items()}
            jobs.append(ReadJob(plan, full.view(-1), numels, {f: s.checksums for f, s in specs.items()}))
    with torch.no_grad():
        execute_reads(
            storage,
            jobs,
            headers=headers,
            num_threads=num_threads,
            verify_chunk_bytes=metadata.checksum_chunk_bytes if verify else None,
        )
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
    headers = HeaderCache(storage, metadata.file_ids)
    for key, meta in metadata.tensors.items():
        _check_whole(headers, key, meta)
    out = {
        key: torch.empty(meta.shape, dtype=dtype_from_code(meta.dtype), device=device)
        for key, meta in metadata.tensors.items()
    }
    chunk = metadata.checksum_chunk_bytes if verify else None
    with torch.no_grad():
        loads = plan_local_loads(storage, metadata, out)
        fill_in_place(storage, loads, num_threads=num_threads, verify_chunk_bytes=chunk, headers=headers)
    return out


def _check_whole(headers: HeaderCache, key: str, meta: TensorStorageMetadata) -> None:
    """Before a full ``key`` is allocated: the files hold its pieces, and the pieces cover it.

    The headers come first: a piece's ranges (one per row of a box) are only expanded once its
    file is known to hold that many elements, so a hostile shape in ``metadata.json`` costs
    nothing before it is refused.
    """
    check_files_hold(headers, key, meta)
    if stored_cover_exactly(meta):
        return
    index = SourceIndex([spec_ranges(s, meta.shape) for s in meta.shard_spec_per_file.values()])
    if index.covered() != meta.numel:
        raise CorruptCheckpointError(f"tensor {key!r}: the files hold {index.covered()} of its {meta.numel} elements")
