"""Every rank's pieces from a layout that is the same on every rank: the first save without an exchange.

A DTensor's piece on each rank is a function of its global shape, its mesh's shape and its
placements (when the mesh numbers the ranks ``0..W-1`` in row-major order, as
``init_device_mesh`` does); a plain tensor is whole on every rank. When every rank describes
its state dict by the same such layouts, every rank can compute every rank's pieces and make
the save plan alone, after one all-reduce that confirms the descriptions agree.

The recipe (the engine's side is ``engine.save``):

1. :func:`layout_entries` and :func:`description_digest`: this rank's keys with their layouts,
   and a digest of them (with the aliases, world size and form), ``-1`` when a value has none.
2. :func:`layout_pieces`: per distinct (shape, layout), every rank's piece, computed in bulk;
   :func:`matches_own` checks this rank's own pieces against them (else it sends ``-1``).
3. One all-reduce: every rank sent the same digest (not ``-1``)?
4. :func:`plan_from_layouts`: the plan ``build_save_plan`` makes from the exchanged pieces,
   the same one (same metadata, same writer for every piece), from the computed ones.

A layout is a tuple: ``()`` for a tensor every rank holds whole, or ``(mesh_shape, placements)``
with placements ``("S", dim)`` (``Shard``), ``("R",)`` (``Replicate``) and ``("T", dim,
split_factor)`` (``_StridedShard``). The pieces follow ``sharding.describe`` exactly: a box when
every placement is ``Shard``/``Replicate`` (an empty one included); with ``_StridedShard``, the
index runs of :func:`runs_piece` (a box when one run along every dim or no element at all).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..format.layout import rank_filename
from ..format.specs import Layout, gc_paused
from .overlap import Range
from .pieces import BOX, Piece
from .plan import SavePlan, _analyse, _assign, _mixed, _Planned

__all__ = [
    "LayoutEntry", "ClassPieces", "layout_entries", "description_digest", "layout_pieces", "matches_own",
    "plan_from_layouts", "runs_piece", "Described", "describe_layouts",
]

WHOLE: tuple = ()
"""The layout of a tensor every rank holds whole."""


@dataclass(frozen=True, slots=True)
class LayoutEntry:
    """One key of a rank's state dict, described by a layout the same on every rank."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    is_sharded: bool
    layout: tuple


@dataclass(frozen=True)
class ClassPieces:
    """Every rank's piece of one (shape, layout): ``block[:, r]`` the numbers of rank ``r``'s
    piece when every piece has one ``kind``, else ``pieces[r]``."""

    kind: int | None
    block: np.ndarray | None
    pieces: list[Piece] | None

    def piece(self, rank: int) -> Piece:
        if self.pieces is not None:
            return self.pieces[rank]
        assert self.block is not None and self.kind is not None
        return Piece.from_numbers(self.kind, self.block[:, rank].tolist())


@dataclass(frozen=True)
class Described:
    """Steps 1-2 on one rank: its entries, every rank's pieces of them, and the digest to compare."""

    entries: list[LayoutEntry]
    classes: dict[tuple, ClassPieces]
    digest: int


def describe_layouts(
    items: Sequence[tuple[str, tuple[int, ...], str, bool, tuple | None]], own: Mapping[str, Piece],
    aliases: Mapping[str, str], *, world: int, rank: int, form: str,
) -> Described | None:
    """Steps 1-2: ``items`` (``(key, shape, dtype, is_sharded, layout)`` per key, in order) and this
    rank's own pieces by key; ``None`` when the pieces must be exchanged instead."""
    entries = layout_entries(items)
    if entries is None:
        return None
    classes = layout_pieces(entries, world)
    if classes is None or not matches_own(entries, classes, rank, own):
        return None
    return Described(entries, classes, description_digest(entries, aliases, world, form))


def layout_entries(items: Sequence[tuple[str, tuple[int, ...], str, bool, tuple | None]]) -> list[LayoutEntry] | None:
    """``(key, shape, dtype, is_sharded, layout)`` per key as entries; ``None`` if a layout is ``None``."""
    if any(layout is None for *_, layout in items):
        return None
    return [LayoutEntry(key, tuple(shape), dtype, sharded, layout) for key, shape, dtype, sharded, layout in items]


def description_digest(entries: Sequence[LayoutEntry], aliases: Mapping[str, str], world: int, form: str) -> int:
    """A 62-bit digest of what every rank must agree on: keys in order, layouts, aliases, world, form."""
    text = json.dumps(
        [[[e.key, list(e.shape), e.dtype, e.is_sharded, e.layout] for e in entries], sorted(aliases.items()), world, form],
        separators=(",", ":"),
    ).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 2


def layout_pieces(entries: Sequence[LayoutEntry], world: int) -> dict[tuple, ClassPieces] | None:
    """Per distinct ``(shape, layout)``, every rank's piece; ``None`` when a layout's mesh is not
    the ``world`` ranks (then the pieces must be exchanged)."""
    out: dict[tuple, ClassPieces] = {}
    for e in entries:
        sig = (e.shape, e.layout)
        if sig not in out:
            got = _class_pieces(e.shape, e.layout, world)
            if got is None:
                return None
            out[sig] = got
    return out


def matches_own(entries: Sequence[LayoutEntry], classes: Mapping[tuple, ClassPieces], rank: int,
                own: Mapping[str, Piece]) -> bool:
    """Whether this rank's own pieces are those its layouts give it (a cheap guard)."""
    for e in entries:
        mine, want = own[e.key], classes[(e.shape, e.layout)].piece(rank)
        if mine.kind != want.kind or mine.numbers() != want.numbers():
            return False
    return True


def plan_from_layouts(
    entries: Sequence[LayoutEntry], classes: Mapping[tuple, ClassPieces], world: int, *,
    aliases: dict[str, str] | None = None, compact: bool = True,
) -> SavePlan:
    """The plan :func:`~checkpointer.planning.plan.build_save_plan` makes from every rank's
    pieces, each (shape, layout) analysed once."""
    with gc_paused():
        ranks = np.arange(world)
        names = [rank_filename(r) for r in range(world)]
        layouts: dict[tuple, list[Layout]] = {}
        answers: dict[tuple, _Planned] = {}
        planned: list[_Planned] = []
        for e in entries:
            sig = (e.shape, e.layout)
            answer = answers.get(sig)
            if answer is None:
                c = classes[sig]
                if c.block is not None and c.kind is not None:
                    answer = _analyse(e.key, e.shape, c.kind, c.block, ranks, names, layouts, everyone=True,
                                      compact=compact)
                else:
                    assert c.pieces is not None
                    answer = _mixed(e.key, e.shape, ranks.tolist(), list(c.pieces), everyone=True)
                answers[sig] = answer
            planned.append(answer)
        return _assign(world, tuple(e.key for e in entries), [e.shape for e in entries], [e.dtype for e in entries],
                       [e.is_sharded for e in entries], planned, names, layouts, aliases, compact)


def _class_pieces(shape: tuple[int, ...], layout: tuple, world: int) -> ClassPieces | None:
    if layout == WHOLE:
        numel = math.prod(shape)
        block = np.empty((2, world), dtype=np.int64)
        block[0], block[1] = 0, numel
        return ClassPieces(1, block, None)
    mesh, placements = layout
    if math.prod(mesh) != world or len(mesh) != len(placements):
        return None
    coords = np.unravel_index(np.arange(world, dtype=np.int64), mesh) if mesh else ()
    if all(p[0] in ("S", "R") for p in placements):
        sizes, offsets = _boxes(shape, mesh, placements, coords, world)
        return ClassPieces(BOX, np.concatenate([sizes, offsets]) if shape else np.zeros((0, world), np.int64), None)
    return _strided(shape, mesh, placements, coords, world)


def _chunk(size: Any, n: int, c: Any) -> tuple[Any, Any]:
    """``[start, end)`` of chunk ``c`` of ``n`` of ``size`` like ``torch.chunk`` (numpy arrays ok)."""
    step = -(-size // n)
    start = np.minimum(c * step, size)
    return start, np.minimum(start + step, size)


def _boxes(shape, mesh, placements, coords, world) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's box for ``Shard``/``Replicate`` placements (``sharding.dtensor_box`` in bulk)."""
    sizes = np.array([[s] * world for s in shape], dtype=np.int64).reshape(len(shape), world)
    offsets = np.zeros_like(sizes)
    for p, n, c in zip(placements, mesh, coords):
        if p[0] == "S":
            d = p[1]
            start, end = _chunk(sizes[d], n, c)
            offsets[d] += start
            sizes[d] = end - start
    return sizes, offsets


def _strided(shape, mesh, placements, coords, world) -> ClassPieces:
    """With ``_StridedShard``: per dim, the index runs of every coordinate of the mesh dims that
    cut it (``sharding.dtensor_index_runs`` in bulk), then each rank's piece."""
    per_dim = []  # per dim: (starts, ends) arrays (ranks x runs), and whether a placement cuts it
    for d, extent in enumerate(shape):
        s = np.zeros((1, 1), dtype=np.int64)
        e = np.full((1, 1), extent, dtype=np.int64)
        state = np.zeros(world, dtype=np.int64)
        cut = False
        for p, n, c in zip(placements, mesh, coords):
            if p[0] == "R" or p[1] != d:
                continue
            cut = True
            lengths = e - s
            pos = np.cumsum(lengths, axis=1) - lengths
            count = lengths.sum(axis=1)[:, None]  # states x 1
            cs = np.arange(n, dtype=np.int64)[None, :]
            if p[0] == "S":
                lo, hi = _chunk(count, n, cs)
                windows = [(lo, hi)]  # each states x n
            else:
                windows = []
                for j in range(p[2]):
                    start, end = _chunk(count, p[2], j)
                    lo, hi = _chunk(end - start, n, cs)
                    windows.append((start + lo, start + hi))
            new_s, new_e = [], []
            for lo, hi in windows:
                a = np.maximum(lo[:, :, None], pos[:, None, :])
                b = np.minimum(hi[:, :, None], (pos + lengths)[:, None, :])
                keep = b > a
                new_s.append(np.where(keep, s[:, None, :] + a - pos[:, None, :], 0))
                new_e.append(np.where(keep, s[:, None, :] + b - pos[:, None, :], 0))
            states = len(s)
            s = np.concatenate(new_s, axis=2).reshape(states * n, -1)
            e = np.concatenate(new_e, axis=2).reshape(states * n, -1)
            state = state * n + c
        per_dim.append((s[state], e[state], cut))
    # An uncut dim is its one run, even when empty; a cut keeps the runs with elements.
    counts = [(e > s).sum(axis=1) if cut else np.ones(world, np.int64) for s, e, cut in per_dim]
    boxes = np.all([k == 1 for k in counts], axis=0) | np.any([k == 0 for k in counts], axis=0)
    if boxes.all():  # one run along every dim, or no element (an empty box at the first run, else 0)
        sizes = np.stack([np.where(e > s, e - s, 0).sum(axis=1) if cut else e[:, 0] for s, e, cut in per_dim])
        offsets = np.stack([np.where(e > s, s, 0)[np.arange(world), (e > s).argmax(axis=1)] if cut else s[:, 0]
                            for s, e, cut in per_dim])
        return ClassPieces(BOX, np.concatenate([sizes, offsets]), None)
    pieces = []
    for r in range(world):
        runs = [[(a, b) for a, b in zip(s[r].tolist(), e[r].tolist()) if b > a] if cut else [(int(s[r, 0]), int(e[r, 0]))]
                for s, e, cut in per_dim]
        pieces.append(runs_piece(shape, runs))
    kinds = {p.kind for p in pieces}
    if len(kinds) == 1:
        kind = kinds.pop()
        block = np.array([p.numbers() for p in pieces], dtype=np.int64).reshape(world, -1).T
        return ClassPieces(kind, np.ascontiguousarray(block), None)
    return ClassPieces(None, None, pieces)


def runs_piece(shape: Sequence[int], runs: Sequence[Sequence[Range]]) -> Piece:
    """The :class:`Piece` of a local tensor holding, along each dim ``d``, the indices ``runs[d]``
    in order: a box when every dim is one run, else the flattened ranges in local row-major order."""
    shape = tuple(shape)
    sizes = tuple(sum(e - s for s, e in r) for r in runs)
    if all(len(r) == 1 for r in runs):
        return Piece(local_shape=sizes, global_offset=tuple(r[0][0] for r in runs))
    if math.prod(sizes) == 0:  # an empty box (a box, as the other ranks' pieces usually are)
        return Piece(local_shape=sizes, global_offset=tuple(r[0][0] if r else 0 for r in runs))
    # Dims after ``split`` are whole, so each run of dim ``split`` is one flat range per outer index.
    split = len(shape) - 1
    while split > 0 and list(runs[split]) == [(0, shape[split])]:
        split -= 1
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    base = np.zeros(1, dtype=np.int64)  # flat offset of each outer index, in row-major order
    for d in range(split):
        held = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in runs[d]])
        base = (base[:, None] + held[None, :] * strides[d]).reshape(-1)
    inner = np.array([r for r in runs[split] if r[1] > r[0]], dtype=np.int64).reshape(-1, 2) * strides[split]
    starts, ends = (base[:, None] + inner[None, :, 0]).reshape(-1), (base[:, None] + inner[None, :, 1]).reshape(-1)
    apart = starts[1:] != ends[:-1]  # a range that starts where the previous one ends joins it
    starts, ends = starts[np.concatenate(([True], apart))], ends[np.concatenate((apart, [True]))]
    return Piece(flat=tuple(zip(starts.tolist(), ends.tolist())))
