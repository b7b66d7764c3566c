"""Save and load plans: frozen dataclasses that say exactly what to write and what to copy where.

``build_save_plan`` turns what every rank holds into the checkpoint's metadata and each
rank's list of pieces to write: a piece held by several ranks (a replicated tensor, a
``Replicate`` placement) is written once, by the holder with the fewest bytes so far.
``build_load_plan`` turns one tensor's metadata and the piece a rank wants into reads.
Rank and world size are arguments; nothing here looks them up.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize
from ..format.layout import rank_filename
from ..format.metadata import StorageMetadata, TensorShardSpec, TensorStorageMetadata, new_metadata
from .overlap import Range, SourceIndex, box_ranges, merge_adjacent

__all__ = [
    "Piece",
    "PieceDesc",
    "SavePlan",
    "ReadItem",
    "TensorLoadPlan",
    "build_save_plan",
    "build_load_plan",
    "piece_ranges",
    "spec_ranges",
]


@dataclass(frozen=True, slots=True)
class Piece:
    """The elements of a full tensor that one local tensor holds, stored back to back.

    Either ``flat`` ranges of the flattened tensor, or a box (``local_shape`` at ``global_offset``).
    """

    flat: tuple[Range, ...] | None = None
    local_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        if self.flat is not None:
            return sum(e - s for s, e in self.flat)
        assert self.local_shape is not None
        return math.prod(self.local_shape)

    def to_spec(self) -> TensorShardSpec:
        if self.flat is not None:
            return TensorShardSpec.model_construct(flattened_offsets=self.flat, local_shape=None, global_offset=None)
        return TensorShardSpec.model_construct(
            flattened_offsets=None, local_shape=self.local_shape, global_offset=self.global_offset
        )

    @staticmethod
    def whole(shape: Sequence[int]) -> Piece:
        return Piece(flat=((0, math.prod(shape)),))


@dataclass(frozen=True, slots=True)
class PieceDesc:
    """What one rank holds of one tensor of the state dict."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    is_sharded: bool
    piece: Piece


@dataclass(frozen=True)
class SavePlan:
    metadata: StorageMetadata
    keys_per_rank: tuple[tuple[str, ...], ...]
    """The keys each rank writes to its file, in order."""

    def bytes_per_rank(self) -> list[int]:
        out = [0] * len(self.keys_per_rank)
        for rank, keys in enumerate(self.keys_per_rank):
            name = rank_filename(rank)
            for key in keys:
                meta = self.metadata.tensors[key]
                out[rank] += meta.shard_spec_per_file[name].local_numel * itemsize(meta.dtype)
        return out


def piece_ranges(piece: Piece, shape: Sequence[int]) -> list[Range]:
    if piece.flat is not None:
        return list(piece.flat)
    assert piece.local_shape is not None and piece.global_offset is not None
    return box_ranges(shape, piece.local_shape, piece.global_offset)


def spec_ranges(spec: TensorShardSpec, shape: Sequence[int]) -> list[Range]:
    if spec.flattened_offsets is not None:
        return [tuple(r) for r in spec.flattened_offsets]  # type: ignore[misc]
    assert spec.local_shape is not None and spec.global_offset is not None
    return box_ranges(shape, spec.local_shape, spec.global_offset)


def build_save_plan(
    descs_per_rank: Sequence[Sequence[PieceDesc]], *, aliases: dict[str, str] | None = None
) -> SavePlan:
    """Merge every rank's pieces into metadata and assign each distinct piece one writer.

    Raises ``ValueError`` naming the key when ranks disagree on a tensor's shape or dtype,
    or when the distinct pieces of a tensor overlap or leave elements out.
    """
    world_size = len(descs_per_rank)
    by_key: dict[str, dict[Piece, list[int]]] = {}
    first: dict[str, PieceDesc] = {}
    for rank, descs in enumerate(descs_per_rank):
        for d in descs:
            ref = first.setdefault(d.key, d)
            if (ref.shape, ref.dtype) != (d.shape, d.dtype):
                raise ValueError(
                    f"tensor {d.key!r} is {list(ref.shape)} {ref.dtype} on one rank and "
                    f"{list(d.shape)} {d.dtype} on rank {rank}"
                )
            by_key.setdefault(d.key, {}).setdefault(d.piece, []).append(rank)

    load = [0] * world_size
    writer: dict[tuple[str, Piece], int] = {}
    shared: list[tuple[int, str, Piece, list[int]]] = []
    for key, holders_by_piece in by_key.items():
        desc = first[key]
        numel = math.prod(desc.shape)
        pieces = [p for p in holders_by_piece if p.numel > 0] if numel else list(holders_by_piece)[:1]
        _check_tiling(key, desc.shape, pieces)
        size = itemsize(desc.dtype)
        for piece in pieces:
            holders = holders_by_piece[piece]
            if len(holders) == 1:
                writer[(key, piece)] = holders[0]
                load[holders[0]] += piece.numel * size
            else:
                shared.append((piece.numel * size, key, piece, holders))
    # Longest first, each to its least-loaded holder: balanced within one largest piece.
    shared.sort(key=lambda item: (-item[0], item[1]))
    for nbytes, key, piece, holders in shared:
        rank = min(holders, key=lambda r: (load[r], r))
        writer[(key, piece)] = rank
        load[rank] += nbytes

    keys_per_rank: list[list[str]] = [[] for _ in range(world_size)]
    specs: dict[str, dict[str, TensorShardSpec]] = defaultdict(dict)
    for (key, piece), rank in writer.items():
        keys_per_rank[rank].append(key)
        specs[key][rank_filename(rank)] = piece.to_spec()
    tensors = {}
    for key in sorted(by_key):
        desc = first[key]
        files = dict(sorted(specs[key].items(), key=lambda kv: _rank_of(kv[0])))
        tensors[key] = TensorStorageMetadata.model_construct(
            shape=desc.shape, is_sharded=desc.is_sharded, dtype=desc.dtype, shard_spec_per_file=files
        )
    metadata = new_metadata(tensors, world_size=world_size, aliases=dict(aliases or {}))
    return SavePlan(metadata, tuple(tuple(sorted(keys)) for keys in keys_per_rank))


def _rank_of(filename: str) -> int:
    return int(filename[len("rank_") : -len(".safetensors")])


def _check_tiling(key: str, shape: Sequence[int], pieces: Sequence[Piece]) -> None:
    numel = math.prod(shape)
    ranges = sorted(r for p in pieces for r in merge_adjacent(piece_ranges(p, shape)))
    pos = 0
    for start, end in ranges:
        if start != pos:
            what = "overlap" if start < pos else f"leave elements [{pos}, {start}) out"
            raise ValueError(f"the pieces of tensor {key!r} held by the ranks {what}")
        pos = end
    if pos != numel:
        raise ValueError(f"the pieces of tensor {key!r} held by the ranks leave elements [{pos}, {numel}) out")


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy ``numel`` elements from ``file``'s piece of the tensor, at ``src_offset`` elements
    into that piece, to ``dst_offset`` elements into the destination piece."""

    file: str
    src_offset: int
    dst_offset: int
    numel: int


@dataclass(frozen=True)
class TensorLoadPlan:
    key: str
    dtype: str
    items: tuple[ReadItem, ...]

    @property
    def numel(self) -> int:
        return sum(item.numel for item in self.items)


def build_load_plan(key: str, meta: TensorStorageMetadata, wanted: Sequence[Range]) -> TensorLoadPlan:
    """The reads that fill a destination piece holding ``wanted`` ranges of tensor ``key``.

    Raises :class:`CorruptCheckpointError` when some wanted element is in no file.
    """
    files = list(meta.shard_spec_per_file)
    index = SourceIndex([spec_ranges(meta.shard_spec_per_file[f], meta.shape) for f in files])
    overlaps = index.overlaps(wanted)
    items = tuple(ReadItem(files[o.source], o.src_offset, o.dst_offset, o.numel) for o in overlaps)
    plan = TensorLoadPlan(key, meta.dtype, items)
    want = sum(e - s for s, e in wanted)
    if plan.numel != want:
        gaps = index.gaps(meta.numel)
        raise CorruptCheckpointError(
            f"tensor {key!r}: {want - plan.numel} of the {want} elements to load are in no file "
            f"(missing ranges start {gaps[:3]})"
        )
    return plan
