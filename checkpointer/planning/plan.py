"""Save and load plans: frozen dataclasses that say exactly what to write and what to copy where.

``build_save_plan`` turns what every rank holds into the checkpoint's metadata and each
rank's list of pieces to write: a piece held by several ranks (a replicated tensor, a
``Replicate`` placement) is written once, by the holder with the fewest bytes so far; the
other holders' copies (:meth:`SavePlan.copies_for`) are compared with it before a commit.
(The load side, from metadata to reads, is :mod:`~checkpointer.planning.load_plan`.)
Rank and world size are arguments; nothing here looks them up.
"""

from __future__ import annotations

import math
from itertools import compress
from operator import attrgetter
from typing import Sequence

import numpy as np

from ..format.dtypes import itemsize
from ..format.layout import FORMAT_VERSION, LEGACY_FORMAT_VERSION, rank_filename
from ..format.rules import detect_rule
from ..format.metadata import TensorStorageMetadata, new_metadata
from ..format.specs import MAX_RUNS_PER_TENSOR, Layout, ShardSpecs, box_run_count, gc_paused, shared_layout
from .box_groups import box_groups
from .boxes import TileIndex
from .overlap import merge_adjacent
from .pieces import (
    BOX, Piece, PieceDesc, RankPieces, Structure, check_agreement, descs_by_key, piece_ranges, piece_tiles,
)
from .save_plan import SavePlan

__all__ = ["Piece", "PieceDesc", "RankPieces", "Structure", "SavePlan", "build_save_plan", "check_tiling"]


_PIECE = attrgetter("piece")
_FLAT = attrgetter("flat")
_LOCAL_SHAPE = attrgetter("local_shape")
_GLOBAL_OFFSET = attrgetter("global_offset")
_FORM = attrgetter("flat", "local_shape", "global_offset")


def build_save_plan(
    descs_per_rank: Sequence[Sequence[PieceDesc] | RankPieces],
    *,
    aliases: dict[str, str] | None = None,
    compact: bool = True,
) -> SavePlan:
    """Merge every rank's pieces into metadata and assign each distinct piece one writer.

    Each rank's pieces come as :class:`PieceDesc` s or as columns (:class:`RankPieces`).
    Raises ``ValueError`` naming the key when ranks disagree on a tensor's shape or dtype,
    or when the distinct pieces of a tensor overlap or leave elements out.

    ``aliases`` (key -> the key it shares memory with) are what any rank found: a rank whose
    piece of a tied tensor is empty cannot tell that it shares memory, so it may still list
    the alias as a key of its own; such empty pieces are dropped here.

    ``compact``: a tensor whose pieces follow a shard rule (:mod:`~checkpointer.format.rules`)
    is described by the rule (format 2); without, every piece is listed (format 1, the form
    OLMo-core 0.1.0 reads). Pieces that several ranks hold (HSDP) are then written by the
    holders of one replica for each contiguous block of pieces, which a rule describes.
    """
    with gc_paused():
        columns = [d if isinstance(d, RankPieces) else RankPieces.from_descs(d) for d in descs_per_rank]
        if aliases:
            listed: dict[int, bool] = {}  # per structure (ranks of one model share one): lists an alias?
            for c in columns:
                if id(c.structure) not in listed:
                    listed[id(c.structure)] = any(key in aliases for key in c.structure.keys)
            if any(listed.values()):
                columns = [_without_aliases(c, aliases) if listed[id(c.structure)] else c for c in columns]
                descs_per_rank = columns
        if columns and all(c.structure == columns[0].structure for c in columns):
            plan = _plan_uniform(columns[0].structure, np.stack([c.values for c in columns]), aliases, compact)
        else:
            plan = _plan_general([d.descs() if isinstance(d, RankPieces) else d for d in descs_per_rank], aliases, compact)
        return plan


def _without_aliases(columns: RankPieces, aliases: dict[str, str]) -> RankPieces:
    """A rank's pieces less the keys other ranks found to be aliases (which must be empty here)."""
    kept = []
    for desc in columns.descs():
        if desc.key not in aliases:
            kept.append(desc)
        elif desc.piece.numel:
            raise ValueError(
                f"tensor {desc.key!r} shares memory with {aliases[desc.key]!r} on some ranks but not on others"
            )
    return RankPieces.from_descs(kept)


class _Planned:
    """What the analysis of one tensor's pieces decided, before shared pieces get their writers."""

    __slots__ = ("writers", "pieces", "layout", "numels", "held", "fixed", "options", "own_layout")

    def __init__(self, writers: Sequence[int], pieces: list[Piece] | None, layout: Layout | None,
                 numels: Sequence[int], held: list[tuple[int, Piece, list[int] | None]],
                 fixed: tuple[np.ndarray, list[Piece], np.ndarray] | None = None):
        self.writers = np.asarray(writers, dtype=np.int64)  # ranks writing one piece each
        self.pieces = pieces  # their pieces (None: ``layout`` holds them)
        self.layout = layout
        self.numels = np.asarray(numels, dtype=np.int64)
        self.held = held  # pieces several ranks hold: (element count, piece, holders or None for all)
        # Pieces several ranks hold, written by one option of writers: (writers, options x pieces;
        # the pieces; their element counts).
        self.fixed = fixed
        self.options: dict[int, list] = {}  # option -> [its writers, its pieces, layout, writers array] once made
        self.own_layout: Layout | None = None  # the layout of ``writers`` and ``pieces`` alone, once made


def _plan_uniform(structure: Structure, values: np.ndarray, aliases: dict[str, str] | None, compact: bool = True) -> SavePlan:
    """Every rank holds the same keys: each tensor's pieces are one block of the columns, and
    tensors whose blocks are equal (the layers of a model) are analysed once."""
    world = len(values)
    ranks = np.arange(world)
    names = [rank_filename(r) for r in range(world)]
    by_rank = np.ascontiguousarray(values.T)
    layouts: dict[tuple, list[Layout]] = {}
    answers: dict[tuple, _Planned] = {}
    planned: list[_Planned] = []
    for i, (key, shape, kind) in enumerate(zip(structure.keys, structure.shapes, structure.kinds)):
        block = by_rank[slice(*structure.span(i))]
        signature = (shape, kind, block.tobytes())
        answer = answers.get(signature)
        if answer is None:
            answer = answers[signature] = _analyse(key, shape, kind, block, ranks, names, layouts, everyone=True,
                                                   compact=compact)
        planned.append(answer)
    return _assign(
        world, structure.keys, structure.shapes, structure.dtypes, structure.sharded, planned, names, layouts, aliases,
        compact,
    )


def _plan_general(
    descs_per_rank: Sequence[Sequence[PieceDesc]], aliases: dict[str, str] | None, compact: bool = True
) -> SavePlan:
    """Ranks hold different keys (pipeline stages, a rank without some tensor): tensor by tensor."""
    world = len(descs_per_rank)
    names = [rank_filename(r) for r in range(world)]
    groups = descs_by_key(descs_per_rank)
    layouts: dict[tuple, list[Layout]] = {}
    keys, shapes, dtypes, sharded, planned = [], [], [], [], []
    for key, (holders, descs) in groups.items():
        check_agreement(key, holders, descs)
        desc = descs[0]
        pieces = list(map(_PIECE, descs))
        kinds = {p.kind for p in pieces}
        if len(kinds) == 1:
            block = np.array([p.numbers() for p in pieces], dtype=np.int64).reshape(len(pieces), -1).T
            answer = _analyse(key, desc.shape, kinds.pop(), block, np.array(holders), names, layouts,
                              everyone=len(holders) == world, compact=compact)
        else:
            answer = _mixed(key, desc.shape, list(holders), pieces, everyone=len(holders) == world)
        keys.append(key)
        shapes.append(desc.shape)
        dtypes.append(desc.dtype)
        sharded.append(desc.is_sharded)
        planned.append(answer)
    return _assign(world, tuple(keys), shapes, dtypes, sharded, planned, names, layouts, aliases, compact)


def _analyse(
    key: str, shape: tuple[int, ...], kind: int, block: np.ndarray, ranks: np.ndarray, names: list[str],
    layouts: dict[tuple, list[Layout]], *, everyone: bool, compact: bool = False,
) -> _Planned:
    """One tensor's pieces, ``block[:, j]`` the numbers of the piece of ``ranks[j]``: the usual
    cases in bulk (rows tiling the tensor, as FSDP2's ``Shard(0)``; one flattened range per rank
    tiling it; the same piece on every rank), anything else piece by piece."""
    numel = math.prod(shape)
    if numel and block.shape[1]:
        tiled = _tiling(shape, kind, block, numel)
        if tiled is not None:
            keep, numels = tiled
            writers = ranks[keep]
            kept = block[:, keep].T.tolist()
            if kind == BOX:
                ndim = len(shape)
                ls, go = [tuple(v[:ndim]) for v in kept], [tuple(v[ndim:]) for v in kept]
                layout = shared_layout(layouts, shape, [names[r] for r in writers.tolist()], None, ls, go)
            else:
                flat = [((v[0], v[1]),) for v in kept]
                layout = shared_layout(layouts, shape, [names[r] for r in writers.tolist()], flat, None, None)
            return _Planned(writers, None, layout, numels, [])
        if block.shape[1] > 1 and (block == block[:, :1]).all():
            piece = Piece.from_numbers(kind, block[:, 0].tolist())
            if piece.numel:
                check_tiling(key, shape, [piece])
                return _Planned([], [], None, [], [(piece.numel, piece, None if everyone else ranks.tolist())])
    if kind == BOX:
        grouped = _grouped(shape, block, ranks, names, layouts, everyone=everyone, compact=compact)
        if grouped is not None:
            return grouped
    pieces = [Piece.from_numbers(kind, column) for column in block.T.tolist()]
    if compact:
        blocks = _replica_blocks(key, shape, ranks.tolist(), pieces)
        if blocks is not None:
            return blocks
    return _mixed(key, shape, ranks.tolist(), pieces, everyone=everyone)


def _replica_blocks(key: str, shape: tuple[int, ...], ranks: list[int], pieces: list[Piece]) -> _Planned | None:
    """HSDP: every distinct piece held by the same number ``R > 1`` of ranks. Each option ``q``
    has every piece written by its ``q``-th holder (one replica writes the whole tensor; which
    one is chosen per tensor, the least loaded): a rule describes it, as it does one replica's."""
    writers, mine, numels, held = _split(key, shape, ranks, pieces)
    if writers or not held or len({len(by) for _, _, by in held}) != 1:
        return None
    options = np.array([by for _, _, by in held], dtype=np.int64).T
    return _Planned([], [], None, [], [], (options, [p for _, p, _ in held], np.array([n for n, _, _ in held])))


def _grouped(shape: tuple[int, ...], block: np.ndarray, ranks: np.ndarray, names: list[str],
             layouts: dict[tuple, list[Layout]], *, everyone: bool, compact: bool) -> _Planned | None:
    """What ``_split`` and the analysis after it decide for box pieces, from arrays
    (:func:`~checkpointer.planning.box_groups.box_groups`); ``None``: take that path."""
    groups = box_groups(shape, block)
    if groups is None:
        return None
    if (groups.counts == 1).all():  # each rank its own piece: the layout, without an object per rank
        writers, ndim = ranks[groups.first], len(shape)
        kept = block[:, groups.first].T.tolist()
        layout = shared_layout(layouts, shape, [names[r] for r in writers.tolist()], None,
                               [tuple(v[:ndim]) for v in kept], [tuple(v[ndim:]) for v in kept])
        return _Planned(writers, None, layout, groups.numels, [])
    pieces = [Piece.from_numbers(BOX, v) for v in block[:, groups.first].T.tolist()]
    if compact and (groups.counts == groups.counts[0]).all():  # HSDP: as ``_replica_blocks``
        options = ranks[groups.members].reshape(len(pieces), -1).T
        return _Planned([], [], None, [], [], (options, pieces, groups.numels))
    single = (groups.counts == 1).tolist()
    numels = groups.numels.tolist()
    held = [(n, p, None if everyone and len(by) == len(ranks) else by.tolist())
            for one, n, p, by in zip(single, numels, pieces, groups.holders()) if not one]
    return _Planned(ranks[groups.first[groups.counts == 1]], list(compress(pieces, single)), None,
                    list(compress(numels, single)), held)


def _tiling(shape: tuple[int, ...], kind: int, block: np.ndarray, numel: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(which pieces are not empty, their element counts)`` when the pieces are whole rows
    (boxes) or single ranges (flat) tiling the tensor exactly; ``None``: not shown."""
    if kind == BOX and shape:
        ndim = len(shape)
        sizes, offsets = block[:ndim], block[ndim:]
        counts = sizes.prod(axis=0)
        keep = counts > 0
        if not keep.any() or (sizes < 0).any() or (offsets < 0).any():
            return None
        if ndim > 1:
            inner = np.array(shape[1:], dtype=np.int64)[:, None]
            if not ((sizes[1:, keep] == inner).all() and (offsets[1:, keep] == 0).all()):
                return None
        starts, ends, extent = offsets[0, keep], offsets[0, keep] + sizes[0, keep], shape[0]
    elif kind == 1:
        counts = block[1] - block[0]
        keep = counts > 0
        if not keep.any() or (counts < 0).any() or (block[0] < 0).any():
            return None
        starts, ends, extent = block[0, keep], block[1, keep], numel
    else:
        return None
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    if starts[0] != 0 or ends[-1] != extent or not (starts[1:] == ends[:-1]).all():
        return None
    return keep, counts[keep]


def _mixed(key: str, shape: tuple[int, ...], ranks: list[int], pieces: list[Piece], *, everyone: bool) -> _Planned:
    writers, mine, numels, held = _split(key, shape, ranks, pieces)
    return _Planned(writers, mine, None, numels,
                    [(n, piece, None if everyone and len(by) == len(ranks) else by) for n, piece, by in held])


def _assign(
    world: int, keys: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str],
    sharded: Sequence[bool], planned: list[_Planned], names: list[str], layouts: dict[tuple, list[Layout]],
    aliases: dict[str, str] | None, compact: bool = False,
) -> SavePlan:
    """Give each shared piece a writer, then build the metadata and the table of who writes what."""
    writes = np.zeros((world, len(keys)), dtype=bool, order="F")  # filled a key (column) at a time
    extra: dict[int, tuple[list[int], list[Piece]]] = {}  # key index -> shared pieces' writers and pieces
    chosen: dict[int, list] = {}  # key index -> its option's memo (keys of one answer share it)
    fixed_load = np.zeros(world, dtype=np.int64)
    for i, answer in enumerate(planned):
        if answer.fixed is not None:  # the options write the same pieces, each by other ranks
            options, pieces, numels = answer.fixed
            q = int(fixed_load[options].sum(axis=1).argmin())  # the first least loaded
            memo = chosen[i] = answer.options.setdefault(q, [options[q].tolist(), list(pieces), None, None])
            extra[i] = (memo[0], memo[1])
            np.add.at(fixed_load, options[q], numels * itemsize(dtypes[i]))
    shared = [(n * itemsize(dtypes[i]), keys[i], i, piece, holders)
              for i, answer in enumerate(planned) for n, piece, holders in answer.held]
    if shared:
        # Longest first, each to its least-loaded holder (the lowest rank among equals):
        # balanced within one largest piece.
        load = fixed_load.copy()
        for i, answer in enumerate(planned):
            if len(answer.writers):
                load[answer.writers] += answer.numels * itemsize(dtypes[i])
        shared.sort(key=lambda item: (-item[0], item[1]))
        for nbytes, _, i, piece, holders in shared:
            if holders is None:
                rank = int(np.argmin(load))
            else:
                rank = min(holders, key=load.__getitem__)
            writers, pieces = extra.setdefault(i, ([], []))
            writers.append(rank)
            pieces.append(piece)
            load[rank] += nbytes
    tensors = {}
    columns: dict[int, np.ndarray] = {}
    for i in sorted(range(len(keys)), key=keys.__getitem__):
        answer, key = planned[i], keys[i]
        layout = answer.layout
        if layout is None and i not in extra and answer.own_layout is not None:
            layout, writers = answer.own_layout, answer.writers  # keys of one answer: the same shape
        elif layout is None and i in chosen and chosen[i][2] is not None:
            layout, writers = chosen[i][2], chosen[i][3]  # keys of one answer, the same option
        elif layout is None:
            writers, pieces = answer.writers.tolist(), list(answer.pieces or [])
            if i in extra:
                writers += extra[i][0]
                pieces += extra[i][1]
                order = sorted(range(len(writers)), key=writers.__getitem__)
                writers, pieces = [writers[j] for j in order], [pieces[j] for j in order]
            layout = _layout(layouts, shapes[i], [names[r] for r in writers], pieces)
            if i not in extra:
                answer.own_layout = layout
            elif i in chosen and not answer.held and not len(answer.writers):
                chosen[i][2:] = [layout, np.array(writers, dtype=np.int64)]
        else:
            writers = answer.writers
        column = columns.get(id(layout))  # the writers are the layout's files: keys of one layout share it
        if column is None:
            column = columns[id(layout)] = np.zeros(world, dtype=bool)
            column[writers] = True
        writes[:, i] = column
        rule = None
        if compact:
            rule = layout.memo.get("rule", _UNKNOWN)
            if rule is _UNKNOWN:
                rule = layout.memo["rule"] = detect_rule(
                    layout.shape, layout.names, layout.flat, layout.local_shape, layout.global_offset, ranks=writers
                )
        tensors[key] = TensorStorageMetadata.model_construct(
            shape=shapes[i], is_sharded=sharded[i], dtype=dtypes[i], shard_spec_per_file=ShardSpecs(layout, rule=rule)
        )
    metadata = new_metadata(
        tensors, world_size=world, aliases=dict(aliases or {}),
        format_version=FORMAT_VERSION if compact else LEGACY_FORMAT_VERSION,
    )
    return SavePlan(metadata, tuple(keys), writes, extra)


_UNKNOWN = object()


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
    check_tiling(key, shape, distinct)
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


def check_tiling(key: str, shape: Sequence[int], pieces: Sequence[Piece]) -> None:
    """``ValueError`` naming what is wrong unless ``pieces`` (each inside ``shape``) cover the
    tensor exactly once (equal pieces, replicas, count once)."""
    numel = math.prod(shape)
    index = TileIndex(shape, [piece_tiles(p, shape) for p in pieces])
    if index.ok and index.covered == numel and not index.replicas:
        return  # proven as boxes; the flattened ranges below only say what is wrong
    runs = sum(len(p.flat) if p.flat is not None else box_run_count(p.local_shape, p.global_offset, shape) for p in pieces)
    if runs > MAX_RUNS_PER_TENSOR:
        raise ValueError(f"the pieces of tensor {key!r} held by the ranks neither tile it as boxes nor are few enough runs to check")
    ranges = sorted(r for p in pieces for r in merge_adjacent(piece_ranges(p, shape)))
    pos = 0
    for start, end in ranges:
        if start != pos:
            what = "overlap" if start < pos else f"leave elements [{pos}, {start}) out"
            raise ValueError(f"the pieces of tensor {key!r} held by the ranks {what}")
        pos = end
    if pos != numel:
        raise ValueError(f"the pieces of tensor {key!r} held by the ranks leave elements [{pos}, {numel}) out")
