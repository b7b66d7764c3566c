"""``convert SRC DST --to olmo``: a checkpoint of this library in the verbose form OLMo-core 0.1.0 reads.

Format 2 describes regular layouts by shard rules and keeps the checksums and the file id in the
rank files; ai2-olmo-core 0.1.0 reads only format 1's ``shard_spec_per_file``, every piece listed
file by file. The conversion, for each part (``train/``, ``model/``, ``optim/`` of a top-level
directory, in the order a save commits them, or the one directory given):

0. Verify every part as ``checkpointer verify`` does, reading every byte: its layout, headers
   and checksums. The copy below moves bytes without looking at them, and OLMo-core checks no
   checksum, so a damaged source is refused here, before anything is written.
1. Read ``metadata.json`` and each rank file's header (its file id checked against the metadata);
   in format 2, read each file's checksums (its ``__checkpointer_crc32c__`` tensor).
2. Copy every rank file as it is, byte for byte (a format-1 reader ignores the checksums tensor).
   A tied key (saved once, as an alias of its target) gets a copy of its target's pieces under
   its own name, in a file beside each rank file that holds them (``rank_0.tied.safetensors``):
   OLMo-core reads every key of a model's state dict from a file that holds it by that name.
3. Write ``metadata.json`` last: :meth:`~checkpointer.StorageMetadata.verbose`, ``format_version``
   1, each piece's checksums and each file's id listed in it.

A format-1 source (ours or OLMo-core's) is copied with its metadata as it is. Rank files are read
and written in blocks of 64 MiB: nothing holds a whole tensor.
"""

from __future__ import annotations

from typing import Any, Callable

from ..engine.checks import HeaderCache, read_with
from ..engine.commit import check_directory, commit_metadata, refuse_existing, release_lock
from ..engine.load import read_metadata
from ..engine.reader import CheckpointReader
from ..engine.locate import checkpoint_parts
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.layout import FILE_ID_KEY, FORMAT_VERSION, LEGACY_FORMAT_VERSION, METADATA_FILENAME
from ..format.safetensors_header import build_header
from ..format.metadata import StorageMetadata
from ..storage import open_storage
from ..storage.base import Storage
from .verify import verify_checkpoint

__all__ = ["write_olmo", "olmo_metadata"]

_BLOCK = 64 << 20
_COMMIT_ORDER = ("train", "model", "optim")
_TIED_SUFFIX = ".tied.safetensors"


def olmo_metadata(metadata: StorageMetadata, headers: HeaderCache) -> StorageMetadata:
    """``metadata`` in format 1: every piece listed per file, with its checksums and its file's id
    (read from the rank files through ``headers`` when the metadata does not list them)."""
    if (metadata.format_version or 0) < FORMAT_VERSION:
        return metadata
    verbose = metadata.verbose()
    files = verbose.files()
    if metadata.checksums_in_files and metadata.checksum_chunk_bytes:
        crcs = {name: headers.checksums(name, metadata.checksum_chunk_bytes) for name in files}
        verbose = verbose.with_checksums(
            {name: {key: list(c) for key, c in per_key.items()} for name, per_key in crcs.items()},
            algorithm=metadata.checksum_algorithm or "crc32c",
            chunk_bytes=metadata.checksum_chunk_bytes,
        )
    ids = {name: metadata.file_ids[name] for name in files} if metadata.file_ids else {}
    return verbose.with_file_ids(ids).model_copy(
        update={"format_version": LEGACY_FORMAT_VERSION, "file_id": None, "checksums_in_files": None}
    )


def write_olmo(
    src: str,
    dst: str,
    *,
    save_overwrite: bool = False,
    make_progress: Callable[[int, int], Any] | None = None,
) -> list[str]:
    """Write ``src`` (a checkpoint directory of this library, or a top-level one holding
    ``model/`` and ``optim/``) to ``dst`` in format 1; returns the files written.

    Raises:
        FileExistsError: ``dst`` (or one of its parts) holds a checkpoint and ``save_overwrite`` is False.
        CorruptCheckpointError: a part fails :func:`~checkpointer.tools.verify.verify_checkpoint`
            (a rank file missing, of another save or damaged; pieces that overlap or leave elements out).
    """
    source, target = open_storage(src), open_storage(dst)
    if source.place() == target.place():
        raise CheckpointError(f"convert --to olmo writes a new directory: {dst} is the source itself")
    parts = dict(checkpoint_parts(source))
    if "" not in parts and "train" not in parts and source.part("train").exists(METADATA_FILENAME):
        parts["train"] = source.part("train")
    names = [name for name in _COMMIT_ORDER if name in parts] or [""]
    for name in names:
        problems = verify_checkpoint(parts[name])
        if problems:
            more = f" (and {len(problems) - 1} more: checkpointer verify lists them)" if len(problems) > 1 else ""
            raise CorruptCheckpointError(f"{parts[name].url} is damaged, nothing was written: {problems[0]}{more}")
    read = [(name, parts[name], read_metadata(parts[name], no_dist=True)) for name in names]
    targets = [target.part(name) if name else target for name, _, _ in read]
    if not save_overwrite:  # every part refused before any is written
        refuse_existing(targets)
    elif "optim" in names and targets[-1].exists(METADATA_FILENAME):
        targets[-1].delete(METADATA_FILENAME)  # the old step reads as incomplete until optim/ commits again
    total = sum(_total_bytes(storage, metadata) for _, storage, metadata in read)
    bar = make_progress(total, sum(len(m.files()) for _, _, m in read)) if make_progress else None
    written: list[str] = []
    try:
        for (_, storage, metadata), part in zip(read, targets):
            written += _convert_part(storage, part, metadata, save_overwrite, bar)
    finally:
        if bar is not None:
            bar.close()
    return written


def _total_bytes(storage: Storage, metadata: StorageMetadata) -> int:
    return sum(storage.size(name) for name in metadata.files())


def _convert_part(source: Storage, target: Storage, metadata: StorageMetadata, save_overwrite: bool, bar: Any) -> list[str]:
    headers = CheckpointReader(source, metadata).headers
    try:
        converted, tied = _untie(olmo_metadata(metadata, headers))
        files = metadata.files()
        for name in files:
            headers.get(name)  # every file of this save, before anything is written
        lock = check_directory(target, save_overwrite, retire_old=True)
        committed = False
        try:
            if save_overwrite:  # the commit drops stale rank files; a conversion's .tied files go here
                for name in target.list():
                    if name.endswith(_TIED_SUFFIX) and name not in tied:
                        target.delete(name)
            for name in files:
                _copy(headers.storage, target, name, bar)
            for name, copies in tied.items():
                _write_tied(headers, target, name, copies, (converted.file_ids or {}).get(name))
            commit_metadata(target, converted, lock)
            committed = True
        finally:
            if not committed:
                release_lock(target, lock)
    finally:
        headers.close()
    return [target.join(name) for name in files + list(tied)] + [target.join(METADATA_FILENAME)]


def _untie(metadata: StorageMetadata) -> tuple[StorageMetadata, dict[str, list[tuple[str, str, str]]]]:
    """``metadata`` with each alias listed as a tensor of its own, held in the ``.tied`` file beside
    each file that holds its target; and per such file its ``(key, source file, target key)``."""
    if not metadata.aliases:
        return metadata, {}
    tensors, tied = dict(metadata.tensors), {}
    for alias, saved in sorted(metadata.aliases.items()):
        meta = metadata.tensors[saved]
        specs = {}
        for name, spec in meta.shard_spec_per_file.items():
            specs[_tied_name(name)] = spec
            tied.setdefault(_tied_name(name), []).append((alias, name, saved))
        tensors[alias] = meta.model_copy(update={"shard_spec_per_file": specs})
    ids = dict(metadata.file_ids or {})
    if ids:  # a .tied file has the id of the file it sits beside
        ids.update({_tied_name(name): ids[name] for name in metadata.files() if _tied_name(name) in tied})
    return metadata.model_copy(update={"tensors": tensors, "aliases": None, "file_ids": ids or None}), tied


def _tied_name(name: str) -> str:
    return f"{name.removesuffix('.safetensors')}{_TIED_SUFFIX}"


def _write_tied(headers: HeaderCache, target: Storage, name: str, copies: list[tuple[str, str, str]], file_id: str | None) -> None:
    """A ``.tied`` file: each key's bytes, copied from its target's piece in ``source``."""
    sources = [headers.get(source).entries[saved] for _, source, saved in copies]
    header, _ = build_header([(key, e.dtype, e.numel) for (key, _, _), e in zip(copies, sources)],
                             user_metadata={FILE_ID_KEY: file_id} if file_id else None)
    storage = headers.storage
    with target.open_writer(name) as writer:
        writer.expect_bytes(len(header) + sum(e.end - e.start for e in sources), 0)  # all copied: see LocalWriter
        writer.write([memoryview(header)])
        for (_, source, _), entry in zip(copies, sources):
            for at in range(entry.start, entry.end, _BLOCK):
                end = min(entry.end, at + _BLOCK)
                block = read_with(storage, source, lambda: storage.read(source, at, end))
                if len(block) != end - at:
                    raise CheckpointError(f"{storage.join(source)}: changed while it was copied")
                writer.write([memoryview(block)])
        writer.commit()


def _copy(source: Storage, target: Storage, name: str, bar: Any) -> None:
    size = source.size(name)
    with target.open_writer(name) as writer:
        writer.expect_bytes(size, 0)  # every byte is copied: see LocalWriter
        at = 0
        while at < size:
            end = min(size, at + _BLOCK)
            block = read_with(source, name, lambda: source.read(name, at, end))
            if len(block) != end - at:
                raise CheckpointError(f"{source.join(name)}: changed while it was copied (cut short at {at + len(block)} bytes)")
            writer.write([memoryview(block)])
            if bar is not None:
                bar.advance(len(block), 0)
            at = end
        writer.commit()
    if bar is not None:
        bar.advance(0, 1)
