"""What a checkpoint holds, as plain data: every tensor's shape, dtype, pieces, bytes and files."""

from __future__ import annotations

import os
from typing import Any

from ..format.dtypes import itemsize
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..format.metadata import StorageMetadata, TensorShardSpec, TensorStorageMetadata
from ..storage import open_storage
from ..storage.base import Storage
from ..engine.load import read_metadata
from ..engine.locate import checkpoint_parts
from .detect import detect
from .hf import HFSource
from .hub import is_hf_url
from .sources import Where

__all__ = ["describe_metadata", "describe_parts"]


def describe_metadata(url: str, metadata: StorageMetadata) -> dict[str, Any]:
    """A JSON-ready description of one checkpoint directory's metadata.

    Tensors keep the metadata's order; ``pieces`` is the number of files holding part of a
    tensor, ``bytes`` its full size. Tied names (aliases) are listed apart and hold no bytes.
    A tensor is ``checksummed`` when the metadata lists its pieces' checksums or (format 2) says
    that the rank files hold them; ``verify`` reads them.
    """
    in_files = bool(metadata.checksums_in_files and metadata.checksum_chunk_bytes)
    tensors = []
    total = 0
    for key, meta in metadata.tensors.items():
        nbytes = meta.numel * itemsize(meta.dtype)
        total += nbytes
        tensors.append(
            {
                "key": key,
                "shape": list(meta.shape),
                "dtype": meta.dtype,
                "is_sharded": meta.is_sharded,
                "pieces": len(meta.shard_spec_per_file),
                "files": list(meta.shard_spec_per_file),
                "numel": meta.numel,
                "bytes": nbytes,
                "checksummed": in_files or all(s.checksums is not None for s in meta.shard_spec_per_file.values()),
            }
        )
    return {
        "path": url,
        "format_version": metadata.format_version,
        "world_size": metadata.world_size,
        "checksum_algorithm": metadata.checksum_algorithm,
        "num_tensors": len(tensors),
        "num_aliases": len(metadata.aliases or {}),
        "total_bytes": total,
        "files": metadata.files(),
        "tensors": tensors,
        "aliases": dict(metadata.aliases or {}),
    }


def describe_parts(dir: str | Storage) -> list[tuple[str, dict[str, Any]]]:
    """``[(part, description)]``: one entry ``("", ...)`` for a checkpoint directory, or
    ``("model", ...)``, ``("optim", ...)`` and ``("train", ...)`` for the top-level directory of
    a model save; one entry ``("", ...)`` for Hugging Face safetensors (``hf://`` too: fetched
    into the cache)."""
    if is_hf_url(dir):
        return [("", _describe_hf(dir))]
    storage = open_storage(dir)
    try:
        parts = checkpoint_parts(storage, train=True)
    except IncompleteCheckpointError:
        if _hf_directory(storage):
            return [("", _describe_hf(dir))]
        raise
    out = []
    for name, storage in parts:
        out.append((name, describe_metadata(storage.url, read_metadata(storage, no_dist=True))))
    return out


def _hf_directory(storage: Storage) -> bool:
    """Whether ``storage`` is a directory of Hugging Face safetensors (a file given as a
    directory is not: ``inspect`` takes directories)."""
    if storage.is_local() and not os.path.isdir(storage.url):
        return False
    try:
        return HFSource.supports(Where(storage))
    except (OSError, ValueError):
        return False


def _describe_hf(dir: str | Storage) -> dict[str, Any]:
    """A Hugging Face checkpoint described as a checkpoint of whole tensors, one file each."""
    cls, where = detect(dir)
    if cls is not HFSource:
        raise CorruptCheckpointError(f"{where.shown}: not a checkpoint of this library nor Hugging Face safetensors")
    source = HFSource(where)
    tensors = {}
    for key, shape, code in source.entries():
        stored = source.locate(key)
        spec = TensorShardSpec.model_construct(local_shape=shape, global_offset=(0,) * len(shape), checksums=None,
                                               flattened_offsets=None)
        tensors[key] = TensorStorageMetadata.model_construct(
            shape=shape, is_sharded=False, dtype=code, shard_spec_per_file={stored.file: spec})
    info = describe_metadata(source.url, StorageMetadata.model_construct(tensors=tensors, aliases=None))
    info["format"] = "hf"
    return info
