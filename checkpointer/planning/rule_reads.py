"""The copies that fill a wanted box from pieces a shard rule describes, found from the rule alone.

A box rule (:mod:`~checkpointer.format.rules`) cuts each listed dim at multiples of its chunk,
so the pieces a wanted box meets are, along each cut dim, the cells from ``origin // chunk``
to ``(end - 1) // chunk``: no index over every file, and Python work per wanted box that
grows with the pieces it meets, never with the ranks. The rule was validated when read
(:func:`~checkpointer.format.rules.check_rule`: its pieces tile the tensor, one per file),
so no disjointness proof is needed either.

The copies are those :meth:`~checkpointer.planning.boxes.TileIndex.copies` gives over the
same pieces, in its order: per wanted tile, the stored pieces it meets by their start along
the index's key dim (the dim with the most distinct starts, the first among equals), then by
their position in the layout.
"""

from __future__ import annotations

from itertools import product
from typing import Any, Sequence

from ..format.specs import Layout
from .boxes import BoxCopy, Tile, box_tile, tile_copy

__all__ = ["rule_copies"]


def rule_copies(layout: Layout, rule: dict[str, Any], wanted: Sequence[Tile]) -> list[BoxCopy]:
    """The copies filling ``wanted`` from ``layout``'s pieces, which the box ``rule`` (already
    checked) describes; a copy's ``source`` is the file's position in ``layout.names``."""
    shape = layout.shape
    ndim = len(shape)
    cut_dims = [d for d, _ in rule["cuts"]]
    chunks = [c for _, c in rule["cuts"]]
    parts = [-(-shape[d] // c) for d, c in zip(cut_dims, chunks)]
    first, terms = rule["files"]
    along = [1] * ndim
    for d, n in zip(cut_dims, parts):
        along[d] = n
    key = max(range(ndim), key=lambda d: (along[d], -d))
    out: list[BoxCopy] = []
    for w in wanted:
        if w.numel == 0:
            continue
        spans = []
        for d, c, n in zip(cut_dims, chunks, parts):
            lo, hi = max(w.origin[d], 0) // c, min(-(-(w.origin[d] + w.sizes[d]) // c), n)
            spans.append(range(lo, max(lo, hi)))
        met = []
        for coords in product(*spans):
            j = 0
            origin, sizes = [0] * ndim, list(shape)
            for d, c, n, k in zip(cut_dims, chunks, parts, coords):
                j = j * n + k
                origin[d] = k * c
                sizes[d] = min(origin[d] + c, shape[d]) - origin[d]
            f = first + sum((j // div) % mod * mul for div, mod, mul in terms)
            met.append((origin[key], _position(layout, j, f), origin, sizes))
        met.sort(key=lambda m: (m[0], m[1]))
        for _, source, origin, sizes in met:
            copy = tile_copy(source, box_tile(sizes, origin), w)
            if copy is not None:
                out.append(copy)
    return out


def _position(layout: Layout, cell: int, file: int) -> int:
    """Where file ``rank_{file}`` is in the layout: at ``cell`` when the layout lists the pieces
    in cell order (as read from a rule), else looked up."""
    name = f"rank_{file}.safetensors"
    names = layout.names
    if cell < len(names) and names[cell] == name:
        return cell
    return layout.index[name]
