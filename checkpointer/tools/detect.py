"""The one format detector of the tools: which :class:`~checkpointer.tools.sources.TensorSource`
reads what a path points at.

1. The path is resolved to a directory or a file (:class:`~checkpointer.tools.sources.Where`):
   a local path by what is there (a missing one is ``FileNotFoundError``); a URL as a directory
   first, then as a file, or the other way round when its name ends like a checkpoint file
   (``.safetensors``, ``.pt``, ``.pth``, ``.bin``). Remote storage reads through
   :class:`~checkpointer.tools.gathered.GatheredReads`. An ``hf://`` URL is fetched into the
   Hugging Face cache first (:func:`~checkpointer.tools.hub.fetch_hf`) and read from there.
2. Each source in :data:`SOURCES` is asked, in order, whether it ``supports`` it; the first
   that does reads it (files are recognised by their first bytes, not their names).
3. When none does: a directory holding a save's files but no ``metadata.json`` is an
   :class:`~checkpointer.IncompleteCheckpointError`; anything else a
   :class:`~checkpointer.CorruptCheckpointError` that lists what was looked for.
"""

from __future__ import annotations

import os
from typing import Any

from ..engine.locate import run_directory_hint, unfinished_save_message
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..format.layout import is_save_file
from ..storage import open_storage
from ..storage.base import Storage, path_arg
from ..storage.local import LocalStorage
from ..storage.urls import local_path, split_url
from .checkpoint_tensors import OursSource
from .dcp import DCPSource
from .gathered import GatheredReads
from .hf import HFSource
from .hub import fetch_hf, is_hf_url
from .sources import TensorSource, Where
from .torch_files import TorchSource

__all__ = ["SOURCES", "detect", "open_source"]

SOURCES: tuple[type[TensorSource], ...] = (OursSource, DCPSource, HFSource, TorchSource)
"""Every format the tools read, asked in this order."""

_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")

Found = tuple[type[TensorSource], Where]


def open_source(path: str | os.PathLike[str] | Storage, **options: Any) -> TensorSource:
    """The tensor source for ``path``, its format detected (:func:`detect`).

    ``options`` go to the source: ``allow_pickle`` (DCP), ``mmap`` and ``restrict`` (torch pickles).
    """
    cls, where = detect(path)
    return cls(where, **options)


def detect(path: str | os.PathLike[str] | Storage) -> Found:
    """The source class that reads ``path``, and where (see the module docstring).

    Raises:
        FileNotFoundError: a local path that does not exist.
        IncompleteCheckpointError: a directory where a save began and never finished.
        CorruptCheckpointError: no format fits, naming the path and what was looked for.
    """
    if isinstance(path, Storage):
        storage = path if path.is_local() or isinstance(path, GatheredReads) else GatheredReads(path)
        return _in_dir(Where(storage)) or _nothing(storage)
    url = path_arg(path)
    if is_hf_url(url):  # fetched whole into the Hugging Face cache, then read from there
        url = fetch_hf(url)
    local = local_path(url)
    if local is not None:
        local = os.path.expanduser(local)
        if os.path.isdir(local):
            storage = LocalStorage(local)
            return _in_dir(Where(storage)) or _nothing(storage)
        if os.path.isfile(local):
            real = os.path.realpath(local)
            return _in_file(Where(LocalStorage(os.path.dirname(real)), os.path.basename(real), url))
        raise FileNotFoundError(f"no checkpoint at {url}: the path does not exist")
    remote: Storage = GatheredReads(open_storage(url))
    parent, name = split_url(url)
    looks_like_file = name.lower().endswith(_FILE_SUFFIXES)
    if not looks_like_file and (found := _in_dir(Where(remote))) is not None:
        return found
    if name:
        parent_storage = GatheredReads(open_storage(parent))
        if parent_storage.exists(name):
            return _in_file(Where(parent_storage, name, url))
    if looks_like_file and (found := _in_dir(Where(remote))) is not None:
        return found
    raise CorruptCheckpointError(f"{url}: no checkpoint found (neither a checkpoint directory nor a checkpoint file)")


def _in_dir(where: Where) -> Found | None:
    for cls in SOURCES:
        if cls.supports(where):
            return cls, where
    storage = where.storage
    for root in (storage, storage.part("model")):
        try:
            names = root.list()
        except (OSError, NotImplementedError):  # http(s) cannot list; no model/ there
            names = []
        if any(is_save_file(n) for n in names):  # a save began here (rank files, its lock) and never finished
            raise IncompleteCheckpointError(unfinished_save_message(root))
    return None


def _in_file(where: Where) -> Found:
    for cls in SOURCES:
        if cls.supports(where):
            return cls, where
    lowered = str(where.name).lower()
    if lowered.endswith(".safetensors"):
        raise CorruptCheckpointError(f"{where.shown}: not a valid safetensors file (bad header length or header)")
    if lowered.endswith((".pt", ".pth", ".bin")):
        raise CorruptCheckpointError(f"{where.shown}: not a torch checkpoint (neither a zip archive nor a pickle)")
    raise CorruptCheckpointError(f"{where.shown}: unknown checkpoint format (not safetensors, not a torch pickle)")


def _nothing(storage: Storage) -> Found:
    run = run_directory_hint(storage)
    expected = ", ".join(cls.looks_for for cls in SOURCES)
    raise CorruptCheckpointError(
        f"cannot tell the format of {storage.url}: expected {expected}; no checkpoint found there"
        + (f"; {run}" if run else "")
    )
