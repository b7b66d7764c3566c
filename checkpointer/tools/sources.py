"""The one interface the offline tools read checkpoints through: a *tensor source*.

A :class:`TensorSource` is one checkpoint in one format. It lists its tensors up front
(:meth:`~TensorSource.entries`), reads one whole (:meth:`~TensorSource.fetch`, for
``convert``), and gives each as a :class:`LazyTensor` whose ``read(box)`` reads just a box of
it (:meth:`~TensorSource.tensors`, for ``lazy_load``); formats that store a tensor's bytes in
one place read only the box's bytes.

Each format is one subclass with a ``supports(where)`` check, asked in order by
:func:`~checkpointer.tools.detect.open_source` (the model is fairseq2's delegating checkpoint
loader):

1. :class:`~checkpointer.tools.ours.OursSource`: this library's checkpoints (and the
   ``model/`` part of a model and optimizer save, as OLMo-core writes them too);
2. :class:`~checkpointer.tools.dcp.DCPSource`: torch DCP directories (reading needs
   ``allow_pickle``);
3. :class:`~checkpointer.tools.hf.HFSource`: Hugging Face safetensors (an index directory, a
   single file, or a directory holding such files), the one safetensors reader of the tools;
4. :class:`~checkpointer.tools.torch_files.TorchSource`: torch pickles (``.pt``/``.bin``,
   alone or sharded by ``pytorch_model.bin.index.json``).

A :class:`Where` says what was pointed at: a directory, or one file in a directory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..format.dtypes import dtype_from_code
from ..planning.pieces import Piece, whole
from ..storage.base import Storage

__all__ = ["Box", "LazyTensor", "Where", "TensorSource", "box_piece", "read_box", "cut_box"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(local_shape, global_offset)`` of the part of a tensor to read."""

Entry = tuple[str, tuple[int, ...], str]
"""``(key, shape, dtype code)`` of one stored tensor."""


@dataclass(frozen=True)
class LazyTensor:
    """One tensor of a checkpoint, not read yet: ``read(box)`` returns a fresh tensor holding
    that box of it (``None``: all of it)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[Box | None], torch.Tensor]


@dataclass(frozen=True)
class Where:
    """What a tool was pointed at: the directory ``storage``, or the file ``name`` in it."""

    storage: Storage
    name: str | None = None
    url: str = ""

    @property
    def shown(self) -> str:
        """The location for messages: the URL given, else the storage's."""
        if self.url:
            return self.url
        return self.storage.join(self.name) if self.name else self.storage.url


class TensorSource(ABC):
    """One checkpoint in one format, read one tensor at a time.

    Subclasses set :attr:`format` (the name ``convert`` uses) and :attr:`looks_for` (what
    :meth:`supports` probes, for the error when no format fits), and are built as
    ``cls(where, **options)``: ``allow_pickle`` (DCP), ``mmap`` and ``restrict`` (torch
    pickles); a source ignores the options it has no use for.
    """

    format: ClassVar[str]
    looks_for: ClassVar[str]
    url: str
    aliases: dict[str, str]
    """Tied names: ``alias -> key`` whose memory it shares (listed once in :meth:`entries`)."""
    skipped: list[str]
    """Entries that are not tensors and are not read (named by ``convert``)."""

    @classmethod
    @abstractmethod
    def supports(cls, where: Where) -> bool:
        """Whether ``where`` holds a checkpoint of this format (by the names and bytes probed)."""

    @abstractmethod
    def entries(self) -> list[Entry]:
        """Every tensor as ``(key, shape, dtype code)``, aliases not included."""

    @abstractmethod
    def fetch(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (a key of :meth:`entries` or an alias)."""

    def tensors(self) -> Iterator[LazyTensor]:
        """Every tensor (aliases after the key they share memory with), read as the caller asks;
        by default each box is cut from the whole tensor."""
        by_target = self.tied_names()
        for key, shape, code in self.entries():

            def read(box: Box | None, key: str = key) -> torch.Tensor:
                return cut_box(self.fetch(key), box)

            for name in [key, *by_target.get(key, [])]:
                yield LazyTensor(name, shape, dtype_from_code(code), read)

    def tied_names(self) -> dict[str, list[str]]:
        """``key -> [aliases]`` for the keys that other names share memory with."""
        out: dict[str, list[str]] = {}
        for alias, target in self.aliases.items():
            out.setdefault(target, []).append(alias)
        return out


def box_piece(shape: Sequence[int], box: Box | None) -> Piece:
    """``box`` of a tensor of ``shape`` as a piece to read (all of it for ``None``)."""
    if box is None:
        return whole(shape)
    local, offset = box
    return Piece(local_shape=tuple(local), global_offset=tuple(offset))


def read_box(
    shape: Sequence[int], dtype: torch.dtype, box: Box | None, read_piece: Callable[[Piece, torch.Tensor], None]
) -> torch.Tensor:
    """A fresh tensor holding ``box`` of a stored tensor (all of it for ``None``).

    ``read_piece(piece, flat)`` fills ``flat`` with the elements of ``piece`` in its row-major
    order: a box stays a box, read as a few strided copies however many rows it has."""
    piece = box_piece(shape, box)
    dest = torch.empty(tuple(shape) if box is None else tuple(box[0]), dtype=dtype)
    if dest.numel():
        read_piece(piece, dest.view(-1))
    return dest


def cut_box(tensor: torch.Tensor, box: Box | None) -> torch.Tensor:
    """``box`` of a tensor already in memory: a contiguous copy when it is less than all of it."""
    if box is None:
        return tensor
    part = tensor
    for dim, (size, offset) in enumerate(zip(*box)):
        if size != tensor.shape[dim]:
            part = part.narrow(dim, offset, size)
    return part.clone(memory_format=torch.contiguous_format) if part.numel() < tensor.numel() else part
