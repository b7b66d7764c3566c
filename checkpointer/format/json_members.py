"""Walk a JSON object's members one at a time, so a large document is never one tree in memory.

``json.loads`` of a big ``metadata.json`` builds every object of it at once (about six times
the text's size) before anything can be checked or dropped. :func:`object_members` reads the
outer objects itself and leaves each member's value to the caller, who decodes it (with
``json.JSONDecoder.raw_decode``), keeps what it needs, and lets the rest go before the next.

Same grammar as the ``json`` module (whitespace, string escapes and control characters
alike); every key given twice in an object walked this way is an error.
"""

from __future__ import annotations

import re
from json import JSONDecodeError
from json.decoder import scanstring
from typing import Callable

__all__ = ["object_members", "skip_whitespace"]

_WHITESPACE = re.compile(r"[ \t\n\r]*")


def skip_whitespace(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()  # type: ignore[union-attr] - matches the empty string


def object_members(text: str, start: int, on_member: Callable[[str, int], int]) -> int:
    """For each member of the object at ``text[start]``, call ``on_member(key, value_start)``,
    which decodes the value and returns the index just past it. Returns the index past ``}``.

    Raises:
        JSONDecodeError: the text is not a JSON object there, or gives a key twice.
    """
    if text[start : start + 1] != "{":
        raise JSONDecodeError("Expecting '{'", text, start)
    seen: set[str] = set()
    i = skip_whitespace(text, start + 1)
    if text[i : i + 1] == "}":
        return i + 1
    while True:
        if text[i : i + 1] != '"':
            raise JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        key, i = scanstring(text, i + 1)
        if key in seen:
            raise JSONDecodeError(f"duplicate key {key!r}", text, i)
        seen.add(key)
        i = skip_whitespace(text, i)
        if text[i : i + 1] != ":":
            raise JSONDecodeError("Expecting ':' delimiter", text, i)
        i = skip_whitespace(text, on_member(key, skip_whitespace(text, i + 1)))
        if text[i : i + 1] == "}":
            return i + 1
        if text[i : i + 1] != ",":
            raise JSONDecodeError("Expecting ',' delimiter", text, i)
        i = skip_whitespace(text, i + 1)
