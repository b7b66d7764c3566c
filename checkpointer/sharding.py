"""What a local tensor holds of its full tensor: the only module that knows DTensor and FSDP types.

:func:`describe` turns a state-dict value into a :class:`LocalTensor`: the local memory to
write from or read into, the full shape, and the :class:`~checkpointer.planning.plan.Piece`
of the full tensor that memory holds. Values may be plain tensors (replicated), DTensors
(``Shard(d)`` on any dim and ``Replicate`` over any mesh, and ``_StridedShard``, which FSDP2
uses over tensor parallelism), :class:`FlatShardedTensor`, or OLMo-core's ``ShardedFlatTensor``.

A DTensor's local tensor is a box of the full tensor for ``Shard``/``Replicate`` placements.
With ``_StridedShard`` its indices along a dim may be several runs (interleaved rows); such a
local tensor is described by the exact flattened ranges it holds, in its own row-major order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from collections.abc import Iterable, Mapping
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .errors import CheckpointError
from .format.dtypes import code_from_dtype
from .format.layout import CHECKSUMS_KEY
from .format.safetensors_header import RESERVED_KEY
from .planning.overlap import Range
from .planning.layouts import runs_piece
from .planning.pieces import Piece

try:  # torch's own type, not a Shard subclass: ``isinstance(_StridedShard(0, split_factor=2), Shard)`` is False
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch builds without it
    _StridedShard = None  # type: ignore[assignment,misc]

__all__ = [
    "FlatShardedTensor", "LocalTensor", "describe", "describe_state_dict", "dtensor_box", "dtensor_index_runs",
    "runs_piece", "with_sharding_of", "local_data", "get_shard_dims",
]


@dataclass(frozen=True)
class FlatShardedTensor:
    """A local 1-D piece of a larger tensor: ``local`` holds elements ``flattened_offsets``
    (``[start, end)`` ranges of the row-major flattened full tensor of ``shape``), back to back.

    Example: rank 1 of 2 holding the second half of a 4x4 tensor::

        FlatShardedTensor(local=torch.empty(8), shape=(4, 4), flattened_offsets=((8, 16),))
    """

    local: torch.Tensor
    shape: tuple[int, ...]
    flattened_offsets: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        numel = sum(e - s for s, e in self.flattened_offsets)
        if self.local.numel() != numel:
            raise ValueError(f"local tensor has {self.local.numel()} elements, offsets describe {numel}")

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype


@dataclass(frozen=True)
class LocalTensor:
    """One state-dict value as the engine sees it."""

    data: torch.Tensor  # local memory, any device; read into / written from in place
    shape: tuple[int, ...]  # full tensor
    dtype: str
    is_sharded: bool
    piece: Piece
    layout: tuple | None = None
    """How every rank's piece follows from the shape (:mod:`~checkpointer.planning.layouts`):
    ``()`` whole on every rank, ``(mesh_shape, placements)`` for a DTensor over all ranks in
    order; ``None`` when not known (flat-sharded values, other meshes)."""

    @property
    def numel(self) -> int:
        return self.piece.numel


@dataclass(frozen=True)
class _SameShardingAs:
    """A local tensor laid out like another value's local tensor (optimizer state of a sharded param)."""

    local: torch.Tensor
    like: LocalTensor


def with_sharding_of(local: torch.Tensor, param: Any) -> Any:
    """Wrap ``local`` so it is described with the sharding of ``param``'s local tensor."""
    return _SameShardingAs(local, describe(param))


def local_data(value: Any) -> torch.Tensor:
    """The local tensor memory of a state-dict value."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, (FlatShardedTensor, _SameShardingAs)):
        return value.local
    if _is_olmo_flat(value):
        return value.sharded_data
    if isinstance(value, nn.Parameter):
        return value.data
    return value


def describe(value: Any) -> LocalTensor:
    if isinstance(value, DTensor):
        local = value.to_local()
        shape = tuple(value.shape)
        coord = value.device_mesh.get_coordinate()
        if coord is None:
            return LocalTensor(local, shape, code_from_dtype(value.dtype), True, Piece(flat=()))
        mesh_sizes = [value.device_mesh.size(i) for i in range(value.device_mesh.ndim)]
        if all(type(p) is Shard or isinstance(p, Replicate) for p in value.placements):
            sizes, offsets = dtensor_box(shape, value.placements, mesh_sizes, coord)
            piece = Piece(local_shape=sizes, global_offset=offsets)
        else:  # remembered for the placements it knows; others are refused by name, uncached
            known = all(isinstance(p, (Shard, Replicate)) or (_StridedShard and isinstance(p, _StridedShard)) for p in value.placements)
            find = _strided_piece if known else _strided_piece.__wrapped__
            sizes, piece = find(shape, tuple(value.placements), value.device_mesh, tuple(mesh_sizes), tuple(coord))
        if tuple(local.shape) != sizes:
            raise ValueError(f"DTensor local shape {tuple(local.shape)} is not the expected {sizes} for {value.placements}")
        layout = _layout(value.device_mesh, value.placements, mesh_sizes)
        return LocalTensor(local, shape, code_from_dtype(value.dtype), True, piece, layout)
    if isinstance(value, FlatShardedTensor):
        return LocalTensor(
            value.local, tuple(value.shape), code_from_dtype(value.local.dtype), True, Piece(flat=tuple(map(tuple, value.flattened_offsets)))
        )
    if isinstance(value, _SameShardingAs):
        like = value.like
        if value.local.numel() != like.data.numel():
            raise ValueError("state tensor does not match its parameter's local shard")
        return LocalTensor(value.local, like.shape, code_from_dtype(value.local.dtype), like.is_sharded, like.piece, like.layout)
    if _is_olmo_flat(value):
        return _describe_olmo_flat(value)
    if isinstance(value, torch.Tensor):
        data = value.data if isinstance(value, nn.Parameter) else value
        return LocalTensor(data, tuple(data.shape), code_from_dtype(data.dtype), False, Piece.whole(data.shape), ())
    raise TypeError(f"cannot checkpoint a value of type {type(value).__name__}")


_ORDERED_MESHES: dict[int, tuple[Any, bool]] = {}


def _layout(mesh: Any, placements: Sequence[Any], mesh_sizes: list[int]) -> tuple | None:
    """A DTensor's layout for :mod:`~checkpointer.planning.layouts`: ``(mesh shape, placements)``
    when its mesh numbers ranks ``0..n-1`` in row-major order, else ``None``."""
    seen = _ORDERED_MESHES.get(id(mesh))
    if seen is None or seen[0] is not mesh:
        ranks = mesh.mesh.flatten()
        if len(_ORDERED_MESHES) > 64:
            _ORDERED_MESHES.clear()
        seen = _ORDERED_MESHES[id(mesh)] = (mesh, ranks.tolist() == list(range(ranks.numel())))
    if not seen[1]:
        return None
    codes: list[tuple] = []
    for p in placements:
        if type(p) is Shard:
            codes.append(("S", p.dim))
        elif isinstance(p, Replicate):
            codes.append(("R",))
        elif _StridedShard is not None and isinstance(p, _StridedShard):
            codes.append(("T", p.dim, int(p.split_factor)))
        else:
            return None
    return (tuple(mesh_sizes), tuple(codes))


def dtensor_box(
    shape: Sequence[int], placements: Sequence[Any], mesh_sizes: Sequence[int], coord: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box a mesh coordinate holds: ``Shard(d)`` splits dim ``d`` like ``torch.chunk``, in mesh-dim order."""
    sizes, offsets = list(shape), [0] * len(shape)
    for placement, n, c in zip(placements, mesh_sizes, coord):
        if type(placement) is Shard:
            d = placement.dim
            chunk = math.ceil(sizes[d] / n) if n else 0
            start = min(c * chunk, sizes[d])
            end = min(start + chunk, sizes[d])
            offsets[d] += start
            sizes[d] = end - start
        elif not isinstance(placement, Replicate):
            raise TypeError(f"placement {placement} is not supported in checkpoints (use Shard or Replicate)")
    return tuple(sizes), tuple(offsets)


def dtensor_index_runs(
    shape: Sequence[int], placements: Sequence[Any], mesh_sizes: Sequence[int], coord: Sequence[int]
) -> list[list[Range]]:
    """Per dim of the full tensor, the global indices a mesh coordinate holds, in local order,
    as ``[start, end)`` runs.

    Placements apply left to right over the mesh dims, each to what the previous ones left
    (as ``distribute_tensor`` and torch's ``compute_local_shape_and_global_offset`` do):

    - ``Shard(d)``: chunk ``c`` of ``n`` of the current indices of dim ``d``, like ``torch.chunk``.
    - ``_StridedShard(d, split_factor=f)``: the current indices are cut into ``f`` chunks, each
      of those into ``n`` chunks, and chunk ``c`` of each is kept, in order (FSDP2 over tensor
      parallelism: the TP split that happens after it on the mesh is applied first in effect).
    - ``Replicate``: nothing.

    Example: ``_StridedShard(0, split_factor=2)`` then ``Shard(0)`` on a 2x2 mesh, 8 rows:
    coordinate ``(1, 0)`` holds rows ``[2, 4)``; ``Shard(0)`` then ``_StridedShard(0,
    split_factor=2)`` gives ``(0, 1)`` rows 1 and 3: ``[[(1, 2), (3, 4)], ...]``.
    """
    runs: list[list[Range]] = [[(0, n)] for n in shape]
    for placement, n, c in zip(placements, mesh_sizes, coord):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Partial):
            raise TypeError(f"placement {placement} holds partial sums, not values: reduce it before saving")
        if type(placement) is Shard:
            d = placement.dim
            runs[d] = _take(runs[d], *_chunk(_count(runs[d]), n, c))
        elif _StridedShard is not None and isinstance(placement, _StridedShard):
            d, f = placement.dim, int(placement.split_factor)
            size, kept = _count(runs[d]), []
            for j in range(f):
                start, end = _chunk(size, f, j)
                lo, hi = _chunk(end - start, n, c)
                kept += _take(runs[d], start + lo, start + hi)
            runs[d] = kept
        else:
            raise TypeError(f"placement {placement} is not supported in checkpoints (use Shard or Replicate)")
    return runs


@functools.lru_cache(maxsize=4096)
def _strided_piece(shape: tuple[int, ...], placements: tuple, mesh: Any, mesh_sizes: tuple[int, ...], coord: tuple[int, ...]) -> tuple[tuple[int, ...], Piece]:
    """Placements beyond Shard/Replicate: the exact indices held (see :func:`dtensor_index_runs`),
    cross-checked against the local shape torch computes (remembered: a millisecond a tensor)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    runs = dtensor_index_runs(shape, placements, mesh_sizes, coord)
    sizes = tuple(_count(r) for r in runs)
    torch_sizes, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, list(placements))
    if tuple(torch_sizes) != sizes:
        raise ValueError(
            f"DTensor placements {placements} on mesh {tuple(mesh_sizes)} at {tuple(coord)}: torch says the local "
            f"shape is {tuple(torch_sizes)}, the checkpointer's reading of the placements gives {sizes}; refusing to guess"
        )
    return sizes, runs_piece(shape, runs)


def _chunk(size: int, n: int, c: int) -> tuple[int, int]:
    """``[start, end)`` of chunk ``c`` of ``n`` of ``size`` like ``torch.chunk`` (empty past the last)."""
    step = -(-size // n) if n else 0
    start = min(c * step, size)
    return start, min(start + step, size)


def _count(runs: Sequence[Range]) -> int:
    return sum(e - s for s, e in runs)


def _take(runs: Sequence[Range], start: int, end: int) -> list[Range]:
    """Positions ``[start, end)`` of the indices the runs list, back to back, as runs."""
    out: list[Range] = []
    pos = 0
    for s, e in runs:
        lo, hi = max(start, pos), min(end, pos + e - s)
        if hi > lo:
            out.append((s + lo - pos, s + hi - pos))
        pos += e - s
    return out


def _is_olmo_flat(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and hasattr(value, "sharding_spec") and hasattr(value, "sharded_data")


def _describe_olmo_flat(value: Any) -> LocalTensor:
    import torch.distributed as dist

    spec = value.sharding_spec
    group = getattr(value, "process_group", None)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    offsets = tuple(tuple(r) for r in spec.unsharded_flattened_offsets[rank])
    data = value.sharded_data
    return LocalTensor(data, tuple(spec.unsharded_shape), code_from_dtype(data.dtype), True, Piece(flat=offsets))


def fsdp1_flat_views(model: nn.Module) -> dict[nn.Parameter, FlatShardedTensor]:
    """For an FSDP1 model with ``use_orig_params=True``: each original parameter's local flat piece.

    FSDP1 exposes no public API for this, so this one function reads the flat parameter's
    ``_shard_param_infos``; keep every private access here.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out: dict[nn.Parameter, FlatShardedTensor] = {}
    for module in model.modules():
        if not isinstance(module, FSDP):
            continue
        handle = getattr(module, "_handle", None)
        if handle is None or not handle.uses_sharded_strategy:
            continue
        if not handle._use_orig_params:
            raise TypeError("FSDP1 models must use use_orig_params=True")
        flat = handle.flat_param
        for param, shape, info in zip(flat._params, flat._shapes, flat._shard_param_infos):
            if info.in_shard:
                ranges: tuple[tuple[int, int], ...] = ((info.intra_param_start_idx, info.intra_param_end_idx + 1),)
            else:
                ranges = ()
            out[param] = FlatShardedTensor(param.data.view(-1), tuple(shape), ranges)
    return out


# ---------------------------------------------------------------------------------------
# Which dimension of each parameter tensor parallelism splits (for lazy_load)
# ---------------------------------------------------------------------------------------


def get_shard_dims(model: nn.Module) -> dict[str, int]:
    """The tensor-parallel dimension of each parameter of ``model`` that has one.

    Two sources, the second winning where both speak:

    - Parameters (and buffers) that are ``DTensor``s with a ``Shard(d)`` placement on a
      tensor-parallel mesh dimension: ``d``. Under FSDP2 (``fully_shard``), FSDP's own
      leading mesh dimensions (any ``Replicate`` of HSDP, then FSDP's shard placement) are
      data parallel and skipped; the ``Shard`` after them is tensor parallel. FSDP's shard
      placement is ``Shard(0)``, or ``_StridedShard(0, split_factor=tp)`` where the TP
      placement shards dim 0 too; ``_StridedShard`` is a placement type of its own in torch,
      not a ``Shard`` subclass. A ``_StridedShard`` after FSDP's dims is not a ``torch.chunk``
      split, so it gives no TP dim.
    - Modules that declare ``get_shard_dims()`` themselves, returning a mapping (or pairs)
      of their own parameter names to dims; names are prefixed with the module's path.

    Replicated parameters are omitted, as :func:`reshard_tensor` and ``lazy_load`` expect.

    Args:
        model: any ``nn.Module``.

    Returns:
        ``{state-dict key: dim}``.

    Example::

        parallelize_module(model, tp_mesh, {"proj": ColwiseParallel()})
        get_shard_dims(model)     # {"proj.weight": 0, "proj.bias": 0}
    """
    from torch.distributed.tensor import DTensor

    fsdp_module = _fsdp_module_class()
    out: dict[str, int] = {}
    declared: dict[str, int] = {}
    under_fsdp: dict[str, bool] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        parent = prefix.rpartition(".")[0]
        fsdp = (fsdp_module is not None and isinstance(module, fsdp_module)) or (
            bool(prefix) and under_fsdp.get(parent, False)
        )
        under_fsdp[prefix] = fsdp
        for name, value in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if isinstance(value, DTensor):
                dim = _tp_dim(value.placements, skip_fsdp=fsdp)
                if dim is not None:
                    out[_join(prefix, name)] = dim
        own = getattr(type(module), "get_shard_dims", None)
        if callable(own):
            declared.update({_join(prefix, k): int(d) for k, d in _pairs(module.get_shard_dims())})
    out.update(declared)
    return out


def _pairs(value: Mapping[str, int] | Iterable[tuple[str, int]]) -> Iterable[tuple[str, int]]:
    return value.items() if isinstance(value, Mapping) else value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    return FSDPModule


def _tp_dim(placements: Sequence[Any], *, skip_fsdp: bool) -> int | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    i = 0
    if skip_fsdp:
        while i < len(placements) and isinstance(placements[i], Replicate):
            i += 1  # HSDP's replicate dims
        # FSDP's shard dim: Shard, or _StridedShard over TP (its own type: not an instance of Shard).
        if i < len(placements) and isinstance(placements[i], (Shard, _StridedShard)):
            i += 1
    dims = [p.dim for p in placements[i:] if type(p) is Shard]
    return dims[-1] if dims else None


def describe_state_dict(
    state_dict: Mapping[str, Any], *, action: str = "save"
) -> tuple[dict[str, LocalTensor], dict[str, str]]:
    """Describe every value; a value sharing memory with an earlier key becomes an alias of it."""
    described: dict[str, LocalTensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"state dict keys must be strings, got {key!r}")
        if key in (RESERVED_KEY, CHECKSUMS_KEY):
            raise CheckpointError(f"cannot {action} {key!r}: safetensors reserves the name for a file's own metadata")
        try:
            lt = describe(value)
        except (TypeError, ValueError) as ex:
            raise CheckpointError(f"cannot {action} {key!r}: {ex}") from ex
        data = lt.data
        if data.device.type == "meta":
            raise CheckpointError(
                f"cannot {action} {key!r}: it is on the meta device and holds no data "
                "(materialise the model first, e.g. model.to_empty(device=...))"
            )
        if data.layout != torch.strided:
            raise CheckpointError(f"cannot {action} {key!r}: it is a {data.layout} tensor (save its .to_dense())")
        if data.is_neg() or data.is_conj():  # a lazy view: its memory holds other values than it reads as
            if action != "save":
                raise CheckpointError(f"cannot {action} into {key!r}: it is a negated or conjugated view "
                                      "(torch's lazy .conj(), .imag of one): pass the tensor it views")
            lt = replace(lt, data=data.resolve_conj().resolve_neg())
            data = lt.data
        if data.numel() > 0:
            ident = (data.device, data.data_ptr(), tuple(data.shape), tuple(data.stride()), data.dtype, lt.shape, lt.piece)
            if ident in seen:
                aliases[key] = seen[ident]
                continue
            seen[ident] = key
        described[key] = lt
    return described, aliases
