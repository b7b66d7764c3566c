"""Run as a program by the ``hf://`` tests: a fresh process (``huggingface_hub`` reads
``HF_ENDPOINT`` and ``HF_HOME`` when it is imported), alone or as ``WORLD`` gloo ranks.

``python hub_workers.py MODE URL OUT WORLD``:

- ``load``: our GPT-2 (under FSDP2 when ``WORLD > 1``) filled from ``URL`` with ``key_map``;
- ``load_skip``: the same, block 1 skipped by the ``key_map`` (``strict=False``);
- ``lazy``: ``lazy_load(URL)`` in this process.

Rank 0 writes the full tensors by Hugging Face names (and the load's missing keys) to ``OUT``
(``torch.save``).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch


def _key_map(mode: str):
    from hf_helpers import gpt2_key_map

    if mode == "load_skip":
        return lambda k: None if ".h.1." in k else gpt2_key_map(k)
    return gpt2_key_map


def _rank(rank: int, world: int, mode: str, url: str, out: str, init: str) -> None:
    from hf_helpers import OwnGPT2, own_to_hf, zero_

    from checkpointer import lazy_load, load_model_and_optim_state

    if mode == "lazy":
        torch.save({"tensors": dict(lazy_load(url)), "missing": []}, out)
        return
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        model = zero_(OwnGPT2())
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = zero_(OwnGPT2())
    result = load_model_and_optim_state(url, model, key_map=_key_map(mode), strict=mode != "load_skip")
    state = {}
    for k, v in model.state_dict().items():
        state[k] = v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
    if rank == 0:
        torch.save({"tensors": own_to_hf(state), "missing": result.missing_keys}, out)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    mode, url, out, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    init = f"file://{tempfile.mkdtemp()}/rendezvous"
    if world == 1:
        _rank(0, 1, mode, url, out, init)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_rank, args=(world, mode, url, out, init), nprocs=world)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    main()
