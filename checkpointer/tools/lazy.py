"""fairseq2-style lazy loading: one tensor at a time, already cut for this tensor-parallel rank.

The format is found from what is stored, not from names alone:

1. a directory holding ``metadata.json`` (this library; a directory holding ``model/`` from
   ``save_model_and_optim_state`` means its ``model/``);
2. a Hugging Face directory: ``model.safetensors.index.json`` (or
   ``pytorch_model.bin.index.json``), else a lone ``model.safetensors`` / ``pytorch_model.bin``;
3. a single file: safetensors if it starts with a valid safetensors header, a torch pickle
   if it starts like one (a zip archive or a pickle), whatever its name.

For the safetensors-based formats only the bytes of each rank's slice are read (a slice
along a trailing dimension with many short rows is read as whole rows, 16 MiB at a time,
and copied out; on remote storage, ranges less than 1 MiB apart go as one request); a torch
pickle is loaded whole with ``torch.load`` (``mmap=True`` maps it instead) and cut.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Union

import torch
from torch import Tensor

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..format.layout import METADATA_FILENAME, is_save_file
from ..format.safetensors_header import MAX_HEADER_BYTES, PREFIX_BYTES
from ..storage import open_storage
from ..storage.base import Storage, path_arg
from ..storage.local import LocalStorage
from ..storage.urls import local_path, split_url
from .lazy_sources import (
    Box,
    GatheredReads,
    LazyTensor,
    checkpoint_tensors,
    hf_index_tensors,
    safetensors_tensors,
    torch_file_tensors,
)
from ..engine.load import read_metadata
from ..engine.locate import run_directory_hint, unfinished_save_message
from ..planning.reshard import tp_bounds

__all__ = ["lazy_load", "StateDictConverter"]

StateDictConverter = Callable[
    [str, Tensor], Union[tuple[str, Tensor], Iterable[tuple[str, Tensor]], Mapping[str, Tensor], None]
]
"""``(key, tensor) -> (key, tensor)``, or any number of pairs (an iterable or a mapping; ``None``
or an empty iterable drops the tensor)."""

HF_INDEX = "model.safetensors.index.json"
HF_BIN_INDEX = "pytorch_model.bin.index.json"
HF_SINGLE = "model.safetensors"
HF_BIN_SINGLE = "pytorch_model.bin"
DCP_METADATA = ".metadata"
_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def lazy_load(
    path: str | os.PathLike[str] | Storage,
    shard_dims: Mapping[str, int] | None = None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mmap: bool = False,
    state_dict_converter: StateDictConverter | None = None,
    restrict: bool = True,
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(key, tensor)`` one at a time, each already this TP rank's slice.

    The format is detected (see the module docstring) and checked when this is called;
    tensors are read as the iterator is advanced, and the checkpoint is never whole in
    memory where the format allows (every format but an un-mapped torch pickle).

    A key in ``shard_dims`` (with ``tp_size > 1``) is cut along ``shard_dims[key]`` like
    ``torch.chunk(full, tp_size, dim)[tp_rank]`` (the same rule as
    :func:`~checkpointer.reshard_tensor` and ``DTensor``'s ``Shard``); a rank past the last
    chunk ``torch.chunk`` makes, when the size does not divide, gets an empty slice. Other
    keys come whole.

    ``state_dict_converter`` is called per tensor, ``(key, tensor) -> (key, tensor)`` or any
    number of pairs, so a converted checkpoint is never whole in memory either; ``shard_dims``
    speaks of the converted keys. With ``tp_size > 1`` it is first called once with a
    ``meta`` tensor: if it returns that same tensor under one key (a pure rename), only the
    slice is read; otherwise the full tensor is read, converted, and each result is cut. A
    fairseq2 converter of whole state dicts that works key by key fits with
    ``lambda k, t: convert({k: t})``.

    Args:
        path: a local path, ``file://``, ``s3://``, ``gs://`` or ``http(s)://`` URL of a
            directory or file, or a :class:`~checkpointer.storage.base.Storage` of a directory.
        shard_dims: key -> tensor-parallel dimension (see :func:`~checkpointer.get_shard_dims`).
        tp_rank: this process's tensor-parallel rank.
        tp_size: the tensor-parallel size.
        mmap: memory-map a local torch pickle instead of reading it (safetensors-based
            formats always read just the slices and ignore it).
        state_dict_converter: per-tensor converter, see above.
        restrict: ``torch.load(weights_only=True)`` for torch pickles: nothing but tensors
            and builtins is unpickled.

    Returns:
        An iterator of ``(key, tensor)``, CPU tensors the caller owns.

    Raises:
        FileNotFoundError: a local path that does not exist.
        IncompleteCheckpointError: a checkpoint directory without ``metadata.json``.
        CorruptCheckpointError: an unknown or damaged format, naming the path (also while iterating).
        ValueError: ``tp_rank``/``tp_size`` out of range, or a shard dim the tensor lacks.

    Example::

        shard_dims = get_shard_dims(model)
        for key, tensor in lazy_load("/ckpt/step1000", shard_dims, tp_rank=1, tp_size=2):
            model_state[key].copy_(tensor)
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not a rank of tp_size {tp_size}")
    tensors = _open(path, mmap=mmap, restrict=restrict)
    return _iterate(tensors, dict(shard_dims or {}), tp_rank, tp_size, state_dict_converter)


def _iterate(
    tensors: Iterator[LazyTensor],
    shard_dims: dict[str, int],
    tp_rank: int,
    tp_size: int,
    converter: StateDictConverter | None,
) -> Iterator[tuple[str, Tensor]]:
    def box(key: str, shape: tuple[int, ...]) -> Box | None:
        dim = shard_dims.get(key) if tp_size > 1 else None
        if dim is None:
            return None
        if not -len(shape) <= dim < len(shape) or not shape:
            raise ValueError(f"{key!r}: shard dim {dim} is out of range for shape {list(shape)}")
        dim %= len(shape)
        start, end = tp_bounds(shape[dim], tp_size, tp_rank)
        local, offset = list(shape), [0] * len(shape)
        local[dim], offset[dim] = end - start, start
        return tuple(local), tuple(offset)

    for lazy in tensors:
        if converter is None:
            yield lazy.key, lazy.read(box(lazy.key, lazy.shape))
            continue
        renamed = _renamed_by(converter, lazy) if tp_size > 1 else None
        if renamed is not None:
            yield renamed, lazy.read(box(renamed, lazy.shape))
            continue
        full = lazy.read(None)
        for key, tensor in _convert(converter, lazy.key, full):
            cut = box(key, tuple(tensor.shape))
            if cut is not None:
                (local, offset), part = cut, tensor
                for dim, (size, start) in enumerate(zip(local, offset)):
                    if size != tensor.shape[dim]:
                        part = part.narrow(dim, start, size).clone(memory_format=torch.contiguous_format)
                tensor = part
            yield key, tensor
        del full


def _convert(converter: StateDictConverter, key: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
    out: Any = converter(key, tensor)
    if out is None:
        return []
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str):
        pairs = [out]
    else:
        pairs = list(out.items() if isinstance(out, Mapping) else out)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], Tensor)):
            raise TypeError(f"state_dict_converter gave {pair!r:.200} for {key!r}; expected (str, Tensor) pairs")
    return pairs


def _renamed_by(converter: StateDictConverter, lazy: LazyTensor) -> str | None:
    """The new key when the converter only renames (tried on a meta tensor), else None."""
    probe = torch.empty(lazy.shape, dtype=lazy.dtype, device="meta")
    try:
        pairs = _convert(converter, lazy.key, probe)
    except Exception:  # noqa: BLE001 - a converter that needs real data is run on real data
        return None
    if len(pairs) == 1 and pairs[0][1] is probe:
        return pairs[0][0]
    return None


# ---------------------------------------------------------------------------------------
# Format detection
# ---------------------------------------------------------------------------------------


def _open(path: str | os.PathLike[str] | Storage, *, mmap: bool, restrict: bool) -> Iterator[LazyTensor]:
    if isinstance(path, Storage):
        return _open_dir(path, mmap=mmap, restrict=restrict) or _no_checkpoint(path)
    url = path_arg(path)
    local = local_path(url)
    if local is not None:
        local = os.path.expanduser(local)
        if os.path.isdir(local):
            storage = LocalStorage(local)
            return _open_dir(storage, mmap=mmap, restrict=restrict) or _no_checkpoint(storage)
        if os.path.isfile(local):
            real = os.path.realpath(local)
            return _open_file(LocalStorage(os.path.dirname(real)), os.path.basename(real), url, mmap=mmap, restrict=restrict)
        raise FileNotFoundError(f"no checkpoint at {url}: the path does not exist")
    remote: Storage = GatheredReads(open_storage(url))
    parent, name = split_url(url)
    looks_like_file = name.lower().endswith(_FILE_SUFFIXES)
    if not looks_like_file:
        found = _open_dir(remote, mmap=mmap, restrict=restrict)
        if found is not None:
            return found
    if name:
        parent_storage = GatheredReads(open_storage(parent))
        if parent_storage.exists(name):
            return _open_file(parent_storage, name, url, mmap=mmap, restrict=restrict)
    if looks_like_file:
        found = _open_dir(remote, mmap=mmap, restrict=restrict)
        if found is not None:
            return found
    raise CorruptCheckpointError(f"{url}: no checkpoint found (neither a checkpoint directory nor a checkpoint file)")


def _open_dir(storage: Storage, *, mmap: bool, restrict: bool) -> Iterator[LazyTensor] | None:
    """The tensors of the checkpoint in a directory; None when it holds none (by the names probed)."""
    if not storage.is_local() and not isinstance(storage, GatheredReads):
        storage = GatheredReads(storage)
    model = storage.part("model")
    for root in (storage, model):
        if root.exists(METADATA_FILENAME):
            return checkpoint_tensors(root, read_metadata(root, no_dist=True))
    if isinstance(model, LocalStorage) and os.path.isfile(os.path.join(model.root, METADATA_FILENAME)):
        read_metadata(model, no_dist=True)  # there, but leads out of the checkpoint: the error says so
    if _has(storage, HF_INDEX):
        return hf_index_tensors(storage, HF_INDEX, safetensors_tensors, _resolve)
    if _has(storage, HF_BIN_INDEX):

        def per_file(s: Storage, name: str, keys: Any) -> Iterator[LazyTensor]:
            return torch_file_tensors(s, name, keys, mmap=mmap, restrict=restrict)

        return hf_index_tensors(storage, HF_BIN_INDEX, per_file, _resolve)
    for single in (HF_SINGLE, HF_BIN_SINGLE):
        if _has(storage, single):
            file_storage, name = _resolve(storage, single)
            return _open_file(file_storage, name, storage.join(single), mmap=mmap, restrict=restrict)
    if _has(storage, DCP_METADATA):
        raise CorruptCheckpointError(
            f"{storage.url} is a torch DCP checkpoint, which lazy_load does not read: convert it first "
            f"(checkpointer convert {storage.url} OUT --to checkpointer --allow-pickle, for a DCP checkpoint you trust)"
        )
    for root in (storage, storage.part("model")):
        try:
            names = root.list()
        except (OSError, NotImplementedError):  # http(s) cannot list; no model/ there
            names = []
        if any(is_save_file(n) for n in names):  # a save began here (rank files, its lock) and never finished
            raise IncompleteCheckpointError(unfinished_save_message(root))
    return None


def _no_checkpoint(storage: Storage) -> Iterator[LazyTensor]:
    run = run_directory_hint(storage)
    raise CorruptCheckpointError(
        f"{storage.url}: no checkpoint found: expected {METADATA_FILENAME}, model/{METADATA_FILENAME}, "
        f"{HF_INDEX}, {HF_SINGLE} or {HF_BIN_SINGLE}" + (f"; {run}" if run else "")
    )


def _has(storage: Storage, name: str) -> bool:
    if isinstance(storage, LocalStorage):
        return os.path.isfile(os.path.join(storage.root, name))
    return storage.exists(name)


def _resolve(storage: Storage, name: str) -> tuple[Storage, str]:
    """Where to read ``name`` of a local directory from, following symlinks that leave it (the
    Hugging Face cache links ``snapshots/<rev>/*`` to ``blobs/``); names were checked plain."""
    if not isinstance(storage, LocalStorage):
        return storage, name
    root = os.path.realpath(storage.root)
    real = os.path.realpath(os.path.join(storage.root, name))
    if os.path.dirname(real) == root:
        return storage, name
    return LocalStorage(os.path.dirname(real)), os.path.basename(real)


def _open_file(storage: Storage, name: str, where: str, *, mmap: bool, restrict: bool) -> Iterator[LazyTensor]:
    size = storage.size(name)
    head = storage.read(name, 0, min(size, 16))
    if _looks_like_safetensors(head, size):
        return safetensors_tensors(storage, name)
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        return torch_file_tensors(storage, name, mmap=mmap, restrict=restrict)
    lowered = name.lower()
    if lowered.endswith(".safetensors"):
        raise CorruptCheckpointError(f"{where}: not a valid safetensors file (bad header length or header)")
    if lowered.endswith((".pt", ".pth", ".bin")):
        raise CorruptCheckpointError(f"{where}: not a torch checkpoint (neither a zip archive nor a pickle)")
    raise CorruptCheckpointError(f"{where}: unknown checkpoint format (not safetensors, not a torch pickle)")


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < PREFIX_BYTES + 1:
        return False
    (n,) = struct.unpack("<Q", head[:PREFIX_BYTES])
    return 2 <= n <= min(MAX_HEADER_BYTES, size - PREFIX_BYTES) and head[PREFIX_BYTES : PREFIX_BYTES + 1] == b"{"
