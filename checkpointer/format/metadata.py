"""``metadata.json``: the pydantic models of OLMo-core 0.1.0's layout, plus optional new fields.

A shard spec says which elements of the full tensor a file holds, in one of two forms:
``flattened_offsets`` (``[start, end)`` ranges of the row-major flattened tensor, stored
back to back), or ``local_shape`` + ``global_offset`` (a box, stored row-major). Models
validate themselves on construction; use :func:`parse_metadata` for untrusted bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from json import JSONDecodeError
from typing import Any

from pydantic import BaseModel, ConfigDict, field_serializer, field_validator, model_validator

from ..errors import CorruptCheckpointError
from .dtypes import DTYPE_CODES
from .json_members import object_members, skip_whitespace
from .layout import FORMAT_VERSION, check_filename
from .shard_spec import TensorShardSpec
from .spec_parser import SpecParser
from .specs import MAX_RUNS_PER_TENSOR, ShardSpecs, box_run_count, gc_paused

__all__ = [
    "TensorShardSpec",
    "TensorStorageMetadata",
    "StorageMetadata",
    "parse_metadata",
    "MAX_NDIM",
    "MAX_NUMEL",
    "dims_fit",
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

    @field_serializer("shard_spec_per_file", mode="wrap")
    def _serialize_specs(self, specs: Mapping[str, TensorShardSpec], handler):
        return handler(dict(specs))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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
        rest: dict[str, Any] = {name: getattr(self, name) for name in _TOP_FIELDS if name != "tensors"}
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


def _run_count(spec: TensorShardSpec, shape: tuple[int, ...]) -> int:
    """How many contiguous runs a piece has (a box is one run per row of its leading dims)."""
    if spec.flattened_offsets is not None:
        return len(spec.flattened_offsets)
    assert spec.local_shape is not None and spec.global_offset is not None
    return box_run_count(spec.local_shape, spec.global_offset, shape)


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


def parse_metadata(data: bytes, *, where: str) -> StorageMetadata:
    """Parse untrusted ``metadata.json`` bytes; any problem is a :class:`CorruptCheckpointError`.

    Strict: integers must be JSON integers, ``is_sharded`` a JSON boolean, and no object may
    give a key twice.
    """
    with gc_paused():
        return _parse(data, where)


def _parse(data: bytes, where: str) -> StorageMetadata:
    try:
        text = (data if isinstance(data, (bytes, bytearray)) else bytes(data)).decode("utf-8")
    except ValueError as ex:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({_short(ex)})") from ex
    parser = SpecParser()
    try:
        top, tensors = _read_document(text, parser)
        return _validate(top, tensors, parser)
    except _NotAnObject:
        raise CorruptCheckpointError(f"{where}: expected a JSON object") from None
    except (JSONDecodeError, RecursionError) as ex:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({_short(ex)})") from ex
    except (ValueError, CorruptCheckpointError) as ex:
        raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: {_short(ex)}") from ex


class _NotAnObject(Exception):
    pass


_TOP_FIELDS = (
    "tensors", "format_version", "world_size", "aliases", "checksum_algorithm", "checksum_chunk_bytes", "file_ids",
    "file_id", "checksums_in_files",
)
_TENSOR_FIELDS = ("shape", "is_sharded", "dtype", "shard_spec_per_file")
_RULE_FIELDS = ("shape", "is_sharded", "dtype", "shard_rule")


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a key given twice is an error, not a silent overwrite."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


_PLAIN = json.JSONDecoder()
_NO_DUPLICATES = json.JSONDecoder(object_pairs_hook=reject_duplicate_keys)


def _read_document(text: str, parser: SpecParser) -> tuple[dict[str, Any], dict[str, TensorStorageMetadata] | None]:
    """The top-level members but ``tensors``, and ``tensors`` validated (``None`` unless an object).

    Each tensor's entry is decoded, validated into its compact form and dropped before the
    next, so the document is never one tree of JSON values in memory."""
    start = skip_whitespace(text, 0)
    if text[start : start + 1] != "{":
        json.loads(text)  # not JSON at all: say why
        raise _NotAnObject
    top: dict[str, Any] = {}
    tensors: dict[str, TensorStorageMetadata] | None = None

    def tensor(key: str, i: int) -> int:
        assert tensors is not None
        tensors[key], end = _tensor_entry(text, key, i, parser)
        return end

    def member(key: str, i: int) -> int:
        nonlocal tensors
        if key == "tensors" and text[i : i + 1] == "{":
            tensors = {}
            return object_members(text, i, tensor)
        top[key], end = _NO_DUPLICATES.raw_decode(text, i)
        return end

    end = skip_whitespace(text, object_members(text, start, member))
    if end != len(text):
        raise JSONDecodeError("Extra data", text, end)
    return top, tensors


def _tensor_entry(text: str, key: str, i: int, parser: SpecParser) -> tuple[TensorStorageMetadata, int]:
    """Decode and validate the entry of tensor ``key`` at ``text[i]``; returns it and its end.

    A key given twice inside it is found without a hook per object (millions of shard specs):
    without escapes, its text holds exactly one ``:`` per member plus those inside strings,
    which the validation counts. With escapes it is decoded again with the hook."""
    entry, end = _PLAIN.raw_decode(text, i)
    escaped = text.find("\\", i, end) >= 0
    if escaped:
        _NO_DUPLICATES.raw_decode(text, i)
    members, colons = parser.members, parser.colons
    try:
        meta = _tensor(entry, parser)
    except (ValueError, CorruptCheckpointError) as ex:
        raise ValueError(f"tensors[{key!r}]: {ex}") from None
    if not escaped and text.count(":", i, end) - (parser.colons - colons) != parser.members - members:
        raise JSONDecodeError(f"an object in tensors[{key!r}] gives a key twice", text, i)
    return meta, end


def _validate(
    raw: dict[str, Any], tensors: dict[str, TensorStorageMetadata] | None, parser: SpecParser | None = None
) -> StorageMetadata:
    fields: dict[str, Any] = {}
    for name in ("format_version", "world_size", "checksum_chunk_bytes"):
        value = raw.get(name)
        if value is not None and type(value) is not int:
            raise ValueError(f"{name} must be an integer or null")
        fields[name] = value
    if fields["checksum_chunk_bytes"] is not None and fields["checksum_chunk_bytes"] <= 0:
        raise ValueError("checksum_chunk_bytes must be positive")
    algorithm = raw.get("checksum_algorithm")
    if algorithm is not None and type(algorithm) is not str:
        raise ValueError("checksum_algorithm must be a string or null")
    fields["checksum_algorithm"] = algorithm
    file_ids = raw.get("file_ids")
    if file_ids is not None and (type(file_ids) is not dict or not all(type(v) is str for v in file_ids.values())):
        raise ValueError("file_ids must be an object of strings or null")
    fields["file_ids"] = file_ids
    file_id = raw.get("file_id")
    if file_id is not None and type(file_id) is not str:
        raise ValueError("file_id must be a string or null")
    fields["file_id"] = file_id
    in_files = raw.get("checksums_in_files")
    if in_files is not None and type(in_files) is not bool:
        raise ValueError("checksums_in_files must be true, false or null")
    fields["checksums_in_files"] = in_files
    if parser is not None and parser.max_file >= 0:
        world = fields["world_size"]
        if world is None or parser.max_file >= world:
            raise ValueError(f"a shard rule names rank_{parser.max_file}.safetensors, past the world size {world}")
    extra = {k: v for k, v in raw.items() if k not in _TOP_FIELDS}
    if tensors is None:
        raise ValueError("tensors must be an object")

    aliases = raw.get("aliases")
    if aliases is not None:
        if type(aliases) is not dict or not all(type(v) is str for v in aliases.values()):
            raise ValueError("aliases must be an object of strings")
        for alias, target in aliases.items():
            if target not in tensors or alias in tensors:
                raise ValueError(f"alias {alias!r} -> {target!r} does not resolve to a saved tensor")
    if file_id is not None and file_ids is None:
        fields["file_ids"] = SameId(file_id)
    return StorageMetadata.model_construct(tensors=tensors, aliases=aliases, **fields, **extra)


def _tensor(entry: Any, parser: SpecParser) -> TensorStorageMetadata:
    if type(entry) is not dict:
        raise ValueError("must be an object")
    ruled = "shard_rule" in entry
    if ruled and "shard_spec_per_file" in entry:
        raise ValueError("gives both shard_rule and shard_spec_per_file")
    fields = _RULE_FIELDS if ruled else _TENSOR_FIELDS
    missing = [name for name in fields if name not in entry]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    shape = entry["shape"]
    if type(shape) is not list or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"bad shape {_short_value(shape)}")
    if not dims_fit(shape):
        raise ValueError(f"shape {_short_value(shape)} has too many elements, or a dimension over {MAX_NUMEL}")
    shape = tuple(shape)
    if type(entry["is_sharded"]) is not bool:
        raise ValueError("is_sharded must be true or false")
    dtype = entry["dtype"]
    if type(dtype) is not str or dtype not in DTYPE_CODES:
        raise ValueError(f"unknown dtype {_short_value(dtype)}")
    extra = {k: v for k, v in entry.items() if k not in fields}
    parser.members += len(entry) - len(extra)
    parser.count(extra)
    if ruled:
        specs = parser.parse_rule(shape, entry["shard_rule"])
    else:
        specs = parser.parse(shape, entry["shard_spec_per_file"])
    return TensorStorageMetadata.model_construct(
        shape=shape, is_sharded=entry["is_sharded"], dtype=dtype, shard_spec_per_file=specs, **extra
    )


def _short_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 100 else text[:100] + "..."


def _short(ex: BaseException) -> str:
    text = str(ex)
    return text if len(text) < 600 else text[:600] + "..."
