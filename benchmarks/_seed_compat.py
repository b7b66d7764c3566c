"""Run the seed, ai2-olmo-core 0.1.0's legacy checkpointer, on torch 2.13 (benchmark only).

Two small patches, applied by monkeypatching at import time in the benchmark's workers
(site-packages is never edited):

1. ``Shard._local_shard_size_on_dim(size, num_chunks, rank, return_offset=False)`` was
   renamed in torch; 2.13 has the static ``Shard.local_shard_size_and_offset(size,
   num_chunks, rank) -> (size, offset)``. OLMo's ``dtensor_utils`` calls the old name.
2. ``_unflatten_optimizer_state`` strips DTensor wrappers from the optimizer state it
   rebuilds (``_get_local_tensor_data``), so an FSDP2 optimizer would get plain local tensors
   for DTensor parameters and fail at its next step (and DCP's ``get_state_dict`` after it).
   The patch keeps DTensors as they are while that function runs.
"""

from __future__ import annotations

from typing import Any

_PATCHED = False


def seed_available() -> tuple[bool, str]:
    """Whether ai2-olmo-core 0.1.0 imports here, and if not, why."""
    try:
        import importlib.metadata as md

        version = md.version("ai2-olmo-core")
        import olmo_core.distributed.checkpoint  # noqa: F401
    except Exception as ex:  # noqa: BLE001 - reported in the table
        return False, f"ai2-olmo-core not importable: {type(ex).__name__}: {ex}"
    if version != "0.1.0":
        return False, f"ai2-olmo-core {version} installed, the seed is 0.1.0"
    return True, "ai2-olmo-core 0.1.0"


def patch_seed() -> Any:
    """Apply both patches (idempotent) and return the ``olmo_core.distributed.checkpoint`` module."""
    global _PATCHED
    from torch.distributed.tensor import DTensor, Shard

    import olmo_core.distributed.checkpoint as oc

    if _PATCHED:
        return oc

    if not hasattr(Shard, "_local_shard_size_on_dim"):

        def _local_shard_size_on_dim(size_on_dim: int, num_chunks: int, rank: int, return_offset: bool = False):
            size, offset = Shard.local_shard_size_and_offset(size_on_dim, num_chunks, rank)
            return (int(size), int(offset)) if return_offset else (int(size), -1)

        Shard._local_shard_size_on_dim = staticmethod(_local_shard_size_on_dim)  # type: ignore[attr-defined]

    original_unflatten = oc._unflatten_optimizer_state

    def _unflatten_keeping_dtensors(flat_optim_state):
        saved = oc._get_local_tensor_data
        oc._get_local_tensor_data = lambda t: t if isinstance(t, DTensor) else saved(t)
        try:
            return original_unflatten(flat_optim_state)
        finally:
            oc._get_local_tensor_data = saved

    oc._unflatten_optimizer_state = _unflatten_keeping_dtensors
    _PATCHED = True
    return oc
