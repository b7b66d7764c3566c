"""format/json_members.py: walking a JSON object member by member, against ``json.loads``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.format.json_members import object_members, skip_whitespace

DECODER = json.JSONDecoder()


def walk(text: str) -> dict:
    """The object in ``text`` through object_members, each value decoded by raw_decode."""
    out: dict = {}

    def member(key: str, i: int) -> int:
        out[key], end = DECODER.raw_decode(text, i)
        return end

    end = skip_whitespace(text, object_members(text, skip_whitespace(text, 0), member))
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return out


scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                      max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=10), values, max_size=6), st.sampled_from([None, 0, 2]),
       st.sampled_from([(", ", ": "), (",", ":"), (" ,\n", " :\t")]), st.booleans())
def test_walking_gives_what_json_loads_gives(doc, indent, separators, ascii_only):
    text = json.dumps(doc, indent=indent, separators=separators, ensure_ascii=ascii_only)
    assert walk(text) == json.loads(text)
    assert walk(" \n\t" + text + "\r\n ") == doc


BAD = [
    "", "{", '{"a"', '{"a":', '{"a":1', '{"a":1,}', '{"a" 1}', '{"a":1 "b":2}', "{a:1}",
    "{'a':1}", '{"a":1}}', '{"a":1}{}', '{"a\x01":1}', '{"\\x":1}', '{,}', '{"a":1,,"b":2}',
]


@pytest.mark.parametrize("text", BAD)
def test_what_json_refuses_is_refused(text):
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        walk(text)


@pytest.mark.parametrize("text", ["[]", '"x"', "3", "null"])
def test_a_json_value_other_than_an_object_is_refused(text):
    with pytest.raises(json.JSONDecodeError, match="Expecting '{'"):
        walk(text)


@pytest.mark.parametrize("text", ['{"a":1,"a":1}', '{"a":1, "b":{}, "a":2}', '{"\\u0061":1,"a":2}'])
def test_a_key_given_twice_is_refused(text):
    with pytest.raises(json.JSONDecodeError, match="duplicate key 'a'"):
        walk(text)


def test_values_are_left_to_the_caller():
    text = '{"skip": [1, 2, {"deep": true}], "keep": 3}'
    seen = []

    def member(key: str, i: int) -> int:
        seen.append((key, text[i]))
        return DECODER.raw_decode(text, i)[1]

    assert object_members(text, 0, member) == len(text)
    assert seen == [("skip", "["), ("keep", "3")]
