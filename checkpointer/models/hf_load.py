"""Loading a Hugging Face checkpoint in place into a model sharded any way (:func:`load_hf`).

1. Every rank refuses an optimizer or a training state: a Hugging Face checkpoint has neither.
2. Rank 0 opens the source as ``lazy_load`` does (:func:`~checkpointer.tools.detect.detect`; an
   ``hf://`` URL is fetched into the cache first, only the shards holding keys the model takes),
   reading the index and those shards' headers, and shares what it found: every checkpoint key,
   and where the bytes of each tensor the model takes are (storage, file, dtype, shape). A rank
   that cannot see rank 0's cache (another node) fetches the same files into its own.
3. While every rank plans (so a refusal is raised on every rank), checkpoint names become model
   names (``key_map``), the key differences are computed (tied parameters count once) and
   refused with ``strict``, and dtypes are checked: only ``dtype=`` casts.
4. Each storage's files are described as a :class:`~checkpointer.format.metadata.StorageMetadata`
   whose tensors are each one piece in one file, under their names in the file. The engine's
   in-place load (default or two-stage) then reads only each rank's byte ranges, checking every
   file's header against that description as it does for its own rank files.
5. Tensors stored in another dtype than ``dtype`` are read into buffers of the stored dtype,
   sharded like their destinations, and cast into place once their reads are done: in batches
   of about :data:`CAST_BATCH_BYTES` per rank, one load each after the first.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from .. import dist
from ..engine.checkpointer import load_parts
from ..engine.reader import HEADER_BYTES_FIELD, CheckpointReader
from ..errors import CheckpointMismatchError, CorruptCheckpointError
from ..format.dtypes import DTYPE_CODES, READABLE_CODES, itemsize
from ..format.layout import METADATA_FILENAME
from ..format.metadata import StorageMetadata, TensorShardSpec, TensorStorageMetadata
from ..sharding import describe, local_data, with_sharding_of
from ..storage import open_storage
from ..storage.base import Storage
from ..storage.local import LocalStorage
from ..storage.urls import local_path
from ..tools.detect import detect
from ..tools.hf import HFSource, INDEX_NAME, SINGLE_NAME, has_file
from ..tools.hub import fetch_hf, is_hf_url
from ..tools.sources import Where
from .load_result import LoadResult
from .names import load_hook_copies, load_targets
from .strict import difference_message, keys_to_load

__all__ = ["KeyMap", "load_hf", "is_hf_checkpoint", "map_name", "CAST_BATCH_BYTES"]

CAST_BATCH_BYTES = 256 << 20
"""The most bytes of stored-dtype buffers (per rank, about) a load casting with ``dtype=`` holds."""

KeyMap = Mapping[str, "str | None"] | Callable[[str], "str | None"] | None
"""Checkpoint name -> model name: a dict (names it does not list keep their own), or a callable;
None (from either) skips that checkpoint key."""


def map_name(key_map: KeyMap, key: str) -> str | None:
    """The model name of checkpoint key ``key`` under ``key_map`` (None: skipped)."""
    if key_map is None:
        return key
    name = key_map(key) if callable(key_map) else key_map.get(key, key)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"key_map gave {name!r} for {key!r}: a model name (str) or None to skip the key")
    return name


def is_hf_checkpoint(src: str) -> bool:
    """Whether ``src`` is a Hugging Face checkpoint rather than this library's save: an ``hf://``
    URL, a file, or a directory with Hugging Face safetensors and no ``metadata.json`` (its own,
    or in ``model/``). Cheap: a few existence checks."""
    if is_hf_url(src):
        return True
    local = local_path(src)
    if local is not None:
        path = os.path.expanduser(local)
        if os.path.isfile(path):
            return True
        if not os.path.isdir(path):
            return False
        storage: Storage = LocalStorage(path)
    else:
        if src.rstrip("/").lower().endswith(".safetensors"):
            return True
        storage = open_storage(src)
    try:
        if has_file(storage, METADATA_FILENAME) or has_file(storage.child("model"), METADATA_FILENAME):
            return False
        return has_file(storage, INDEX_NAME) or has_file(storage, SINGLE_NAME) or HFSource.supports(Where(storage))
    except (OSError, ValueError):
        return False


def load_hf(
    src: str,
    model: nn.Module,
    *,
    key_map: KeyMap = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    strategy: str = "default",
    cast_batch_bytes: int = CAST_BATCH_BYTES,
) -> LoadResult:
    """Fill ``model`` in place from the Hugging Face checkpoint ``src`` (see the module docstring).
    Every rank calls it together. Tensors cast on load go through buffers of about
    ``cast_batch_bytes`` per rank at a time (one load each batch after the first)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, not {dtype!r}")
    model_state: dict[str, Any] = {}

    def wanted(key: str) -> bool:
        name = map_name(key_map, key)
        return name is not None and name in model_state

    def targets_then_describe() -> Any:  # a model's hook failing on one rank reaches every rank here
        model_state.update(load_targets(model, strict=strict))
        return _describe(src, wanted) if dist.get_rank() == 0 else None

    found = dist.agree_after(targets_then_describe, "reading the Hugging Face checkpoint")
    desc = json.loads(dist.share_from(0, lambda: json.dumps(found).encode(), "reading the Hugging Face checkpoint"))
    if is_hf_url(src):  # a rank on another node fetches into its own cache
        seen = all(os.path.exists(os.path.join(url, file)) for _, url, file, *_ in desc["tensors"])
        desc = dist.agree_after(lambda: desc if seen else _describe(src, wanted), "fetching the Hugging Face checkpoint")
    where = src
    by_storage: dict[str, dict[str, tuple[str, str, tuple[int, ...]]]] = {}
    header_bytes: dict[str, dict[str, int]] = {}
    stored = {key: (url, file, code, tuple(shape)) for key, url, file, code, shape, _ in desc["tensors"]}
    for key, url, file, code, shape, data_start in desc["tensors"]:
        by_storage.setdefault(url, {})[key] = (file, code, tuple(shape))
        header_bytes.setdefault(url, {})[file] = data_start
    urls = list(by_storage)
    storages = [open_storage(url) for url in urls]
    result = LoadResult()
    casts: list[tuple[str, Any, Any]] = []  # (key, destination, buffer of the stored dtype)
    batches: list[list[tuple[int, str, Any, str]]] = []  # tensors to cast, a load each after the first

    def state_dicts(_readers: list[CheckpointReader]) -> list[dict[str, Any]]:
        result.missing_keys.clear()
        result.unexpected_keys.clear()
        casts.clear()
        model_of: dict[str, str] = {}  # model name -> checkpoint key
        for key in desc["keys"]:
            name = map_name(key_map, key)
            if name is None:
                continue
            if name in model_of:
                raise CheckpointMismatchError(
                    f"key_map maps both {model_of[name]!r} and {key!r} of {where} to the model's {name!r}"
                )
            model_of[name] = key
        to_load, missing, unexpected = keys_to_load(model_state, model_of, {})
        unexpected = sorted(model_of[name] for name in unexpected)
        if strict and (missing or unexpected):
            raise CheckpointMismatchError(difference_message("model", where, missing, unexpected, noun="model key"))
        result.missing_keys.extend(missing)
        result.unexpected_keys.extend(unexpected)
        out: list[dict[str, Any]] = [{} for _ in urls]
        to_cast: list[tuple[int, str, Any, str]] = []
        for name, value in to_load.items():
            key = model_of[name]
            url, _, code, shape = stored[key]
            if tuple(shape) != (have := describe(value).shape):
                raise CheckpointMismatchError(
                    f"shape mismatch for {name!r}: {where} stores {key!r} as {list(shape)}, the model has "
                    f"{list(have)} (global shapes)"
                )
            if _needs_cast(name, key, value, code, dtype, where):
                to_cast.append((urls.index(url), key, value, code))
            else:
                out[urls.index(url)][key] = value
        batches[:] = _cast_batches(to_cast, {k: v[3] for k, v in stored.items()}, cast_batch_bytes)
        return _with_buffers(out, batches.pop(0) if batches else [])

    def _with_buffers(out: list[dict[str, Any]], batch: list[tuple[int, str, Any, str]]) -> list[dict[str, Any]]:
        """``out`` with a buffer of the stored dtype, sharded like its destination, for each of ``batch``."""
        for i, key, value, code in batch:
            buffer = with_sharding_of(torch.empty_like(local_data(value), dtype=READABLE_CODES[code]), value)
            casts.append((key, value, buffer))
            out[i][key] = buffer
        return out

    def finish() -> None:
        with torch.no_grad():
            for _, dest, buffer in casts:
                local_data(dest).copy_(local_data(buffer))
        casts.clear()

    metadatas = [_metadata(by_storage[url], header_bytes[url], where) for url in urls]
    load_parts(storages, state_dicts, finish=finish, strategy=strategy, metadatas=metadatas)  # type: ignore[arg-type]
    while batches:  # the same batches on every rank: they are cut by global sizes
        batch = batches.pop(0)
        load_parts(storages, lambda _, batch=batch: _with_buffers([{} for _ in urls], batch), finish=finish,
                   strategy=strategy, metadatas=metadatas)  # type: ignore[arg-type]
    load_hook_copies(model, model_state)  # a state_dict hook's copies (fused QKV) go back through load hooks
    return result


def _needs_cast(name: str, key: str, value: Any, code: str, dtype: torch.dtype | None, where: str) -> bool:
    """Whether model key ``name`` (checkpoint key ``key``, stored as ``code``) is read through a
    buffer of the stored dtype and cast; a dtype that differs without ``dtype=``, or a
    destination not of ``dtype``, is refused."""
    have = local_data(value).dtype
    stored = READABLE_CODES.get(code)
    if dtype is None:
        if stored != have:
            raise CheckpointMismatchError(
                f"dtype mismatch for {name!r}: {where} stores {key!r} as {code} ({stored}), the model has {have}. "
                f"Pass dtype={have} to cast on load"
            )
        return False
    if have != dtype:
        raise CheckpointMismatchError(
            f"dtype={dtype} casts on load into tensors of that dtype, but the model's {name!r} is {have}"
        )
    if stored == dtype:
        return False
    if code not in DTYPE_CODES:
        raise CheckpointMismatchError(f"{where}: {key!r} is stored as {code}, which cannot be cast on load")
    return True


def _cast_batches(to_cast: list[tuple[int, str, Any, str]], shapes: Mapping[str, tuple[int, ...]],
                  budget: int) -> list[list[tuple[int, str, Any, str]]]:
    """``to_cast`` in batches whose buffers hold about ``budget`` bytes per rank (by global sizes
    over the world size, so that every rank cuts the same batches)."""
    world = max(1, dist.get_world_size())
    batches: list[list[tuple[int, str, Any, str]]] = []
    held = 0
    for item in to_cast:
        size = math.prod(shapes[item[1]]) * itemsize(item[3]) // world
        if not batches or held + size > budget:
            batches.append([])
            held = 0
        batches[-1].append(item)
        held += size
    return batches


def _metadata(tensors: Mapping[str, tuple[str, str, tuple[int, ...]]], header_bytes: Mapping[str, int],
              where: str) -> StorageMetadata:
    """One storage's Hugging Face files as a checkpoint: each tensor one piece in one file (each
    file's header read in one exact read, its size known)."""
    out: dict[str, TensorStorageMetadata] = {}
    for key, (file, code, shape) in tensors.items():
        if code not in DTYPE_CODES:
            raise CheckpointMismatchError(f"{where}: {key!r} is stored as {code}, which a model load cannot take")
        spec = TensorShardSpec(local_shape=shape, global_offset=(0,) * len(shape))
        out[key] = TensorStorageMetadata(shape=shape, is_sharded=False, dtype=code, shard_spec_per_file={file: spec})
    files = {file for file, _, _ in tensors.values()}
    return StorageMetadata(tensors=out, **{HEADER_BYTES_FIELD: {f: n for f, n in header_bytes.items() if f in files}})


def _describe(src: str, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """Every key of ``src`` and where each wanted tensor is: ``{"keys": [...], "tensors":
    [[key, storage URL, file, dtype code, shape, header size of the file], ...]}``."""
    path = fetch_hf(src, wanted) if is_hf_url(src) else src
    cls, found = detect(path)
    if cls is not HFSource:
        raise CorruptCheckpointError(f"{src}: a {cls.format} checkpoint, not Hugging Face safetensors")
    source = HFSource(found, wanted=wanted)
    tensors = []
    for key, _, _ in source.entries():
        if wanted(key):
            s = source.locate(key)
            tensors.append([key, s.storage.url, s.file, s.dtype, list(s.shape), s.data_start])
    return {"keys": source.keys(), "tensors": tensors}

