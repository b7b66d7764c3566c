"""Training-state values as JSON plus tensors (:mod:`checkpointer.models.train_codec`): every
storable value comes back as JSON gives it (tuples as lists, tensors as the same tensors), and
hostile JSON trees are refused as corrupt, never run or allowed to recurse without bound."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.errors import CorruptCheckpointError
from checkpointer.models import train_codec

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.booleans(), st.none(), st.sampled_from(["$tensor", "$items", "$x"]))
tensors = st.builds(lambda n, d: torch.arange(n, dtype=d), st.integers(0, 5), st.sampled_from([torch.int64, torch.float32, torch.uint8]))
values = st.recursive(
    st.one_of(scalars, tensors),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=20,
)


def as_json_gives(value):
    """The oracle: what a stored value should come back as."""
    if isinstance(value, (list, tuple)):
        return [as_json_gives(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json_gives(v) for k, v in value.items()}
    return value


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def round_trip(value):
    stored: dict[str, torch.Tensor] = {}

    def add(t: torch.Tensor) -> str:
        name = f"v/{len(stored)}"
        stored[name] = t.clone()
        return name

    text = train_codec.dumps(train_codec.encode(value, "v", add))
    return train_codec.decode(train_codec.loads(text, "v"), "v", stored)


@settings(max_examples=300, deadline=None)
@given(values)
def test_every_storable_value_comes_back_as_json_gives_it(value):
    assert same(as_json_gives(value), round_trip(value))


def test_a_scheduler_state_dict_round_trips():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10)
    for _ in range(3):
        opt.step()
        sched.step()
    state = sched.state_dict()
    state.pop("anneal_func", None)
    assert same(as_json_gives(state), round_trip(state))


@pytest.mark.parametrize("value", [{1, 2}, object(), {(1, 2): 3}, b"bytes", 1j])
def test_values_json_cannot_hold_are_refused_by_name(value):
    with pytest.raises(train_codec.UnstorableValueError, match=r"v"):
        train_codec.encode({"inner": [value]}, "v", lambda t: "x")


def test_nesting_beyond_the_limit_is_refused_on_save():
    deep: list = []
    for _ in range(train_codec.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(train_codec.UnstorableValueError, match="nested"):
        train_codec.encode(deep, "v", lambda t: "x")


HOSTILE = {
    "unknown tag": b'{"$pickle": "cos\\nsystem"}',
    "tag with extra keys": b'{"$tensor": "v/0", "x": 1}',
    "tensor it does not hold": b'{"$tensor": "../model/rank_0.safetensors"}',
    "tensor name not a string": b'{"$tensor": 5}',
    "bad float": b'{"$float": "1e999999"}',
    "items not a list": b'{"$items": {"a": 1}}',
    "items entry not a pair": b'{"$items": [[1, 2, 3]]}',
    "items key a container": b'{"$items": [[[1], 2]]}',
    "NaN literal": b"[NaN]",
    "Infinity literal": b"[Infinity]",
    "not JSON": b"{",
    "not UTF-8": b'"\xff\xfe"',
    "deep arrays": b"[" * 100_000 + b"]" * 100_000,
    "deep but parseable": b"[" * 200 + b"]" * 200,
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_json_is_a_corrupt_checkpoint(name):
    with pytest.raises(CorruptCheckpointError, match="where"):
        train_codec.decode(train_codec.loads(HOSTILE[name], "where"), "where", {"v/0": torch.zeros(1)})


def test_floats_json_cannot_spell_come_back():
    """``-inf`` too: the random values above seldom hold one (a decoder refusing it passed them)."""
    back = round_trip([math.nan, math.inf, -math.inf, {"x": -math.inf}])
    assert math.isnan(back[0]) and back[1:] == [math.inf, -math.inf, {"x": -math.inf}]


def test_numpy_values_come_back_as_python_values_and_tensors():
    np = pytest.importorskip("numpy")
    back = round_trip({"i": np.int64(5), "f": np.float32(0.5), "b": np.bool_(True), "a": np.arange(3), "l": [np.uint8(7)]})
    assert [(type(back[k]), back[k]) for k in ("i", "f", "b")] == [(int, 5), (float, 0.5), (bool, True)]
    assert back["l"] == [7] and type(back["l"][0]) is int
    assert back["a"].dtype == torch.int64 and torch.equal(back["a"], torch.arange(3))


@pytest.mark.parametrize("dtype", ["<U3", "object"])
def test_numpy_arrays_torch_cannot_hold_are_refused_naming_the_value(dtype):
    """Not the bare ``TypeError`` of ``torch.from_numpy`` (found by a review)."""
    np = pytest.importorskip("numpy")
    with pytest.raises(train_codec.UnstorableValueError, match=rf"train_state\['labels'\]\[1\]: a numpy array of dtype {dtype}"):
        train_codec.encode([0, np.array(["cat", "dog"], dtype=dtype)], "train_state['labels']", lambda t: "t")


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_the_deepest_value_a_save_takes_loads_and_one_deeper_is_refused_both_ways():
    """``MAX_DEPTH + 1`` nested lists (depths 0 to ``MAX_DEPTH``) are stored and read back; one
    more level is refused on save, and as JSON on load."""
    deepest = _nested(train_codec.MAX_DEPTH + 1)
    assert round_trip(deepest) == deepest
    with pytest.raises(train_codec.UnstorableValueError, match="nested"):
        train_codec.encode([deepest], "v", lambda t: "x")
    text = b"[" * (train_codec.MAX_DEPTH + 2) + b"]" * (train_codec.MAX_DEPTH + 2)
    with pytest.raises(CorruptCheckpointError, match="nested"):
        train_codec.decode(train_codec.loads(text, "v"), "v", {})


@pytest.mark.parametrize("text", [b'{"a":' * 100 + b"1" + b"}" * 100, b'{"$items":[[1,' * 100 + b"1" + b"]]}" * 100],
                         ids=["deep objects", "deep $items"])
def test_deep_dicts_are_refused_like_deep_lists(text):
    with pytest.raises(CorruptCheckpointError, match="nested"):
        train_codec.decode(train_codec.loads(text, "v"), "v", {})
