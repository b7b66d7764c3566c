"""The optimizer's ``param_group{i}`` and ``state_keys`` values: pickles of plain builtins only.

OLMo-core 0.1.0 stores these as pickle bytes, so we write pickles it can read. We read them
with a decoder that resolves no global at all: a payload naming any class or function
(the only way a pickle can run code) is refused, never executed.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

from ..errors import CorruptCheckpointError

__all__ = ["encode_builtins", "decode_builtins"]

_SCALARS = (str, int, float, bool, type(None))


def _check(value: Any, where: str, depth: int = 0) -> None:
    if depth > 32:
        raise ValueError(f"{where}: nested too deeply")
    if isinstance(value, _SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check(item, where, depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check(k, where, depth + 1)
            _check(v, where, depth + 1)
        return
    raise ValueError(f"{where}: {type(value).__name__} is not a plain builtin (dict, list, tuple, str, int, float, bool, None)")


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


def _check_memo_indices(data: bytes, where: str) -> None:
    """Refuse a memo index no honest pickle of ``len(data)`` bytes could hold.

    The unpickler grows its memo to fit the largest index it is told to store at, so a
    ``LONG_BINPUT 2**31`` in a ten-byte payload would make it allocate gigabytes. Indices are
    handed out from 0 and each store takes at least two bytes, so an honest index is always
    below the payload length. The scan decodes opcodes only; it builds no object.
    """
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            if opcode.name in _MEMO_PUTS and not (isinstance(arg, int) and 0 <= arg < len(data)):
                raise CorruptCheckpointError(
                    f"{where}: refused a pickle that stores at memo index {arg} in a {len(data)}-byte payload"
                )
    except CorruptCheckpointError:
        raise
    except Exception as ex:  # noqa: BLE001 - any malformed pickle is corrupt data
        raise CorruptCheckpointError(f"{where}: not a valid pickle of builtins ({type(ex).__name__}: {ex})") from ex


def decode_builtins(data: bytes, *, where: str) -> Any:
    """Decode pickle bytes holding only plain builtins; anything else is a :class:`CorruptCheckpointError`."""
    _check_memo_indices(bytes(data), where)
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
