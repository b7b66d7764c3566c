"""Hostile input, part 2: safetensors headers of rank files.

Each test damages ``model/rank_1.safetensors`` of a copy of the template; every loader that
reads rank files must raise a CheckpointError naming that file (see ``test_hostile_files``
for the rule), and the loaders that only read metadata.json may still succeed.
"""

from __future__ import annotations

import os
import struct

import pytest
from hostile import check_part, edit_header, split_rank_file, write_rank_file

FILE = "rank_1.safetensors"


def rank_file(copy) -> str:
    return os.path.join(copy.part("model"), FILE)


def check(copy, tmp_path, *needles):
    __tracebackhide__ = True
    check_part(copy, "model", tmp_path, FILE, *needles, scope="data")


def data_keys(header: dict) -> list[str]:
    """Tensor keys in file order (by offset)."""
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


# --------------------------------------------------------------------------------------
# The 8-byte length
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", ["2**64-1", "2**63", "2**40", "100_000_001", "size", "size-7"])
def test_header_length_huge(ckpt, tmp_path, length):
    path = rank_file(ckpt)
    size = os.path.getsize(path)
    n = eval(length, {"size": size})  # noqa: S307 - test parameters only
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", n))
    check(ckpt, tmp_path)


@pytest.mark.parametrize("size", [0, 7, 8])
def test_file_too_short_for_a_header(ckpt, tmp_path, size):
    path = rank_file(ckpt)
    with open(path, "r+b") as f:
        f.truncate(size)
    check(ckpt, tmp_path)


def test_header_of_100_mb_that_is_not_json(ckpt, tmp_path):
    """A length the file backs (a sparse file) but a header that is garbage: refused, nothing larger read."""
    path = rank_file(ckpt)
    n = 99_999_000
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + b'{"bias": ')
        f.truncate(8 + n + 4096)
    check(ckpt, tmp_path)


# --------------------------------------------------------------------------------------
# Offsets
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["end_past_file", "start_past_file", "both_huge"])
def test_offsets_past_the_end_of_the_file(ckpt, tmp_path, where):
    def edit(header):
        key = data_keys(header)[-1]
        start, end = header[key]["data_offsets"]
        n = end - start
        header[key]["data_offsets"] = {
            "end_past_file": [start + 4, end + 4],
            "start_past_file": [end + 4096, end + 4096 + n],
            "both_huge": [2**62, 2**62 + n],
        }[where]

    edit_header(rank_file(ckpt), edit)
    check(ckpt, tmp_path)


def test_offsets_overlapping(ckpt, tmp_path):
    """The second tensor starts inside the first (same lengths, so each alone looks fine)."""

    def edit(header):
        first, second = data_keys(header)[:2]
        a0, _ = header[first]["data_offsets"]
        b0, b1 = header[second]["data_offsets"]
        header[second]["data_offsets"] = [a0 + 4, a0 + 4 + (b1 - b0)]

    edit_header(rank_file(ckpt), edit)
    check(ckpt, tmp_path)


def test_offsets_that_do_not_fit_the_shape(ckpt, tmp_path):
    def edit(header):
        key = data_keys(header)[0]
        start, end = header[key]["data_offsets"]
        header[key]["data_offsets"] = [start, end - 4]

    edit_header(rank_file(ckpt), edit)
    check(ckpt, tmp_path)


@pytest.mark.parametrize(
    "offsets",
    [[-4, 4], [8, 4], [0.0, 8.0], [True, 9], ["0", "8"], [0], [0, 4, 8], None, [2**70, 2**70 + 8], {"a": 1}],
    ids=["negative", "reversed", "floats", "bool", "strings", "one", "three", "null", "beyond_int64", "object"],
)
def test_offsets_of_the_wrong_kind(ckpt, tmp_path, offsets):
    def edit(header):
        header[data_keys(header)[0]]["data_offsets"] = offsets

    edit_header(rank_file(ckpt), edit)
    check(ckpt, tmp_path)


# --------------------------------------------------------------------------------------
# Shapes and dtypes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [[2**32, 2**32, 2**32], [2**63], [2**64 + 1], [2**62, 2**62], [-1], [1] * 65, ["7"], [2.0], "7", None],
    ids=["2^96", "2^63", "beyond_uint64", "2^124", "negative", "65_dims", "string_dim", "float_dim", "string", "null"],
)
def test_shape_whose_element_count_overflows_or_is_bad(ckpt, tmp_path, shape):
    def edit(header):
        header[data_keys(header)[0]]["shape"] = shape

    edit_header(rank_file(ckpt), edit)
    check(ckpt, tmp_path)


def test_shape_and_dtype_that_fit_the_bytes_but_not_the_metadata(ckpt, tmp_path):
    """F32 x n stored as F16 x 2n: consistent in the file, a disagreement with metadata.json."""

    def edit(header):
        entry = header[data_keys(header)[0]]
        entry["dtype"] = "F16"
        entry["shape"] = [entry["shape"][0] * 2]

    edit_header(rank_file(ckpt), edit)
    check(ckpt, tmp_path)


@pytest.mark.parametrize("dtype", ["F128", "C64", "f32", "", None, 4, "U16", "F8_E8M0", ["F32"]])
def test_unknown_dtype_in_header(ckpt, tmp_path, dtype):
    def edit(header):
        header[data_keys(header)[0]]["dtype"] = dtype

    edit_header(rank_file(ckpt), edit)
    check(ckpt, tmp_path)


# --------------------------------------------------------------------------------------
# The JSON itself
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_header_json_deeply_nested(ckpt, tmp_path, depth):
    path = rank_file(ckpt)
    _, data = split_rank_file(path)
    write_rank_file(path, '{"bias": ' + "[" * depth + "]" * depth + "}", data)
    check(ckpt, tmp_path)


def test_header_with_a_duplicate_key(ckpt, tmp_path):
    """The second entry for a key would silently win in a plain json.loads."""
    path = rank_file(ckpt)
    header, data = split_rank_file(path)
    key = data_keys(header)[0]
    text = '{"%s": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ' % key
    text += __import__("json").dumps(header)[1:]
    write_rank_file(path, text, data)
    check(ckpt, tmp_path, key)


@pytest.mark.parametrize(
    "text",
    [
        b"[]",
        b"null",
        b'"rank"',
        b"5",
        b'{"bias": 5}',
        b'{"bias": {"dtype": "F32"}}',
        b'{"__metadata__": 5}',
        b'{"__metadata__": {"a": 1}}',
        b"\xff\xfe\x00{",
        b"{",
        b"",
    ],
    ids=["list", "null", "string", "number", "entry_number", "entry_partial", "meta_number", "meta_int_value", "not_utf8", "truncated", "empty"],
)
def test_header_that_is_not_a_header(ckpt, tmp_path, text):
    path = rank_file(ckpt)
    _, data = split_rank_file(path)
    write_rank_file(path, text, data)
    check(ckpt, tmp_path)


def test_header_without_a_tensor_of_the_metadata(ckpt, tmp_path):
    def edit(header):
        del header[data_keys(header)[0]]

    edit_header(rank_file(ckpt), edit)
    check(ckpt, tmp_path)


def test_data_area_truncated(ckpt, tmp_path):
    path = rank_file(ckpt)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1)
    check(ckpt, tmp_path)
