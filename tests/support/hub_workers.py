"""Run as a program by the ``hf://`` tests: a fresh process (``huggingface_hub`` reads
``HF_ENDPOINT`` and ``HF_HOME`` when it is imported), alone or as ``WORLD`` gloo ranks (this
process is rank 0 and starts the others).

``python hub_workers.py MODE URL OUT WORLD``:

- ``load``: our GPT-2 (under FSDP2 when ``WORLD > 1``) filled from ``URL`` with ``key_map``;
- ``load_skip``: the same, block 1 skipped by the ``key_map`` (``strict=False``);
- ``lazy``: ``lazy_load(URL)`` in this process;
- ``cached``: ``load`` and ``lazy`` one after the other, then the command line's
  ``inspect URL --json`` and ``convert URL OUT.converted --to checkpointer``, all in this process;
- ``load_then_missing``: ``load``, then a load from ``hf://nobody/nothing``, whose
  ``FileNotFoundError`` message it keeps (``None`` if none was raised);
- ``error``: a load from ``URL``; writes the class name and message of what it raised.

Rank 0 writes the full tensors by Hugging Face names (and the load's missing keys) to ``OUT``
(``torch.save``); ``cached`` writes one such result per step, and the two commands' exit
statuses and ``inspect``'s output.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import sys
import tempfile
import traceback

import torch


def _key_map(mode: str):
    from hf_helpers import gpt2_key_map

    if mode == "load_skip":
        return lambda k: None if ".h.1." in k else gpt2_key_map(k)
    return gpt2_key_map


def _rank(rank: int, world: int, mode: str, url: str, init: str) -> dict | None:
    from hf_helpers import OwnGPT2, own_to_hf, zero_

    from checkpointer import lazy_load, load_model_and_optim_state

    if mode == "lazy":
        return {"tensors": dict(lazy_load(url)), "missing": []}
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
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
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return {"tensors": own_to_hf(state), "missing": result.missing_keys} if rank == 0 else None


def _cli(*argv: str) -> tuple[int, str]:
    from checkpointer.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(list(argv))
    return code, out.getvalue()


def _cached(url: str, out: str) -> dict:
    code, inspected = _cli("inspect", url, "--json")
    converted = _cli("convert", url, f"{out}.converted", "--to", "checkpointer", "-q")[0]
    return {"load": _rank(0, 1, "load", url, ""), "lazy": _rank(0, 1, "lazy", url, ""),
            "inspect": (code, inspected), "convert": converted}


def _missing_repository() -> str | None:
    from checkpointer import load_model_and_optim_state

    try:
        load_model_and_optim_state("hf://nobody/nothing", torch.nn.Linear(2, 2))
    except FileNotFoundError as e:
        return str(e)
    return None


def main() -> None:
    mode, url, out, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if mode == "cached":
        torch.save(_cached(url, out), out)
        return
    if mode == "error":
        try:
            _rank(0, 1, "load", url, "")
        except Exception as e:  # the test asserts on the class, the message and the printed traceback
            torch.save({"type": type(e).__name__, "message": str(e), "traceback": "".join(traceback.format_exception(e))}, out)
        else:
            torch.save({"type": None}, out)
        return
    if mode == "load_then_missing":
        torch.save({**_rank(0, 1, "load", url, ""), "missing_repository": _missing_repository()}, out)
        return
    init = f"file://{tempfile.mkdtemp()}/rendezvous"
    others = []
    if world > 1:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        others = [ctx.Process(target=_rank, args=(rank, world, mode, url, init)) for rank in range(1, world)]
        for p in others:
            p.start()
    result = _rank(0, world, mode, url, init)
    for p in others:
        p.join(timeout=120)
        assert p.exitcode == 0, f"rank {others.index(p) + 1} exited with {p.exitcode}"
    torch.save(result, out)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    main()
