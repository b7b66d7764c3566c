"""Validation of the ``shard_spec_per_file`` objects of a ``metadata.json``, a column at a time.

Validation is strict (JSON integers are integers, not booleans, floats or strings) and rejects
exactly what the pydantic models reject, and more; anything the bulk checks cannot vouch for is
checked again one spec at a time, which names the file. Equal layouts come out shared
(:func:`~checkpointer.format.specs.shared_layout`).
"""

from __future__ import annotations

import math
from itertools import chain
from operator import add, itemgetter, le
from typing import Any, Sequence

import json

from .layout import check_filename
from .rules import MAX_RULE_CELLS, MAX_RULE_VALUES, check_rule, expand_rule, rule_values
from .specs import FIELDS, MAX_RUNS_PER_TENSOR, Layout, ShardSpecs, shared_layout

__all__ = ["SpecParser"]

_FLAT = itemgetter("flattened_offsets")
_LOCAL_SHAPE = itemgetter("local_shape")
_GLOBAL_OFFSET = itemgetter("global_offset")
_CHECKSUMS = itemgetter("checksums")
_NONE = type(None)
_MAX_ENTRIES = 4096  # distinct tensor entries kept by their text (a model has a few per layer kind)
_RECENT_ENTRIES = 4  # compared before decoding: each costs at most one entry's length of text


def _is_int(x: Any) -> bool:
    return type(x) is int


def _all_ints(values: Sequence[Any]) -> bool:
    return not values or set(map(type, values)) == {int}


class SpecParser:
    """Validates the ``shard_spec_per_file`` objects of one ``metadata.json``.

    Keeps, across the document's tensors, the file names already checked, equal layouts
    (shared), and the count of object members and of ``:`` inside strings seen (for the
    duplicate-key check of :func:`~checkpointer.format.metadata_parse.parse_metadata`).
    """

    def __init__(self) -> None:
        self._good_names: set[str] = set()
        self._layouts: dict[tuple, list[Layout]] = {}
        self._rules: dict[tuple, tuple[Layout, dict, int, int, int]] = {}
        self.rule_cells = 0
        self.rule_values = 0
        self.max_file = -1
        """The largest rank file index a rule names (checked against ``world_size``)."""
        self.members = 0
        self.colons = 0
        self.entries: dict[str, Any] = {}
        """Validated tensor entries with a shard rule, by their text (at most :data:`_MAX_ENTRIES`)."""
        self.recent_entries: list[str] = []
        """The texts of the last few distinct entries seen, newest first."""

    def remember_entry(self, text: str, meta: Any) -> None:
        """Keep a validated entry with a shard rule under its text, and among the recent ones."""
        if text not in self.entries:
            if len(self.entries) >= _MAX_ENTRIES:
                return
            self.entries[text] = meta
        if self.recent_entries[:1] != [text]:
            if text in self.recent_entries:
                self.recent_entries.remove(text)
            self.recent_entries.insert(0, text)
            del self.recent_entries[_RECENT_ENTRIES:]

    def parse_rule(self, shape: tuple[int, ...], raw: Any) -> ShardSpecs:
        """A ``shard_rule`` (see :mod:`~checkpointer.format.rules`): checked in time linear in
        its size, then expanded, once per distinct (shape, rule), within a budget of
        :data:`~checkpointer.format.rules.MAX_RULE_CELLS` pieces and
        :data:`~checkpointer.format.rules.MAX_RULE_VALUES` numbers for the whole document."""
        try:
            key = (shape, json.dumps(raw, separators=(",", ":")))
        except (TypeError, ValueError, RecursionError):
            key = None  # not a rule: check_rule says why
        known = self._rules.get(key) if key is not None else None
        if known is None:
            members, colons = self.members, self.colons
            self.count(raw)
            cells, top = check_rule(shape, raw)
            self.rule_cells += cells
            self.rule_values += rule_values(shape, raw, cells)
            if self.rule_cells > MAX_RULE_CELLS:
                raise ValueError(f"the document's shard rules describe more than {MAX_RULE_CELLS} pieces together")
            if self.rule_values > MAX_RULE_VALUES:
                raise ValueError(f"the document's shard rules expand into more than {MAX_RULE_VALUES} numbers "
                                 "together (a piece of an n-dim box is 2n + 1)")
            names, flat, ls, go = expand_rule(shape, raw)
            known = (Layout(shape, names, flat, ls, go), raw, self.members - members, self.colons - colons, top)
            if key is not None:
                self._rules[key] = known
        else:  # the same rule again: its counts and checks are known
            self.members += known[2]
            self.colons += known[3]
        self.max_file = max(self.max_file, known[4])
        return ShardSpecs(known[0], None, None, known[1])

    def parse(self, shape: tuple[int, ...], raw: Any) -> ShardSpecs:
        """``raw``: the parsed JSON value. Raises ``ValueError`` naming the file at fault."""
        if type(raw) is not dict:
            raise ValueError(f"shard_spec_per_file must be an object, not {_kind(raw)}")
        names = list(raw)
        if not self._good_names.issuperset(names):
            for name in names:
                check_filename(name)
                self._good_names.add(name)
        values = list(raw.values())
        self.members += len(names)
        columns = self._bulk(shape, values) if values else ([], None, None, None)
        if columns is None:
            flat, ls, go, checksums, extras = self._one_by_one(shape, names, values)
        else:
            flat, ls, go, checksums = columns
            extras = None
        return ShardSpecs(self._layout(shape, names, flat, ls, go), checksums, extras)

    def _layout(self, shape, names, flat, ls, go) -> Layout:
        return shared_layout(self._layouts, shape, names, flat, ls, go)

    def _bulk(self, shape: tuple[int, ...], values: list[Any]):
        """The common forms, checked a column at a time: every spec is all boxes or all flattened
        ranges, with the OLMo fields (and ``checksums``). ``None`` when anything else is there.

        Anything of the wrong kind fails a lookup (``TypeError``) or the type checks; the one-by-one
        check then says what."""
        n = len(values)
        try:
            sizes = set(map(len, values))
            flat = list(map(_FLAT, values))
            ls = list(map(_LOCAL_SHAPE, values))
            go = list(map(_GLOBAL_OFFSET, values))
            if sizes == {3}:
                checksums = None
            elif sizes == {4}:
                checksums = list(map(_CHECKSUMS, values))
            else:
                return None
            if checksums is not None:
                kinds = set(map(type, checksums))
                if not kinds <= {list, _NONE} or not _all_ints(list(chain.from_iterable(filter(None, checksums)))):
                    return None
                if kinds == {_NONE}:
                    checksums = None
            if flat.count(None) == n:
                if not self._boxes_fit(shape, ls, go):
                    return None
                columns = None, ls, go, checksums
            elif ls.count(None) == n and go.count(None) == n:
                if not self._ranges_fit(math.prod(shape), flat):
                    return None
                columns = flat, None, None, checksums
            else:
                return None
        except (KeyError, TypeError):
            return None
        self.members += n * next(iter(sizes))
        return columns

    def count(self, value: Any) -> None:
        """Add the members of the objects in a JSON value, and the ``:`` in its strings."""
        stack = [value]
        while stack:
            v = stack.pop()
            kind = type(v)
            if kind is dict:
                self.members += len(v)
                for k, x in v.items():
                    self.colons += k.count(":")
                    stack.append(x)
            elif kind is list:
                stack.extend(v)
            elif kind is str:
                self.colons += v.count(":")

    @staticmethod
    def _boxes_fit(shape: tuple[int, ...], ls: Sequence[Any], go: Sequence[Any]) -> bool:
        ndim, n = len(shape), len(ls)
        if ndim == 0 or set(map(len, ls)) != {ndim} or set(map(len, go)) != {ndim}:
            return False
        sizes_all, offsets_all = list(chain.from_iterable(ls)), list(chain.from_iterable(go))
        if not _all_ints(sizes_all) or not _all_ints(offsets_all) or min(sizes_all) < 0 or min(offsets_all) < 0:
            return False
        for d in range(ndim):
            sizes, offsets = sizes_all[d::ndim], offsets_all[d::ndim]
            if max(map(add, sizes, offsets)) > shape[d]:
                return False
        return n <= MAX_RUNS_PER_TENSOR  # a box counts once (see ``metadata._run_count``)

    @staticmethod
    def _ranges_fit(numel: int, flat: Sequence[Any]) -> bool:
        if set(map(type, flat)) != {list}:
            return False
        pairs = list(chain.from_iterable(flat))
        if len(pairs) > MAX_RUNS_PER_TENSOR:
            return False
        if not pairs:
            return True
        if set(map(type, pairs)) != {list} or set(map(len, pairs)) != {2}:
            return False
        starts, ends = zip(*pairs)
        if not _all_ints(starts) or not _all_ints(ends):
            return False
        return min(starts) >= 0 and max(ends) <= numel and all(map(le, starts, ends))

    def _one_by_one(self, shape: tuple[int, ...], names: list[str], values: list[Any]):
        """Every spec on its own: any mix of forms and unknown fields; the error names the file."""
        numel, ndim = math.prod(shape), len(shape)
        flat: list[Any] = []
        ls: list[Any] = []
        go: list[Any] = []
        checksums: list[Any] = []
        extras: dict[int, dict] = {}
        runs = 0
        for i, (name, spec) in enumerate(zip(names, values)):
            try:
                if type(spec) is not dict:
                    raise ValueError(f"must be an object, not {_kind(spec)}")
                f = spec.get("flattened_offsets")
                s = spec.get("local_shape")
                o = spec.get("global_offset")
                c = spec.get("checksums")
                extra = {k: v for k, v in spec.items() if k not in FIELDS}
                self.members += len(spec) - len(extra)
                if extra:
                    self.count(extra)
                    extras[i] = extra
                for field, value in (("local_shape", s), ("global_offset", o)):
                    if value is not None and (type(value) is not list or not all(map(_is_int, value))):
                        raise ValueError(f"{field} must be a list of integers or null")
                if c is not None and (type(c) is not list or not all(map(_is_int, c))):
                    raise ValueError("checksums must be a list of integers or null")
                if f is not None:
                    if type(f) is not list:
                        raise ValueError("flattened_offsets must be a list of [start, end] pairs or null")
                    for pair in f:
                        if type(pair) is not list or len(pair) != 2 or not all(map(_is_int, pair)):
                            raise ValueError("flattened_offsets must be a list of [start, end] pairs of integers")
                        if not 0 <= pair[0] <= pair[1]:
                            raise ValueError(f"bad flattened range [{pair[0]}, {pair[1]})")
                        if pair[1] > numel:
                            raise ValueError(f"flattened offsets past the tensor's {numel} elements")
                    runs += len(f)
                elif s is not None and o is not None:
                    if len(s) != len(o):
                        raise ValueError("local_shape and global_offset differ in length")
                    if min(s, default=0) < 0 or min(o, default=0) < 0:
                        raise ValueError("negative local_shape or global_offset")
                    if len(s) != ndim:
                        raise ValueError(f"local_shape {s} does not match shape {list(shape)}")
                    if any(off + size > full for size, off, full in zip(s, o, shape)):
                        raise ValueError(f"box {s} at {o} leaves {list(shape)}")
                    runs += 1
                else:
                    raise ValueError("a shard spec needs flattened_offsets, or local_shape and global_offset")
                if runs > MAX_RUNS_PER_TENSOR:
                    raise ValueError(f"the pieces split into more than {MAX_RUNS_PER_TENSOR} runs")
            except ValueError as ex:
                raise ValueError(f"shard_spec_per_file[{name!r}]: {ex}") from None
            flat.append(f)
            ls.append(s)
            go.append(o)
            checksums.append(c)
        def column(values: list[Any]) -> tuple[Any, ...] | None:
            return tuple(values) if values.count(None) != len(values) else None

        return column(flat), column(ls), column(go), column(checksums), extras or None


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", _NONE: "null"}.get(type(value), type(value).__name__)  # fmt: skip
