"""Loading a flat state dict in place: each rank reads only the bytes of its own pieces.

1. Rank 0 reads ``metadata.json`` and shares it (one broadcast).
2. Each rank checks its keys, shapes and dtypes against it and plans, per tensor, which
   byte ranges of which file land where in its local memory. A plan that does not cover
   every local element is an error, so a completed load has filled every element.
3. Reads go straight into the destination tensors (``preadv`` locally, ranged requests
   remotely); only CUDA or non-contiguous destinations pass through a host buffer.
4. All ranks agree: an error on one rank makes every rank raise.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import dist
from ..errors import CheckpointMismatchError, IncompleteCheckpointError
from ..format.layout import METADATA_FILENAME
from ..format.metadata import StorageMetadata, TensorStorageMetadata, parse_metadata
from ..planning.plan import TensorLoadPlan, build_load_plan, piece_ranges
from ..sharding import LocalTensor
from ..storage.base import Storage
from .rankfile import HeaderCache, execute_reads
from .save import describe_state_dict

__all__ = ["read_metadata", "load_state_dict", "plan_local_loads", "MAX_METADATA_BYTES"]

MAX_METADATA_BYTES = 1 << 30
_STAGE_BYTES = 256 << 20


def _read_metadata_bytes(storage: Storage) -> bytes:
    try:
        size = storage.size(METADATA_FILENAME)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{storage.join(METADATA_FILENAME)} is missing: {storage.url} is not a complete checkpoint"
        ) from None
    if size > MAX_METADATA_BYTES:
        raise IncompleteCheckpointError(f"{storage.join(METADATA_FILENAME)} is {size} bytes, over the 1 GiB limit")
    return storage.read(METADATA_FILENAME)


def read_metadata(storage: Storage, *, no_dist: bool = False) -> StorageMetadata:
    data = dist.share_from(0, lambda: _read_metadata_bytes(storage), "reading metadata", no_dist=no_dist)
    return parse_metadata(data, where=storage.join(METADATA_FILENAME))


def _meta_for(metadata: StorageMetadata, key: str, storage: Storage) -> TensorStorageMetadata:
    meta = metadata.tensors.get(key)
    if meta is None and metadata.aliases and key in metadata.aliases:
        meta = metadata.tensors[metadata.aliases[key]]
    if meta is None:
        raise CheckpointMismatchError(f"key {key!r} is not in the checkpoint at {storage.url}")
    return meta


def plan_local_loads(
    storage: Storage, metadata: StorageMetadata, state_dict: Mapping[str, Any]
) -> list[tuple[str, LocalTensor, TensorLoadPlan, dict[str, int]]]:
    """Check every key against the metadata and plan its reads (keys sharing memory load once)."""
    described, _ = describe_state_dict(state_dict)
    out = []
    for key, lt in described.items():
        meta = _meta_for(metadata, key, storage)
        if tuple(meta.shape) != lt.shape:
            raise CheckpointMismatchError(
                f"shape mismatch for {key!r}: checkpoint has {list(meta.shape)}, state dict has {list(lt.shape)}"
            )
        if meta.dtype != lt.dtype:
            raise CheckpointMismatchError(
                f"dtype mismatch for {key!r}: checkpoint has {meta.dtype}, state dict has {lt.dtype}"
            )
        saved_key = key if key in metadata.tensors else metadata.aliases[key]  # type: ignore[index]
        plan = build_load_plan(saved_key, meta, piece_ranges(lt.piece, lt.shape))
        numel_per_file = {f: spec.local_numel for f, spec in meta.shard_spec_per_file.items()}
        out.append((key, lt, plan, numel_per_file))
    return out


def load_state_dict(
    storage: Storage,
    state_dict: Mapping[str, Any],
    *,
    no_dist: bool = False,
    metadata: StorageMetadata | None = None,
    num_threads: int | None = None,
) -> None:
    if metadata is None:
        metadata = read_metadata(storage, no_dist=no_dist)
    error: BaseException | None = None
    try:
        with torch.no_grad():
            fill_in_place(storage, plan_local_loads(storage, metadata, state_dict), num_threads=num_threads)
    except BaseException as ex:  # noqa: BLE001 - reported to every rank
        error = ex
    dist.agree(error, "load", no_dist=no_dist)


def fill_in_place(storage: Storage, planned, *, num_threads: int | None = None) -> None:
    headers = HeaderCache(storage)
    direct, staged = [], []
    for key, lt, plan, numel_per_file in planned:
        if lt.numel == 0:
            continue
        data = lt.data
        if data.device.type == "cpu" and data.is_contiguous():
            direct.append((plan, data.view(-1), numel_per_file))
        else:
            staged.append((lt, plan, numel_per_file))
    execute_reads(storage, direct, headers=headers, num_threads=num_threads)
    # Host staging in batches of bounded size, for device or strided destinations.
    batch, batch_bytes = [], 0
    for item in staged + [None]:
        if item is not None:
            lt, plan, numel_per_file = item
            host = torch.empty(lt.numel, dtype=lt.data.dtype, pin_memory=lt.data.is_cuda)
            batch.append((lt, plan, numel_per_file, host))
            batch_bytes += host.numel() * host.element_size()
        if batch and (item is None or batch_bytes >= _STAGE_BYTES):
            execute_reads(storage, [(p, h, n) for _, p, n, h in batch], headers=headers, num_threads=num_threads)
            for lt, _, _, host in batch:
                lt.data.copy_(host.view(lt.data.shape))
            batch, batch_bytes = [], 0
