"""Writing a checkpoint of this library from a source of whole tensors, one tensor at a time.

The result is what a one-process :meth:`~checkpointer.Checkpointer.save` writes: one
``rank_0.safetensors`` holding every tensor flat, then ``metadata.json`` (with a CRC32C per
chunk of every tensor) written last, atomically.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ..buffers import memoryview_of
from ..checksums import ALGORITHM, CHUNK_BYTES, chunk_crcs
from ..errors import CheckpointError
from ..format.dtypes import DTYPE_CODES, dtype_from_code
from ..engine.commit import check_directory, commit_metadata, release_lock
from ..format.layout import CHECKSUMS_KEY, FILE_ID_KEY, METADATA_FILENAME, new_file_id, rank_filename
from ..format.metadata import TensorShardSpec, TensorStorageMetadata, new_metadata
from ..format.safetensors_header import RESERVED_KEY, build_header
from ..storage import open_storage

__all__ = ["write_checkpoint"]

Entry = tuple[str, Sequence[int], str]


def write_checkpoint(
    dst: str,
    entries: Sequence[Entry],
    fetch: Callable[[str], torch.Tensor],
    *,
    aliases: dict[str, str] | None = None,
    save_overwrite: bool = False,
    make_progress: Callable[[int, int], Any] | None = None,
) -> list[str]:
    """Write ``entries`` (``(key, shape, dtype_code)``, fetched by key) as a checkpoint in ``dst``.

    Raises:
        FileExistsError: ``dst`` holds a checkpoint and ``save_overwrite`` is False.
    """
    if not entries:
        raise CheckpointError("nothing to write: the source holds no tensor")
    foreign = [(key, code) for key, _, code in entries if code not in DTYPE_CODES]
    if foreign:
        raise CheckpointError(
            f"cannot write {foreign[0][0]!r} ({len(foreign)} tensors in all): its dtype {foreign[0][1]} is not one "
            f"this library's checkpoints hold ({', '.join(DTYPE_CODES)})"
        )
    reserved = [key for key in [*(key for key, _, _ in entries), *(aliases or {})] if key in (RESERVED_KEY, CHECKSUMS_KEY)]
    if reserved:  # a DCP key may be anything
        raise CheckpointError(f"cannot write the tensor {reserved[0]!r}: a rank file reserves the name for its own use")
    name = rank_filename(0)
    file_id = new_file_id()
    header, _ = build_header(
        [(key, code, math.prod(shape)) for key, shape, code in entries], user_metadata={FILE_ID_KEY: file_id}
    )
    storage = open_storage(dst)
    # As a save does: refuse, or make the old checkpoint read as incomplete from here on.
    lock = check_directory(storage, save_overwrite, retire_old=True)
    total = sum(math.prod(shape) * dtype_from_code(code).itemsize for _, shape, code in entries)
    bar = make_progress(total, len(entries)) if make_progress else None
    crcs: dict[str, list[int]] = {}
    written = False
    try:
        with storage.open_writer(name) as writer:
            writer.expect_bytes(len(header) + total, 0)  # every byte is copied: see LocalWriter
            writer.write([memoryview(header)])
            for key, shape, code in entries:
                data = fetch(key)
                if tuple(data.shape) != tuple(shape) or data.dtype != dtype_from_code(code):
                    raise CheckpointError(
                        f"tensor {key!r} came back as {list(data.shape)} {data.dtype}, expected {list(shape)} {code}"
                    )
                flat = data.detach().cpu().contiguous().view(-1)
                view = memoryview_of(flat)
                crcs[key] = chunk_crcs(view)
                writer.write([view])
                del data, flat, view
                if bar is not None:
                    bar.advance(math.prod(shape) * dtype_from_code(code).itemsize, 1)
            writer.commit()
        written = True
    finally:
        if not written:
            release_lock(storage, lock)  # as a failed save does: a failure here is not a crashed save
        if bar is not None:
            bar.close()
    committed = False
    try:
        tensors = {
            key: TensorStorageMetadata(
                shape=tuple(shape),
                is_sharded=False,
                dtype=code,
                shard_spec_per_file={name: TensorShardSpec(flattened_offsets=((0, math.prod(shape)),))},
            )
            for key, shape, code in entries
        }
        metadata = new_metadata(tensors, world_size=1, aliases=dict(aliases or {}))
        metadata = metadata.with_checksums({name: crcs}, algorithm=ALGORITHM, chunk_bytes=CHUNK_BYTES)
        commit_metadata(storage, metadata.with_file_ids({name: file_id}), lock)
        committed = True
    finally:
        if not committed:
            release_lock(storage, lock)
    return [storage.join(name), storage.join(METADATA_FILENAME)]
