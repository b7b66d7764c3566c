"""Parsing untrusted ``metadata.json`` bytes into :class:`~checkpointer.format.metadata.StorageMetadata`.

The document is read member by member (each tensor's entry decoded and validated one at a time,
shard specs through :class:`~checkpointer.format.spec_parser.SpecParser`), so a hostile file
costs time and memory linear in its size; any problem is a :class:`CorruptCheckpointError`.
"""

from __future__ import annotations

import json
from json import JSONDecodeError
from typing import Any

from ..errors import CorruptCheckpointError
from .dtypes import DTYPE_CODES
from .json_members import object_members, skip_whitespace
from .layout import FORMAT_VERSION
from .metadata import MAX_NDIM, MAX_NUMEL, TOP_FIELDS, SameId, StorageMetadata, TensorStorageMetadata, check_chunk_bytes, dims_fit
from .spec_parser import SpecParser
from .specs import gc_paused

__all__ = ["parse_metadata", "reject_duplicate_keys"]


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
    except MemoryError:
        raise CorruptCheckpointError(f"{where}: describes more than this host's memory holds") from None


class _NotAnObject(Exception):
    pass


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


_MAX_SHARED_ENTRY = 4096  # bytes: longer entries (rules listing thousands of files) are not kept as text
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
    which the validation counts. With escapes it is decoded again with the hook.

    The entries of a model's tensors repeat (a shape, a dtype and a shard rule per layout): an
    entry whose text equals one already validated is that entry again, found by comparing text
    (the last few distinct ones, before decoding) or by its text once decoded, and its
    validated form is shared (it is never changed once parsed)."""
    for known in parser.recent_entries:
        if text.startswith(known, i):  # a whole JSON object: the entry at i is exactly this one
            return parser.entries[known], i + len(known)
    entry, end = _PLAIN.raw_decode(text, i)
    escaped = text.find("\\", i, end) >= 0
    if escaped:
        _NO_DUPLICATES.raw_decode(text, i)
    cacheable = not escaped and type(entry) is dict and "shard_rule" in entry and end - i <= _MAX_SHARED_ENTRY
    entry_text = text[i:end] if cacheable else ""
    if cacheable:
        shared = parser.entries.get(entry_text)
        if shared is not None:
            parser.remember_entry(entry_text, shared)
            return shared, end
    members, colons = parser.members, parser.colons
    try:
        meta = _tensor(entry, parser)
    except (ValueError, CorruptCheckpointError) as ex:
        raise ValueError(f"tensors[{key!r}]: {ex}") from None
    if not escaped and text.count(":", i, end) - (parser.colons - colons) != parser.members - members:
        raise JSONDecodeError(f"an object in tensors[{key!r}] gives a key twice", text, i)
    if cacheable:
        parser.remember_entry(entry_text, meta)
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
    if fields["world_size"] is not None and fields["world_size"] <= 0:
        raise ValueError("world_size must be positive")
    if fields["checksum_chunk_bytes"] is not None:
        check_chunk_bytes(fields["checksum_chunk_bytes"])
    version = fields["format_version"]
    if version is not None and not 1 <= version <= FORMAT_VERSION:
        raise ValueError(f"format_version {version}: this version of checkpointer reads 1 to {FORMAT_VERSION}"
                         + (" (a newer checkpointer wrote it: upgrade)" if version > FORMAT_VERSION else ""))
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
    if in_files and (fields.get("checksum_algorithm") is None or raw.get("checksum_chunk_bytes") is None):
        raise ValueError("checksums_in_files needs checksum_algorithm and checksum_chunk_bytes")
    fields["checksums_in_files"] = in_files
    if parser is not None and parser.max_file >= 0:
        world = fields["world_size"]
        if world is None or parser.max_file >= world:
            raise ValueError(f"a shard rule names rank_{parser.max_file}.safetensors, past the world size {world}")
    extra = {k: v for k, v in raw.items() if k not in TOP_FIELDS}
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
