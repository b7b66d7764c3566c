"""format/specs.py: shard specs held as columns, checked in bulk, against the pydantic models.

The pydantic models are the reference: what ``parse_metadata`` accepts must equal what
``StorageMetadata.model_validate`` builds, its JSON must be ``model_dump``'s, and anything the
bulk checks let through must pass the one-by-one checks (which name the file).
"""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointer.errors import CorruptCheckpointError
from checkpointer.format.layout import rank_filename
from checkpointer.format.metadata import StorageMetadata
from checkpointer.format.metadata_parse import parse_metadata
from checkpointer.format.specs import ShardSpecs
from checkpointer.planning.plan import Piece, PieceDesc, build_save_plan
from checkpointer.planning.load_plan import build_load_plan

WHERE = "ckpt/metadata.json"


def rows_doc(world: int = 8, rows: int = 16, cols: int = 3, *, checksums: bool = False, key: str = "w") -> dict:
    """A tensor split by rows over ``world`` files, as FSDP2 saves it (the bulk path)."""
    step = rows // world
    specs = {}
    for r in range(world):
        spec = {"flattened_offsets": None, "local_shape": [step, cols], "global_offset": [r * step, 0]}
        if checksums:
            spec["checksums"] = [r, r + 1]
        specs[rank_filename(r)] = spec
    return {"tensors": {key: {"shape": [rows, cols], "is_sharded": True, "dtype": "F32", "shard_spec_per_file": specs}}}


def flat_doc(world: int = 8, numel: int = 40) -> dict:
    step = numel // world
    specs = {rank_filename(r): {"flattened_offsets": [[r * step, (r + 1) * step]]} for r in range(world)}
    return {"tensors": {"f": {"shape": [numel], "is_sharded": True, "dtype": "BF16", "shard_spec_per_file": specs}}}


def parse(doc) -> StorageMetadata:
    return parse_metadata(json.dumps(doc).encode(), where=WHERE)


def reference_json(md: StorageMetadata) -> bytes:
    """The JSON pydantic writes: the verbose form (a save plan's compact form goes through ``verbose()``)."""
    return json.dumps(md.model_dump(exclude_none=False), separators=(",", ":")).encode()


@pytest.mark.parametrize("doc", [rows_doc(), rows_doc(checksums=True), flat_doc()], ids=["rows", "rows+crc", "flat"])
def test_bulk_parse_equals_pydantic(doc):
    md = parse(doc)
    assert isinstance(md.tensors[next(iter(md.tensors))].shard_spec_per_file, ShardSpecs)
    assert md == StorageMetadata.model_validate(doc)
    assert md.to_json_bytes() == reference_json(md)
    assert parse_metadata(md.to_json_bytes(), where=WHERE) == md


def test_shard_specs_is_a_read_only_mapping():
    md = parse(rows_doc(checksums=True))
    specs = md.tensors["w"].shard_spec_per_file
    assert list(specs) == [rank_filename(r) for r in range(8)] and len(specs) == 8
    assert "rank_3.safetensors" in specs and "rank_9.safetensors" not in specs
    spec = specs["rank_3.safetensors"]
    assert spec.local_shape == (2, 3) and spec.global_offset == (6, 0) and spec.checksums == (3, 4)
    assert spec.local_numel == 6 and specs.local_numel("rank_3.safetensors") == 6
    assert specs.checksums_of("rank_3.safetensors") == (3, 4)
    with pytest.raises(KeyError):
        specs["rank_9.safetensors"]
    with pytest.raises(TypeError):
        specs["rank_3.safetensors"] = spec  # type: ignore[index]
    assert dict(specs) == StorageMetadata.model_validate(rows_doc(checksums=True)).tensors["w"].shard_spec_per_file


def test_equal_layouts_are_shared():
    doc = rows_doc()
    doc["tensors"]["v"] = copy.deepcopy(doc["tensors"]["w"])
    other = rows_doc(rows=32)["tensors"]["w"]
    doc["tensors"]["u"] = other
    md = parse(doc)
    layout = md.tensors["w"].shard_spec_per_file.layout
    assert md.tensors["v"].shard_spec_per_file.layout is layout
    assert md.tensors["u"].shard_spec_per_file.layout is not layout
    # the load planner indexes a shared layout once
    build_load_plan("w", md.tensors["w"], [(0, 48)])
    index = layout.memo["tile_index"]  # box pieces: indexed as boxes
    build_load_plan("v", md.tensors["v"], [(0, 48)])
    assert layout.memo["tile_index"] is index


def test_equal_layouts_are_shared_past_the_first_few_of_a_shape():
    """Past the layouts of a shape compared one by one, layouts are found by a hash of their
    columns: equal ones are still shared, unequal ones never are (lists or tuples alike)."""
    from checkpointer.format.specs import _SCANNED, shared_layout

    names = [rank_filename(r) for r in range(3)]
    layouts: dict = {}
    made = []
    for cut in range(1, 4 * _SCANNED):
        made.append(shared_layout(layouts, (100,), names, [[[0, cut]], [[cut, 99]], [[99, 100]]], None, None))
    assert len({id(layout) for layout in made}) == len(made)
    for cut in range(1, 4 * _SCANNED):
        again = shared_layout(layouts, (100,), list(names), [[[0, cut]], [[cut, 99]], [[99, 100]]], None, None)
        assert again is made[cut - 1]
        planned = shared_layout(layouts, (100,), tuple(names), (((0, cut),), ((cut, 99),), ((99, 100),)), None, None)
        assert planned.form(1) == (((cut, 99),), None, None)  # the planner's tuples hash as well
    boxes = [shared_layout(layouts, (100,), names, None, [[cut], [99 - cut], [1]], [[0], [cut], [99]]) for cut in range(1, 40)]
    assert boxes == [shared_layout(layouts, (100,), names, None, [[cut], [99 - cut], [1]], [[0], [cut], [99]]) for cut in range(1, 40)]
    huge = [[0, 2**70]]  # past 64 bits: hashed as JSON text
    first = [shared_layout(layouts, (2**71,), ["a"], [huge + [[2**70, 2**70 + i]]], None, None) for i in range(20)]
    assert first == [shared_layout(layouts, (2**71,), ["a"], [huge + [[2**70, 2**70 + i]]], None, None) for i in range(20)]
    assert len(set(map(id, first))) == 20


def test_with_checksums_matches_pydantic():
    doc = rows_doc()
    crcs = {rank_filename(r): {"w": [r * 10]} for r in range(0, 8, 2)}
    ours = parse(doc).with_checksums(crcs, algorithm="crc32c", chunk_bytes=64)
    ref = StorageMetadata.model_validate(doc).with_checksums(crcs, algorithm="crc32c", chunk_bytes=64)
    assert ours == ref
    assert ours.to_json_bytes() == reference_json(ref)
    # checksums already there are kept where none are given
    again = ours.with_checksums({rank_filename(1): {"w": [7, 8]}}, algorithm="crc32c", chunk_bytes=64)
    assert again.tensors["w"].shard_spec_per_file["rank_0.safetensors"].checksums == (0,)
    assert again.tensors["w"].shard_spec_per_file["rank_1.safetensors"].checksums == (7, 8)


def test_save_plan_metadata_round_trips():
    world, shape = 16, (20, 4)
    descs = []
    for r in range(world):
        start = min(r * 2, 20)
        end = min(start + 2, 20)
        descs.append([
            PieceDesc("w", shape, "F32", True, Piece(local_shape=(end - start, 4), global_offset=(start, 0))),
            PieceDesc("b", (4,), "F32", False, Piece.whole((4,))),
        ])
    plan = build_save_plan(descs)
    md = plan.metadata
    assert md.verbose().to_json_bytes() == reference_json(md)
    assert parse_metadata(md.verbose().to_json_bytes(), where=WHERE) == md
    compact = json.loads(md.to_json_bytes())  # the same pieces, as shard rules
    assert compact["tensors"]["w"]["shard_rule"] == {"form": "box", "cuts": [[0, 2]], "files": [0, [[1, 10, 1]]]}
    assert "shard_spec_per_file" not in compact["tensors"]["b"]
    assert parse_metadata(md.to_json_bytes(), where=WHERE) == md
    assert md.files() == sorted(rank_filename(r) for r in range(11))  # ranks 10.. hold no rows
    assert sum(len(keys) for keys in plan.keys_per_rank) == 11


# --------------------------------------------------------------------------------------
# Duplicate keys: found by counting members, at every depth, whatever the strings hold
# --------------------------------------------------------------------------------------


def _dup_spec_member(text: str) -> str:
    return text.replace('"global_offset": [4, 0]}', '"global_offset": [4, 0], "global_offset": [4, 0]}', 1)


DUPLICATES = {
    "top": lambda t: t.replace('{"tensors"', '{"x": 1, "x": 2, "tensors"', 1),
    "tensor": lambda t: t.replace('"is_sharded"', '"dtype": "F32", "is_sharded"', 1),
    "file": lambda t: t.replace('"rank_1.safetensors"', '"rank_0.safetensors"', 1),
    "spec member": _dup_spec_member,
    "extra": lambda t: t.replace('{"tensors"', '{"x": {"a:b": [{"c": 1, "c": 1}]}, "tensors"', 1),
}


@pytest.mark.parametrize("escapes", [False, True], ids=["plain", "escaped"])
@pytest.mark.parametrize("where", DUPLICATES)
def test_duplicate_keys_anywhere_are_corrupt(where, escapes):
    doc = rows_doc()
    doc["note"] = "a:b::c" + ("\u00e9\\" if escapes else "")
    text = json.dumps(doc)
    assert ("\\" in text) == escapes
    parse_metadata(text.encode(), where=WHERE)
    bad = DUPLICATES[where](text)
    assert bad != text
    with pytest.raises(CorruptCheckpointError, match="twice|duplicate"):
        parse_metadata(bad.encode(), where=WHERE)


_NAMES = st.text(alphabet=st.sampled_from("ab:.{}[]\", "), min_size=1, max_size=6)


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(_NAMES, min_size=1, max_size=4, unique=True), extra=st.dictionaries(_NAMES, _NAMES, max_size=3))
def test_colons_and_brackets_in_strings_are_not_duplicates(keys, extra):
    doc = {"tensors": {}, "aliases": {}, **{"x" + k: v for k, v in extra.items()}}
    for i, key in enumerate(keys):
        doc["tensors"][key] = rows_doc(key=key)["tensors"][key] | extra
        doc["aliases"][f"alias:{i}"] = key
    md = parse(doc)
    assert md == StorageMetadata.model_validate(doc)
    assert md.to_json_bytes() == reference_json(md)


# --------------------------------------------------------------------------------------
# Bulk and one-by-one agree; strict types
# --------------------------------------------------------------------------------------


def _set_spec(doc, key, name, **fields):
    doc["tensors"][key]["shard_spec_per_file"][name].update(fields)
    return doc


BAD_BULK = {
    "bool size": ("w", {"local_shape": [True, 3]}),
    "float offset": ("w", {"global_offset": [4.0, 0]}),
    "string size": ("w", {"local_shape": ["2", 3]}),
    "past the end": ("w", {"global_offset": [15, 0]}),
    "negative": ("w", {"global_offset": [-2, 0]}),
    "short box": ("w", {"local_shape": [2]}),
    "null box": ("w", {"local_shape": None}),
    "crc not int": ("w", {"checksums": ["1"]}),
    "crc bool": ("w", {"checksums": [False]}),
    "crc nested": ("w", {"checksums": [[1]]}),
    "range past end": ("f", {"flattened_offsets": [[35, 41]]}),
    "range reversed": ("f", {"flattened_offsets": [[10, 5]]}),
    "range bool": ("f", {"flattened_offsets": [[0, True]]}),
    "range triple": ("f", {"flattened_offsets": [[0, 1, 2]]}),
}


@pytest.mark.parametrize("case", BAD_BULK.values(), ids=BAD_BULK.keys())
def test_bad_spec_among_many_names_the_file(case):
    key, fields = case
    doc = rows_doc() if key == "w" else flat_doc()
    _set_spec(doc, key, "rank_5.safetensors", **fields)
    with pytest.raises(CorruptCheckpointError, match=r"rank_5\.safetensors"):
        parse(doc)


@pytest.mark.parametrize("value", [1, "true", None, 0.0])
def test_is_sharded_must_be_a_boolean(value):
    doc = rows_doc()
    doc["tensors"]["w"]["is_sharded"] = value
    with pytest.raises(CorruptCheckpointError, match="is_sharded"):
        parse(doc)


def test_mixed_forms_and_unknown_fields_take_the_one_by_one_path():
    doc = rows_doc()
    _set_spec(doc, "w", "rank_2.safetensors", flattened_offsets=[[12, 18]], local_shape=None, global_offset=None)
    _set_spec(doc, "w", "rank_3.safetensors", sha256="00ff", checksums=[1])
    md = parse(doc)
    assert md == StorageMetadata.model_validate(doc)
    assert md.to_json_bytes() == reference_json(md)
    assert md.tensors["w"].shard_spec_per_file["rank_3.safetensors"].model_extra == {"sha256": "00ff"}
    plan = build_load_plan("w", md.tensors["w"], [(0, 48)])
    assert plan.numel == 48


@pytest.mark.parametrize(
    "last, error",
    [([5, 11], "flattened offsets past the tensor's 10 elements"), ([7, 5], r"bad flattened range \[7, 5\)")],
    ids=["one-past-the-end", "reversed"],
)
def test_bulk_ranges_past_the_end_or_reversed_are_refused(last, error):
    """Specs of three fields each take the bulk path: a range ending one element past the tensor,
    or ending before it starts, is refused there and named by the one-by-one check (mutants of
    the bulk check that let either through passed every test: the other tests' bad ranges took
    the one-by-one path)."""
    def doc(pair):
        specs = {
            rank_filename(0): {"flattened_offsets": [[0, 5]], "local_shape": None, "global_offset": None},
            rank_filename(1): {"flattened_offsets": [pair], "local_shape": None, "global_offset": None},
        }
        return {"tensors": {"f": {"shape": [10], "is_sharded": True, "dtype": "F32", "shard_spec_per_file": specs}}}

    assert parse(doc([5, 10])) == StorageMetadata.model_validate(doc([5, 10]))
    with pytest.raises(CorruptCheckpointError, match=rf"shard_spec_per_file\['rank_1.safetensors'\]: {error}$"):
        parse(doc(last))
