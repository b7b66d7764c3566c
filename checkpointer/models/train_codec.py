"""Training-state values as JSON plus tensors, both ways, without pickle.

A value is encoded into a JSON tree whose leaves are plain values, with three tags:

- ``{"$tensor": NAME}``: a tensor, stored beside the JSON under the key ``NAME``;
- ``{"$items": [[KEY, VALUE], ...]}``: a dict whose keys are not all strings (ints, floats, bools,
  None), or has a string key starting with ``$``;
- ``{"$float": "nan" | "inf" | "-inf"}``: a float JSON cannot spell.

Every other dict is a dict with string keys, none starting with ``$``. Tuples come back as lists. Decoding refuses
anything else (an unknown tag, a tag with extra keys, a tensor name the checkpoint does not
hold, nesting deeper than :data:`MAX_DEPTH`) as a :class:`~checkpointer.errors.CorruptCheckpointError`,
in time linear in the size of the JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Mapping

import torch

from ..errors import CorruptCheckpointError

__all__ = ["MAX_DEPTH", "encode", "decode", "dumps", "loads", "UnstorableValueError"]

MAX_DEPTH = 64
_TAGS = ("$tensor", "$items", "$float")


class UnstorableValueError(TypeError):
    """A training-state value that is neither plain, a tensor, nor a container of them."""


def encode(value: Any, name: str, add_tensor: Callable[[torch.Tensor], str]) -> Any:
    """``value`` as a JSON tree; each tensor goes to ``add_tensor``, which returns the name it is
    stored under. ``name`` (``train_state['sched']``) names the value in errors."""
    return _encode(value, name, add_tensor, 0)


def _encode(value: Any, where: str, add_tensor: Callable[[torch.Tensor], str], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise UnstorableValueError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(float(value))}
    if isinstance(value, torch.Tensor):
        return {"$tensor": add_tensor(value)}
    if _is_numpy(value):
        return _encode(_from_numpy(value, where), where, add_tensor, depth)
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{where}[{i}]", add_tensor, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, f"{where}[{k!r}]", add_tensor, depth + 1) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise UnstorableValueError(f"{where}: a dict key of type {type(k).__name__} cannot be stored")
            items.append([_encode(k, where, add_tensor, depth + 1), _encode(v, f"{where}[{k!r}]", add_tensor, depth + 1)])
        return {"$items": items}
    raise UnstorableValueError(
        f"{where}: a {type(value).__name__} cannot be stored in train_state (plain values, tensors, "
        "lists/tuples/dicts of them, or objects with state_dict()/load_state_dict())"
    )


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy"


def _from_numpy(value: Any, where: str) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        try:
            return torch.from_numpy(value.copy())
        except TypeError:  # strings, objects: no torch dtype
            raise UnstorableValueError(
                f"{where}: a numpy array of dtype {value.dtype} cannot be stored (numeric and bool arrays can; "
                "store strings as a list: .tolist())"
            ) from None
    if isinstance(value, np.generic):
        return value.item()
    raise UnstorableValueError(f"{where}: a numpy {type(value).__name__} cannot be stored in train_state")


def dumps(tree: Any) -> bytes:
    return json.dumps(tree, allow_nan=False, separators=(",", ":"), sort_keys=False).encode()


def loads(data: bytes, where: str) -> Any:
    """Parse JSON written by :func:`dumps`; bad JSON, NaN literals and deep nesting are corrupt."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as ex:
        raise CorruptCheckpointError(f"{where}: not valid training-state JSON ({type(ex).__name__}: {ex})") from None


def _refuse_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def decode(tree: Any, where: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The value :func:`encode` made ``tree`` from, its tensors taken from ``tensors``."""
    return _decode(tree, where, tensors, 0)


def _decode(tree: Any, where: str, tensors: Mapping[str, torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CorruptCheckpointError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [_decode(v, where, tensors, depth + 1) for v in tree]
    if not isinstance(tree, dict):  # json gives nothing else; kept for trees from elsewhere
        raise CorruptCheckpointError(f"{where}: a {type(tree).__name__} in training-state JSON")
    tag = next((k for k in _TAGS if k in tree), None)
    if tag is None:
        if any(k.startswith("$") for k in tree):
            raise CorruptCheckpointError(f"{where}: unknown tag in training-state JSON: {sorted(k for k in tree if k.startswith('$'))[:3]}")
        return {k: _decode(v, where, tensors, depth + 1) for k, v in tree.items()}
    if len(tree) != 1:
        raise CorruptCheckpointError(f"{where}: the tag {tag!r} has other keys beside it")
    body = tree[tag]
    if tag == "$tensor":
        if not isinstance(body, str) or body not in tensors:
            raise CorruptCheckpointError(f"{where}: refers to tensor {str(body)[:100]!r}, which the checkpoint does not hold")
        return tensors[body]
    if tag == "$float":
        if body not in ("nan", "inf", "-inf"):
            raise CorruptCheckpointError(f"{where}: bad $float {str(body)[:20]!r}")
        return float(body)
    if not isinstance(body, list):
        raise CorruptCheckpointError(f"{where}: $items is not a list")
    out: dict[Any, Any] = {}
    for item in body:
        if not (isinstance(item, list) and len(item) == 2):
            raise CorruptCheckpointError(f"{where}: an $items entry is not a [key, value] pair")
        key = _decode(item[0], where, tensors, depth + 1)
        if not (key is None or isinstance(key, (bool, int, float, str))):
            raise CorruptCheckpointError(f"{where}: an $items key is a {type(key).__name__}")
        out[key] = _decode(item[1], where, tensors, depth + 1)
    return out
