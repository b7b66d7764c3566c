"""format/metadata_parse.py and the pydantic models of format/metadata.py: values of the wrong
kind or sign are refused, even where a looser check would let them through (booleans are JSON
booleans, not integers; dimensions are never negative, whatever their product)."""

from __future__ import annotations

import json

import pytest

from checkpointer.errors import CorruptCheckpointError
from checkpointer.format.metadata import StorageMetadata, TensorStorageMetadata
from checkpointer.format.metadata_parse import parse_metadata

WHERE = "ckpt/model/metadata.json"


def entry(shape: list[int]) -> dict:
    return {"shape": shape, "is_sharded": False, "dtype": "F32", "shard_spec_per_file": {}}


def parse(doc: dict):
    return parse_metadata(json.dumps(doc).encode(), where=WHERE)


@pytest.mark.parametrize("field", ["format_version", "world_size", "checksum_chunk_bytes"])
def test_a_boolean_is_not_an_integer_field(field):
    """``true`` is 1 to Python's ``isinstance(_, int)``: a format version, world size or chunk
    size of ``true`` is refused, as ``1`` is not (a mutant that took booleans passed every test)."""
    good = {"tensors": {"a": entry([2])}, "format_version": 1, "world_size": 1}
    number = 8 if field == "checksum_chunk_bytes" else 1  # a chunk is a multiple of 8 bytes
    assert getattr(parse({**good, field: number}), field) == number
    with pytest.raises(CorruptCheckpointError, match=f"^{WHERE}: invalid checkpoint metadata: {field} must be an integer or null$"):
        parse({**good, field: True})


def test_negative_dimensions_are_refused_whatever_their_product():
    """``[-2, -3]`` has a product of 6 that fits every size check; its dimensions are still
    negative (a mutant that dropped the sign check of shapes passed every test)."""
    with pytest.raises(CorruptCheckpointError, match=r"^ckpt/model/metadata\.json: invalid checkpoint metadata: tensors\['a'\]: bad shape \[-2, -3\]$"):
        parse({"tensors": {"a": entry([-2, -3])}})


def test_the_model_refuses_negative_dimensions_whatever_their_product():
    """The pydantic model checks what parse_metadata checks (a mutant that dropped its sign
    check of shapes passed every test)."""
    TensorStorageMetadata(shape=(2, 3), is_sharded=False, dtype="F32", shard_spec_per_file={})
    with pytest.raises(ValueError, match=r"bad shape \(-2, -3\)"):
        TensorStorageMetadata(shape=(-2, -3), is_sharded=False, dtype="F32", shard_spec_per_file={})


def test_the_model_refuses_a_checksum_chunk_size_of_zero():
    """A chunk size of 0 would make every piece a division by zero (a mutant of the model that
    took 0 passed every test)."""
    assert StorageMetadata(tensors={}, checksum_chunk_bytes=8).checksum_chunk_bytes == 8
    with pytest.raises(ValueError, match="checksum_chunk_bytes must be positive"):
        StorageMetadata(tensors={}, checksum_chunk_bytes=0)


@pytest.mark.parametrize("chunk", [1, 4, 1002])
def test_a_checksum_chunk_that_ends_inside_an_element_is_refused(chunk):
    """Box reads check whole chunks of whole elements: a chunk of 1,002 bytes over float32 data
    once made a verified strided load report a mismatch on an intact checkpoint."""
    with pytest.raises(ValueError, match=f"checksum_chunk_bytes must be a multiple of 8 .*, not {chunk}"):
        StorageMetadata(tensors={}, checksum_chunk_bytes=chunk)
    doc = {"tensors": {}, "format_version": 1, "checksum_algorithm": "crc32c", "checksum_chunk_bytes": chunk}
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}: .*multiple of 8 .*, not {chunk}"):
        parse(doc)


@pytest.mark.parametrize("field", ["world_size", "checksum_chunk_bytes"])
def test_a_world_size_or_chunk_size_below_one_is_refused(field):
    good = {"tensors": {"a": entry([2])}, "format_version": 1, "world_size": 1}
    for bad in (0, -3):
        with pytest.raises(CorruptCheckpointError, match=f"^{WHERE}: invalid checkpoint metadata: {field} must be positive$"):
            parse({**good, field: bad})
