"""``metadata.json``: the pydantic models of OLMo-core 0.1.0's layout, plus optional new fields.

A shard spec says which elements of the full tensor a file holds, in one of two forms:
``flattened_offsets`` (``[start, end)`` ranges of the row-major flattened tensor, stored
back to back), or ``local_shape`` + ``global_offset`` (a box, stored row-major). Models
validate themselves on construction; use :func:`parse_metadata` for untrusted bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from ..errors import CorruptCheckpointError
from .dtypes import DTYPE_CODES
from .layout import FORMAT_VERSION, check_filename

__all__ = [
    "TensorShardSpec",
    "TensorStorageMetadata",
    "StorageMetadata",
    "parse_metadata",
    "MAX_NDIM",
]

MAX_NDIM = 64
MAX_NUMEL = 2**62
MAX_RUNS_PER_TENSOR = 1 << 24
"""A tensor's pieces may split into at most this many contiguous runs (bounds planning work)."""


class TensorShardSpec(BaseModel):
    """Which elements of the full tensor one file holds."""

    model_config = ConfigDict(frozen=True, extra="allow")

    flattened_offsets: tuple[tuple[int, int], ...] | None = None
    local_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    checksums: tuple[int, ...] | None = None
    """CRC32C of each ``StorageMetadata.checksum_chunk_bytes`` of this piece's bytes (new, optional)."""

    @model_validator(mode="after")
    def _one_form(self) -> TensorShardSpec:
        if self.flattened_offsets is not None:
            for start, end in self.flattened_offsets:
                if not 0 <= start <= end:
                    raise ValueError(f"bad flattened range [{start}, {end})")
        elif self.local_shape is not None and self.global_offset is not None:
            if len(self.local_shape) != len(self.global_offset):
                raise ValueError("local_shape and global_offset differ in length")
            if any(d < 0 for d in self.local_shape) or any(o < 0 for o in self.global_offset):
                raise ValueError("negative local_shape or global_offset")
        else:
            raise ValueError("a shard spec needs flattened_offsets, or local_shape and global_offset")
        return self

    @property
    def local_numel(self) -> int:
        if self.flattened_offsets is not None:
            return sum(end - start for start, end in self.flattened_offsets)
        assert self.local_shape is not None
        return math.prod(self.local_shape)


class TensorStorageMetadata(BaseModel):
    """Shape, dtype and where the pieces of one tensor are."""

    model_config = ConfigDict(extra="allow")

    shape: tuple[int, ...]
    is_sharded: bool
    dtype: str
    shard_spec_per_file: dict[str, TensorShardSpec]

    @field_validator("shape")
    @classmethod
    def _shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
            raise ValueError(f"bad shape {shape}")
        if math.prod(shape) > MAX_NUMEL:
            raise ValueError(f"shape {shape} has too many elements")
        return shape

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, dtype: str) -> str:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return dtype

    @field_validator("shard_spec_per_file")
    @classmethod
    def _filenames(cls, specs: dict[str, TensorShardSpec]) -> dict[str, TensorShardSpec]:
        for name in specs:
            check_filename(name)
        return specs

    @model_validator(mode="after")
    def _specs_fit(self) -> TensorStorageMetadata:
        numel = math.prod(self.shape)
        runs = 0
        for name, spec in self.shard_spec_per_file.items():
            runs += _run_count(spec, self.shape)
            if runs > MAX_RUNS_PER_TENSOR:
                raise ValueError(f"{name}: the pieces split into more than {MAX_RUNS_PER_TENSOR} runs")
            if spec.flattened_offsets is not None:
                if any(end > numel for _, end in spec.flattened_offsets):
                    raise ValueError(f"{name}: flattened offsets past the tensor's {numel} elements")
            else:
                assert spec.local_shape is not None and spec.global_offset is not None
                if len(spec.local_shape) != len(self.shape):
                    raise ValueError(f"{name}: local_shape {spec.local_shape} does not match shape {self.shape}")
                for size, off, full in zip(spec.local_shape, spec.global_offset, self.shape):
                    if off + size > full:
                        raise ValueError(f"{name}: box {spec.local_shape} at {spec.global_offset} leaves {self.shape}")
        return self

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class StorageMetadata(BaseModel):
    """The contents of ``metadata.json``."""

    model_config = ConfigDict(extra="allow")

    tensors: dict[str, TensorStorageMetadata]
    format_version: int | None = None
    world_size: int | None = None
    aliases: dict[str, str] | None = None
    """Keys saved once under another name (tied parameters): ``{alias: saved_key}``."""
    checksum_algorithm: str | None = None
    checksum_chunk_bytes: int | None = None

    @field_validator("checksum_chunk_bytes")
    @classmethod
    def _chunk(cls, n: int | None) -> int | None:
        if n is not None and n <= 0:
            raise ValueError("checksum_chunk_bytes must be positive")
        return n

    @model_validator(mode="after")
    def _aliases_resolve(self) -> StorageMetadata:
        for alias, target in (self.aliases or {}).items():
            if target not in self.tensors or alias in self.tensors:
                raise ValueError(f"alias {alias!r} -> {target!r} does not resolve to a saved tensor")
        return self

    def with_checksums(self, crcs_per_file: dict[str, dict[str, list[int]]], *, algorithm: str, chunk_bytes: int) -> StorageMetadata:
        """A copy with each file's per-piece checksums filled in."""
        tensors = {}
        for key, meta in self.tensors.items():
            specs = {
                name: spec.model_copy(update={"checksums": tuple(crcs_per_file[name][key])})
                if key in crcs_per_file.get(name, {})
                else spec
                for name, spec in meta.shard_spec_per_file.items()
            }
            tensors[key] = meta.model_copy(update={"shard_spec_per_file": specs})
        return self.model_copy(
            update={"tensors": tensors, "checksum_algorithm": algorithm, "checksum_chunk_bytes": chunk_bytes}
        )

    def files(self) -> list[str]:
        names = {name for t in self.tensors.values() for name in t.shard_spec_per_file}
        return sorted(names)

    def to_json_bytes(self) -> bytes:
        return json.dumps(self.model_dump(exclude_none=False), separators=(",", ":")).encode()


def _run_count(spec: TensorShardSpec, shape: tuple[int, ...]) -> int:
    """How many contiguous runs a piece has (a box is one run per row of its leading dims)."""
    if spec.flattened_offsets is not None:
        return len(spec.flattened_offsets)
    assert spec.local_shape is not None and spec.global_offset is not None
    if len(spec.local_shape) != len(shape) or 0 in spec.local_shape:
        return 0
    split = len(shape) - 1
    while split > 0 and spec.local_shape[split] == shape[split] and spec.global_offset[split] == 0:
        split -= 1
    return math.prod(spec.local_shape[:split])


def new_metadata(tensors: dict[str, TensorStorageMetadata], *, world_size: int, aliases: dict[str, str]) -> StorageMetadata:
    return StorageMetadata(
        tensors=tensors, format_version=FORMAT_VERSION, world_size=world_size, aliases=aliases or None
    )


def parse_metadata(data: bytes, *, where: str) -> StorageMetadata:
    """Parse untrusted ``metadata.json`` bytes; any problem is a :class:`CorruptCheckpointError`."""
    try:
        raw: Any = json.loads(data, object_pairs_hook=reject_duplicate_keys)
    except (ValueError, RecursionError) as ex:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({ex})") from ex
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object")
    try:
        return StorageMetadata.model_validate(raw)
    except (ValidationError, RecursionError, CorruptCheckpointError) as ex:
        raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: {_short(ex)}") from ex


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a key given twice is an error, not a silent overwrite."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _short(ex: Exception) -> str:
    text = str(ex)
    return text if len(text) < 600 else text[:600] + "..."
