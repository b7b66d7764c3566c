"""Every rank's box of one tensor, grouped and proven to tile it, in bulk (numpy, no object per rank).

The save plan needs, per tensor, its distinct non-empty pieces (in the order of their first
holder), the ranks holding each, and a proof that the distinct pieces tile the tensor: what
``plan._split`` and ``plan.check_tiling`` do piece by piece. At 16,384 ranks that is tens of
thousands of objects per tensor class. :func:`box_groups` does the same for box pieces with
arrays, and proves the tiling the way :class:`~checkpointer.planning.boxes.TileIndex` first tries:

1. Every box inside the tensor, sizes and offsets not negative; the empty ones dropped.
2. The distinct boxes, each with its holders (``np.unique`` over the columns).
3. Cut every dim at every distinct box's start and end: each box must be exactly one cell of
   that grid. Distinct boxes are then distinct cells, so disjoint, and they tile the tensor
   when their element counts add up to it.

When any step fails it returns ``None`` and the caller takes the piece-by-piece path, which
says what is wrong (or proves a tiling this grid cannot), so a plan is the same either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["BoxGroups", "box_groups"]


@dataclass(frozen=True)
class BoxGroups:
    """The distinct non-empty boxes of one tensor, in the order of their first holder.

    ``first[g]``: the column of ``block`` (a holder) where box ``g`` is first seen; ``counts[g]``:
    how many columns hold it; ``members``: the columns holding each box, box after box, each
    box's columns ascending; ``numels[g]``: its element count."""

    first: np.ndarray
    counts: np.ndarray
    members: np.ndarray
    numels: np.ndarray

    def holders(self) -> list[np.ndarray]:
        """Per box, the columns holding it (ascending)."""
        return np.split(self.members, np.cumsum(self.counts)[:-1])


def box_groups(shape: tuple[int, ...], block: np.ndarray) -> BoxGroups | None:
    """Group ``block``'s box pieces (``block[:, j]`` = local shape then global offset of column
    ``j``) and prove the distinct non-empty ones tile ``shape`` exactly; ``None``: not shown."""
    ndim = len(shape)
    numel = math.prod(shape)
    if not ndim or not numel or block.shape[0] != 2 * ndim or not block.shape[1]:
        return None
    sizes, offsets = block[:ndim], block[ndim:]
    extent = np.array(shape, dtype=np.int64)[:, None]
    if (sizes < 0).any() or (offsets < 0).any() or (sizes > extent).any() or (offsets > extent - sizes).any():
        return None
    keep = np.flatnonzero((sizes > 0).all(axis=0))
    if not len(keep):
        return None
    columns = np.ascontiguousarray(block[:, keep].T)
    boxes, first, inverse, counts = np.unique(
        columns, axis=0, return_index=True, return_inverse=True, return_counts=True
    )
    order = np.argsort(first, kind="stable")  # distinct boxes by first holder
    renumber = np.empty_like(order)
    renumber[order] = np.arange(len(order))
    group = renumber[inverse.reshape(-1)]
    boxes, first, counts = boxes[order], first[order], counts[order]
    lo, ends = boxes[:, ndim:], boxes[:, ndim:] + boxes[:, :ndim]
    for d in range(ndim):
        cuts = np.unique(np.concatenate([lo[:, d], ends[:, d]]))
        if not (np.searchsorted(cuts, ends[:, d]) == np.searchsorted(cuts, lo[:, d]) + 1).all():
            return None  # a box spans several cells of the grid: not shown disjoint here
    numels = boxes[:, :ndim].prod(axis=1)
    if int(numels.sum()) != numel:
        return None
    return BoxGroups(keep[first], counts, keep[np.argsort(group, kind="stable")], numels)
