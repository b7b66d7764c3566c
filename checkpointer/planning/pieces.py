"""What a rank holds, described for planning: per key a :class:`PieceDesc`, or all keys at once
as columns (:class:`RankPieces`).

Thousands of ranks each holding hundreds of tensors make millions of pieces. The save plan
is made from columns: one :class:`Structure` (keys, shapes, dtypes, how each piece is
described) that ranks of one model share and send only once, plus one ``int64`` array per
rank with the numbers of every piece back to back. Turning either form into the other is lossless.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import CheckpointError
from ..format.metadata import TensorShardSpec
from ..format.specs import Layout
from .boxes import Tile, box_tile, range_tiles
from .index_runs import ranges_as_runs, runs_tiles
from .overlap import box_ranges

__all__ = [
    "Range", "Piece", "PieceDesc", "Structure", "RankPieces", "BOX", "piece_ranges", "whole",
    "piece_tiles", "strided_runs", "layout_tiles", "spec_tiles", "pieces_payload", "parse_pieces", "descs_by_key", "check_agreement",
]

Range = tuple[int, int]

_KEY = attrgetter("key")
_SHAPE = attrgetter("shape")
_DTYPE = attrgetter("dtype")

BOX = -1
"""The kind of a piece given as a box; a kind ``n >= 0`` is ``n`` flattened ranges."""


@dataclass(frozen=True, slots=True)
class Piece:
    """The elements of a full tensor that one local tensor holds, stored back to back.

    Either ``flat`` ranges of the flattened tensor, or a box (``local_shape`` at ``global_offset``).
    """

    flat: tuple[Range, ...] | None = None
    local_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    _numel: int = field(default=-1, init=False, compare=False, repr=False)  # counted once: ranges may be many
    _hash: int | None = field(default=None, init=False, compare=False, repr=False)  # hashed once, as above

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((self.flat, self.local_shape, self.global_offset)))
        return self._hash  # type: ignore[return-value]

    def __reduce__(self) -> tuple:  # the fields only: a hash of ``None`` differs between processes (Python 3.11)
        return (Piece, (self.flat, self.local_shape, self.global_offset))

    @property
    def numel(self) -> int:
        if self._numel < 0:
            if self.flat is not None:
                object.__setattr__(self, "_numel", sum(e - s for s, e in self.flat))
            else:
                assert self.local_shape is not None
                object.__setattr__(self, "_numel", math.prod(self.local_shape))
        return self._numel

    def to_spec(self) -> TensorShardSpec:
        if self.flat is not None:
            return TensorShardSpec.model_construct(flattened_offsets=self.flat, local_shape=None, global_offset=None)
        return TensorShardSpec.model_construct(
            flattened_offsets=None, local_shape=self.local_shape, global_offset=self.global_offset
        )

    @staticmethod
    def whole(shape: Sequence[int]) -> Piece:
        return Piece(flat=((0, math.prod(shape)),))

    @property
    def kind(self) -> int:
        return BOX if self.flat is None else len(self.flat)

    def numbers(self) -> list[int]:
        """The piece's integers as its column of :class:`RankPieces` holds them."""
        if self.flat is not None:
            return [x for r in self.flat for x in r]
        assert self.local_shape is not None and self.global_offset is not None
        return [*self.local_shape, *self.global_offset]

    @staticmethod
    def from_numbers(kind: int, numbers: Sequence[int]) -> Piece:
        values = [int(x) for x in numbers]
        if kind == BOX:
            ndim = len(values) // 2
            return Piece(local_shape=tuple(values[:ndim]), global_offset=tuple(values[ndim:]))
        return Piece(flat=tuple(zip(values[0::2], values[1::2])))


@dataclass(frozen=True, slots=True)
class PieceDesc:
    """What one rank holds of one tensor of the state dict."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    is_sharded: bool
    piece: Piece


class Structure:
    """The keys a rank holds, in its order, with each tensor's shape, dtype, whether it is
    sharded, and each piece's kind: what is the same on every rank of an FSDP job."""

    __slots__ = ("keys", "shapes", "dtypes", "sharded", "kinds", "starts", "width", "__dict__")

    def __init__(
        self,
        keys: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[str],
        sharded: Sequence[bool],
        kinds: Sequence[int],
    ):
        n = len(keys)
        if not len(shapes) == len(dtypes) == len(sharded) == len(kinds) == n:
            raise ValueError("the columns of a structure differ in length")
        self.keys = tuple(keys)
        self.shapes = tuple(map(tuple, shapes))
        self.dtypes = tuple(dtypes)
        self.sharded = tuple(map(bool, sharded))
        self.kinds = tuple(kinds)
        starts = [0] * n
        width = 0
        for i, (shape, kind) in enumerate(zip(self.shapes, self.kinds)):
            if kind < BOX:
                raise ValueError(f"bad piece kind {kind} for {keys[i]!r}")
            starts[i] = width
            width += 2 * len(shape) if kind == BOX else 2 * kind
        self.starts = tuple(starts)
        self.width = width

    def span(self, i: int) -> tuple[int, int]:
        """The columns of key ``i``'s numbers."""
        start = self.starts[i]
        end = self.starts[i + 1] if i + 1 < len(self.starts) else self.width
        return start, end

    @cached_property
    def json_bytes(self) -> bytes:
        return json.dumps(
            [self.keys, self.shapes, self.dtypes, self.sharded, self.kinds], separators=(",", ":")
        ).encode()

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.json_bytes).hexdigest()

    @staticmethod
    def from_json_bytes(data: bytes) -> Structure:
        keys, shapes, dtypes, sharded, kinds = json.loads(data)
        return Structure(keys, [tuple(s) for s in shapes], dtypes, sharded, kinds)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Structure) and (self is other or self.json_bytes == other.json_bytes)

    def __hash__(self) -> int:
        return hash(self.json_bytes)


@dataclass(frozen=True, eq=False)
class RankPieces:
    """One rank's pieces: its :class:`Structure` and the numbers of all its pieces, in one array
    (per key, in order: a box's ``local_shape`` then ``global_offset``; flat ranges as
    ``start, end`` pairs)."""

    structure: Structure
    values: np.ndarray

    def __post_init__(self) -> None:
        if self.values.dtype != np.int64 or self.values.ndim != 1 or len(self.values) != self.structure.width:
            raise ValueError(
                f"a rank's piece numbers must be {self.structure.width} int64 values, "
                f"got {self.values.dtype} of shape {tuple(self.values.shape)}"
            )

    @staticmethod
    def from_descs(descs: Sequence[PieceDesc]) -> RankPieces:
        structure = Structure(
            [d.key for d in descs],
            [d.shape for d in descs],
            [d.dtype for d in descs],
            [d.is_sharded for d in descs],
            [d.piece.kind for d in descs],
        )
        numbers = [x for d in descs for x in d.piece.numbers()]
        return RankPieces(structure, np.array(numbers, dtype=np.int64).reshape(-1))

    def descs(self) -> list[PieceDesc]:
        s = self.structure
        return [
            PieceDesc(key, shape, dtype, sharded, Piece.from_numbers(kind, self.values[slice(*s.span(i))].tolist()))
            for i, (key, shape, dtype, sharded, kind) in enumerate(zip(s.keys, s.shapes, s.dtypes, s.sharded, s.kinds))
        ]


def descs_by_key(descs_per_rank: Sequence[Sequence[PieceDesc]]) -> dict[str, tuple[Sequence[int], Sequence[PieceDesc]]]:
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


def check_agreement(key: str, ranks: Sequence[int], descs: Sequence[PieceDesc]) -> None:
    """Raise ``ValueError`` naming ``key`` and a rank when the ranks disagree on its shape or dtype."""
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


def piece_ranges(piece: Piece, shape: Sequence[int]) -> list[Range]:
    if piece.flat is not None:
        return list(piece.flat)
    assert piece.local_shape is not None and piece.global_offset is not None
    return box_ranges(shape, piece.local_shape, piece.global_offset)


def whole(shape: Sequence[int]) -> Piece:
    """The whole tensor as a piece to load: one box (one flattened range for a scalar)."""
    if not shape:
        return Piece.whole(shape)
    return Piece(local_shape=tuple(shape), global_offset=(0,) * len(shape))


def piece_tiles(piece: Piece, shape: Sequence[int]) -> list[Tile]:
    """A piece as tiles: a box is one; flattened ranges that are a product of index runs (a
    ``_StridedShard`` piece) one per combination of runs; other ranges at most ``2 * ndim - 1``
    each."""
    if piece.flat is None:
        assert piece.local_shape is not None and piece.global_offset is not None
        return [box_tile(piece.local_shape, piece.global_offset)]
    runs = strided_runs(piece, shape)
    if runs is not None:
        return runs_tiles(runs)
    out: list[Tile] = []
    offset = 0
    for start, end in piece.flat:
        out += range_tiles(shape, start, end, offset)
        offset += end - start
    return out


def strided_runs(piece: Piece, shape: Sequence[int]) -> list[list[Range]] | None:
    """The index runs per dim of a piece of flattened ranges that are their product, when that
    makes fewer tiles than the ranges (see :mod:`~checkpointer.planning.index_runs`)."""
    if piece.flat is None:
        return None
    runs = ranges_as_runs(shape, piece.flat)
    return runs if runs is not None and math.prod(map(len, runs)) < len(piece.flat) else None


def layout_tiles(layout: Layout, i: int) -> list[Tile]:
    flat, local_shape, global_offset = layout.form(i)
    return piece_tiles(Piece(flat, local_shape, global_offset), layout.shape)


def spec_tiles(spec: TensorShardSpec, shape: Sequence[int]) -> list[Tile]:
    flat = None if spec.flattened_offsets is None else tuple(map(tuple, spec.flattened_offsets))
    ls = None if spec.local_shape is None else tuple(spec.local_shape)
    go = None if spec.global_offset is None else tuple(spec.global_offset)
    return piece_tiles(Piece(flat, ls, go), shape)  # type: ignore[arg-type]


def pieces_payload(
    columns: RankPieces, aliases: Mapping[str, str], *, with_structure: bool, fingerprint: str = ""
) -> bytes:
    """A rank's pieces for the others (the full exchange of a first save): a JSON header, then the
    piece numbers as raw ``int64``. The structure travels from rank 0, and from a rank whose
    structure differs from rank 0's (ranks of one model share it); the others name it by its
    digest. ``fingerprint`` (the key of the rank's plan cache) goes into the plan's id."""
    structure = columns.structure
    header: dict[str, Any] = {"digest": structure.digest, "aliases": dict(aliases), "fingerprint": fingerprint}
    if with_structure:
        header["structure"] = structure.json_bytes.decode()
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"P" + len(head).to_bytes(8, "little") + head + columns.values.astype("<i8", copy=False).tobytes()


def parse_pieces(payload: bytes, known: dict[str, Structure]) -> tuple[RankPieces, dict[str, str], str]:
    """One rank's :func:`pieces_payload`: its pieces, aliases and fingerprint; ``known``
    (digest -> structure) gains the structures it carries."""
    n = int.from_bytes(payload[1:9], "little")
    header = json.loads(payload[9 : 9 + n])
    digest = header["digest"]
    structure = known.get(digest)
    if structure is None:
        if "structure" not in header:
            raise CheckpointError(f"a rank's pieces name structure {digest}, which no rank sent")
        structure = Structure.from_json_bytes(header["structure"].encode())
        if structure.digest != digest:
            raise CheckpointError(f"a rank's structure does not match its digest {digest}")
        known[digest] = structure
    values = np.frombuffer(payload, dtype="<i8", offset=9 + n).astype(np.int64, copy=False)
    if (values < 0).any():  # sizes, offsets and flattened bounds: a negative one is no piece
        raise CheckpointError(f"a rank sent a piece with a negative size or offset ({int(values.min())})")
    return RankPieces(structure, values), header["aliases"], header["fingerprint"]
