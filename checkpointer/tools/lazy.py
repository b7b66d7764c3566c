"""fairseq2-style lazy loading: one tensor at a time, already cut for this tensor-parallel rank.

The format is found from what is stored, not from names alone, by the tools' one detector
(:func:`~checkpointer.tools.detect.detect`): this library's checkpoints (a directory holding
``model/`` from ``save_model_and_optim_state`` means its ``model/``), Hugging Face safetensors
(an index directory, a single file, a directory holding one) and torch pickles (``.pt``/``.bin``,
alone or sharded by ``pytorch_model.bin.index.json``); a torch DCP directory is refused with
the way to convert it.

For the safetensors-based formats only the bytes of each rank's slice are read (a slice
along a trailing dimension with many short rows is read as whole rows, 16 MiB at a time,
and copied out; on remote storage, ranges less than 1 MiB apart go as one request); a torch
pickle is loaded whole with ``torch.load`` (``mmap=True`` maps it instead) and cut.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Union

import torch
from torch import Tensor

from ..errors import CorruptCheckpointError
from ..planning.reshard import tp_bounds
from ..storage.base import Storage
from .dcp import DCPSource
from .detect import detect
from .sources import Box, LazyTensor

__all__ = ["lazy_load", "StateDictConverter"]

StateDictConverter = Callable[
    [str, Tensor], Union[tuple[str, Tensor], Iterable[tuple[str, Tensor]], Mapping[str, Tensor], None]
]
"""``(key, tensor) -> (key, tensor)``, or any number of pairs (an iterable or a mapping; ``None``
or an empty iterable drops the tensor)."""


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
# Format detection: the tools' one detector, less the formats lazy_load does not read
# ---------------------------------------------------------------------------------------


def _open(path: str | os.PathLike[str] | Storage, *, mmap: bool, restrict: bool) -> Iterator[LazyTensor]:
    cls, where = detect(path)
    if cls is DCPSource:
        url = where.storage.url
        raise CorruptCheckpointError(
            f"{url} is a torch DCP checkpoint, which lazy_load does not read: convert it first "
            f"(checkpointer convert {url} OUT --to checkpointer --allow-pickle, for a DCP checkpoint you trust)"
        )
    return cls(where, mmap=mmap, restrict=restrict).tensors()
