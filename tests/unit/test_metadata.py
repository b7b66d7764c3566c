"""format/metadata.py, format/layout.py, format/dtypes.py: round trips and hostile input."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.errors import CheckpointError, CorruptCheckpointError
from checkpointer.format.dtypes import DTYPE_CODES, code_from_dtype, dtype_from_code, itemsize
from checkpointer.format.layout import (
    METADATA_FILENAME,
    check_filename,
    is_rank_filename,
    rank_filename,
    temp_name,
)
from checkpointer.format.metadata import StorageMetadata, TensorShardSpec, TensorStorageMetadata
from checkpointer.format.metadata_parse import parse_metadata
from checkpointer.planning.load_plan import build_load_plan, stored_ranges
from checkpointer.planning.pieces import whole

WHERE = "ckpt/model/metadata.json"


def valid_doc() -> dict:
    """A metadata document as OLMo-core 0.1.0 writes it (no new fields)."""
    return {
        "tensors": {
            "w": {
                "shape": [4, 6],
                "is_sharded": True,
                "dtype": "F32",
                "shard_spec_per_file": {
                    "rank_0.safetensors": {"flattened_offsets": None, "local_shape": [2, 6], "global_offset": [0, 0]},
                    "rank_1.safetensors": {"flattened_offsets": None, "local_shape": [2, 6], "global_offset": [2, 0]},
                },
            },
            "flat": {
                "shape": [10],
                "is_sharded": True,
                "dtype": "BF16",
                "shard_spec_per_file": {
                    "rank_0.safetensors": {"flattened_offsets": [[0, 3], [7, 10]]},
                    "rank_1.safetensors": {"flattened_offsets": [[3, 7]], "local_shape": None, "global_offset": None},
                },
            },
            "scalar": {
                "shape": [],
                "is_sharded": False,
                "dtype": "I64",
                "shard_spec_per_file": {"rank_1.safetensors": {"flattened_offsets": [[0, 1]]}},
            },
            "param_group0": {
                "shape": [17],
                "is_sharded": False,
                "dtype": "U8",
                "shard_spec_per_file": {"rank_0.safetensors": {"flattened_offsets": [[0, 17]]}},
            },
        }
    }


def parse(doc) -> StorageMetadata:
    return parse_metadata(json.dumps(doc).encode(), where=WHERE)


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


def test_olmo_document_parses():
    md = parse(valid_doc())
    w = md.tensors["w"]
    assert w.shape == (4, 6) and w.dtype == "F32" and w.is_sharded
    assert w.shard_spec_per_file["rank_1.safetensors"].global_offset == (2, 0)
    assert md.tensors["flat"].shard_spec_per_file["rank_0.safetensors"].flattened_offsets == ((0, 3), (7, 10))
    assert md.tensors["flat"].shard_spec_per_file["rank_0.safetensors"].local_numel == 6
    assert w.shard_spec_per_file["rank_0.safetensors"].local_numel == 12
    assert md.tensors["scalar"].numel == 1
    assert md.files() == ["rank_0.safetensors", "rank_1.safetensors"]
    assert md.format_version is None and md.aliases is None


def test_round_trip_of_parsed_document():
    md = parse(valid_doc())
    again = parse_metadata(md.to_json_bytes(), where=WHERE)
    assert again == md
    assert again.to_json_bytes() == md.to_json_bytes()


def test_round_trip_with_new_fields_and_aliases():
    doc = valid_doc()
    doc["format_version"] = 1
    doc["world_size"] = 2
    doc["aliases"] = {"tied.weight": "w"}
    md = parse(doc)
    assert md.aliases == {"tied.weight": "w"} and md.world_size == 2
    assert parse_metadata(md.to_json_bytes(), where=WHERE) == md


def test_round_trip_with_file_ids():
    md = parse(valid_doc()).with_file_ids({"rank_0.safetensors": "0123456789abcdef"})
    again = parse_metadata(md.to_json_bytes(), where=WHERE)
    assert again.file_ids == {"rank_0.safetensors": "0123456789abcdef"} and again == md
    assert StorageMetadata.model_validate_json(md.to_json_bytes()).file_ids == again.file_ids
    assert parse(valid_doc()).with_file_ids({}).file_ids is None


def test_round_trip_of_constructed_metadata():
    md = StorageMetadata(
        tensors={
            "a": TensorStorageMetadata(
                shape=(3, 0, 2),
                is_sharded=True,
                dtype="F8_E4M3",
                shard_spec_per_file={"rank_0.safetensors": TensorShardSpec(local_shape=(3, 0, 2), global_offset=(0, 0, 0))},
            ),
            "b": TensorStorageMetadata(
                shape=(5,),
                is_sharded=False,
                dtype="BOOL",
                shard_spec_per_file={"rank_3.safetensors": TensorShardSpec(flattened_offsets=((0, 5),))},
            ),
        },
        format_version=1,
        world_size=4,
    )
    assert parse_metadata(md.to_json_bytes(), where=WHERE) == md
    assert StorageMetadata(tensors={}) == parse_metadata(b'{"tensors": {}}', where=WHERE)


@st.composite
def metadata_docs(draw):
    tensors = {}
    for key in draw(st.lists(st.text(min_size=1, max_size=8), max_size=4, unique=True)):
        ndim = draw(st.integers(0, 3))
        shape = draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim))
        numel = 1
        for n in shape:
            numel *= n
        specs = {}
        for rank in draw(st.lists(st.integers(0, 99), max_size=3, unique=True)):
            if ndim and draw(st.booleans()):
                offs = [draw(st.integers(0, n)) for n in shape]
                local = [draw(st.integers(0, n - o)) for n, o in zip(shape, offs)]
                specs[rank_filename(rank)] = {"local_shape": local, "global_offset": offs}
            else:
                cuts = sorted(draw(st.lists(st.integers(0, numel), max_size=4)))
                specs[rank_filename(rank)] = {
                    "flattened_offsets": [[cuts[i], cuts[i + 1]] for i in range(0, len(cuts) - 1, 2)]
                }
        tensors[key] = {
            "shape": shape,
            "is_sharded": draw(st.booleans()),
            "dtype": draw(st.sampled_from(sorted(DTYPE_CODES))),
            "shard_spec_per_file": specs,
        }
    doc = {"tensors": tensors}
    if draw(st.booleans()):
        doc["format_version"] = draw(st.integers(1, 2))
        doc["world_size"] = draw(st.integers(1, 100))
    if tensors and draw(st.booleans()):
        doc["aliases"] = {"alias-of-" + k: k for k in tensors if "alias-of-" + k not in tensors}
    return doc


@settings(max_examples=100, deadline=None)
@given(metadata_docs())
def test_round_trip_property(doc):
    md = parse(doc)
    assert parse_metadata(md.to_json_bytes(), where=WHERE) == md
    # Nothing is lost: every field of the input is in the output with the same value.
    out = json.loads(md.to_json_bytes())
    for key, t in doc["tensors"].items():
        assert out["tensors"][key]["shape"] == t["shape"]
        assert out["tensors"][key]["dtype"] == t["dtype"]
        for name, spec in t["shard_spec_per_file"].items():
            for field, value in spec.items():
                assert out["tensors"][key]["shard_spec_per_file"][name][field] == value


def test_checksums_round_trip():
    doc = valid_doc()
    doc["checksum_algorithm"] = "crc32c"
    doc["checksum_chunk_bytes"] = 16 << 20
    doc["tensors"]["w"]["shard_spec_per_file"]["rank_0.safetensors"]["checksums"] = [0, 4294967295]
    md = parse(doc)
    assert md.tensors["w"].shard_spec_per_file["rank_0.safetensors"].checksums == (0, 4294967295)
    assert parse_metadata(md.to_json_bytes(), where=WHERE) == md
    doc["checksum_chunk_bytes"] = 0
    with pytest.raises(CorruptCheckpointError):
        parse(doc)


@pytest.mark.parametrize("version, message", [(3, "reads 1 to 2 \\(a newer checkpointer wrote it: upgrade\\)"),
                                              (10**30, "reads 1 to 2 .*upgrade"), (0, "reads 1 to 2$"), (-1, "reads 1 to 2$")])
def test_a_format_version_this_library_does_not_read_is_refused(version, message):
    """A format from a later release would be misread as this one's (found by a review)."""
    doc = valid_doc()
    doc["format_version"] = version
    with pytest.raises(CorruptCheckpointError, match=f"format_version {version}: this version of checkpointer {message}"):
        parse(doc)


def test_unknown_fields_are_accepted_and_kept():
    doc = valid_doc()
    doc["checksums"] = {"rank_0.safetensors": "abc"}
    doc["tensors"]["w"]["crc32"] = 12345
    doc["tensors"]["w"]["shard_spec_per_file"]["rank_0.safetensors"]["sha256"] = "00ff"
    md = parse(doc)
    out = json.loads(md.to_json_bytes())
    assert out["checksums"] == {"rank_0.safetensors": "abc"}
    assert out["tensors"]["w"]["crc32"] == 12345
    assert out["tensors"]["w"]["shard_spec_per_file"]["rank_0.safetensors"]["sha256"] == "00ff"
    assert parse_metadata(md.to_json_bytes(), where=WHERE) == md


# ---------------------------------------------------------------------------------------------
# Rejections
# ---------------------------------------------------------------------------------------------


def mutate(fn):
    doc = copy.deepcopy(valid_doc())
    fn(doc)
    return json.dumps(doc).encode()


def _empty_tensor_doc(shape: list[int]) -> bytes:
    """A tensor of no element, in no file."""
    entry = {"shape": shape, "is_sharded": False, "dtype": "F32", "shard_spec_per_file": {}}
    return json.dumps({"tensors": {"a": entry}}).encode()


def _set(path, value):
    def fn(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return fn


def _rename_file(key, old, new):
    def fn(doc):
        specs = doc["tensors"][key]["shard_spec_per_file"]
        specs[new] = specs.pop(old)

    return fn


W0 = ("tensors", "w", "shard_spec_per_file", "rank_0.safetensors")
F0 = ("tensors", "flat", "shard_spec_per_file", "rank_0.safetensors")

BAD_DOCS = {
    "not json": b"{not json",
    "truncated json": b'{"tensors": {',
    "empty": b"",
    "not utf-8": b'{"tensors": {"\xff\xfe": 1}}',
    "array": b"[]",
    "string": b'"tensors"',
    "number": b"3",
    "null": b"null",
    "no tensors": b"{}",
    "tensors is a list": b'{"tensors": []}',
    "duplicate top-level key": b'{"tensors": {}, "tensors": {}}',
    "duplicate tensor key": (
        b'{"tensors": {"a": {"shape": [1], "is_sharded": false, "dtype": "F32", "shard_spec_per_file": {}},'
        b' "a": {"shape": [2], "is_sharded": false, "dtype": "F32", "shard_spec_per_file": {}}}}'
    ),
    "duplicate file key": (
        b'{"tensors": {"a": {"shape": [2], "is_sharded": false, "dtype": "F32", "shard_spec_per_file": {'
        b'"rank_0.safetensors": {"flattened_offsets": [[0, 2]]},'
        b'"rank_0.safetensors": {"flattened_offsets": [[0, 1]]}}}}}'
    ),
    "unknown dtype": mutate(_set(("tensors", "w", "dtype"), "F128")),
    "lowercase dtype": mutate(_set(("tensors", "w", "dtype"), "float32")),
    "negative shape": mutate(_set(("tensors", "w", "shape"), [4, -6])),
    "fractional shape": mutate(_set(("tensors", "w", "shape"), [4, 6.5])),
    "string shape": mutate(_set(("tensors", "w", "shape"), "4,6")),
    "too many dims": mutate(_set(("tensors", "w", "shape"), [1] * 65)),
    "too many elements": mutate(_set(("tensors", "w", "shape"), [2**40, 2**40])),
    "missing is_sharded": mutate(lambda d: d["tensors"]["w"].pop("is_sharded")),
    "missing shard_spec_per_file": mutate(lambda d: d["tensors"]["w"].pop("shard_spec_per_file")),
    "offsets past numel": mutate(_set(F0 + ("flattened_offsets",), [[0, 3], [7, 11]])),
    "offsets reversed": mutate(_set(F0 + ("flattened_offsets",), [[3, 0]])),
    "negative offsets": mutate(_set(F0 + ("flattened_offsets",), [[-1, 3]])),
    "offsets not pairs": mutate(_set(F0 + ("flattened_offsets",), [[0, 3, 5]])),
    "box leaves the shape": mutate(_set(W0 + ("global_offset",), [3, 0])),
    "box too wide": mutate(_set(W0 + ("local_shape",), [2, 7])),
    "box wrong ndim": mutate(_set(W0 + ("local_shape",), [2, 6, 1])),
    "box ndim differs from offset": mutate(_set(W0 + ("global_offset",), [0])),
    "negative local_shape": mutate(_set(W0 + ("local_shape",), [-2, 6])),
    "negative global_offset": mutate(_set(W0 + ("global_offset",), [-1, 0])),
    "spec without a form": mutate(_set(W0, {"local_shape": [2, 6]})),
    "empty spec": mutate(_set(W0, {})),
    "filename with slash": mutate(_rename_file("w", "rank_0.safetensors", "sub/rank_0.safetensors")),
    "filename climbing": mutate(_rename_file("w", "rank_0.safetensors", "../rank_0.safetensors")),
    "filename dotdot": mutate(_rename_file("w", "rank_0.safetensors", "..")),
    "filename dot": mutate(_rename_file("w", "rank_0.safetensors", ".")),
    "absolute filename": mutate(_rename_file("w", "rank_0.safetensors", "/etc/passwd")),
    "hidden filename": mutate(_rename_file("w", "rank_0.safetensors", ".rank_0.safetensors")),
    "backslash filename": mutate(_rename_file("w", "rank_0.safetensors", "..\\rank_0.safetensors")),
    "empty filename": mutate(_rename_file("w", "rank_0.safetensors", "")),
    "nul in filename": mutate(_rename_file("w", "rank_0.safetensors", "rank_0\x00.safetensors")),
    "url filename": mutate(_rename_file("w", "rank_0.safetensors", "s3://bucket/rank_0.safetensors")),
    "metadata.json as a rank file": mutate(_rename_file("w", "rank_0.safetensors", "metadata.json")),
    "alias to nothing": mutate(_set(("aliases",), {"tied": "missing"})),
    "file ids a list": mutate(_set(("file_ids",), ["abc"])),
    "file id a number": mutate(_set(("file_ids",), {"rank_0.safetensors": 7})),
    "alias shadows a tensor": mutate(_set(("aliases",), {"flat": "w"})),
    "nested lists": b"[" * 100_000 + b"]" * 100_000,
    "nested objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "nested lists in an extra field": b'{"tensors": {}, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nested objects in a shape": b'{"tensors": {"a": {"shape": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}}}",
    "dimension past int64": _empty_tensor_doc([0, 2**63]),
    "dimension past MAX_NUMEL": _empty_tensor_doc([2**62 + 1, 0]),
    "strides overflow int64": _empty_tensor_doc([0, 2**62, 2**62]),
    "huge integer": b'{"tensors": {"a": {"shape": [' + b"9" * 5000 + b'], "is_sharded": false, "dtype": "F32", "shard_spec_per_file": {}}}}',
    "text after the object": b'{"tensors": {}} x',
    "a second object": b'{"tensors": {}}{}',
    "trailing comma in tensors": b'{"tensors": {"a": {"shape": [1], "is_sharded": false, "dtype": "F32", "shard_spec_per_file": {}},}}',
    "duplicate field in an entry with an escape": (
        b'{"tensors": {"\\u0061": {"shape": [1], "shape": [2], "is_sharded": false, "dtype": "F32",'
        b' "shard_spec_per_file": {}}}}'
    ),
    "duplicate field in an entry with an escaped file name": (
        b'{"tensors": {"a": {"shape": [2], "is_sharded": false, "dtype": "F32", "shard_spec_per_file": {'
        b'"rank_\\u0030.safetensors": {"flattened_offsets": [[0, 2]], "flattened_offsets": [[0, 1]]}}}}}'
    ),
    "duplicate key in file_ids": b'{"tensors": {}, "file_ids": {"rank_0.safetensors": "a", "rank_0.safetensors": "b"}}',
}


@pytest.mark.parametrize("data", BAD_DOCS.values(), ids=BAD_DOCS.keys())
def test_parse_metadata_rejects(data):
    with pytest.raises(CorruptCheckpointError) as info:
        parse_metadata(data, where=WHERE)
    assert WHERE in str(info.value)
    assert len(str(info.value)) < 2000


def test_corrupt_is_a_checkpoint_error():
    assert issubclass(CorruptCheckpointError, CheckpointError)


# ---------------------------------------------------------------------------------------------
# layout.py and dtypes.py
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1, 7, 123])
def test_rank_filename(rank):
    name = rank_filename(rank)
    assert name == f"rank_{rank}.safetensors"
    assert is_rank_filename(name)
    assert check_filename(name) == name


@pytest.mark.parametrize("name", ["metadata.json", "rank_x.safetensors", "rank_1.safetensors.tmp", "xrank_1.safetensors", "rank_-1.safetensors"])
def test_not_rank_filenames(name):
    assert not is_rank_filename(name)


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../x", "a/b", "/abs", ".hidden", METADATA_FILENAME, "a\\b", "a b", None, 3]
)
def test_check_filename_rejects(name):
    with pytest.raises(CorruptCheckpointError):
        check_filename(name)


def test_temp_name_is_hidden_and_unique():
    a, b = temp_name("rank_0.safetensors"), temp_name("rank_0.safetensors")
    assert a != b
    assert a.startswith(".") and "rank_0.safetensors" in a
    with pytest.raises(CorruptCheckpointError):
        check_filename(a)


def test_uploaded_parts_are_a_save_s_files():
    from checkpointer.format.layout import is_rank_temp_file, is_save_file, part_prefix

    prefix = part_prefix("rank_3.safetensors")
    assert prefix != part_prefix("rank_3.safetensors") and prefix.startswith(".rank_3.safetensors.part-")
    for name in (f"{prefix}1", f"{prefix}1024", f"{prefix}c31"):
        assert is_rank_temp_file(name) and is_save_file(name)
    for name in (f"{prefix}", f"{prefix}x", f"{part_prefix('notes.txt')}1", "rank_3.safetensors.part-0a-1"):
        assert not is_rank_temp_file(name) and not is_save_file(name)


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_dtype_codes_round_trip(code):
    dtype = dtype_from_code(code)
    assert code_from_dtype(dtype) == code
    assert itemsize(code) == torch.empty(0, dtype=dtype).element_size()


def test_dtype_sizes():
    assert {c: itemsize(c) for c in DTYPE_CODES} == {
        "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
        "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    }  # fmt: skip


def test_unknown_dtypes():
    with pytest.raises(CorruptCheckpointError):
        dtype_from_code("F128")
    with pytest.raises(CorruptCheckpointError):
        itemsize("float32")
    with pytest.raises(TypeError):
        code_from_dtype(torch.complex64)


# ---------------------------------------------------------------------------------------------
# Fuzz: any JSON put anywhere in a valid document is parsed or refused as corrupt, never
# anything else, and what parses is consistent.
# ---------------------------------------------------------------------------------------------

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 30),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=5),
    st.sampled_from(["F32", "rank_0.safetensors", "..", "/x", METADATA_FILENAME, ".h", "w"]),
)
_JSON = st.recursive(
    _SCALARS,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=4), c, max_size=3)),
    max_leaves=10,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


_DOC_PATHS = list(_paths(valid_doc()))[1:] + [("aliases",), ("tensors", "new")]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_DOC_PATHS), _JSON), min_size=1, max_size=3))
def test_fuzzed_metadata_is_parsed_or_corrupt(mutations):
    doc = valid_doc()
    for path, value in mutations:
        node = doc
        try:
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            pass
    try:
        md = parse_metadata(json.dumps(doc).encode(), where=WHERE)
    except CorruptCheckpointError:
        return
    for key, t in md.tensors.items():
        for name in t.shard_spec_per_file:
            assert check_filename(name) == name
        try:
            for ranges in stored_ranges(key, t):
                assert all(0 <= s <= e <= t.numel for s, e in ranges)
        except CorruptCheckpointError:
            continue
        try:
            plan = build_load_plan(key, t, [(0, t.numel)])
        except CorruptCheckpointError:
            continue
        assert plan.numel == t.numel
    for alias, target in (md.aliases or {}).items():
        assert target in md.tensors and alias not in md.tensors


def test_a_box_of_many_rows_parses_and_is_refused_where_it_would_be_listed_as_ranges():
    """A box one element wide over 2**31 rows is one box (a TP ``Shard(2)`` of ``[4096, 4096, 2]``
    listed explicitly is 16M runs): it parses, and the fallback that lists stored pieces as
    ranges refuses it, naming the tensor, before building 2**31 of them."""
    raw = {
        "tensors": {
            "w": {
                "shape": [2**31, 2],
                "is_sharded": True,
                "dtype": "F32",
                "shard_spec_per_file": {
                    "rank_0.safetensors": {"local_shape": [2**31, 1], "global_offset": [0, 0]}
                },
            }
        }
    }
    meta = parse_metadata(json.dumps(raw).encode(), where="metadata.json").tensors["w"]
    with pytest.raises(CorruptCheckpointError, match="'w'.*too many to check"):
        stored_ranges("w", meta)
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        build_load_plan("w", meta, whole(meta.shape))  # half the tensor is in no file


def test_an_explicit_shard2_layout_of_16m_runs_loads_as_boxes():
    """``[4096, 4096, 2]`` saved as ``Shard(2)`` over 2 ranks, its boxes listed file by file
    (format 1, or ``convert --to olmo``): 2 x 16M runs, planned as two boxes."""
    shape = [4096, 4096, 2]
    specs = {f"rank_{r}.safetensors": {"local_shape": [4096, 4096, 1], "global_offset": [0, 0, r]} for r in range(2)}
    raw = {"tensors": {"w": {"shape": shape, "is_sharded": True, "dtype": "F32", "shard_spec_per_file": specs}}}
    meta = parse_metadata(json.dumps(raw).encode(), where="metadata.json").tensors["w"]
    plan = build_load_plan("w", meta, whole(shape))
    assert plan.numel == 4096 * 4096 * 2 and len(plan.items) == 2


def _wide_metadata(tensors: int, ranks: int) -> bytes:
    per = 1000
    doc = {"tensors": {
        f"layers.{i}.weight": {"shape": [ranks * per], "is_sharded": True, "dtype": "F32", "shard_spec_per_file": {
            f"rank_{r}.safetensors": {"flattened_offsets": [[r * per, (r + 1) * per]], "local_shape": None,
                                      "global_offset": None, "checksums": [(i * 7919 + r) % 2**32]}
            for r in range(ranks)}}
        for i in range(tensors)}, "format_version": 1, "world_size": ranks}
    return json.dumps(doc).encode()


def test_parse_metadata_never_holds_the_whole_document_as_json_values():
    """Each tensor's entry is decoded, validated and dropped before the next: the Python memory
    at the peak stays under 3x the text (the text itself, what is kept, one entry). ``json.loads``
    of the whole document first peaked at 5.3x on this one."""
    import tracemalloc

    data = _wide_metadata(tensors=200, ranks=128)
    tracemalloc.start()
    try:
        metadata = parse_metadata(data, where=WHERE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(data), f"peak {peak / len(data):.1f}x the text"
    spec = metadata.tensors["layers.199.weight"].shard_spec_per_file["rank_127.safetensors"]
    assert spec.flattened_offsets == ((127_000, 128_000),) and spec.checksums == ((199 * 7919 + 127) % 2**32,)


@pytest.mark.parametrize("shape", [(0, 2**63), (2**62 + 1, 0), (0, 2**62, 2**62), (0, 2**40, 2**40)])
def test_tensor_storage_metadata_refuses_huge_dims(shape):
    """A tensor with no element can still overflow int64 in a dimension or a stride."""
    with pytest.raises(ValueError, match="too many elements, or a dimension over"):
        TensorStorageMetadata(shape=shape, is_sharded=False, dtype="F32", shard_spec_per_file={})
    TensorStorageMetadata(shape=(0, 2**62), is_sharded=False, dtype="F32", shard_spec_per_file={})
    assert parse_metadata(_empty_tensor_doc([0, 2**62]), where=WHERE).tensors["a"].shape == (0, 2**62)


def test_checksums_in_the_files_need_their_algorithm_and_chunk_size():
    """Format 2 keeps checksums in the rank files: a metadata.json that says so but leaves out how
    they were computed would make a load skip them silently, so it is corrupt."""
    base = {"tensors": {}, "format_version": 2, "world_size": 1, "checksums_in_files": True}
    parse_metadata(json.dumps({**base, "checksum_algorithm": "crc32c", "checksum_chunk_bytes": 1 << 20}).encode(), where=WHERE)
    for missing in ("checksum_algorithm", "checksum_chunk_bytes"):
        doc = {**base, "checksum_algorithm": "crc32c", "checksum_chunk_bytes": 1 << 20}
        doc.pop(missing)
        with pytest.raises(CorruptCheckpointError, match="checksums_in_files"):
            parse_metadata(json.dumps(doc).encode(), where=WHERE)


# ---------------------------------------------------------------------------------------------
# Repeated tensor entries (a model's layers): validated once, shared
# ---------------------------------------------------------------------------------------------

_RULE_ENTRY = '{{"shape":[{rows},64],"is_sharded":true,"dtype":"F32","shard_rule":{{"form":"box","cuts":[[{dim},{chunk}]],"files":[0,[[1,2,1]]]}}}}'


def _rule_doc(entries: list[str]) -> bytes:
    body = ",".join(f'"t{i}":{e}' for i, e in enumerate(entries))
    return ('{"tensors":{' + body + '},"world_size":2,"format_version":2}').encode()


def test_repeated_entries_are_validated_once_and_shared(monkeypatch):
    """Seven layouts in turn (more than the recent ones compared before decoding), 70 tensors:
    each distinct entry is validated once; every tensor still gets its own layout's values,
    the same as a parse of the entries apart."""
    from checkpointer.format import metadata_parse

    layouts = [_RULE_ENTRY.format(rows=32 * (1 + k), dim=k % 2, chunk=16 * (1 + k) if k % 2 == 0 else 32) for k in range(7)]
    assert len(set(layouts)) == 7
    validated = []
    real = metadata_parse._tensor
    monkeypatch.setattr(metadata_parse, "_tensor", lambda entry, parser: (validated.append(entry), real(entry, parser))[1])
    parsed = parse_metadata(_rule_doc([layouts[i % 7] for i in range(70)]), where=WHERE).tensors
    assert len(validated) == 7
    monkeypatch.setattr(metadata_parse, "_tensor", real)
    for i in range(70):
        alone = parse_metadata(_rule_doc([layouts[i % 7]]), where=WHERE).tensors["t0"]
        meta = parsed[f"t{i}"]
        assert meta.shape == alone.shape and meta.dtype == alone.dtype
        assert dict(meta.shard_spec_per_file) == dict(alone.shard_spec_per_file)
        assert meta is parsed[f"t{i % 7}"]


def test_an_entry_repeated_in_a_row_is_not_even_decoded(monkeypatch):
    """Runs of one layout (a model's layers in file order): an entry equal to one of the last few
    is recognised by its text alone, and still gets that layout's values."""
    from checkpointer.format import metadata_parse

    a, b = (_RULE_ENTRY.format(rows=64, dim=d, chunk=32) for d in (0, 1))
    decoded = []
    real = metadata_parse._PLAIN

    class Counting:
        def raw_decode(self, text, i):
            decoded.append(i)
            return real.raw_decode(text, i)

    monkeypatch.setattr(metadata_parse, "_PLAIN", Counting())
    order = [a] * 10 + [b] * 10 + [a] * 10
    parsed = parse_metadata(_rule_doc(order), where=WHERE).tensors
    assert len(decoded) == 2
    monkeypatch.setattr(metadata_parse, "_PLAIN", real)
    for i, entry in enumerate(order):
        alone = parse_metadata(_rule_doc([entry]), where=WHERE).tensors["t0"]
        assert dict(parsed[f"t{i}"].shard_spec_per_file) == dict(alone.shard_spec_per_file)
    # A known entry's text followed by more than a delimiter is not that entry: the document is refused.
    for tail in (" 1", "x", "}"):
        text = _rule_doc([a, a]).decode().replace(a + "}", a + tail + "}", 1)  # after t1, the last entry
        assert tail + "}," in text
        with pytest.raises(CorruptCheckpointError):
            parse_metadata(text.encode(), where=WHERE)


def test_a_repeated_entry_with_a_flaw_is_still_refused_by_name():
    good = _RULE_ENTRY.format(rows=64, dim=0, chunk=32)
    twice = good.replace('"dtype":"F32"', '"dtype":"F32","dtype":"F32"')
    with pytest.raises(CorruptCheckpointError, match="t5"):
        parse_metadata(_rule_doc([good] * 5 + [twice]), where=WHERE)
    bad_dtype = good.replace("F32", "F33")
    with pytest.raises(CorruptCheckpointError, match=r"tensors\['t3'\].*unknown dtype"):
        parse_metadata(_rule_doc([good] * 3 + [bad_dtype]), where=WHERE)
    past_world = good.replace("[0,[[1,2,1]]]", "[1,[[1,2,1]]]")
    with pytest.raises(CorruptCheckpointError, match="past the world size"):
        parse_metadata(_rule_doc([good] * 4 + [past_world] + [good]), where=WHERE)


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_tensor_metadata_gives_its_torch_dtype(code):
    meta = TensorStorageMetadata(shape=(2,), is_sharded=False, dtype=code, shard_spec_per_file={})
    assert meta.torch_dtype == dtype_from_code(code)
