"""The safetensors container: an 8-byte little-endian header length, a JSON header, raw bytes.

Parsing takes bytes and the file size; it never opens a file. Building returns the header
bytes for a list of flat pieces, so a writer can stream the tensors straight after it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from .dtypes import READABLE_CODES, itemsize
from .metadata import MAX_NDIM, MAX_NUMEL, dims_fit
from .metadata_parse import reject_duplicate_keys

__all__ = [
    "HeaderEntry",
    "SafetensorsHeader",
    "parse_header",
    "build_header",
    "check_header_size",
    "MAX_HEADER_BYTES",
    "PREFIX_BYTES",
    "RESERVED_KEY",
]

MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces
PREFIX_BYTES = 8
RESERVED_KEY = "__metadata__"  # the header's own metadata, never a tensor
DATA_ALIGNMENT = 64


@dataclass(frozen=True)
class HeaderEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    entries: dict[str, HeaderEntry]
    data_start: int
    user_metadata: dict[str, str] | None


def header_length(prefix: bytes, *, where: str, file_size: int) -> int:
    if len(prefix) < PREFIX_BYTES:
        raise CorruptCheckpointError(f"{where}: file too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(f"{where}: safetensors header length {n} is over the limit of {MAX_HEADER_BYTES} bytes")
    if PREFIX_BYTES + n > file_size:
        raise CorruptCheckpointError(f"{where}: safetensors header length {n} exceeds the file ({file_size} bytes)")
    return n


def parse_header(header_json: bytes, *, where: str, file_size: int) -> SafetensorsHeader:
    """Validate a header (the JSON part) against the file's size."""
    data_start = PREFIX_BYTES + len(header_json)
    try:
        raw: Any = json.loads(header_json, object_pairs_hook=reject_duplicate_keys)
    except (ValueError, RecursionError, UnicodeDecodeError) as ex:
        raise CorruptCheckpointError(f"{where}: bad safetensors header ({ex})") from ex
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{where}: safetensors header is not a JSON object")
    user_metadata = raw.pop(RESERVED_KEY, None)
    if user_metadata is not None and not (
        isinstance(user_metadata, dict) and all(isinstance(v, str) for v in user_metadata.values())
    ):
        raise CorruptCheckpointError(f"{where}: bad __metadata__ in safetensors header")
    entries: dict[str, HeaderEntry] = {}
    for key, info in raw.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (
                isinstance(dtype, str)
                and isinstance(shape, list)
                and len(shape) <= MAX_NDIM
                and all(type(d) is int and d >= 0 for d in shape)
                and type(start) is int
                and type(end) is int
                and 0 <= start <= end
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CorruptCheckpointError(f"{where}: bad safetensors header entry for {key!r}")
        if not dims_fit(shape):
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} has shape {shape!r:.200} with too many elements, or a dimension over {MAX_NUMEL}"
            )
        if dtype not in READABLE_CODES:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} has dtype {dtype!r:.40}, which cannot be read (known: {', '.join(READABLE_CODES)})"
            )
        numel = math.prod(shape)
        if (end - start) != numel * itemsize(dtype) or data_start + end > file_size:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} has byte range [{start}, {end}) that does not fit its "
                f"shape {shape} {dtype} or the file ({file_size} bytes)"
            )
        entries[key] = HeaderEntry(dtype, tuple(shape), data_start + start, data_start + end)
    spans = sorted((e.start, e.end, k) for k, e in entries.items() if e.end > e.start)
    for (_, prev_end, prev_key), (start, _, key) in zip(spans, spans[1:]):
        if start < prev_end:
            raise CorruptCheckpointError(f"{where}: tensors {prev_key!r} and {key!r} overlap in the file")
    return SafetensorsHeader(entries, data_start, user_metadata)


def check_header_size(length: int, count: int) -> None:
    """Refuse to write a header that no reader would read: one over :data:`MAX_HEADER_BYTES`
    (``length`` bytes of JSON, for ``count`` tensors)."""
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"a safetensors header of {length:,} bytes for {count:,} tensors is over the {MAX_HEADER_BYTES:,} bytes "
            "that safetensors (and this library) read: the file could not be loaded, so it is not written; "
            "save fewer or shorter-named tensors per file (more ranks, or several state dicts)"
        )


def build_header(
    pieces: list[tuple[str, str, int]],
    *,
    user_metadata: dict[str, str] | None = None,
    data_start: tuple[int, int] | None = None,
) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for flat pieces ``(key, dtype_code, numel)``.

    Returns the bytes and each piece's absolute byte offset in the file. The data area
    starts on a 64-byte boundary (the header is padded with spaces, as safetensors does);
    with ``data_start=(r, m)`` (``r`` a multiple of 64), at the first such boundary that
    leaves ``r`` modulo ``m``.
    """
    header: dict[str, Any] = {}
    if user_metadata:
        header[RESERVED_KEY] = user_metadata
    offsets: list[int] = []
    pos = 0
    for key, dtype, numel in pieces:
        if key in header or key == RESERVED_KEY:
            raise ValueError(f"tensor key {key!r} is given twice or is reserved")
        nbytes = numel * itemsize(dtype)
        header[key] = {"dtype": dtype, "shape": [numel], "data_offsets": [pos, pos + nbytes]}
        offsets.append(pos)
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(PREFIX_BYTES + len(text)) // DATA_ALIGNMENT) * DATA_ALIGNMENT - PREFIX_BYTES
    if data_start is not None:
        remainder, modulus = data_start
        if remainder % DATA_ALIGNMENT or modulus <= 0 or modulus % DATA_ALIGNMENT:
            raise ValueError(f"data_start={data_start}: both must be multiples of {DATA_ALIGNMENT}")
        padded += (remainder - PREFIX_BYTES - padded) % modulus
    check_header_size(padded, len(pieces))
    text += b" " * (padded - len(text))
    data_start = PREFIX_BYTES + len(text)
    return struct.pack("<Q", len(text)) + text, [data_start + o for o in offsets]
