"""Where one default-strategy load's time goes: per-phase wall and CPU time of one of
tp_compare's load cases (``--case``; by default ``mix_same``: 64 fp32 [1024, 1024] matrices,
Shard(0)/Shard(1) alternating, saved at world size 2, loaded with the same placements at 4:
64 MiB per rank).

1. Two processes save the checkpoint (once; ``--dir`` keeps it between runs).
2. Four processes load it ``--rounds`` times (gloo, 127.0.0.1), every load checked exactly.
   Timers wrap the engine's phase functions in these processes only (main thread; the read
   threads' work shows as ``_run``): the metadata broadcast, its parse, planning, the two
   agreements, building the read tasks, the reads. ``cpu/rank`` is ``time.process_time()``
   (every thread of the process) around the whole load.
3. ``--side 64`` makes the matrices small: what is left is a load's fixed cost.
4. Prints, per phase, the median over rounds after the first (the slowest rank), and the first
   round (a fresh process; warm page cache after the first run).

Usage::

    python benchmarks/load_phases.py --rounds 10 --dir /tmp/load-phases-ckpt
    python benchmarks/load_phases.py --case interleaved --rounds 10
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

WALL: dict[str, float] = collections.defaultdict(float)
CPU: dict[str, float] = collections.defaultdict(float)

PHASES = [  # (module, attribute, label), outermost first
    ("checkpointer.dist", "share_from", "metadata broadcast (rank 0 reads it)"),
    ("checkpointer.engine.load", "parse_metadata", "metadata parse"),
    ("checkpointer.engine.load", "plan_local_loads", "planning"),
    ("checkpointer.dist", "_settle", "agreements (2 all-reduces)"),
    ("checkpointer.engine.reads", "_strided_tasks", "read tasks: strided"),
    ("checkpointer.engine.reads", "_read_tasks", "read tasks: plain"),
    ("checkpointer.engine.reads", "_run", "reads (thread pool)"),
]


def _timed(module: str, name: str, label: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    fn = getattr(mod, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            WALL[label] += time.perf_counter() - t
            CPU[label] += time.thread_time() - c

    setattr(mod, name, timed)


def _worker(rank: int, world: int, port: int, ckpt: str, rounds: int, out: str, case: str, side: int) -> None:
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    import checkpointer
    from tp_compare import LOAD_LAYOUTS, build_state, checkpoint_specs, mismatches, zeros_like_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    spec, mesh_shape, rule = LOAD_LAYOUTS[case]
    base = checkpoint_specs(1.0, False)[spec]
    base = dict(base, shape=[side, side] if len(base["shape"]) == 2 else [*base["shape"][:-2], side, side])
    if rounds == 0:
        ref, _ = build_state(base, init_device_mesh("cpu", (world,)), base["save_dims"])
        checkpointer.Checkpointer().save(ckpt, ref)
    else:
        ref, expected = build_state(base, init_device_mesh("cpu", tuple(mesh_shape)), rule)
        target = zeros_like_state(ref)
        for module, name, label in PHASES:
            _timed(module, name, label)
        rows = []
        for _ in range(rounds):
            for v in target.values():
                v.to_local().zero_()
            WALL.clear()
            CPU.clear()
            tdist.barrier()
            t, c = time.perf_counter(), time.process_time()
            checkpointer.Checkpointer().load(ckpt, target)
            row = {"total": time.perf_counter() - t, "cpu/rank": time.process_time() - c}
            if mismatches(target, expected):
                raise SystemExit(f"rank {rank}: wrong values loaded")
            row.update({f"{k} wall": v for k, v in WALL.items()})
            row.update({f"{k} cpu": v for k, v in CPU.items()})
            rows.append(row)
        Path(f"{out}.{rank}.json").write_text(json.dumps(rows))
    tdist.barrier()
    tdist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="loads per process (default 10)")
    ap.add_argument("--dir", default=None, help="the checkpoint (saved there if absent; default a temp dir)")
    ap.add_argument("--case", default="mix_same", help="one of tp_compare's load cases (default mix_same)")
    ap.add_argument("--side", type=int, default=1024,
                    help="the matrices' side (default 1024; a small one leaves the fixed cost of a load)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.dir or f"{tmp}/ckpt"
        if not os.path.exists(os.path.join(ckpt, "metadata.json")):
            mp.spawn(_worker, args=(2, _port(), ckpt, 0, "", args.case, args.side), nprocs=2)
        out = f"{tmp}/phases"
        mp.spawn(_worker, args=(4, _port(), ckpt, args.rounds, out, args.case, args.side), nprocs=4)
        per_rank = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(4)]
    labels = ["total", "cpu/rank"] + [f"{label} {kind}" for _, _, label in PHASES for kind in ("wall", "cpu")]
    print(f"load average {os.getloadavg()[0]:.1f}; ms, slowest rank; median of rounds 2-{args.rounds}, then round 1")
    for label in labels:
        later = max(statistics.median(row.get(label, 0.0) for row in rows[1:]) for rows in per_rank)
        first = max(rows[0].get(label, 0.0) for rows in per_rank)
        print(f"  {label:45s} {1e3 * later:8.1f} {1e3 * first:8.1f}")


if __name__ == "__main__":
    main()
