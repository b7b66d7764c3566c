"""Speed-up of ``export_safetensors`` from 1 to N processes (the shards are divided among the ranks).

Saves one checkpoint of random float32 tensors, then exports it to Hugging Face shards with 1, 2,
... processes (a gloo group meeting through a file, as ``torchrun`` would run it), timing the
export alone between two barriers (process start-up and ``import torch`` excluded). Each
configuration runs ``--repeats`` times; the best time counts. ``cpu s`` is the most CPU time
(all threads) any one rank spent: it halves with two ranks whether or not the machine has
idle cores to turn that into wall-clock time. The checkpoint is in the page
cache after it is written, so this measures the export itself, not a cold disk.

    python benchmarks/export_speedup.py --size-mb 1024 --procs 1,2
    python benchmarks/export_speedup.py --dir /dev/shm --dtype bf16 --io-threads 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpointer import Checkpointer, export_safetensors  # noqa: E402


def _worker(rank: int, world: int, init_file: str, ckpt: str, out: str, shard: str, dtype: str | None, result: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=f"file://{init_file}", timeout=datetime.timedelta(seconds=600)
        )
        dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    files = export_safetensors(ckpt, out, max_shard_size=shard, dtype=dtype)
    cpu = time.process_time() - cpu
    if world > 1:
        dist.barrier()
    elapsed = time.perf_counter() - start
    with open(f"{result}.{rank}", "w") as f:
        json.dump({"seconds": elapsed, "cpu": cpu, "files": len(files)}, f)
    if world > 1:
        dist.destroy_process_group()


def run(world: int, ckpt: str, out: str, shard: str, dtype: str | None, scratch: str) -> tuple[float, float, list[int]]:
    """Wall seconds of the export, the most CPU seconds any rank spent, and each rank's file count."""
    shutil.rmtree(out, ignore_errors=True)
    init_file = tempfile.mktemp(dir=scratch, prefix="rendezvous-")
    result = os.path.join(scratch, f"result-{world}")
    mp.spawn(_worker, args=(world, init_file, ckpt, out, shard, dtype, result), nprocs=world, join=True)
    per_rank = [json.load(open(f"{result}.{r}")) for r in range(world)]
    return max(p["seconds"] for p in per_rank), max(p["cpu"] for p in per_rank), [p["files"] for p in per_rank]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="checkpoint size (float32 MiB)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--max-shard-size", default="64MB")
    p.add_argument("--dtype", default=None, help="cast while exporting (e.g. bf16)")
    p.add_argument("--procs", default="1,2", help="process counts to compare")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to put the checkpoint and the exports")
    p.add_argument("--io-threads", type=int, default=None, help="CHECKPOINTER_IO_THREADS of each process")
    args = p.parse_args()
    if args.io_threads is not None:
        os.environ["CHECKPOINTER_IO_THREADS"] = str(args.io_threads)  # inherited by the spawned workers

    scratch = tempfile.mkdtemp(prefix="export-bench-", dir=args.dir)
    try:
        ckpt = os.path.join(scratch, "ckpt")
        per_tensor = args.size_mb * 2**20 // 4 // args.tensors
        cols = 1024
        rows = max(1, per_tensor // cols)
        torch.manual_seed(0)
        state = {f"layers.{i}.weight": torch.randn(rows, cols) for i in range(args.tensors)}
        Checkpointer().save(ckpt, state)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        del state
        print(
            f"checkpoint: {args.tensors} tensors of [{rows}, {cols}] float32, {nbytes / 2**20:.0f} MiB; "
            f"max shard {args.max_shard_size}; dtype {args.dtype or 'as saved'}; {os.cpu_count()} CPUs; "
            f"I/O threads per process {os.environ.get('CHECKPOINTER_IO_THREADS', 'default (4)')}; "
            f"scratch {scratch}"
        )
        print(
            f"{'procs':>5}  {'best s':>8}  {'MiB/s':>8}  {'speed-up':>8}  {'cpu s':>7}  files per rank  (all runs, s)"
        )
        base = None
        for world in [int(x) for x in args.procs.split(",")]:
            times, cpus, files = [], [], []
            for _ in range(args.repeats):
                seconds, cpu, files = run(world, ckpt, os.path.join(scratch, "out"), args.max_shard_size, args.dtype, scratch)
                times.append(seconds)
                cpus.append(cpu)
            best = min(times)
            base = base or best
            print(
                f"{world:>5}  {best:>8.2f}  {nbytes / 2**20 / best:>8.0f}  {base / best:>7.2f}x  {min(cpus):>7.2f}  "
                f"{files}  ({', '.join(f'{t:.2f}' for t in times)})"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
