"""fairseq2-style resharding: pure tensor functions, no ``torch.distributed`` calls.

:func:`reshard_tensor` turns the splits of one parameter saved under a ``(tp_size, dp_size)``
configuration into the piece one rank of another configuration needs. :func:`~checkpointer.sharding.get_shard_dims`
says along which dimension each parameter of a model is tensor-parallel. :func:`tp_bounds`
is the one definition of "the piece of TP rank ``r`` of ``n``" that both this module and
:func:`~checkpointer.tools.lazy.lazy_load` use: ``torch.chunk``'s, with empty pieces for
the ranks ``torch.chunk`` runs out before (as ``DTensor``'s ``Shard`` does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["reshard_tensor", "tp_bounds"]


def tp_bounds(size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The ``[start, end)`` of TP rank ``tp_rank``'s piece of a dimension of ``size``.

    Args:
        size: the length of the full dimension.
        tp_size: the number of pieces.
        tp_rank: which piece, ``0 <= tp_rank < tp_size``.

    Returns:
        ``torch.chunk(full, tp_size, dim)[tp_rank]``'s bounds; ``(size, size)`` (empty) for a
        rank past the last chunk ``torch.chunk`` returns.

    Example:
        ``tp_bounds(10, 4, 3) == (9, 10)`` and ``tp_bounds(6, 4, 3) == (6, 6)`` (chunks of 2).
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not a rank of tp_size {tp_size}")
    step = math.ceil(size / tp_size)
    start = min(tp_rank * step, size)
    return start, min(start + step, size)


def reshard_tensor(
    key: str,
    source_splits: Sequence[Sequence[Tensor]],
    source_shard_sizes: tuple[int, int],
    target_shard_sizes: tuple[int, int],
    target_shard_ranks: tuple[int, int],
    shard_dims: Mapping[str, int] | None,
) -> Tensor:
    """The piece of parameter ``key`` that one rank of the target configuration holds.

    Semantics are fairseq2's: ``source_splits[tp_idx][dp_idx]`` are the saved pieces, the
    data-parallel splits of each tensor-parallel shard being consecutive along dim 0.

    - The DP splits of a shard are concatenated along dim 0; the result is whole over DP
      (``target_shard_sizes[1]`` and the DP rank do not cut it: FSDP does that afterwards).
    - Replicated parameters (``key`` not in ``shard_dims``): the DP concatenation of
      ``source_splits[tp_rank]`` when the TP sizes match, else of ``source_splits[0]``.
    - TP parameters: the TP shards, concatenated along ``shard_dims[key]``, are cut into
      ``target_tp_size`` pieces like ``torch.chunk`` and piece ``tp_rank`` is returned (empty
      for a rank past the last chunk). When the TP sizes match, that is the source shard itself.

    Only the overlapping parts of the sources are copied, straight into the result (no
    full-tensor concatenation, whatever the sizes); when a single source split covers the
    target piece exactly, the result is a view of it, with no copy.

    Args:
        key: the parameter's name (looked up in ``shard_dims``; named in errors).
        source_splits: ``[tp_idx][dp_idx]`` source tensors.
        source_shard_sizes: ``(tp_size, dp_size)`` of the source.
        target_shard_sizes: ``(tp_size, dp_size)`` of the target.
        target_shard_ranks: ``(tp_rank, dp_rank)`` of this process in the target.
        shard_dims: parameter name -> TP dimension (as from :func:`get_shard_dims`).

    Returns:
        The target rank's tensor (may be a view of a source split).

    Raises:
        ValueError: the splits do not match the sizes, or their shapes do not line up.

    Example::

        w = torch.arange(32.0).view(8, 4)
        splits = [[w[:4]], [w[4:]]]                  # 2-way TP, 1-way DP, along dim 0
        reshard_tensor("w", splits, (2, 1), (4, 1), (2, 0), {"w": 0})   # == w[4:6]
    """
    src_tp, src_dp = source_shard_sizes
    tgt_tp, _ = target_shard_sizes
    tp_rank, _ = target_shard_ranks
    if len(source_splits) != src_tp or any(len(s) != src_dp for s in source_splits) or src_dp <= 0:
        raise ValueError(
            f"{key}: source_splits is {len(source_splits)} x {[len(s) for s in source_splits]}, "
            f"expected {src_tp} x {src_dp} (source_shard_sizes)"
        )
    if not 0 <= tp_rank < tgt_tp:
        raise ValueError(f"{key}: target tp_rank {tp_rank} is not a rank of tp_size {tgt_tp}")
    tp_dim = None if shard_dims is None else shard_dims.get(key)
    if tp_dim is None or src_tp == tgt_tp:
        return _cat_dim0(key, source_splits[tp_rank if src_tp == tgt_tp else 0])

    ndim = source_splits[0][0].dim()
    if not -ndim <= tp_dim < ndim or ndim == 0:
        raise ValueError(f"{key}: shard dim {tp_dim} is out of range for a {ndim}-d tensor")
    tp_dim %= ndim
    if tp_dim == 0:
        # All (tp, dp) splits in order tile dim 0.
        pieces = [s for shard in source_splits for s in shard]
        return _take(key, pieces, 0, tgt_tp, tp_rank)
    # DP splits tile dim 0 of each TP shard; TP shards tile dim ``tp_dim``.
    widths = [shard[0].size(tp_dim) for shard in source_splits]
    start, end = tp_bounds(sum(widths), tgt_tp, tp_rank)
    parts: list[tuple[int, list[Tensor]]] = []  # (offset along tp_dim in the result, DP splits narrowed)
    pos = 0
    for shard, width in zip(source_splits, widths):
        lo, hi = max(start, pos), min(end, pos + width)
        if hi > lo:
            parts.append((lo - start, [s.narrow(tp_dim, lo - pos, hi - lo) for s in shard]))
        pos += width
    if len(parts) == 1:
        return _cat_dim0(key, parts[0][1])
    ref = source_splits[0][0]
    rows = sum(s.size(0) for s in source_splits[0])
    shape = list(ref.shape)
    shape[0], shape[tp_dim] = rows, end - start
    out = ref.new_empty(shape)
    for offset, stack in parts:
        row = 0
        for s in stack:
            _check_rest(key, ref, s, (0, tp_dim))
            out.narrow(0, row, s.size(0)).narrow(tp_dim, offset, s.size(tp_dim)).copy_(s)
            row += s.size(0)
        if row != rows:
            raise ValueError(f"{key}: the TP shards have different sizes along dim 0 ({row} vs {rows})")
    return out


def _take(key: str, pieces: Sequence[Tensor], dim: int, tgt_tp: int, tp_rank: int) -> Tensor:
    """Piece ``tp_rank`` of ``tgt_tp`` of the concatenation of ``pieces`` along ``dim``, copying only it."""
    total = sum(p.size(dim) for p in pieces)
    start, end = tp_bounds(total, tgt_tp, tp_rank)
    ref = pieces[0]
    overlap: list[tuple[int, Tensor]] = []
    pos = 0
    for p in pieces:
        _check_rest(key, ref, p, (dim,))
        lo, hi = max(start, pos), min(end, pos + p.size(dim))
        if hi > lo:
            overlap.append((lo - start, p.narrow(dim, lo - pos, hi - lo)))
        pos += p.size(dim)
    if len(overlap) == 1 and overlap[0][1].size(dim) == end - start:
        return overlap[0][1]
    shape = list(ref.shape)
    shape[dim] = end - start
    out = ref.new_empty(shape)
    for offset, part in overlap:
        out.narrow(dim, offset, part.size(dim)).copy_(part)
    return out


def _cat_dim0(key: str, splits: Sequence[Tensor]) -> Tensor:
    if len(splits) == 1:
        return splits[0]
    if splits[0].dim() == 0:
        raise ValueError(f"{key}: cannot concatenate {len(splits)} DP splits of a 0-d tensor")
    for s in splits[1:]:
        _check_rest(key, splits[0], s, (0,))
    return torch.cat(list(splits), dim=0)


def _check_rest(key: str, ref: Tensor, t: Tensor, free: tuple[int, ...]) -> None:
    """Shapes must agree on every dimension but ``free``; dtypes must agree."""
    same = t.dim() == ref.dim() and all(a == b for d, (a, b) in enumerate(zip(ref.shape, t.shape)) if d not in free)
    if not same or t.dtype != ref.dtype:
        raise ValueError(
            f"{key}: splits {list(ref.shape)} {ref.dtype} and {list(t.shape)} {t.dtype} do not line up "
            f"(they may differ only along dims {list(free)})"
        )
