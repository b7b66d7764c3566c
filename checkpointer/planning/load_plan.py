"""Load plans: which bytes of which rank file land where in a destination piece.

:func:`build_load_plan` turns one tensor's metadata and the piece a rank wants into reads. A box
stays a box: the stored pieces are indexed as tiles once per distinct layout
(:class:`~checkpointer.planning.boxes.TileIndex`) and each read is a strided box on both sides,
a few per stored piece it meets, however many rows it has. Flattened ranges that are a product
of index runs (``_StridedShard``) are tiles too, and a wanted piece equal to a stored one is one
contiguous read. Other flattened ranges read from flattened ranges keep their own 1-D path
(:class:`~checkpointer.planning.overlap.SourceIndex`), which also serves any layout the tile
index cannot prove disjoint. Pieces a box shard rule
describes are found from the rule (:mod:`~checkpointer.planning.rule_reads`), without the index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import CorruptCheckpointError
from ..format.metadata import TensorStorageMetadata
from ..format.specs import MAX_RUNS_PER_TENSOR, Layout, ShardSpecs, box_run_count
from .boxes import BoxCopy, TileIndex
from .overlap import Range, SourceIndex, box_ranges
from .pieces import Piece, layout_tiles, piece_ranges, piece_tiles, spec_tiles, strided_runs, whole
from .index_runs import runs_tiles
from .rule_reads import rule_copies

__all__ = ["ReadItem", "TensorLoadPlan", "build_load_plan", "whole_file_plan", "stored_cover_exactly", "stored_ranges"]

_REMEMBERED_PIECES = 1024
"""Wanted pieces whose items a layout keeps (a model's ranks want a few each; a streaming read
of a large tensor wants one per block, and those are not worth keeping)."""


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy ``numel`` elements from ``file``'s piece of the tensor, at ``src_offset`` elements
    into that piece, to ``dst_offset`` elements into the destination piece.

    With ``sizes``, the elements are a strided box on each side: ``sizes`` with ``src_strides``
    in the stored piece and ``dst_strides`` in the destination (a tensor-parallel piece read
    from pieces cut along another dimension). Without, they are one contiguous run on both."""

    file: str
    src_offset: int
    dst_offset: int
    numel: int
    sizes: tuple[int, ...] = ()
    src_strides: tuple[int, ...] = ()
    dst_strides: tuple[int, ...] = ()

    @property
    def src_end(self) -> int:
        """One past the last element of the stored piece this item reads."""
        if not self.sizes:
            return self.src_offset + self.numel
        return self.src_offset + 1 + sum((n - 1) * s for n, s in zip(self.sizes, self.src_strides))


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


def build_load_plan(key: str, meta: TensorStorageMetadata, wanted: Sequence[Range] | Piece) -> TensorLoadPlan:
    """The reads that fill a destination piece of tensor ``key``: ``wanted`` flattened ranges
    stored back to back, or a :class:`Piece` (a box stays a box: its reads are strided boxes,
    a few per stored piece it meets, however many rows it has).

    Raises :class:`CorruptCheckpointError` when some wanted element is in no file.
    """
    piece = wanted if isinstance(wanted, Piece) else Piece(flat=tuple(map(tuple, wanted)))  # type: ignore[arg-type]
    specs = meta.shard_spec_per_file
    if isinstance(specs, ShardSpecs):
        layout: Layout | None = specs.layout
        files: Sequence[str] = specs.layout.names
        all_flat = specs.layout.local_shape is None
    else:
        layout, files = None, list(specs)
        all_flat = all(specs[f].flattened_offsets is not None for f in files)
    if layout is None:
        return _build(key, meta, piece, layout, files, all_flat)
    remembered = layout.memo.setdefault("items", {})  # tensors of one layout wanting one piece share items
    try:
        known = remembered.get(piece)
    except TypeError:  # a Piece holding lists cannot be a key: planned, not remembered
        return _build(key, meta, piece, layout, files, all_flat)
    if known is not None:
        return TensorLoadPlan(key, meta.dtype, known)
    plan = _build(key, meta, piece, layout, files, all_flat)
    if len(remembered) < _REMEMBERED_PIECES:
        remembered[piece] = plan.items
    return plan


def _build(
    key: str, meta: TensorStorageMetadata, piece: Piece, layout: Layout | None, files: Sequence[str], all_flat: bool
) -> TensorLoadPlan:
    plain = all_flat and not _strided_layout(meta, layout, files)  # ranges best read as ranges
    if piece.flat is None and plain and box_run_count(piece.local_shape, piece.global_offset, meta.shape) <= 1:
        piece = Piece(flat=tuple(piece_ranges(piece, meta.shape)))  # one run: the flattened ranges' own path
    runs = strided_runs(piece, meta.shape) if piece.flat is not None and plain else None
    if not (piece.flat is not None and plain and runs is None):
        wanted = runs_tiles(runs) if runs is not None else piece_tiles(piece, meta.shape)  # the runs found once
        rule = _box_rule(meta)
        if rule is not None:
            assert layout is not None
            copies = rule_copies(layout, rule, wanted)
        else:
            tiles = _tile_index(meta, layout, files)
            _refuse_conflict(key, tiles.conflict, files)
            if piece.flat is not None and tiles.ok and (i := _file_holding(meta, layout, files, piece.flat)) is not None:
                return TensorLoadPlan(key, meta.dtype, (ReadItem(files[i], 0, 0, piece.numel),) if piece.numel else ())
            copies = tiles.copies(wanted) if tiles.ok else None
        if copies is not None:
            items = tuple(map(_read_item, [files[c.source] for c in copies], copies))
            return _checked(key, meta, TensorLoadPlan(key, meta.dtype, items), piece.numel, lambda: _gaps(key, meta, layout, files))
    index = _source_index(key, meta, layout, files)
    _refuse_conflict(key, index.conflict, files)
    overlaps = index.overlaps(piece_ranges(piece, meta.shape))
    items = tuple(ReadItem(files[o.source], o.src_offset, o.dst_offset, o.numel) for o in overlaps)
    return _checked(key, meta, TensorLoadPlan(key, meta.dtype, items), piece.numel, lambda: index.gaps(meta.numel))


def whole_file_plan(key: str, dtype: str, shape: Sequence[int], file: str, piece: Piece) -> TensorLoadPlan:
    """The reads of ``piece`` from ``file``, which holds the whole tensor (a safetensors file of
    full tensors, as Hugging Face writes): at most ``2 * ndim - 1`` items, however many rows."""
    index = TileIndex(shape, [piece_tiles(whole(shape), shape)])
    copies = index.copies(piece_tiles(piece, shape))
    return TensorLoadPlan(key, dtype, tuple(_read_item(file, c) for c in copies))


def _box_rule(meta: TensorStorageMetadata) -> dict | None:
    """The box shard rule the stored pieces follow (checked when read or planned), if any."""
    specs = meta.shard_spec_per_file
    rule = specs.rule if isinstance(specs, ShardSpecs) else None
    return rule if rule is not None and rule["form"] == "box" else None


def _strided_layout(meta: TensorStorageMetadata, layout: Layout | None, files: Sequence[str]) -> bool:
    """Whether some stored piece is flattened ranges that are a product of index runs (read as tiles)."""
    if layout is not None and "strided" in layout.memo:
        return layout.memo["strided"]
    strided = any(
        flat is not None and strided_runs(Piece(flat=flat), meta.shape) is not None
        for flat in _stored_flat(meta, layout, files)
    )
    if layout is not None:
        layout.memo["strided"] = strided
    return strided


def _file_holding(meta: TensorStorageMetadata, layout: Layout | None, files: Sequence[str], flat) -> int | None:
    """The first file whose piece is exactly the ranges ``flat`` (the same layout saved and loaded:
    one contiguous read, not one per tile)."""
    held = layout.memo.get("held") if layout is not None else None
    if held is None:
        held = {}
        for i, stored in enumerate(_stored_flat(meta, layout, files)):
            if stored is not None:
                held.setdefault(stored, i)
        if layout is not None:
            layout.memo["held"] = held
    return held.get(tuple(map(tuple, flat)))


def _stored_flat(meta: TensorStorageMetadata, layout: Layout | None, files: Sequence[str]):
    """Each file's flattened ranges as a tuple of pairs (None for a box), in the order of ``files``."""
    if layout is not None:
        return (layout.form(i)[0] for i in range(len(files)))
    specs = meta.shard_spec_per_file
    return (None if (s := specs[f]).flattened_offsets is None else tuple(map(tuple, s.flattened_offsets)) for f in files)


def _tile_index(meta: TensorStorageMetadata, layout: Layout | None, files: Sequence[str]) -> TileIndex:
    """The stored pieces as tiles, indexed once per distinct layout."""
    if layout is None:
        specs = meta.shard_spec_per_file
        return TileIndex(meta.shape, [spec_tiles(specs[f], meta.shape) for f in files])
    index = layout.memo.get("tile_index")
    if index is None:
        index = layout.memo["tile_index"] = TileIndex(layout.shape, [layout_tiles(layout, i) for i in range(len(files))])
    return index


def _source_index(key: str, meta: TensorStorageMetadata, layout: Layout | None, files: Sequence[str]) -> SourceIndex:
    """The stored pieces as flattened ranges, indexed once per distinct layout."""
    index = layout.memo.get("source_index") if layout is not None else None
    if index is None:
        index = SourceIndex(stored_ranges(key, meta))
        if layout is not None:
            layout.memo["source_index"] = index
    return index


def stored_ranges(key: str, meta: TensorStorageMetadata) -> list[list[Range]]:
    """Each file's piece of ``key`` as flattened ranges (the fallback for pieces not proven to
    tile the tensor as boxes). A box is a range per row of its leading dims: refused, as a
    :class:`CorruptCheckpointError`, once the pieces come to more than
    :data:`~checkpointer.format.specs.MAX_RUNS_PER_TENSOR` ranges, before they are listed."""
    specs = meta.shard_spec_per_file
    layout = specs.layout if isinstance(specs, ShardSpecs) else None
    forms = (
        (layout.form(i) for i in range(len(layout.names)))
        if layout is not None
        else ((s.flattened_offsets, s.local_shape, s.global_offset) for s in specs.values())
    )
    out, runs = [], 0
    for flat, local_shape, global_offset in forms:
        runs += len(flat) if flat is not None else box_run_count(local_shape, global_offset, meta.shape)
        if runs > MAX_RUNS_PER_TENSOR:
            raise CorruptCheckpointError(
                f"tensor {key!r}: its pieces do not tile it as boxes, and as flattened ranges they are more than "
                f"{MAX_RUNS_PER_TENSOR} of them: too many to check"
            )
        out.append([tuple(r) for r in flat] if flat is not None else box_ranges(meta.shape, local_shape, global_offset))
    return out


def stored_cover_exactly(meta: TensorStorageMetadata, *, replicas: bool = True) -> bool:
    """Whether the stored pieces are proven, as boxes, to hold every element (once, but for
    whole replicas where ``replicas``). ``False``: not proven; check with flattened ranges,
    which also say where."""
    if _box_rule(meta) is not None:
        return True  # a box rule's pieces tile the tensor, each once (``check_rule``)
    specs = meta.shard_spec_per_file
    layout = specs.layout if isinstance(specs, ShardSpecs) else None
    index = _tile_index(meta, layout, list(specs))
    return index.ok and index.covered == meta.numel and (replicas or not index.replicas)


def _read_item(file: str, copy: BoxCopy) -> ReadItem:
    if copy.contiguous:
        return ReadItem(file, copy.src_offset, copy.dst_offset, copy.numel)
    return ReadItem(file, copy.src_offset, copy.dst_offset, copy.numel, copy.sizes, copy.src_strides, copy.dst_strides)


def _gaps(key: str, meta: TensorStorageMetadata, layout: Layout | None, files: Sequence[str]) -> list[Range]:
    return _source_index(key, meta, layout, files).gaps(meta.numel)


def _refuse_conflict(key: str, conflict: tuple[int, int] | None, files: Sequence[str]) -> None:
    """Pieces that overlap, other than as replicas, are a corrupt checkpoint: not read first-come."""
    if conflict is not None:
        a, b = sorted(conflict)
        raise CorruptCheckpointError(f"tensor {key!r}: the pieces in {files[a]} and {files[b]} overlap")


def _checked(key: str, meta: TensorStorageMetadata, plan: TensorLoadPlan, want: int, gaps) -> TensorLoadPlan:
    if plan.numel != want:
        raise CorruptCheckpointError(
            f"tensor {key!r}: {want - plan.numel} of the {want} elements to load are in no file "
            f"(missing ranges start {gaps()[:3]})"
        )
    return plan
