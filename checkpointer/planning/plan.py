"""Save and load plans: frozen dataclasses that say exactly what to write and what to copy where.

``build_save_plan`` turns what every rank holds into the checkpoint's metadata and each
rank's list of pieces to write: a piece held by several ranks (a replicated tensor, a
``Replicate`` placement) is written once, by the holder with the fewest bytes so far.
``build_load_plan`` turns one tensor's metadata and the piece a rank wants into reads.
Rank and world size are arguments; nothing here looks them up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain, compress
from operator import add, attrgetter, lt
from typing import Sequence

from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize
from ..format.layout import rank_filename
from ..format.metadata import StorageMetadata, TensorShardSpec, TensorStorageMetadata, new_metadata
from ..format.specs import Layout, ShardSpecs, gc_paused, shared_layout
from .overlap import Range, SourceIndex, box_ranges, layout_ranges, merge_adjacent

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


_KEY = attrgetter("key")
_PIECE = attrgetter("piece")
_SHAPE = attrgetter("shape")
_DTYPE = attrgetter("dtype")
_FLAT = attrgetter("flat")
_LOCAL_SHAPE = attrgetter("local_shape")
_GLOBAL_OFFSET = attrgetter("global_offset")
_FORM = attrgetter("flat", "local_shape", "global_offset")


def build_save_plan(
    descs_per_rank: Sequence[Sequence[PieceDesc]], *, aliases: dict[str, str] | None = None
) -> SavePlan:
    """Merge every rank's pieces into metadata and assign each distinct piece one writer.

    Raises ``ValueError`` naming the key when ranks disagree on a tensor's shape or dtype,
    or when the distinct pieces of a tensor overlap or leave elements out.
    """
    with gc_paused():
        return _build_save_plan(descs_per_rank, aliases)


def _build_save_plan(descs_per_rank: Sequence[Sequence[PieceDesc]], aliases: dict[str, str] | None) -> SavePlan:
    world_size = len(descs_per_rank)
    groups = _by_key(descs_per_rank)
    # key -> the ranks writing its pieces, the pieces, their element counts, its item size
    written: dict[str, tuple[list[int], list[Piece], list[int], int]] = {}
    shared: list[tuple[int, str, Piece, list[int]]] = []
    names = [rank_filename(r) for r in range(world_size)]
    seen: dict[tuple, list[tuple]] = {}
    planned: dict[str, Layout] = {}
    for key, (ranks, descs) in groups.items():
        desc = descs[0]
        _check_agreement(key, ranks, descs)
        size = itemsize(desc.dtype)
        pieces = list(map(_PIECE, descs))
        fast = _split_tiling(desc.shape, ranks, pieces, names, seen)
        if fast is not None:
            writers, mine, numels, planned[key] = fast
            written[key] = (list(writers), mine, numels, size)
            continue
        writers, mine, numels, held = _split(key, desc.shape, ranks, pieces)
        written[key] = (writers, mine, numels, size)
        shared.extend((n * size, key, piece, holders) for n, piece, holders in held)
    if shared:
        # Longest first, each to its least-loaded holder (the lowest rank among equals):
        # balanced within one largest piece.
        load = [0] * world_size
        for writers, _, numels, size in written.values():
            for rank, n in zip(writers, numels):
                load[rank] += n * size
        shared.sort(key=lambda item: (-item[0], item[1]))
        for nbytes, key, piece, holders in shared:
            rank = min(holders, key=load.__getitem__)
            written[key][0].append(rank)
            written[key][1].append(piece)
            load[rank] += nbytes
    unsorted = {key for _, key, _, _ in shared}

    keys_per_rank: list[list[str]] = [[] for _ in range(world_size)]
    layouts: dict[tuple, list[Layout]] = {}
    tensors = {}
    for key in sorted(groups):
        desc = groups[key][1][0]
        writers, mine, _, _ = written[key]
        if key in unsorted:
            order = sorted(range(len(writers)), key=writers.__getitem__)
            writers, mine = [writers[i] for i in order], [mine[i] for i in order]
        for keys in map(keys_per_rank.__getitem__, writers):
            keys.append(key)
        layout = planned.get(key) or _layout(layouts, desc.shape, list(map(names.__getitem__, writers)), mine)
        tensors[key] = TensorStorageMetadata.model_construct(
            shape=desc.shape, is_sharded=desc.is_sharded, dtype=desc.dtype, shard_spec_per_file=ShardSpecs(layout)
        )
    metadata = new_metadata(tensors, world_size=world_size, aliases=dict(aliases or {}))
    return SavePlan(metadata, tuple(map(tuple, keys_per_rank)))


def _split_tiling(
    shape: tuple[int, ...], ranks: Sequence[int], pieces: list[Piece], names: list[str], seen: dict[tuple, list[tuple]]
) -> tuple[list[int], list[Piece], list[int], Layout] | None:
    """The usual cases in bulk: sharded rows (FSDP2's ``Shard(0)``) or one flattened range per
    rank (flat-sharded), tiling the tensor, so that no two pieces are equal and each has one
    holder, its writer. Returns the writers, pieces, element counts and layout; or ``None``
    ("not shown": :func:`_split` decides). ``seen`` remembers answers: the many tensors of one
    shape usually have equal pieces."""
    numel, n = math.prod(shape), len(pieces)
    if not numel or not n:
        return None
    flat = list(map(_FLAT, pieces))
    if flat.count(None) == n:
        sizes, offsets = list(map(_LOCAL_SHAPE, pieces)), list(map(_GLOBAL_OFFSET, pieces))
        memo = seen.setdefault(("rows", shape, n), [])
        for was in memo:
            if was[0] == ranks and was[1] == sizes and was[2] == offsets:
                return was[3]
        answer = None
        if None not in sizes and None not in offsets:
            answer = _rows(shape, ranks, pieces, sizes, offsets, names)
        memo.append((ranks, sizes, offsets, answer))
        return answer
    if flat.count(None) == 0:
        memo = seen.setdefault(("ranges", shape, n), [])
        for was in memo:
            if was[0] == ranks and was[1] == flat:
                return was[3]
        answer = _ranges(numel, shape, ranks, pieces, flat, names) if set(map(len, flat)) == {1} else None
        memo.append((ranks, flat, None, answer))
        return answer
    return None


def _rows(shape, ranks, pieces, sizes, offsets, names) -> tuple[list[int], list[Piece], list[int], Layout] | None:
    numels = list(map(math.prod, sizes))
    if 0 in numels:
        ranks, pieces, sizes, offsets = (list(compress(x, numels)) for x in (ranks, pieces, sizes, offsets))
        numels = list(filter(None, numels))
    if not _tiles_by_rows(shape, sizes, offsets):
        return None
    ranks = list(ranks)
    return ranks, list(pieces), numels, Layout(shape, list(map(names.__getitem__, ranks)), None, sizes, offsets)


def _ranges(numel, shape, ranks, pieces, flat, names) -> tuple[list[int], list[Piece], list[int], Layout] | None:
    bounds = [f[0] for f in flat]
    numels = [end - start for start, end in bounds]
    if 0 in numels:
        ranks, pieces, bounds, flat = (list(compress(x, numels)) for x in (ranks, pieces, bounds, flat))
        numels = list(filter(None, numels))
    if not bounds or not _tiles_by_bounds(numel, bounds):
        return None
    ranks = list(ranks)
    return ranks, list(pieces), numels, Layout(shape, list(map(names.__getitem__, ranks)), flat, None, None)


def _split(
    key: str, shape: tuple[int, ...], ranks: Sequence[int], pieces: list[Piece]
) -> tuple[list[int], list[Piece], list[int], list[tuple[int, Piece, list[int]]]]:
    """One tensor's distinct pieces to write, checked to tile it: those held by one rank (that
    rank, the piece, its element count, each in rank order), and those held by several (element
    count, piece, holders)."""
    numel = math.prod(shape)
    distinct, holders = _distinct(ranks, pieces)
    counts = [p.numel for p in distinct]
    if numel:
        distinct, holders, counts = (list(compress(x, counts)) for x in (distinct, holders, counts))
    else:
        distinct, holders, counts = distinct[:1], holders[:1], counts[:1]
    _check_tiling(key, shape, distinct)
    writers: list[int] = []
    mine: list[Piece] = []
    numels = []
    held: list[tuple[int, Piece, list[int]]] = []
    for piece, by, count in zip(distinct, holders, counts):
        if len(by) == 1:
            writers.append(by[0])
            mine.append(piece)
            numels.append(count)
        else:
            held.append((count, piece, by))
    return writers, mine, numels, held


def _tiles_by_bounds(numel: int, bounds: list[tuple[int, int]]) -> bool:
    """True when the ``[start, end)`` ranges tile ``[0, numel)`` exactly (False: not shown)."""
    starts, ends = zip(*sorted(bounds))
    return starts[0] == 0 and ends[-1] == numel and starts[1:] == ends[:-1] and all(map(lt, starts, ends))


def _by_key(descs_per_rank: Sequence[Sequence[PieceDesc]]) -> dict[str, tuple[Sequence[int], Sequence[PieceDesc]]]:
    """Each key's holders (ascending) and their descriptions, keys in first-seen order."""
    if descs_per_rank:
        keys = list(map(_KEY, descs_per_rank[0]))
        if len(set(keys)) == len(keys) and all(list(map(_KEY, descs)) == keys for descs in descs_per_rank[1:]):
            ranks = range(len(descs_per_rank))  # the usual case: every rank holds every key, in one order
            return {key: (ranks, column) for key, column in zip(keys, zip(*descs_per_rank))}
    groups: dict[str, tuple[list[int], list[PieceDesc]]] = {}
    for rank, descs in enumerate(descs_per_rank):
        for d in descs:
            group = groups.get(d.key)
            if group is None:
                groups[d.key] = group = ([], [])
            group[0].append(rank)
            group[1].append(d)
    return groups


def _check_agreement(key: str, ranks: Sequence[int], descs: Sequence[PieceDesc]) -> None:
    shapes, dtypes = list(map(_SHAPE, descs)), list(map(_DTYPE, descs))
    if shapes.count(shapes[0]) == len(shapes) and dtypes.count(dtypes[0]) == len(dtypes):
        return
    ref = descs[0]
    for rank, d in zip(ranks, descs):
        if (ref.shape, ref.dtype) != (d.shape, d.dtype):
            raise ValueError(
                f"tensor {key!r} is {list(ref.shape)} {ref.dtype} on one rank and "
                f"{list(d.shape)} {d.dtype} on rank {rank}"
            )


def _distinct(ranks: Sequence[int], pieces: list[Piece]) -> tuple[list[Piece], list[list[int]]]:
    """The distinct pieces, first-seen order, each with its holders (ascending)."""
    forms = list(map(_FORM, pieces))
    if not forms or forms.count(forms[0]) == len(forms):  # replicated (or none)
        return pieces[:1], [list(ranks)]
    holders: dict[tuple, list[int]] = {}
    first: list[Piece] = []
    for rank, form, piece in zip(ranks, forms, pieces):
        by = holders.get(form)
        if by is None:
            holders[form] = [rank]
            first.append(piece)
        else:
            by.append(rank)
    return first, list(holders.values())


def _tiles_by_rows(shape: Sequence[int], sizes: list, offsets: list) -> bool:
    """True when the boxes (``sizes`` at ``offsets``) are whole rows that tile ``shape`` exactly
    (FSDP's ``Shard(0)``). False means "not shown": the exact check decides."""
    n, ndim = len(sizes), len(shape)
    if not ndim or not n or set(map(len, sizes)) != {ndim} or set(map(len, offsets)) != {ndim}:
        return False
    sizes_all, offsets_all = list(chain.from_iterable(sizes)), list(chain.from_iterable(offsets))
    for d in range(1, ndim):
        if sizes_all[d::ndim].count(shape[d]) != n or offsets_all[d::ndim].count(0) != n:
            return False
    rows, starts = sizes_all[::ndim], offsets_all[::ndim]
    return min(rows) > 0 and _tiles_by_bounds(shape[0], list(zip(starts, map(add, starts, rows))))


def _layout(
    layouts: dict[tuple, list[Layout]], shape: tuple[int, ...], names: list[str], pieces: list[Piece]
) -> Layout:
    """The layout of ``pieces`` written to ``names``, shared with an equal one planned before."""

    def column(values: list) -> list | None:
        return values if values.count(None) != len(values) else None

    flat = column(list(map(_FLAT, pieces)))
    ls = column(list(map(_LOCAL_SHAPE, pieces)))
    go = column(list(map(_GLOBAL_OFFSET, pieces)))
    return shared_layout(layouts, shape, names, flat, ls, go)


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

    @property
    def files(self) -> list[str]:
        """The files read, in order of first read."""
        return list(dict.fromkeys(item.file for item in self.items))


def build_load_plan(key: str, meta: TensorStorageMetadata, wanted: Sequence[Range]) -> TensorLoadPlan:
    """The reads that fill a destination piece holding ``wanted`` ranges of tensor ``key``.

    Raises :class:`CorruptCheckpointError` when some wanted element is in no file.
    """
    specs = meta.shard_spec_per_file
    if isinstance(specs, ShardSpecs):
        layout = specs.layout
        files: Sequence[str] = layout.names
        index = layout.memo.get("source_index")
        if index is None:  # equal layouts are shared: planned once per distinct layout
            index = layout.memo["source_index"] = SourceIndex(
                [layout_ranges(layout, i) for i in range(len(files))]
            )
    else:
        files = list(specs)
        index = SourceIndex([spec_ranges(specs[f], meta.shape) for f in files])
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
