"""The cost of comparing replicas before a commit (issue #26 item 7): save time with and without
``CHECKPOINTER_VERIFY_REPLICAS``, on the same data, in the same run.

A model-like state dict (``--layers`` layers of ``d x d`` fp32 weights with AdamW's two state
tensors, a norm weight and a ``step`` scalar each; about ``--size-gib`` GiB of parameters, three
times that in the checkpoint), saved by ``--world-size`` processes (gloo, CPU) in two layouts:

* ``fsdp``: weights, optimizer state and norms ``Shard(0)`` DTensors (as FSDP2 has them); only the
  ``step`` scalars are replicated. Almost nothing to compare.
* ``ddp``: every tensor whole on every rank (a plain module, DDP). Every piece is written once and
  hashed by every other rank: at world size W each rank writes 1/W and hashes (W-1)/W.

Each round saves with the check on and off (the order flips every round, so drift hits both
alike) into fresh directories, synchronous (``Checkpointer.save``) and async (the time the call
blocks, and until ``.result()``); the plans are cached by an untimed save first. Times are the
slowest rank's; the figures are medians over ``--rounds``, and::

    overhead = (median(on) - median(off)) / median(off)

Usage::

    python benchmarks/replica_check_cost.py [--size-gib 0.5] [--world-size 2] [--rounds 7]
                                            [--layouts fsdp,ddp] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ENV = "CHECKPOINTER_VERIFY_REPLICAS"


def _state(layout: str, world: int, layers: int, d: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,)) if layout == "fsdp" else None
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        for name, shape in ((f"layers.{i}.weight", (d, d)), (f"layers.{i}.norm", (d,))):
            full = torch.randn(*shape, generator=g)
            for suffix, value in (("", full), (".exp_avg", full * 0.1), (".exp_avg_sq", full * full)):
                if layout == "fsdp":
                    out[name + suffix] = distribute_tensor(value, mesh, [Shard(0)])
                else:
                    out[name + suffix] = value.clone()
            out[f"{name}.step"] = torch.tensor(10.0)  # AdamW's step: replicated in both layouts
    return out


def _worker(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['rendezvous']}", rank=rank,
                            world_size=cfg["world"], timeout=datetime.timedelta(seconds=600))
    from checkpointer import Checkpointer
    from checkpointer.engine import commit as replicas

    # The check's own work, timed where it runs (robust to a busy host, unlike the wall times):
    # hashing this rank's copies (on a thread, beside the write) and rank 0's comparison.
    spent = {"hash": 0.0, "compare": 0.0, "hashed_bytes": 0}

    def timed_work(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return call

    real_hash = replicas.hash_pieces

    def counted_hash(tensors, **kwargs):
        spent["hashed_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        return real_hash(tensors, **kwargs)

    replicas.hash_pieces = timed_work("hash", counted_hash)
    replicas.check_copies = timed_work("compare", replicas.check_copies)

    results = {}
    for layout in cfg["layouts"]:
        state = _state(layout, cfg["world"], cfg["layers"], cfg["d"])
        ckpt = Checkpointer()
        base = os.path.join(cfg["dir"], layout)
        n = 0

        def fresh() -> str:
            nonlocal n
            n += 1
            return os.path.join(base, f"s{n}")

        def clean(path: str) -> None:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.sync()
            dist.barrier()
            time.sleep(0.3)  # freed blocks are discarded at the next journal commit

        def cpu() -> float:
            ru = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
            return ru.ru_utime + ru.ru_stime

        def timed(fn, then=None) -> tuple[float, float]:
            """Seconds of the slowest rank for ``fn()`` (and for ``then()`` after it, if given),
            and CPU seconds of every rank together."""
            dist.barrier()
            c0, t0 = cpu(), time.perf_counter()
            fn()
            first = time.perf_counter() - t0
            if then is not None:
                then()
            both = torch.tensor([first, time.perf_counter() - t0, cpu() - c0], dtype=torch.float64)
            wall = both[:2].clone()
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            used = both[2:].clone()
            dist.all_reduce(used, op=dist.ReduceOp.SUM)
            return float(wall[0]), float(wall[1]), float(used[0])

        # Warm-up (untimed): plans cached, async staging buffers allocated, hashing code loaded.
        for on in ("1", "0"):
            os.environ[ENV] = on
            p = fresh()
            ckpt.save(p, state)
            clean(p)
            p = fresh()
            ckpt.async_save(p, state).result()
            clean(p)
        times: dict[str, list[float]] = {
            f"{what}_{tag}": [] for what in ("sync", "sync_cpu", "async_block", "async_total", "async_cpu")
            for tag in ("on", "off")
        }
        spent.update(hash=0.0, compare=0.0, hashed_bytes=0)
        for r in range(cfg["rounds"]):
            order = ("1", "0") if r % 2 == 0 else ("0", "1")
            for on in order:
                os.environ[ENV] = on
                tag = "on" if on == "1" else "off"
                p = fresh()
                wall, _, used = timed(lambda: ckpt.save(p, state))
                times[f"sync_{tag}"].append(wall)
                times[f"sync_cpu_{tag}"].append(used)
                clean(p)
            for on in order:
                os.environ[ENV] = on
                tag = "on" if on == "1" else "off"
                p = fresh()
                box = {}

                def call():
                    box["fut"] = ckpt.async_save(p, state)

                blocked, total, used = timed(call, lambda: box["fut"].result())
                times[f"async_block_{tag}"].append(blocked)
                times[f"async_total_{tag}"].append(total)
                times[f"async_cpu_{tag}"].append(used)
                clean(p)
        local = sum(
            (v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size() for v in state.values()
        )
        payload = sum(v.numel() * v.element_size() for v in state.values())
        work = torch.tensor([spent["hash"], spent["compare"], spent["hashed_bytes"]], dtype=torch.float64)
        dist.all_reduce(work, op=dist.ReduceOp.MAX)
        saves_on = 2 * cfg["rounds"]  # sync and async, check on
        results[layout] = {"times": times, "payload_bytes": payload, "local_bytes_rank0": local,
                           "hash_s_per_save": float(work[0]) / saves_on, "compare_s_per_save": float(work[1]) / saves_on,
                           "hashed_bytes_per_save": float(work[2]) / saves_on}
        del state
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.5, help="GiB of fp32 parameters (default 0.5)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layouts", default="fsdp,ddp")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default a temp dir under /tmp)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    import torch.multiprocessing as mp

    d = int((args.size_gib * (1 << 30) / 4 / args.layers) ** 0.5)
    work = tempfile.mkdtemp(prefix="replica-cost-", dir=args.dir)
    cfg = {
        "world": args.world_size, "layers": args.layers, "d": d, "rounds": args.rounds,
        "layouts": args.layouts.split(","), "dir": work, "rendezvous": os.path.join(work, "rendezvous"),
        "out": os.path.join(work, "results.json"),
    }
    try:
        mp.spawn(_worker, args=(cfg,), nprocs=args.world_size, join=True)
        with open(cfg["out"]) as f:
            results = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"world size {args.world_size}, {args.layers} layers of {d}x{d} fp32 + AdamW state, "
          f"{args.rounds} rounds, medians (slowest rank), load average {os.getloadavg()[0]:.1f}")
    print("| layout | payload GB | rank 0 holds GB | what | check off s | check on s | overhead (ratio of medians) "
          "| overhead (median of paired rounds) |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    labels = {"sync": "save (sync), slowest rank", "sync_cpu": "save (sync), CPU s of all ranks",
              "async_block": "async save, blocking", "async_total": "async save, until written",
              "async_cpu": "async save, CPU s of all ranks"}
    for layout, res in results.items():
        t = res["times"]
        for what, label in labels.items():
            off, on = statistics.median(t[f"{what}_off"]), statistics.median(t[f"{what}_on"])
            paired = statistics.median(100 * (a - b) / b for a, b in zip(t[f"{what}_on"], t[f"{what}_off"]))
            res[f"{what}_overhead_percent"] = 100 * (on - off) / off
            res[f"{what}_paired_overhead_percent"] = paired
            print(f"| {layout} | {res['payload_bytes'] / 1e9:.2f} | {res['local_bytes_rank0'] / 1e9:.2f} | "
                  f"{label} | {off:.3f} | {on:.3f} | {100 * (on - off) / off:+.1f} % | {paired:+.1f} % |")
    print()
    print("| layout | bytes hashed per save (busiest rank) | hashing s per save | comparison (rank 0) s per save | "
          "their sum / sync save (check off) |")
    print("|---|---:|---:|---:|---:|")
    for layout, res in results.items():
        own = res["hash_s_per_save"] + res["compare_s_per_save"]
        base = statistics.median(res["times"]["sync_off"])
        print(f"| {layout} | {res['hashed_bytes_per_save'] / 1e9:.3f} GB | {res['hash_s_per_save']:.4f} | "
              f"{res['compare_s_per_save']:.5f} | {100 * own / base:.2f} % |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
