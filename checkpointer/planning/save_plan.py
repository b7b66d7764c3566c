"""The save plan: what each rank writes, and which other ranks hold copies of a written piece.

Built by :func:`~checkpointer.planning.plan.build_save_plan` (or from layouts alone,
:mod:`~checkpointer.planning.layouts`); read by the engine's save and by the replica check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from typing import Mapping

import numpy as np

from ..format.dtypes import itemsize
from ..format.layout import rank_filename
from ..format.metadata import StorageMetadata
from .pieces import Piece

__all__ = ["SavePlan"]


@dataclass(frozen=True)
class SavePlan:
    metadata: StorageMetadata
    keys: tuple[str, ...]
    """The keys the rows of ``writes`` index."""
    writes: np.ndarray
    """``writes[rank, i]``: ``rank`` writes ``keys[i]`` to its file (bool, world size x keys)."""
    shared: dict[int, tuple[list[int], list[Piece]]] = field(default_factory=dict)
    """By index into ``keys``: the pieces several ranks hold, and the rank that writes each (read-only:
    keys whose pieces and writers are equal, the layers of a model, share the lists)."""

    def keys_for(self, rank: int) -> tuple[str, ...]:
        """The keys ``rank`` writes to its file, in file order."""
        return tuple(sorted(compress(self.keys, self.writes[rank].tolist())))

    def copies_for(self, rank: int, pieces: Mapping[str, Piece]) -> dict[str, int]:
        """The keys whose piece ``rank`` holds (``pieces``: its piece of each key) while another
        rank writes the same piece: key -> that writer. These copies are never written; they
        are compared with the written one. Examples: a tensor every rank holds whole (plain
        module, DDP, a ``Replicate`` placement) is written by one rank, a copy on each other;
        under HSDP each shard is written by one rank of its replica group, a copy on the others.
        """
        out: dict[str, int] = {}
        mine_row = self.writes[rank]
        for i, (writers, held) in self.shared.items():
            key = self.keys[i]
            mine = pieces.get(key)
            if mine is None or mine_row[i] or not mine.numel:
                continue
            if len(held) == 1:
                # Every holder of this key holds this piece: a non-empty piece not written by
                # this rank is a copy of it (the plan proved the pieces tile the tensor).
                out[key] = writers[0]
                continue
            # In the form the plan's pieces have (ints in tuples), so that == compares exactly.
            mine = Piece.from_numbers(mine.kind, mine.numbers())
            try:
                out[key] = writers[held.index(mine)]
            except ValueError:
                pass  # cannot happen: a non-empty piece this rank does not write is one of these
        return out

    @property
    def keys_per_rank(self) -> tuple[tuple[str, ...], ...]:
        return tuple(self.keys_for(rank) for rank in range(len(self.writes)))

    def bytes_per_rank(self) -> list[int]:
        out = [0] * len(self.writes)
        for rank in range(len(self.writes)):
            name = rank_filename(rank)
            for key in self.keys_for(rank):
                meta = self.metadata.tensors[key]
                out[rank] += meta.shard_spec_per_file[name].local_numel * itemsize(meta.dtype)
        return out
