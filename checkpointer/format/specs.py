"""One tensor's shard specs, held compactly, and their validation in bulk.

``metadata.json`` lists one shard spec per file per tensor: millions of them when thousands
of ranks save a large model. A pydantic object per spec is what made planning at that scale
slow, so a tensor's specs are kept as plain columns (a :class:`Layout`, shared by tensors
whose pieces sit alike, plus the per-file checksums) and validated a column at a time with
builtins that loop in C. :class:`ShardSpecs` is the ``shard_spec_per_file`` mapping over
them: it builds a :class:`~checkpointer.format.shard_spec.TensorShardSpec` only for the file
asked about.

Validation here is strict (JSON integers are integers, not booleans, floats or strings) and
rejects exactly what the pydantic models reject, and more; anything the bulk checks cannot
vouch for is checked again one spec at a time, which names the file.
"""

from __future__ import annotations

import gc
import json
import math
from array import array
from collections.abc import Mapping
from contextlib import contextmanager
from itertools import chain
from operator import add
from typing import Any, Iterator, Sequence

from .shard_spec import TensorShardSpec

__all__ = ["Layout", "ShardSpecs", "MAX_RUNS_PER_TENSOR", "box_run_count", "gc_paused", "shared_layout", "FIELDS"]

MAX_RUNS_PER_TENSOR = 1 << 24
"""A tensor's pieces may split into at most this many contiguous runs (bounds planning work)."""

FIELDS = ("flattened_offsets", "local_shape", "global_offset", "checksums")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector while building millions of small acyclic objects.

    Each collection walks every container alive, so a bulk build with it on costs time
    quadratic-ish in the objects made (twice the time of ``json.loads`` on a large metadata.json).
    Nothing built inside is a cycle; reference counting frees it all the same.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Layout:
    """Where the pieces of a tensor are: per file, its flattened ranges or its box.

    ``flat[i]``, ``local_shape[i]``, ``global_offset[i]`` are file ``names[i]``'s fields (a
    column is ``None`` when no file uses it). Immutable once built; tensors with equal layouts
    share one, and ``memo`` holds what the planner derives from it (its overlap index).
    """

    __slots__ = ("shape", "names", "flat", "local_shape", "global_offset", "memo", "_index")

    def __init__(
        self,
        shape: tuple[int, ...],
        names: Sequence[str],
        flat: Sequence[Any] | None,
        local_shape: Sequence[Any] | None,
        global_offset: Sequence[Any] | None,
    ):
        self.shape = shape
        self.names = names
        self.flat = flat
        self.local_shape = local_shape
        self.global_offset = global_offset
        self.memo: dict[str, Any] = {}
        self._index: dict[str, int] | None = None

    @property
    def index(self) -> dict[str, int]:
        """File name -> position."""
        if self._index is None:
            self._index = {name: i for i, name in enumerate(self.names)}
        return self._index

    def form(self, i: int) -> tuple[tuple[tuple[int, int], ...] | None, tuple[int, ...] | None, tuple[int, ...] | None]:
        """``(flattened_offsets, local_shape, global_offset)`` of file ``i``, as tuples."""
        flat = self.flat[i] if self.flat is not None else None
        ls = self.local_shape[i] if self.local_shape is not None else None
        go = self.global_offset[i] if self.global_offset is not None else None
        return (
            None if flat is None else tuple(map(tuple, flat)),
            None if ls is None else tuple(ls),
            None if go is None else tuple(go),
        )

    def local_numel(self, i: int) -> int:
        flat = self.flat[i] if self.flat is not None else None
        if flat is not None:
            return sum(e - s for s, e in flat)
        return math.prod(self.local_shape[i])  # type: ignore[index]

    def same(self, names: Sequence[str], flat, local_shape, global_offset) -> bool:
        return (
            self.names == names
            and self.flat == flat
            and self.local_shape == local_shape
            and self.global_offset == global_offset
        )

    def json_prefixes(self, then: str = "") -> list[str]:
        """Each file's ``"name":{...,"checksums":`` as JSON text, followed by ``then``: what comes
        next is its checksums and ``}``. Made once per layout; tensors that share it share the text."""
        prefixes = self.memo.get("json_prefixes" + then)
        if prefixes is None:
            prefixes = self.memo["json_prefixes" + then] = [
                f'{json.dumps(name)}:{_compact(form)[:-1]},"checksums":{then}'
                for name, form in zip(self.names, self.json_forms())
            ]
        return prefixes

    def json_forms(self) -> list[dict[str, Any]]:
        """Each file's spec as a JSON object, without checksums."""
        n = len(self.names)
        none = [None] * n
        cols = (self.flat or none, self.local_shape or none, self.global_offset or none)
        return [{"flattened_offsets": f, "local_shape": s, "global_offset": o} for f, s, o in zip(*cols)]


class ShardSpecs(Mapping):
    """``shard_spec_per_file`` of a tensor read from (or planned for) ``metadata.json``.

    A read-only mapping of file name -> ``TensorShardSpec``, built on access. ``checksums``
    is each file's list of CRCs (``None`` where it has none), or ``None`` for no file;
    ``extras`` maps a file's position to the fields of its spec this release does not know.
    """

    __slots__ = ("layout", "checksums", "extras", "rule")

    def __init__(
        self,
        layout: Layout,
        checksums: Sequence[Any] | None = None,
        extras: dict[int, dict] | None = None,
        rule: dict[str, Any] | None = None,
    ):
        self.layout = layout
        self.checksums = checksums
        self.extras = extras
        self.rule = rule
        """The shard rule (:mod:`~checkpointer.format.rules`) the layout follows, when known:
        ``metadata.json`` then gives the rule, not the list."""

    def __getitem__(self, name: str):
        return self.spec(self.layout.index[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.names)

    def __contains__(self, name: object) -> bool:
        return name in self.layout.index

    def __repr__(self) -> str:
        return f"ShardSpecs({dict(self.items())!r})"

    def spec(self, i: int) -> TensorShardSpec:
        flat, ls, go = self.layout.form(i)
        checksums = self.checksums[i] if self.checksums is not None else None
        extra = (self.extras or {}).get(i, {})
        return TensorShardSpec.model_construct(
            flattened_offsets=flat,
            local_shape=ls,
            global_offset=go,
            checksums=None if checksums is None else tuple(checksums),
            **extra,
        )

    def local_numel(self, name: str) -> int:
        return self.layout.local_numel(self.layout.index[name])

    def checksums_of(self, name: str) -> tuple[int, ...] | None:
        if self.checksums is None:
            return None
        crcs = self.checksums[self.layout.index[name]]
        return None if crcs is None else tuple(crcs)

    def with_checksums(self, checksums: Sequence[Any] | None) -> ShardSpecs:
        return ShardSpecs(self.layout, checksums, self.extras, self.rule if checksums is None else None)

    def verbose(self) -> ShardSpecs:
        """The same specs, written as the list (the form OLMo-core 0.1.0 reads)."""
        return ShardSpecs(self.layout, self.checksums, self.extras)

    def json_text(self) -> str:
        """``to_json()`` as compact JSON text, pieced together from the layout's cached text."""
        if self.extras:
            return _compact(self.to_json())
        prefixes = self.layout.json_prefixes()
        if not prefixes:
            return "{}"
        if self.checksums is None:
            return "{" + "null},".join(prefixes) + "null}}"
        n = len(prefixes)
        text = _compact(self.checksums)
        if None not in self.checksums and [] not in self.checksums and text.count("[") == n + 1 and '"' not in text:
            # "[[1,2],[3]]": n lists of numbers, nothing nested; their texts are between "],["
            crcs = text[2:-2].split("],[")
            if len(crcs) == n:
                return "{" + "]},".join(map(add, self.layout.json_prefixes("["), crcs)) + "]}}"
        return "{" + "},".join(map(add, prefixes, map(_compact, self.checksums))) + "}}"

    def to_json(self) -> dict[str, Any]:
        forms = self.layout.json_forms()
        checksums = self.checksums if self.checksums is not None else [None] * len(forms)
        for spec, crcs in zip(forms, checksums):
            spec["checksums"] = crcs
        for i, extra in (self.extras or {}).items():
            forms[i].update(extra)
        return dict(zip(self.layout.names, forms))


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), check_circular=False)


def box_run_count(local_shape: Sequence[int], global_offset: Sequence[int], shape: Sequence[int]) -> int:
    """How many contiguous runs a box has (one per row of its leading, partly covered, dims)."""
    if len(local_shape) != len(shape) or 0 in local_shape:
        return 0
    split = len(shape) - 1
    while split > 0 and local_shape[split] == shape[split] and global_offset[split] == 0:
        split -= 1
    return math.prod(local_shape[:split])


_SCANNED = 8
"""Layouts of one shape (and first file) compared one by one; past that many, the next are
found by a hash of all their columns."""


def shared_layout(
    layouts: dict[tuple, list[Layout]],
    shape: tuple[int, ...],
    names: list[str],
    flat: list | None,
    ls: list | None,
    go: list | None,
) -> Layout:
    """The layout with these columns from ``layouts``, added there if it is new: tensors whose
    pieces sit alike share one. Candidates are always compared exactly.

    The first :data:`_SCANNED` layouts of a shape and first file share a bucket (most
    checkpoints have a few per shape, found at the cost of a list comparison); further ones
    are filed by a hash of all their columns, so a document of many tensors of one shape, each
    cut elsewhere, still costs time linear in its size (one bucket for all of them made it
    quadratic: 16,000 such tensors took a minute to parse).
    """
    loose = (shape, len(names), names[0] if names else None)
    bucket = layouts.setdefault(loose, [])
    for layout in bucket:
        if layout.same(names, flat, ls, go):
            return layout
    if len(bucket) >= _SCANNED:
        bucket = layouts.setdefault((*loose, _columns_hash(names, flat, ls, go)), [])
        for layout in bucket:
            if layout.same(names, flat, ls, go):
                return layout
    layout = Layout(shape, names, flat, ls, go)
    bucket.append(layout)
    return layout


def _columns_hash(names: Sequence[str], flat: Any, ls: Any, go: Any) -> int:
    """A hash of a layout's columns, equal for equal columns (lists or tuples alike), that input
    cannot steer: strings and bytes hash with a per-process random key, integers would not."""
    return hash((tuple(names), _column_bytes(flat, 2), _column_bytes(ls, 1), _column_bytes(go, 1)))


def _column_bytes(column: Sequence[Any] | None, depth: int) -> bytes | str | None:
    """A column as bytes: each file's length, then every number (``depth`` levels of lists)."""
    if column is None:
        return None
    try:
        values = chain.from_iterable(column)
        if depth == 2:
            values = chain.from_iterable(values)
        return array("q", map(len, column)).tobytes() + array("q", values).tobytes()
    except (TypeError, OverflowError):  # a file without this field (null), or a number past 64 bits
        return json.dumps(column, separators=(",", ":"), default=int)
