"""format/safetensors_header.py against the real safetensors library, and hostile headers."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import safetensors
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from checkpointer.errors import CorruptCheckpointError
from checkpointer.format.dtypes import DTYPE_CODES, itemsize
from checkpointer.format.safetensors_header import (
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    build_header,
    header_length,
    parse_header,
)

WHERE = "ckpt/rank_0.safetensors"


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def sample(code: str, numel: int, seed: int = 0) -> torch.Tensor:
    dtype = DTYPE_CODES[code]
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, (numel,), generator=g, dtype=torch.int64).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, works for every dtype)."""
    return a.dtype == b.dtype and a.shape == b.shape and tensor_bytes(a) == tensor_bytes(b)


def write_pieces(path, pieces: dict[str, torch.Tensor], user_metadata=None) -> tuple[bytes, list[int]]:
    spec = [(key, code_of(t), t.numel()) for key, t in pieces.items()]
    header, offsets = build_header(spec, user_metadata=user_metadata)
    with open(path, "wb") as f:
        f.write(header)
        for t in pieces.values():
            f.write(tensor_bytes(t))
    return header, offsets


def code_of(t: torch.Tensor) -> str:
    return {v: k for k, v in DTYPE_CODES.items()}[t.dtype]


# ---------------------------------------------------------------------------------------------
# build_header -> safetensors.safe_open
# ---------------------------------------------------------------------------------------------

CASES = {
    "f32": {"a": sample("F32", 10)},
    "mixed": {
        "w.f64": sample("F64", 3),
        "w.bf16": sample("BF16", 7, 1),
        "mask": sample("BOOL", 5, 2),
        "empty": torch.empty(0, dtype=torch.float32),
        "ids": sample("I64", 4, 3),
        "h": sample("F16", 9, 4),
        "i32": sample("I32", 2, 5),
        "i16": sample("I16", 3, 6),
        "i8": sample("I8", 5, 7),
        "u8": torch.arange(256, dtype=torch.uint8),
    },
    "fp8": {"e4m3": sample("F8_E4M3", 6), "e5m2": sample("F8_E5M2", 6, 1)},
    "only empty": {"z": torch.empty(0, dtype=torch.bfloat16), "y": torch.empty(0, dtype=torch.bool)},
    "nothing": {},
    "unicode keys": {"état.ü": sample("F32", 2), 'quote"key': sample("U8", 3)},
}


@pytest.mark.parametrize("pieces", CASES.values(), ids=CASES.keys())
def test_build_header_readable_by_safetensors(tmp_path, pieces):
    path = tmp_path / "rank_0.safetensors"
    header, offsets = write_pieces(path, pieces, user_metadata={"format": "pt", "step": "10"})
    # Data starts on a 64-byte boundary, pieces back to back, offsets absolute.
    assert len(header) % 64 == 0
    expected = len(header)
    for off, t in zip(offsets, pieces.values()):
        assert off == expected
        expected += t.numel() * t.element_size()
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(pieces)
        assert f.metadata() == {"format": "pt", "step": "10"}
        for key, t in pieces.items():
            got = f.get_tensor(key)
            assert same(got, t), key
    # And our own parser reads back what it built.
    parsed = parse_header(header[PREFIX_BYTES:], where=WHERE, file_size=path.stat().st_size)
    assert parsed.data_start == len(header)
    assert parsed.user_metadata == {"format": "pt", "step": "10"}
    assert list(parsed.entries) == list(pieces)
    data = path.read_bytes()
    for (key, t), off in zip(pieces.items(), offsets):
        e = parsed.entries[key]
        assert (e.dtype, e.shape, e.start, e.end) == (code_of(t), (t.numel(),), off, off + t.numel() * t.element_size())
        assert data[e.start : e.end] == tensor_bytes(t)


def test_build_header_without_user_metadata(tmp_path):
    path = tmp_path / "f.safetensors"
    header, _ = write_pieces(path, {"x": sample("BF16", 3)})
    assert b"__metadata__" not in header
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() is None
        assert same(f.get_tensor("x"), sample("BF16", 3))


def test_parse_header_of_a_file_written_by_safetensors(tmp_path):
    tensors = {
        "b": sample("BF16", 12).reshape(3, 4),
        "a": sample("F32", 6, 1).reshape(2, 1, 3),
        "m": sample("BOOL", 4, 2),
        "s": torch.tensor(3.5, dtype=torch.float64),
        "z": torch.empty(0, 5, dtype=torch.int32),
    }
    # safetensors.torch.save_file needs numpy; serialize() is the same writer without it.
    specs = {
        key: safetensors.TensorSpec(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=list(t.shape),
            data_ptr=t.data_ptr(),
            data_len=t.numel() * t.element_size(),
        )
        for key, t in tensors.items()
    }
    data = bytes(safetensors.serialize(specs, metadata={"k": "v"}))
    path = tmp_path / "hf.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), framework="pt") as f:
        assert all(same(f.get_tensor(k), t) for k, t in tensors.items())
    n = header_length(data[:8], where=WHERE, file_size=len(data))
    parsed = parse_header(data[8 : 8 + n], where=WHERE, file_size=len(data))
    assert parsed.user_metadata == {"k": "v"}
    assert set(parsed.entries) == set(tensors)
    for key, t in tensors.items():
        e = parsed.entries[key]
        assert e.shape == tuple(t.shape) and e.dtype == code_of(t) and e.numel == t.numel()
        assert data[e.start : e.end] == tensor_bytes(t)


# ---------------------------------------------------------------------------------------------
# Hostile headers
# ---------------------------------------------------------------------------------------------


def test_header_length_checks():
    good = struct.pack("<Q", 100)
    assert header_length(good, where=WHERE, file_size=108) == 100
    with pytest.raises(CorruptCheckpointError, match=WHERE):
        header_length(good, where=WHERE, file_size=107)  # larger than the file
    with pytest.raises(CorruptCheckpointError):
        header_length(struct.pack("<Q", 2**64 - 1), where=WHERE, file_size=2**70)
    with pytest.raises(CorruptCheckpointError):
        header_length(struct.pack("<Q", MAX_HEADER_BYTES + 1), where=WHERE, file_size=2**40)
    with pytest.raises(CorruptCheckpointError):
        header_length(b"\x01\x00\x00", where=WHERE, file_size=3)  # file too short
    with pytest.raises(CorruptCheckpointError):
        header_length(b"", where=WHERE, file_size=0)


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def header_json(entries: dict) -> bytes:
    return json.dumps(entries).encode()


def parse_with_data(hj: bytes, data_bytes: int):
    return parse_header(hj, where=WHERE, file_size=PREFIX_BYTES + len(hj) + data_bytes)


def test_valid_handmade_header():
    hj = header_json({"a": entry(), "b": entry("BF16", (3,), (8, 14)), "e": entry("F32", (0,), (8, 8))})
    parsed = parse_with_data(hj, 14)
    start = PREFIX_BYTES + len(hj)
    assert parsed.entries["b"].start == start + 8 and parsed.entries["b"].end == start + 14
    assert parsed.entries["e"].numel == 0
    # A zero-byte entry sitting inside another is not an overlap.
    parse_with_data(header_json({"a": entry(), "e": entry("F32", (0,), (4, 4))}), 8)


BAD_HEADERS = {
    "not json": b"{nope",
    "not utf-8": b'{"\xff": 1}',
    "empty": b"",
    "array": b"[]",
    "string": b'"x"',
    "duplicate keys": b'{"a": ' + json.dumps(entry()).encode() + b', "a": ' + json.dumps(entry()).encode() + b"}",
    "range shorter than shape": header_json({"a": entry("F32", (2,), (0, 7))}),
    "range longer than shape": header_json({"a": entry("F32", (2,), (0, 12))}),
    "range wrong for dtype": header_json({"a": entry("BF16", (2,), (0, 8))}),
    "range past the file": header_json({"a": entry("F32", (2,), (8, 16))}),
    "reversed range": header_json({"a": entry("F32", (0,), (8, 0))}),
    "negative start": header_json({"a": entry("F32", (2,), (-8, 0))}),
    "overlap": header_json({"a": entry("F32", (2,), (0, 8)), "b": entry("F32", (1,), (4, 8))}),
    "overlap by one byte": header_json({"a": entry("U8", (2,), (0, 2)), "b": entry("U8", (2,), (1, 3))}),
    "contained": header_json({"a": entry("F32", (4,), (0, 16)), "b": entry("F32", (1,), (4, 8)), "c": entry("F32", (1,), (8, 12))}),
    "unknown dtype": header_json({"a": entry("F128", (1,), (0, 16))}),
    "dtype not a string": header_json({"a": entry(["F32"], (2,), (0, 8))}),
    "negative shape": header_json({"a": entry("F32", (-2,), (0, 8))}),
    "negative dims, positive product": header_json({"a": entry("F32", (-1, -2), (0, 8))}),
    "bool in shape": header_json({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}),
    "float in shape": header_json({"a": {"dtype": "U8", "shape": [1.0], "data_offsets": [0, 1]}}),
    "float offsets": header_json({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0.0, 1.0]}}),
    "three offsets": header_json({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}),
    "missing offsets": header_json({"a": {"dtype": "U8", "shape": [1]}}),
    "missing dtype": header_json({"a": {"shape": [1], "data_offsets": [0, 1]}}),
    "entry is a list": header_json({"a": ["U8", [1], [0, 1]]}),
    "entry is a string": header_json({"a": "U8"}),
    "shape is a dict": header_json({"a": {"dtype": "U8", "shape": {"0": 1}, "data_offsets": [0, 1]}}),
    "too many dims": header_json({"a": entry("U8", (1,) * 65, (0, 1))}),
    "bad __metadata__": header_json({"__metadata__": {"k": 1}, "a": entry()}),
    "__metadata__ not an object": header_json({"__metadata__": ["k"], "a": entry()}),
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("hj", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_parse_header_rejects(hj):
    with pytest.raises(CorruptCheckpointError) as info:
        parse_with_data(hj, 8)
    assert WHERE in str(info.value)


def test_build_header_rejects_unknown_dtype():
    with pytest.raises(CorruptCheckpointError):
        build_header([("a", "F128", 1)])


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_every_dtype_builds_and_parses(code):
    header, offsets = build_header([("x", code, 3), ("y", code, 0)])
    size = len(header) + 3 * itemsize(code)
    parsed = parse_header(header[PREFIX_BYTES:], where=WHERE, file_size=size)
    assert parsed.entries["x"].start == offsets[0] and parsed.entries["x"].end == size
    with pytest.raises(CorruptCheckpointError):
        parse_header(header[PREFIX_BYTES:], where=WHERE, file_size=size - 1)


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 40), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=5),
    st.sampled_from(["F32", "U8", "BOOL", "BF16"]),
)  # fmt: skip
_JSON = st.recursive(
    _SCALARS,
    lambda c: st.one_of(
        st.lists(c, max_size=4),
        st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__", "a"]), c, max_size=4),
    ),
    max_leaves=12,
)
_ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "U8", "BOOL", "BF16", "X"]),
        "shape": st.lists(st.integers(-1, 5), max_size=3),
        "data_offsets": st.lists(st.integers(-1, 60), min_size=2, max_size=2),
    }
)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=3), st.one_of(_ENTRY, _JSON), max_size=4), st.integers(0, 80))
def test_fuzzed_header_is_parsed_or_corrupt(header, data_bytes):
    hj = json.dumps(header).encode()
    size = PREFIX_BYTES + len(hj) + data_bytes
    try:
        parsed = parse_header(hj, where=WHERE, file_size=size)
    except CorruptCheckpointError:
        return
    spans = []
    for e in parsed.entries.values():
        assert parsed.data_start <= e.start <= e.end <= size
        assert e.end - e.start == e.numel * itemsize(e.dtype)
        spans.append((e.start, e.end))
    spans = sorted(s for s in spans if s[1] > s[0])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("pieces", [[("a", "F32", 2), ("a", "F32", 3)], [("__metadata__", "U8", 1)]])
def test_build_header_refuses_duplicate_or_reserved_keys(pieces):
    with pytest.raises(ValueError):
        build_header(pieces)


@pytest.mark.parametrize(
    "shape",
    [(0, 2**63), (2**62 + 1, 0), (0, 2**62, 2**62), (0, 2**40, 2**40), (2**31, 2**31, 2**1, 0)],
    ids=["dim-past-int64", "dim-past-max-numel", "strides-overflow", "strides-overflow-small-dims", "with-zero-last"],
)
def test_empty_tensor_with_huge_dims_is_refused(shape):
    """No element, no bytes, yet torch cannot make it: a dimension, or a partial product of
    dimensions (a stride), past 2**62 could overflow int64."""
    with pytest.raises(CorruptCheckpointError, match="too many elements, or a dimension over"):
        parse_with_data(header_json({"a": entry("F32", shape, (0, 0))}), 0)


def test_largest_dims_still_parse():
    parse_with_data(header_json({"a": entry("F32", (0, 2**62), (0, 0)), "b": entry("F32", (2**31, 2**31, 0), (0, 0))}), 0)


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(0, 300), max_size=4),
    remainder=st.integers(0, 63).map(lambda k: 64 * k),
    modulus=st.sampled_from([64, 512, 4096]),
)
def test_build_header_can_start_the_data_at_a_given_remainder(tmp_path_factory, numels, remainder, modulus):
    """``data_start=(r, m)``: the data starts at the first 64-byte boundary leaving r modulo m,
    and the file stays one safetensors reads."""
    remainder %= modulus
    pieces = {f"t{i}": sample("F32", n, i) for i, n in enumerate(numels)}
    spec = [(key, "F32", t.numel()) for key, t in pieces.items()]
    plain, _ = build_header(spec)
    header, offsets = build_header(spec, data_start=(remainder, modulus))
    assert len(header) % 64 == 0 and len(header) % modulus == remainder
    assert len(plain) <= len(header) < len(plain) + modulus
    assert offsets == [o + len(header) - len(plain) for o in build_header(spec)[1]]
    path = tmp_path_factory.mktemp("start") / "f.safetensors"
    with open(path, "wb") as f:
        f.write(header)
        for t in pieces.values():
            f.write(tensor_bytes(t))
    with safe_open(str(path), framework="pt") as f:
        for key, t in pieces.items():
            assert same(f.get_tensor(key), t), key


@pytest.mark.parametrize("data_start", [(32, 512), (0, 100), (64, 0)])
def test_build_header_refuses_a_start_off_its_64_byte_boundaries(data_start):
    with pytest.raises(ValueError, match="multiples of 64"):
        build_header([("a", "F32", 4)], data_start=data_start)
