"""format/builtins_pickle.py: plain builtins round trip; any pickle naming a global is refused, not run."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.errors import CorruptCheckpointError
from checkpointer.format.builtins_pickle import decode_builtins, encode_builtins

WHERE = "optim/param_group0"

builtins_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda c: st.one_of(
        st.lists(c, max_size=4),
        st.lists(c, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), c, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(builtins_values)
def test_round_trip(value):
    data = encode_builtins(value)
    assert decode_builtins(data, where=WHERE) == value
    assert pickle.loads(data) == value  # what OLMo-core does with it


def test_param_group_round_trip():
    group = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": [0, 1, 2], "foreach": None}
    assert decode_builtins(encode_builtins(group), where=WHERE) == group
    # Pickles written by a stock pickle (any protocol) of such a value decode too.
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        assert decode_builtins(pickle.dumps(group, protocol=protocol), where=WHERE) == group


DEEP: list = [1]
for _ in range(40):
    DEEP = [DEEP]


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    "value",
    [
        Boom(),
        {"x": Boom()},
        [1, 2, {3, 4}],  # a set
        b"bytes",
        bytearray(b"x"),
        1 + 2j,
        range(3),
        DEEP,  # deeper than allowed
    ],
    ids=["reduce", "nested-reduce", "set", "bytes", "bytearray", "complex", "range", "deep"],
)
def test_hostile_or_foreign_pickles_are_refused(value):
    data = pickle.dumps(value, protocol=4)
    with pytest.raises(CorruptCheckpointError, match=WHERE):
        decode_builtins(data, where=WHERE)
    with pytest.raises(ValueError):
        encode_builtins(value)


def test_global_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran"
    payload = (
        b"\x80\x04cbuiltins\nexec\n(V"
        + f"open({str(marker)!r}, 'w').write('x')".encode()
        + b"\ntR."
    )
    pickletools.dis(payload, out=io.StringIO())  # a well-formed pickle
    with pytest.raises(CorruptCheckpointError):
        decode_builtins(payload, where=WHERE)
    assert not marker.exists()


def test_self_referencing_list_is_refused():
    loop: list = []
    loop.append(loop)
    with pytest.raises(CorruptCheckpointError):
        decode_builtins(pickle.dumps(loop), where=WHERE)


@pytest.mark.parametrize("data", [b"", b"garbage", b"\x80\x04", pickle.dumps([1, 2])[:-1], b"\x80\x04Q."])
def test_malformed_pickles_are_corrupt(data):
    with pytest.raises(CorruptCheckpointError):
        decode_builtins(data, where=WHERE)


@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x04N" + b"q" + bytes([200]) + b".",  # BINPUT 200 in an 8-byte payload
        b"\x80\x04N" + b"r" + struct.pack("<I", 2**20) + b".",  # LONG_BINPUT: an 8 MiB memo
        b"Np1000000\n.",  # PUT (protocol 0, decimal index)
        b"\x80\x02]q\x00(K\x01K\x02er" + struct.pack("<I", 2**20) + b".",  # after an honest store
    ],
    ids=["binput", "long-binput", "put", "after-honest-put"],
)
def test_memo_bomb_is_refused_before_allocating(data):
    # The unpickler grows its memo to the largest index it stores at: an index past the
    # payload length is refused by a scan of the opcodes, before anything is unpickled.
    with pytest.raises(CorruptCheckpointError, match="memo index"):
        decode_builtins(data, where=WHERE)


def test_honest_memo_indices_decode():
    shared = [1, 2]
    value = {"a": shared, "b": shared, "c": (shared, "x" * 300)}
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        assert decode_builtins(pickle.dumps(value, protocol=protocol), where=WHERE) == value


# ---------------------------------------------------------------------------------------------
# Shared references: a small pickle of a huge tree
# ---------------------------------------------------------------------------------------------


def _shared_lists(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value, value]  # the memo stores each list once: 2**levels values as a tree
    return value


def _hashed_once_dropped(levels: int) -> bytes:
    """A dict keyed by ``levels`` nested shared tuples, built and popped: the result is None,
    but the unpickler hashes the key, a walk of 2**levels tuples."""
    out = b"\x80\x04)\x940"  # EMPTY_TUPLE MEMOIZE POP
    for i in range(1, levels + 1):
        out += b"h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"\x86\x940"  # (t, t) MEMOIZE POP
    return out + b"}h" + bytes([levels]) + b"Ns0N."  # {t: None} POP; None STOP


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps(_shared_lists(30), protocol=4),
        pickle.dumps({"lr": 0.1, "betas": _shared_lists(30)}, protocol=2),
        pickle.dumps({"x": tuple(_shared_lists(30))}, protocol=0),
        _hashed_once_dropped(30),
    ],
    ids=["lists", "in-a-group", "protocol-0", "hashed-key"],
)
def test_shared_reference_bomb_is_refused_quickly(data):
    """Under 400 bytes each; walking (or hashing) them as trees took minutes to hours."""
    assert len(data) < 400
    t0 = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}: refused a .*values counted as a tree"):
        decode_builtins(data, where=WHERE)
    assert time.perf_counter() - t0 < 1.0


def test_tree_size_is_linear_in_the_payload():
    """Just under the budget decodes; the budget grows with the payload, not with the sharing."""
    shared = _shared_lists(15)  # 2**16 - 1 values as a tree: within the smallest budget
    assert decode_builtins(pickle.dumps(shared), where=WHERE) == shared
    wide = list(range(100_000))  # no sharing: a large honest payload stays within its budget
    assert decode_builtins(pickle.dumps(wide), where=WHERE) == wide
    with pytest.raises(CorruptCheckpointError, match="values counted as a tree"):
        decode_builtins(pickle.dumps([shared, shared]), where=WHERE)


def test_a_list_filled_after_it_is_shared_counts_whole():
    """The opcode scan follows the unpickler: a list referenced first and filled later."""
    inner: list = []
    outer = [inner] * 20_000  # 20,000 references to one list, stored once
    inner.extend(range(100))  # ... that holds 100 values: 2 million values as a tree
    data = pickle.dumps(outer, protocol=2)
    with pytest.raises(CorruptCheckpointError, match="values counted as a tree"):
        decode_builtins(data, where=WHERE)


@pytest.mark.parametrize("levels", [31, 32, 33, 34])
def test_depth_limit_unchanged(levels):
    """Nested exactly as deep as before is still accepted, one more still refused."""
    value: object = 1
    for _ in range(levels):
        value = [value]
    if levels <= 32:
        assert decode_builtins(encode_builtins(value), where=WHERE) == value
    else:
        with pytest.raises(CorruptCheckpointError, match="nested too deeply"):
            decode_builtins(pickle.dumps(value), where=WHERE)


def test_hashing_one_key_many_times_is_refused():
    """A key of 2**15 - 1 tuples (under the budget of 2**16 values) set three times in a dict:
    each SETITEM hashes it again, 98,301 values hashed in all, past the budget of this 119-byte
    pickle (the work grows with each 4-byte SETITEM; a mutant that dropped the sum over keys
    passed every test)."""
    out = b"\x80\x04)\x940"  # EMPTY_TUPLE MEMOIZE POP
    for i in range(1, 15):
        out += b"h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"\x86\x940"  # (t, t) MEMOIZE POP
    one = out + b"}h\x0eNs."  # {t: None}
    assert decode_builtins(one, where=WHERE) == {_shared_tuples(14): None}
    three = out + b"}" + b"h\x0eNs" * 3 + b"0N."  # {t: None, t: None, t: None} POP; None STOP
    with pytest.raises(CorruptCheckpointError, match=f"^{WHERE}: refused a {len(three)}-byte pickle that makes the unpickler hash more than 65536 values$"):
        decode_builtins(three, where=WHERE)


def _shared_tuples(levels: int) -> tuple:
    value: tuple = ()
    for _ in range(levels):
        value = (value, value)
    return value


def test_persistent_ids_are_refused():
    """A persistent id (BINPERSID) asks the unpickler for an object outside the pickle: refused,
    never handed back as the value (a mutant that returned the id passed every test)."""
    payload = b"\x80\x04\x8c\x01a\x94Q."  # SHORT_BINUNICODE 'a' MEMOIZE BINPERSID STOP
    pickletools.dis(payload, out=io.StringIO())  # a well-formed pickle
    with pytest.raises(CorruptCheckpointError, match=f"^{WHERE}: refused a pickle with persistent ids"):
        decode_builtins(payload, where=WHERE)
