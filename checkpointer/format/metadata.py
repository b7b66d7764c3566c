"""``metadata.json``: the pydantic models of OLMo-core 0.1.0's layout, plus optional new fields.

A shard spec says which elements of the full tensor a file holds, in one of two forms:
``flattened_offsets`` (``[start, end)`` ranges of the row-major flattened tensor, stored
back to back), or ``local_shape`` + ``global_offset`` (a box, stored row-major). Models
validate themselves on construction; use :func:`~checkpointer.format.metadata_parse.parse_metadata`
for untrusted bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_serializer, field_validator, model_validator

from .dtypes import DTYPE_CODES, LARGEST_ITEMSIZE, dtype_from_code
from .layout import FORMAT_VERSION, check_filename
from .shard_spec import TensorShardSpec
from .specs import MAX_RUNS_PER_TENSOR, ShardSpecs, gc_paused

__all__ = [
    "TensorShardSpec",
    "TensorStorageMetadata",
    "StorageMetadata",
    "MAX_NDIM",
    "MAX_NUMEL",
    "dims_fit",
    "check_chunk_bytes",
]

MAX_NDIM = 64
MAX_NUMEL = 2**62
"""The most elements a tensor may have, and the largest a dimension may be: past it, products
of dimensions (element counts, strides, byte sizes) could overflow torch's int64."""


def dims_fit(shape: Sequence[int]) -> bool:
    """Whether every dimension, and the product of the non-zero ones, is at most :data:`MAX_NUMEL`.

    The non-zero ones: ``[0, 2**62, 2**62]`` has no element, but its strides overflow int64
    (``torch.empty`` fails), so every partial product of dimensions must fit.
    """
    n = 1
    for d in shape:
        if d > MAX_NUMEL:
            return False
        if d:
            n *= d
            if n > MAX_NUMEL:
                return False
    return True


class TensorStorageMetadata(BaseModel):
    """Shape, dtype and where the pieces of one tensor are.

    ``shard_spec_per_file`` is a ``dict`` when built here, and a read-only
    :class:`~checkpointer.format.specs.ShardSpecs` mapping when read from ``metadata.json``
    or planned by ``build_save_plan`` (the specs of thousands of files, built on access).
    """

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
        if not dims_fit(shape):
            raise ValueError(f"shape {shape} has too many elements, or a dimension over {MAX_NUMEL}")
        return shape

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, dtype: str) -> str:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` (a safetensors code, ``"BF16"``) as a torch dtype."""
        return dtype_from_code(self.dtype)

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
            runs += _run_count(spec)
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

    @field_serializer("shard_spec_per_file", mode="wrap")
    def _serialize_specs(self, specs: Mapping[str, TensorShardSpec], handler):
        return handler(dict(specs))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


TOP_FIELDS = (
    "tensors", "format_version", "world_size", "aliases", "checksum_algorithm", "checksum_chunk_bytes", "file_ids",
    "file_id", "checksums_in_files",
)
"""The fields of ``metadata.json`` this version knows; others are kept as extras."""


class SameId(Mapping):
    """``file_ids`` of a format-2 checkpoint: every rank file has the one id ``file_id``.
    Looked up like a dict of every file; lists nothing, and is not written back."""

    def __init__(self, file_id: str):
        self.file_id = file_id

    def __getitem__(self, name: str) -> str:
        return self.file_id

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        return True


def check_chunk_bytes(n: int) -> None:
    """Refuse a ``checksum_chunk_bytes`` that is not positive, or that would end a chunk inside an
    element of some dtype (box reads check whole chunks of whole elements)."""
    if n <= 0:
        raise ValueError("checksum_chunk_bytes must be positive")
    if n % LARGEST_ITEMSIZE:
        raise ValueError(f"checksum_chunk_bytes must be a multiple of {LARGEST_ITEMSIZE} (the largest element), not {n}")


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
    file_ids: dict[str, str] | None = None
    """Each rank file's id, also written in that file's header: a file another save put in
    its place (two saves into one directory) is refused on load, not read as this one's."""
    file_id: str | None = None
    """Format 2: the one id every rank file of this save has in its header (instead of ``file_ids``)."""
    checksums_in_files: bool | None = None
    """Format 2: each rank file holds its pieces' checksums (tensor ``__checkpointer_crc32c__``),
    not ``metadata.json``."""


    def verbose(self) -> StorageMetadata:
        """The same metadata with every tensor's pieces listed file by file (no shard rules)."""
        tensors = {
            key: meta.model_copy(update={"shard_spec_per_file": meta.shard_spec_per_file.verbose()})
            if isinstance(meta.shard_spec_per_file, ShardSpecs)
            else meta
            for key, meta in self.tensors.items()
        }
        return self.model_copy(update={"tensors": tensors})

    @field_validator("checksum_chunk_bytes")
    @classmethod
    def _chunk(cls, n: int | None) -> int | None:
        if n is not None:
            check_chunk_bytes(n)
        return n

    @model_validator(mode="after")
    def _aliases_resolve(self) -> StorageMetadata:
        for alias, target in (self.aliases or {}).items():
            if target not in self.tensors or alias in self.tensors:
                raise ValueError(f"alias {alias!r} -> {target!r} does not resolve to a saved tensor")
        return self

    def with_checksums(self, crcs_per_file: dict[str, dict[str, list[int]]], *, algorithm: str, chunk_bytes: int) -> StorageMetadata:
        """A copy with each file's per-piece checksums filled in."""
        with gc_paused():
            return self._with_checksums(crcs_per_file, algorithm, chunk_bytes)

    def _with_checksums(
        self, crcs_per_file: dict[str, dict[str, list[int]]], algorithm: str, chunk_bytes: int
    ) -> StorageMetadata:
        tensors = {}
        for key, meta in self.tensors.items():
            specs = meta.shard_spec_per_file
            if isinstance(specs, ShardSpecs):
                old = specs.checksums or [None] * len(specs)
                crcs = [crcs_per_file.get(name, _EMPTY).get(key, was) for name, was in zip(specs.layout.names, old)]
                new: Mapping[str, TensorShardSpec] = specs.with_checksums(crcs)
            else:
                new = {
                    name: spec.model_copy(update={"checksums": tuple(crcs_per_file[name][key])})
                    if key in crcs_per_file.get(name, {})
                    else spec
                    for name, spec in specs.items()
                }
            tensors[key] = meta.model_copy(update={"shard_spec_per_file": new})
        return self.model_copy(
            update={"tensors": tensors, "checksum_algorithm": algorithm, "checksum_chunk_bytes": chunk_bytes}
        )

    def with_file_ids(self, file_ids: dict[str, str]) -> StorageMetadata:
        """A copy listing each rank file's id (none listed when ``file_ids`` is empty)."""
        return self.model_copy(update={"file_ids": dict(file_ids) or None})

    def files(self) -> list[str]:
        names: set[str] = set()
        for t in self.tensors.values():
            specs = t.shard_spec_per_file
            names.update(specs.layout.names if isinstance(specs, ShardSpecs) else specs)
        return sorted(names)

    def to_json_bytes(self) -> bytes:
        with gc_paused():
            return self._to_json_bytes()

    def _to_json_bytes(self) -> bytes:
        # The JSON of model_dump(), pieced together: a tensor's shard specs come as text.
        parts = ['{"tensors":{']
        for key, meta in self.tensors.items():
            parts += _tensor_json(key, meta)
            parts.append(",")
        if self.tensors:
            parts.pop()
        rest: dict[str, Any] = {name: getattr(self, name) for name in TOP_FIELDS if name != "tensors"}
        if isinstance(rest["file_ids"], SameId):
            rest["file_ids"] = None
        rest.update(self.__pydantic_extra__ or {})
        parts += ["},", _compact(rest)[1:]]
        return "".join(parts).encode()


_EMPTY: dict = {}


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), check_circular=False)


def _tensor_json(key: str, meta: TensorStorageMetadata) -> tuple[str, str, str]:
    """A tensor's ``"key":{...}`` in three pieces of text."""
    specs = meta.shard_spec_per_file
    field = "shard_spec_per_file"
    if isinstance(specs, ShardSpecs) and specs.rule is not None and specs.checksums is None and not specs.extras:
        field, specs_text = "shard_rule", _compact(specs.rule)
    elif isinstance(specs, ShardSpecs):
        specs_text = specs.json_text()
    else:
        specs_text = _compact({name: _spec_json(spec) for name, spec in specs.items()})
    head = _compact({"shape": list(meta.shape), "is_sharded": meta.is_sharded, "dtype": meta.dtype})
    extra = _compact(meta.__pydantic_extra__)[1:-1] if meta.__pydantic_extra__ else ""
    return f'{json.dumps(key)}:{head[:-1]},"{field}":', specs_text, f',{extra}}}' if extra else "}"


def _spec_json(spec: TensorShardSpec) -> dict[str, Any]:
    out = {
        "flattened_offsets": spec.flattened_offsets,
        "local_shape": spec.local_shape,
        "global_offset": spec.global_offset,
        "checksums": spec.checksums,
    }
    out.update(spec.__pydantic_extra__ or {})
    return out


def _run_count(spec: TensorShardSpec) -> int:
    """How many runs a piece lists: its flattened ranges, or one box (planned as a box; where it
    must be expanded into ranges, ``planning.load_plan.stored_ranges`` bounds them)."""
    if spec.flattened_offsets is not None:
        return len(spec.flattened_offsets)
    return 1


def new_metadata(
    tensors: dict[str, TensorStorageMetadata], *, world_size: int, aliases: dict[str, str],
    format_version: int = FORMAT_VERSION,
) -> StorageMetadata:
    """The metadata of a new checkpoint, from tensors already validated (not validated again)."""
    for alias, target in (aliases or {}).items():
        if target not in tensors or alias in tensors:
            raise ValueError(f"alias {alias!r} -> {target!r} does not resolve to a saved tensor")
    return StorageMetadata.model_construct(
        tensors=tensors,
        format_version=format_version,
        world_size=world_size,
        aliases=aliases or None,
        checksum_algorithm=None,
        checksum_chunk_bytes=None,
        file_ids=None,
        file_id=None,
        checksums_in_files=None,
    )
