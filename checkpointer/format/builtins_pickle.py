"""The optimizer's ``param_group{i}`` and ``state_keys`` values: pickles of plain builtins only.

OLMo-core 0.1.0 stores these as pickle bytes, so we write pickles it can read. We read them
with a decoder that resolves no global at all: a payload naming any class or function
(the only way a pickle can run code) is refused, never executed.

A pickle's memo lets one list appear many times: 30 nested lists, each holding the next one
twice, take under 200 bytes and are a tree of 2**30 values to anything that walks them (a
check, ``str``, ``==``, the hash of a tuple used as a dict key). So before anything is
unpickled, a scan of the opcodes (:func:`_check_opcodes`) works out how many values the result
holds, counted as a tree, and how many the unpickler would hash; either above
:func:`node_budget` is refused. Decoding is linear in the payload's size.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

from ..errors import CorruptCheckpointError

__all__ = ["encode_builtins", "decode_builtins"]

_SCALARS = (str, int, float, bool, type(None))


MAX_DEPTH = 32
"""How deeply lists, tuples and dicts may nest in a decoded value."""

_MIN_NODES = 1 << 16
_NODES_PER_BYTE = 16


def node_budget(nbytes: int) -> int:
    """The most values a pickle of ``nbytes`` may hold counted as a tree (a shared list once
    per place it appears): what an honest pickle of that size holds, with room for some sharing."""
    return max(_MIN_NODES, _NODES_PER_BYTE * nbytes)


def _check(value: Any, where: str) -> None:
    """Raise ``ValueError`` unless ``value`` holds only plain builtins, none more than
    :data:`MAX_DEPTH` levels below it. Each container is looked at once, however often it is
    shared (a container that holds itself is nested infinitely deep)."""
    heights: dict[int, int] = {}  # id -> levels below a container already checked (``value`` keeps it alive)

    def height(item: Any, depth: int) -> int:
        if isinstance(item, _SCALARS):
            return 0
        if depth > MAX_DEPTH:
            raise ValueError(f"{where}: nested too deeply")
        known = heights.get(id(item))
        if known is None:
            if isinstance(item, (list, tuple)):
                children: Any = item
            elif isinstance(item, dict):
                children = [x for kv in item.items() for x in kv]
            else:
                raise ValueError(
                    f"{where}: {type(item).__name__} is not a plain builtin (dict, list, tuple, str, int, float, bool, None)"
                )
            known = max((1 + height(x, depth + 1) for x in children), default=0)
            heights[id(item)] = known
        if depth + known > MAX_DEPTH:
            raise ValueError(f"{where}: nested too deeply")
        return known

    height(value, 0)


def encode_builtins(value: Any, *, where: str = "value") -> bytes:
    """Pickle ``value`` after checking it holds only plain builtins (``ValueError`` otherwise)."""
    _check(value, where)
    return pickle.dumps(value, protocol=4)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise CorruptCheckpointError(f"refused a pickle that names {module}.{name}: only plain builtins are allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise CorruptCheckpointError("refused a pickle with persistent ids: only plain builtins are allowed")


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_EMPTY = frozenset({"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE"})
_FROM_MARK = frozenset({"LIST", "TUPLE", "DICT", "FROZENSET"})
_ADD_FROM_MARK = frozenset({"APPENDS", "SETITEMS", "ADDITEMS"})
_TUPLE_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_LEAF = -1  # a value that holds no other (a number, a string), or one the unpickler will refuse


class _Shape:
    """The pickle machine run on the opcodes alone: which container holds what, no value built.

    Stack entries are container numbers, or ``_LEAF`` for anything else; ``held[c]`` lists what
    container ``c`` holds, as the unpickler would fill it (a list filled after it was shared
    included). ``hashed`` lists what the unpickler would hash (dict keys, set items).
    """

    def __init__(self) -> None:
        self.held: list[list[int]] = []
        self.hashed: list[int] = []
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: dict[int, int] = {}
        self.sizes: dict[int, int] = {}

    def new(self, items: list[int]) -> int:
        self.held.append(items)
        return len(self.held) - 1

    def pop_mark(self) -> list[int]:
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def pop(self, n: int) -> list[int]:
        if len(self.stack) < n or (self.marks and len(self.stack) - n < self.marks[-1]):
            raise ValueError("stack underflow")
        items = self.stack[len(self.stack) - n :]
        del self.stack[len(self.stack) - n :]
        return items

    def top(self) -> int:
        if not self.stack or (self.marks and self.marks[-1] == len(self.stack)):
            raise ValueError("stack underflow")
        return self.stack[-1]

    def fill(self, target: int, items: list[int], kind: str) -> None:
        if kind in ("SETITEMS", "SETITEM", "DICT"):
            self.hashed.extend(items[0::2])
        elif kind in ("ADDITEMS", "FROZENSET"):
            self.hashed.extend(items)
        if target != _LEAF:
            self.held[target].extend(items)

    def step(self, name: str, arg: Any, opcode: Any) -> None:
        stack = self.stack
        if name in _EMPTY:
            stack.append(self.new([]))
        elif name in _FROM_MARK:
            items = self.pop_mark()
            node = self.new([])
            self.fill(node, items, name)
            stack.append(node)
        elif name in _TUPLE_N:
            stack.append(self.new(self.pop(_TUPLE_N[name])))
        elif name in _ADD_FROM_MARK:
            items = self.pop_mark()
            self.fill(self.top(), items, name)  # the container stays on the stack
        elif name == "APPEND":
            item = self.pop(1)
            self.fill(self.top(), item, name)
        elif name == "SETITEM":
            items = self.pop(2)
            self.fill(self.top(), items, name)
        elif name == "MARK":
            self.marks.append(len(stack))
        elif name == "POP":
            if self.marks and self.marks[-1] == len(stack):
                self.marks.pop()
            else:
                self.pop(1)
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            stack.append(self.top())
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = self.top()
        elif name in _MEMO_PUTS:
            self.memo[arg] = self.top()
        elif name in _MEMO_GETS:
            stack.append(self.memo[arg])
        elif name not in ("PROTO", "FRAME", "STOP"):
            # A number or a string; or a global, a reduce, a persistent id: refused when unpickled.
            before = [s.name for s in opcode.stack_before]
            if "mark" in before:
                self.pop_mark()
            else:
                self.pop(len(before))
            stack.extend([_LEAF] * len(opcode.stack_after))

    def tree_size(self, root: int, budget: int) -> int:
        """How many values ``root`` holds counted as a tree, itself included (over ``budget``,
        or a container that holds itself, is a ``ValueError``). Each container is sized once."""
        sizes = self.sizes
        if root == _LEAF:
            return 1
        on_path: set[int] = set()
        todo: list[tuple[int, bool]] = [(root, False)]
        while todo:
            node, done = todo.pop()
            if done:
                on_path.discard(node)
                total = 1 + sum(1 if i == _LEAF else sizes[i] for i in self.held[node])
                if total > budget:
                    raise ValueError(f"holds more than {budget} values counted as a tree")
                sizes[node] = total
            elif node not in sizes:
                if node in on_path:
                    raise ValueError("holds itself")
                on_path.add(node)
                todo.append((node, True))
                todo.extend((i, False) for i in self.held[node] if i != _LEAF and i not in sizes)
        return sizes[root]


def _check_opcodes(data: bytes, where: str) -> None:
    """Scan the opcodes, building no object: refuse a memo index no honest pickle of
    ``len(data)`` bytes could hold, and a value too large counted as a tree.

    The unpickler grows its memo to fit the largest index it is told to store at, so a
    ``LONG_BINPUT 2**31`` in a ten-byte payload would make it allocate gigabytes. Indices are
    handed out from 0 and each store takes at least two bytes, so an honest index is always
    below the payload length.

    A value's tree size bounds the work of anything that walks it, and the containers hashed
    while unpickling (tuples as dict keys) bound the unpickler's own work: both must stay
    within :func:`node_budget`.
    """
    budget = node_budget(len(data))
    shape = _Shape()
    result = _LEAF
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            if opcode.name in _MEMO_PUTS and not (isinstance(arg, int) and 0 <= arg < len(data)):
                raise CorruptCheckpointError(
                    f"{where}: refused a pickle that stores at memo index {arg} in a {len(data)}-byte payload"
                )
            if opcode.name == "STOP":
                result = shape.top()
            shape.step(opcode.name, arg, opcode)
    except CorruptCheckpointError:
        raise
    except Exception as ex:  # noqa: BLE001 - any malformed pickle is corrupt data
        raise CorruptCheckpointError(f"{where}: not a valid pickle of builtins ({type(ex).__name__}: {ex})") from ex
    try:
        shape.tree_size(result, budget)
        hashed = 0
        for key in shape.hashed:
            hashed += shape.tree_size(key, budget)
            if hashed > budget:
                raise ValueError(f"makes the unpickler hash more than {budget} values")
    except ValueError as ex:
        raise CorruptCheckpointError(f"{where}: refused a {len(data)}-byte pickle that {ex}") from None


def decode_builtins(data: bytes, *, where: str) -> Any:
    """Decode pickle bytes holding only plain builtins; anything else is a :class:`CorruptCheckpointError`."""
    _check_opcodes(bytes(data), where)
    try:
        value = _NoGlobals(io.BytesIO(data)).load()
    except CorruptCheckpointError as ex:
        raise CorruptCheckpointError(f"{where}: {ex}") from None
    except Exception as ex:  # noqa: BLE001 - any malformed pickle is corrupt data
        raise CorruptCheckpointError(f"{where}: not a valid pickle of builtins ({type(ex).__name__}: {ex})") from ex
    try:
        _check(value, where)
    except ValueError as ex:
        raise CorruptCheckpointError(str(ex)) from None
    return value
