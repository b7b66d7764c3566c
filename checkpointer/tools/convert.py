"""``convert SRC DST --to FORMAT``: between this library's checkpoints, torch DCP and Hugging Face safetensors.

The source's format is detected; every conversion streams one tensor at a time. A checkpoint
of this library converted to ``hf`` is :func:`~checkpointer.export_safetensors`, which spreads
the shards over the ranks of a process group. The other conversions run on rank 0 while the
other ranks wait for its result, however long it takes.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Protocol

import torch

from .. import dist
from .checkpoint_tensors import CheckpointTensors
from .export import export_checkpoint, parse_dtype, plan_export, run_export, select_tensors
from ..engine.load import read_metadata
from ..engine.locate import checkpoint_parts, model_checkpoint
from ..errors import CheckpointError, IncompleteCheckpointError
from ..format.layout import METADATA_FILENAME, is_rank_filename
from ..storage import open_storage
from ..storage.base import path_arg
from .dcp import DCPTensors, is_dcp, write_dcp
from .hf import HFTensors, is_hf
from .ours import write_checkpoint

__all__ = ["FORMATS", "detect_format", "convert", "open_source"]

FORMATS = ("checkpointer", "dcp", "hf")


class Source(Protocol):
    @property
    def aliases(self) -> dict[str, str]: ...

    def entries(self) -> list[tuple[str, tuple[int, ...], str]]: ...

    def fetch(self, key: str) -> torch.Tensor: ...


def detect_format(src: str) -> str:
    """``"checkpointer"``, ``"dcp"`` or ``"hf"``, from what ``src`` holds."""
    if str(src).endswith(".safetensors"):
        return "hf"
    storage = open_storage(src)
    names = set(storage.list())
    if METADATA_FILENAME in names or any(
        part in names and storage.part(part).exists(METADATA_FILENAME) for part in ("model", "optim")
    ):
        return "checkpointer"
    if is_dcp(names):
        return "dcp"
    if any(is_rank_filename(n) for n in names):
        raise IncompleteCheckpointError(
            f"{storage.join(METADATA_FILENAME)} is missing: {storage.url} is not a complete checkpoint"
        )
    if is_hf(src, names):
        return "hf"
    if not names and storage.is_local() and os.path.isfile(storage.url):
        raise CheckpointError(
            f"cannot tell the format of {storage.url}: it is a file; expected a directory "
            "(checkpointer, torch DCP, Hugging Face) or a .safetensors file"
        )
    if not names:
        raise CheckpointError(f"{storage.url} does not exist or is empty")
    raise CheckpointError(
        f"cannot tell the format of {storage.url}: expected {METADATA_FILENAME} (checkpointer), "
        ".metadata (torch DCP), or .safetensors files (Hugging Face)"
    )


class _OursSource:
    def __init__(self, src: str):
        storage = model_checkpoint(open_storage(src))
        self.source = CheckpointTensors(storage, read_metadata(storage, no_dist=True))
        self.aliases = dict(self.source.metadata.aliases or {})

    def entries(self) -> list[tuple[str, tuple[int, ...], str]]:
        return self.source.entries()

    def fetch(self, key: str) -> torch.Tensor:
        return self.source.fetch(key)


def open_source(fmt: str, src: str, *, allow_pickle: bool = False) -> Source:
    if fmt == "checkpointer":
        return _OursSource(src)
    if fmt == "dcp":
        return DCPTensors(src, allow_pickle=allow_pickle)
    if fmt == "hf":
        return HFTensors(src)
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def convert(
    src: str,
    dst: str,
    *,
    to: str,
    allow_pickle: bool = False,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    save_overwrite: bool = False,
    make_progress: Callable[[int, int], Any] | None = None,
    notes: Callable[[str], None] | None = None,
) -> list[str]:
    """Convert ``src`` (format detected) to ``to`` in ``dst``; returns the files this rank wrote.

    Args:
        to: ``"checkpointer"``, ``"dcp"`` or ``"hf"``.
        allow_pickle: needed to read a DCP source, whose ``.metadata`` is a pickle.
        max_shard_size, dtype: for ``hf`` output, as for :func:`~checkpointer.export_safetensors`.
        save_overwrite: replace a checkpoint already in ``dst`` (``checkpointer`` and ``dcp``).
        notes: called with one-line remarks (entries that were not converted).
    """
    if to not in FORMATS:
        raise ValueError(f"unknown target format {to!r}; expected one of {FORMATS}")
    src, dst = path_arg(src, "source"), path_arg(dst, "destination")
    if not src.strip() or not dst.strip():
        raise ValueError("the path is empty (write '.' for the current directory)")
    fmt: str | None = None
    error: BaseException | None = None
    if dist.get_rank() == 0:
        fmt, error = dist.attempt(lambda: detect_format(src))
    dist.agree(error, "convert")
    fmt = dist.broadcast_bytes(fmt.encode() if fmt else None).decode() if dist.is_distributed() else fmt
    if fmt == "checkpointer" and to == "hf":
        return export_checkpoint(src, dst, max_shard_size=max_shard_size, dtype=dtype, make_progress=make_progress)
    assert fmt is not None

    def alone() -> list[str]:
        if dist.get_rank() != 0:
            return []
        return _convert_alone(fmt, src, dst, to, allow_pickle, max_shard_size, dtype, save_overwrite, make_progress, notes)

    return dist.agree_after(alone, "convert")


def _convert_alone(fmt, src, dst, to, allow_pickle, max_shard_size, dtype, save_overwrite, make_progress, notes) -> list[str]:
    source = open_source(fmt, src, allow_pickle=allow_pickle)
    if fmt == "checkpointer" and notes is not None and "optim" in dict(checkpoint_parts(open_storage(src))):
        notes(f"only the model is converted: the optimizer state in {open_storage(src).join('optim')} is not")
    skipped = getattr(source, "skipped", [])
    if skipped and notes is not None:
        shown = ", ".join(map(repr, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        notes(f"{len(skipped)} non-tensor entries of {src} were not converted: {shown}")
    entries = source.entries()
    if to == "checkpointer":
        return write_checkpoint(
            dst, entries, source.fetch, aliases=source.aliases, save_overwrite=save_overwrite, make_progress=make_progress
        )
    if to == "dcp":
        # DCP has no aliases: tied tensors are written under every name, as a model's state_dict() has them.
        shapes = {key: (shape, code) for key, shape, code in entries}
        full = entries + [(alias, *shapes[target]) for alias, target in sorted(source.aliases.items())]
        return write_dcp(dst, full, source.fetch, save_overwrite=save_overwrite, make_progress=make_progress)
    tensors = select_tensors(entries, aliases=source.aliases, dtype=parse_dtype(dtype))
    plan = plan_export(tensors, single_file=str(dst).endswith(".safetensors"), max_shard_size=max_shard_size)
    return run_export(dst, plan, source.fetch, no_dist=True, make_progress=make_progress)
