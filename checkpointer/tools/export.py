"""Export a checkpoint as Hugging Face-style safetensors: one file, or size-bounded shards plus
``model.safetensors.index.json``. Streams: no process holds more than one tensor.

The recipe, on every rank of a process group (or one process alone):

1. Each rank reads ``metadata.json`` itself (it is small; no collective) and builds the same
   plan: the selected keys in metadata order, packed into output shards of at most
   ``max_shard_size`` bytes (a larger tensor gets a shard of its own). Each shard gets one
   writer rank: largest shard first, to the rank with the fewest bytes so far.
2. Each rank writes its own shards: the header first (shapes and offsets follow from the
   metadata), then tensor by tensor: read the whole tensor from the rank files (checksums
   checked where the checkpoint has them), cast, append, let go.
3. All ranks agree the shards exist (an error anywhere raises everywhere). A sharded export
   first retires an earlier export's index (rank 0, then an agreement): shards overwritten one
   by one never sit beside the old index, which would read them as one model with the old ones.
   A failed export removes the shards it wrote.
4. Rank 0 removes the shards of an earlier export that this one did not write, then writes the
   index last; all ranks agree again.

Tied parameters (``metadata.aliases``) are written once, under the saved name, as
``save_pretrained`` does; the index names only tensors that have data.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from .. import dist
from ..buffers import memoryview_of
from ..errors import CheckpointError
from ..format.dtypes import DTYPE_CODES, READABLE_CODES, code_from_dtype, dtype_from_code, itemsize
from ..format.layout import METADATA_FILENAME
from ..format.safetensors_header import DATA_ALIGNMENT, PREFIX_BYTES, RESERVED_KEY, check_header_size
from ..storage import open_storage
from .checkpoint_tensors import CheckpointTensors, Staging
from ..storage.base import Storage, Writer, path_arg
from ..storage.urls import split_path
from ..engine.load import read_metadata
from ..engine.locate import model_checkpoint

__all__ = [
    "export_safetensors",
    "run_export",
    "ExportTensor",
    "OutputShard",
    "ExportPlan",
    "plan_export",
    "select_tensors",
    "parse_size",
    "parse_dtype",
    "INDEX_NAME",
]

INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_FLOAT_CODES = {code for code, dt in READABLE_CODES.items() if dt.is_floating_point}  # what --dtype casts
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_DTYPE_NAMES = {
    "bf16": "BF16", "bfloat16": "BF16",
    "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
    "fp32": "F32", "f32": "F32", "float32": "F32", "float": "F32",
    "fp64": "F64", "f64": "F64", "float64": "F64", "double": "F64",
}  # fmt: skip

Fetch = Callable[[str], torch.Tensor]
"""Returns the full tensor saved under a key."""
"""Bytes read before the writer may take them. The writer waits for each tensor's first block
(the buffer is reused, so the next tensor's read starts only when this one is written): with
32 MiB blocks that wait cost 30 % of an export of 64 MiB tensors here."""


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000 (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE.fullmatch(str(size))
        if match is None:
            raise ValueError(f"cannot read {size!r} as a size: use bytes or a unit, e.g. 5GB, 500MB, 2GiB")
        unit = (match.group(2) or "").lower()
        base = _UNITS[unit[0]] if unit else 1
        if "i" in unit:
            base = 1024 ** "bkmgt".index(unit[0])
        value = int(float(match.group(1)) * base)
    if value <= 0:
        raise ValueError(f"max shard size must be positive, got {size!r}")
    return value


def parse_dtype(dtype: str | torch.dtype | None) -> str | None:
    """A dtype name (``bf16``, ``float16``, ``F32``...) or ``torch.dtype`` as a safetensors code."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"cannot cast floating-point tensors to {dtype}: use bf16, fp16, fp32 or fp64")
        return code_from_dtype(dtype)
    text = str(dtype).strip()
    if text.upper() in DTYPE_CODES and text.upper() in _FLOAT_CODES:
        return text.upper()
    name = text.lower().removeprefix("torch.")
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES[name]
    raise ValueError(f"unknown dtype {dtype!r}: use bf16, fp16, fp32 or fp64")


@dataclass(frozen=True)
class ExportTensor:
    """One tensor of the output: written as ``name``, read from the source's ``source`` key."""

    name: str
    source: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code in the output

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class OutputShard:
    name: str
    tensors: tuple[ExportTensor, ...]
    writer: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ExportPlan:
    shards: tuple[OutputShard, ...]
    single_file: bool

    def index_json(self) -> bytes:
        weight_map = {t.name: s.name for s in self.shards for t in s.tensors}
        total = sum(s.nbytes for s in self.shards)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        return (json.dumps(index, indent=2) + "\n").encode()


def select_tensors(
    entries: Iterable[tuple[str, Sequence[int], str]],
    *,
    aliases: dict[str, str] | None = None,
    keys: str | re.Pattern[str] | Iterable[str] | None = None,
    dtype: str | None = None,
    where: str = "",
) -> list[ExportTensor]:
    """The tensors to write, in ``entries`` order: ``(key, shape, dtype_code)`` filtered by the
    regular expression ``keys`` (``re.search`` on each name). A tied tensor is written once, under
    its saved key, or under its first matching alias when only aliases match. Floating-point
    tensors are cast to ``dtype`` when given; others keep theirs. ``keys`` may instead be a
    collection of exact names, each of which must be in ``entries`` or ``aliases``."""
    entries = list(entries)
    if keys is not None and not isinstance(keys, (str, re.Pattern)):
        names = set(keys)
        known = {key for key, _, _ in entries} | set(aliases or {})
        unknown = sorted(map(str, names - known))
        if unknown:
            raise ValueError(f"keys not in the checkpoint{where}: {unknown}")
        wanted = names.__contains__
    else:
        try:
            pattern = re.compile(keys) if isinstance(keys, str) else keys
        except re.error as ex:
            raise ValueError(f"--keys {keys!r} is not a valid regular expression: {ex}") from None
        wanted = (lambda name: True) if pattern is None else (lambda name: pattern.search(name) is not None)
    aliases_of: dict[str, list[str]] = {}
    for alias, target in sorted((aliases or {}).items()):
        aliases_of.setdefault(target, []).append(alias)
    out = []
    for key, shape, code in entries:
        name = key if wanted(key) else next((a for a in aliases_of.get(key, ()) if wanted(a)), None)
        if name is None:
            continue
        if name == RESERVED_KEY:  # a DCP key may be anything
            raise CheckpointError(f"cannot write the tensor {name!r}{where}: safetensors reserves the name for a file's own metadata")
        out_code = dtype if dtype is not None and code in _FLOAT_CODES else code
        out.append(ExportTensor(name, key, tuple(shape), out_code))
    return out


def plan_export(
    tensors: Sequence[ExportTensor], *, single_file: bool, max_shard_size: int | str = "5GB", world_size: int = 1
) -> ExportPlan:
    """Pack ``tensors`` in order into shards of at most ``max_shard_size`` bytes and give each a writer."""
    if not tensors:
        raise ValueError("nothing to export: no tensor is selected")
    limit = parse_size(max_shard_size)  # checked for one file too, where it does not apply
    groups: list[list[ExportTensor]] = []
    if single_file:
        groups = [list(tensors)]
    else:
        size = 0
        for t in tensors:
            if not groups or (groups[-1] and size + t.nbytes > limit):
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += t.nbytes
    n = len(groups)
    sizes = [sum(t.nbytes for t in g) for g in groups]
    load = [0] * world_size
    writer = [0] * n
    for i in sorted(range(n), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        writer[i] = rank
        load[rank] += sizes[i]
    shards = tuple(
        OutputShard("" if single_file else f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g), writer[i])
        for i, g in enumerate(groups)
    )
    return ExportPlan(shards, single_file)


def shaped_header(tensors: Sequence[ExportTensor], *, user_metadata: dict[str, str] | None = None) -> bytes:
    """Safetensors header bytes (length prefix included) for full tensors, laid out in order.

    Like :func:`~checkpointer.format.safetensors_header.build_header`, with real shapes
    instead of flat pieces; the data area starts on a 64-byte boundary.
    """
    header: dict[str, Any] = {"__metadata__": user_metadata} if user_metadata else {}
    pos = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(PREFIX_BYTES + len(text)) // DATA_ALIGNMENT) * DATA_ALIGNMENT - PREFIX_BYTES
    check_header_size(padded, len(tensors))
    text += b" " * (padded - len(text))
    return struct.pack("<Q", len(text)) + text


def _write_tensor(writer: Writer, t: ExportTensor, fetch: Fetch, staging: Staging) -> None:
    """Write one tensor; from this library's checkpoints, while the rest of it is still being read."""
    source = getattr(fetch, "__self__", None)
    target = dtype_from_code(t.dtype)
    if isinstance(source, CheckpointTensors) and source.metadata.tensors[
        (source.metadata.aliases or {}).get(t.source, t.source)
    ].dtype == t.dtype:
        data, ready = source.fetch_streaming(t.source)
        if tuple(data.shape) != t.shape:
            raise ValueError(f"tensor {t.source!r} came back as {list(data.shape)}, expected {list(t.shape)}")
        view = memoryview_of(data.view(-1))
        written = 0
        for upto in ready:
            writer.write([view[written:upto]])
            written = upto
        return
    data = fetch(t.source)
    if tuple(data.shape) != t.shape:
        raise ValueError(f"tensor {t.source!r} came back as {list(data.shape)}, expected {list(t.shape)}")
    if data.dtype != target:
        data = staging.take(t.shape, target).copy_(data)
    data = data.detach().cpu().contiguous().view(-1)
    writer.write([memoryview_of(data)])


def _write_shard(storage: Storage, name: str, shard: OutputShard, fetch: Fetch, bar: Any, staging: Staging) -> str:
    header = shaped_header(shard.tensors, user_metadata={"format": "pt"})
    with storage.open_writer(name) as writer:
        writer.expect_bytes(len(header) + shard.nbytes, 0)  # every byte is copied: see LocalWriter
        writer.write([memoryview(header)])
        for t in shard.tensors:
            _write_tensor(writer, t, fetch, staging)
            if bar is not None:
                bar.advance(t.nbytes, 1)
        writer.commit()
    return storage.join(name)


def run_export(
    out: str | Storage,
    plan: ExportPlan,
    fetch: Fetch,
    *,
    no_dist: bool = False,
    make_progress: Callable[[int, int], Any] | None = None,
    prepared_error: BaseException | None = None,
) -> list[str]:
    """Steps 2-4 of the recipe for a plan every rank built alike. Returns this rank's files.

    ``out`` is the output file (single-file plans) or directory. ``prepared_error`` is a failure
    of this rank while planning, brought to the first agreement so that no rank waits alone.
    """
    rank = 0 if no_dist else dist.get_rank()
    files: list[str] = []

    def write_mine() -> Storage:
        if prepared_error is not None:
            raise prepared_error
        if plan.single_file:
            parent, filename = split_path(str(out))
            storage = open_storage(parent)
        else:
            storage, filename = open_storage(out), ""
        storage.prepare()
        mine = [s for s in plan.shards if s.writer == rank]
        bar = make_progress(sum(s.nbytes for s in mine), sum(len(s.tensors) for s in mine)) if make_progress else None
        staging = Staging()
        try:
            for shard in mine:
                files.append(_write_shard(storage, filename or shard.name, shard, fetch, bar, staging))
        finally:
            if bar is not None:
                bar.close()
        return storage

    if not plan.single_file:
        with dist.phase("export", no_dist=no_dist):
            if rank == 0 and prepared_error is None:
                open_storage(out).delete(INDEX_NAME)
    # One rank may write for much longer than another (a single file is all rank 0's work).
    written = False
    try:
        storage = dist.agree_after(write_mine, "export", no_dist=no_dist)
        written = True
    finally:
        if not written:
            _remove(files)
    if plan.single_file:
        return files
    with dist.phase("export index", no_dist=no_dist):
        if rank == 0:
            written = {s.name for s in plan.shards}
            for name in storage.list():
                if (_SHARD_NAME.fullmatch(name) or name == "model.safetensors") and name not in written:
                    storage.delete(name)
            storage.write(INDEX_NAME, plan.index_json())
            files.append(storage.join(INDEX_NAME))
    return files


def _remove(files: list[str]) -> None:
    """The shards a failed export wrote: left, they would read as a model missing the rest."""
    for url in files:
        parent, name = split_path(url)
        try:
            open_storage(parent).delete(name)
        except OSError:
            pass  # the export's own error is the one raised


def export_checkpoint(
    dir: str | Storage,
    out: str,
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    keys: str | re.Pattern[str] | Iterable[str] | None = None,
    no_dist: bool = False,
    make_progress: Callable[[int, int], Any] | None = None,
) -> list[str]:
    """:func:`export_safetensors`, with a progress bar factory ``make_progress(bytes, tensors)``."""
    out = path_arg(out, "output path")
    world = 1 if no_dist else dist.get_world_size()
    def prepare() -> tuple[ExportPlan, Fetch]:
        storage = model_checkpoint(open_storage(dir))
        metadata = read_metadata(storage, no_dist=True)
        _refuse_own_file(out, storage, [*metadata.files(), METADATA_FILENAME])
        source = CheckpointTensors(storage, metadata, reuse_memory=True)
        tensors = select_tensors(
            source.entries(), aliases=metadata.aliases, keys=keys, dtype=parse_dtype(dtype), where=f" at {storage.url}"
        )
        if not tensors:
            raise ValueError(f"no tensor of {storage.url} matches --keys {getattr(keys, 'pattern', keys)!r}")
        plan = plan_export(tensors, single_file=str(out).endswith(".safetensors"), max_shard_size=max_shard_size, world_size=world)
        return plan, source.fetch

    prepared, error = dist.attempt(prepare)  # brought to the agreement in run_export
    plan, fetch = prepared or (ExportPlan((), True), _unplanned)
    return run_export(out, plan, fetch, no_dist=no_dist, make_progress=make_progress, prepared_error=error)


def _refuse_own_file(out: str, storage: Storage, names: Sequence[str]) -> None:
    """An output file that is one of the checkpoint's would be written over while it is read."""
    if not str(out).endswith(".safetensors"):
        return
    parent, name = split_path(out)
    if name not in names:
        return
    if open_storage(parent).place() == storage.place():
        raise CheckpointError(f"{out} is a file of the checkpoint it would export ({storage.url}): write it elsewhere")


def _unplanned(key: str) -> torch.Tensor:
    raise AssertionError("export was not planned")


def export_safetensors(
    dir: str,
    out: str,
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    keys: str | re.Pattern[str] | Iterable[str] | None = None,
) -> list[str]:
    """Write a checkpoint's model tensors as Hugging Face safetensors, streaming one tensor at a time.

    Args:
        dir: a checkpoint directory, or the top-level directory of
            :func:`~checkpointer.save_model_and_optim_state` (its ``model/`` is exported).
        out: a path or URL ending in ``.safetensors`` for one file; otherwise a directory that
            gets ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``.
        max_shard_size: the most bytes per shard (``"5GB"``, ``"500MB"``, ``"2GiB"`` or an int); a
            larger tensor gets a shard of its own. Checked, but not used, for a single file.
        dtype: cast floating-point tensors to it (``"bf16"``, ``torch.float16``...).
        keys: a regular expression; only tensors whose name it matches (``re.search``) are written.
            Or a list (any collection) of names: exactly those are written; a name that is not in
            the checkpoint raises ``ValueError``.

    Returns:
        The files this process wrote. Called on every rank of a process group (e.g. under
        ``torchrun``), the shards are divided among the ranks and written in parallel.

    Example::

        export_safetensors("ckpt/step1000", "hf_out/", max_shard_size="2GB", dtype="bf16")
        model = AutoModelForCausalLM.from_pretrained("hf_out/")   # with a config.json beside it
    """
    return export_checkpoint(dir, out, max_shard_size=max_shard_size, dtype=dtype, keys=keys)
