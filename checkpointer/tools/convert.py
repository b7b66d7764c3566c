"""``convert SRC DST --to FORMAT``: between this library's checkpoints, torch DCP and Hugging Face safetensors.

``--to olmo`` writes a checkpoint of this library in the verbose form of format 1, which
ai2-olmo-core 0.1.0 reads (:mod:`~checkpointer.tools.olmo`): the rank files are copied as they are.

The source's format is detected; every conversion streams one tensor at a time. A checkpoint
of this library converted to ``hf`` is :func:`~checkpointer.export_safetensors`, which spreads
the shards over the ranks of a process group. The other conversions run on rank 0 while the
other ranks wait for its result, however long it takes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import dist
from .detect import detect, open_source
from .export import export_checkpoint, parse_dtype, plan_export, run_export, select_tensors
from ..engine.locate import checkpoint_parts
from ..errors import CheckpointError
from ..storage import open_storage
from ..storage.base import path_arg
from .dcp import write_dcp
from .olmo import write_olmo
from .ours import write_checkpoint

__all__ = ["FORMATS", "TARGETS", "detect_format", "convert"]

FORMATS = ("checkpointer", "dcp", "hf")
"""The formats convert reads (and writes)."""
TARGETS = (*FORMATS, "olmo")
"""The formats convert writes: ``olmo`` only from a checkpoint of this library."""


def detect_format(src: str) -> str:
    """``"checkpointer"``, ``"dcp"`` or ``"hf"``, from what ``src`` holds (the tools' one detector,
    :func:`~checkpointer.tools.detect.detect`, less the formats convert does not read)."""
    cls, where = detect(src)
    if cls.format not in FORMATS and where.name is None:
        raise CheckpointError(f"{where.shown} holds torch pickles, which convert does not read (lazy_load does)")
    if cls.format not in FORMATS:
        raise CheckpointError(
            f"cannot tell the format of {where.shown}: it is a file; expected a directory "
            "(checkpointer, torch DCP, Hugging Face) or a .safetensors file"
        )
    return cls.format


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
        to: ``"checkpointer"``, ``"dcp"``, ``"hf"`` or ``"olmo"`` (format 1, which OLMo-core 0.1.0
            reads; from a checkpoint of this library, or a top-level directory of one).
        allow_pickle: needed to read a DCP source, whose ``.metadata`` is a pickle.
        max_shard_size, dtype: for ``hf`` output, as for :func:`~checkpointer.export_safetensors`.
        save_overwrite: replace a checkpoint already in ``dst`` (``checkpointer``, ``dcp`` and ``olmo``).
        notes: called with one-line remarks (entries that were not converted).
    """
    if to not in TARGETS:
        raise ValueError(f"unknown target format {to!r}; expected one of {TARGETS}")
    src, dst = path_arg(src, "source"), path_arg(dst, "destination")
    if not src.strip() or not dst.strip():
        raise ValueError("the path is empty (write '.' for the current directory)")
    if not src.startswith("hf://") and open_storage(src).place() == open_storage(dst).place():
        # with save_overwrite, the source's own metadata.json would go before it is read
        raise CheckpointError(f"convert writes a new checkpoint: {dst} is the source itself")
    fmt: str | None = None
    error: BaseException | None = None
    if dist.get_rank() == 0:
        fmt, error = dist.attempt(lambda: detect_format(src))
    dist.agree(error, "convert")
    fmt = dist.broadcast_bytes(fmt.encode() if fmt else None).decode() if dist.is_distributed() else fmt
    if fmt == "checkpointer" and to == "hf":
        return export_checkpoint(src, dst, max_shard_size=max_shard_size, dtype=dtype, make_progress=make_progress)
    assert fmt is not None
    if to == "olmo" and fmt != "checkpointer":
        raise CheckpointError(
            f"--to olmo converts checkpoints of this library (or of OLMo-core); {src} holds a {fmt} one: "
            "convert it --to checkpointer first"
        )

    def alone() -> list[str]:
        if dist.get_rank() != 0:
            return []
        return _convert_alone(fmt, src, dst, to, allow_pickle, max_shard_size, dtype, save_overwrite, make_progress, notes)

    return dist.agree_after(alone, "convert")


def _convert_alone(fmt, src, dst, to, allow_pickle, max_shard_size, dtype, save_overwrite, make_progress, notes) -> list[str]:
    if to == "olmo":
        return write_olmo(src, dst, save_overwrite=save_overwrite, make_progress=make_progress)
    source = open_source(src, allow_pickle=allow_pickle)
    if source.format != fmt:
        raise CheckpointError(f"{src} changed while it was converted: it held a {fmt} checkpoint, now a {source.format} one")
    if fmt == "checkpointer" and notes is not None and "optim" in dict(checkpoint_parts(open_storage(src))):
        notes(f"only the model is converted: the optimizer state in {open_storage(src).join('optim')} is not")
    skipped = source.skipped
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
