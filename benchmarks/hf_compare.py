"""Loading a Hugging Face checkpoint into FSDP2: checkpointer against DCP's HuggingFaceStorageReader.

One Hugging Face directory (``model.safetensors.index.json`` and its shards, written by
``safetensors.torch.save_file``) of ``--layers`` bf16 [``--dim``, ``--dim``] matrices (about
320 MiB by default), loaded at world size 2 (gloo, CPU, a file rendezvous) into a model of as
many ``nn.Linear`` layers, each under ``fully_shard``, by both systems in the same run:

* ours: ``checkpointer.load_model_and_optim_state(dir, model)``;
* DCP: ``torch.distributed.checkpoint.load(model.state_dict(), storage_reader=
  HuggingFaceStorageReader(dir))``.

Each round loads warm (the files in the page cache, read once untimed before the rounds) and
cold (every shard dropped from the page cache with ``posix_fadvise(DONTNEED)`` before the load:
no root needed; the kernel drops the clean pages it can), the systems interleaved (ours first
in even rounds). Time: the slowest rank's, between barriers. Peak extra RSS: VmHWM above the
RSS just before the load (``/proc/self/clear_refs``), the largest over ranks; file pages mapped
by a reader count. Every load is checked: the parameters are zeroed before it and every local
shard compared with ``torch.equal`` to the expected values after it.

Usage::

    python benchmarks/hf_compare.py                    # 3 rounds, 320 MiB
    python benchmarks/hf_compare.py --rounds 5 --layers 20 --out /tmp/r

Writes ``hf_compare.md`` and ``hf_compare.json`` to ``--out`` (default ``benchmarks/results/other``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from compare import PeakProbe  # noqa: E402

MiB = 1 << 20
SYSTEMS = ("ours", "dcp")


def layer(i: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(dim, dim, generator=g).to(torch.bfloat16)


def write_hf(path: str, layers: int, dim: int, shard_mib: int) -> list[str]:
    """The HF directory: shards of about ``shard_mib`` MiB and their index."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    per_shard = max(1, shard_mib * MiB // (dim * dim * 2))
    groups = [list(range(i, min(i + per_shard, layers))) for i in range(0, layers, per_shard)]
    weight_map, files = {}, []
    for n, group in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({f"layers.{i}.weight": layer(i, dim) for i in group}, os.path.join(path, name))
        weight_map.update({f"layers.{i}.weight": name for i in group})
        files.append(os.path.join(path, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": layers * dim * dim * 2}, "weight_map": weight_map}, f)
    return files


def drop_cache(files: list[str]) -> None:
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(files: list[str]) -> None:
    for name in files:
        with open(name, "rb") as f:
            while f.read(64 * MiB):
                pass


def worker(rank: int, cfg: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import checkpointer

    world, dim, layers = cfg["world"], cfg["dim"], cfg["layers"]
    dist.init_process_group("gloo", init_method=cfg["init"], rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(*(nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16) for _ in range(layers)))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model = nn.ModuleDict({"layers": model})
    expected = [layer(i, dim).chunk(world)[rank].clone() for i in range(layers)]
    local_bytes = sum(t.numel() * t.element_size() for t in expected)

    def params():
        return [model["layers"][i].weight.to_local() for i in range(layers)]

    def load(system: str) -> None:
        if system == "ours":
            checkpointer.load_model_and_optim_state(cfg["dir"], model)
        else:
            dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(cfg["dir"]))

    records = []
    if rank == 0:
        warm(cfg["files"])
    for system in SYSTEMS:  # each system once, untimed: imports, first-call costs
        load(system)
    for rnd in range(cfg["rounds"]):
        order = SYSTEMS if rnd % 2 == 0 else tuple(reversed(SYSTEMS))
        for mode in ("warm", "cold"):
            for system in order:
                with torch.no_grad():
                    for p in params():
                        p.zero_()
                if mode == "cold" and rank == 0:
                    drop_cache(cfg["files"])
                elif mode == "warm" and rank == 0:
                    warm(cfg["files"])
                dist.barrier()
                probe = PeakProbe()
                t0 = time.perf_counter()
                load(system)
                dist.barrier()
                seconds = time.perf_counter() - t0
                extra = probe.extra_mib()
                ok = all(torch.equal(p, e) for p, e in zip(params(), expected))
                both = [None] * world
                dist.all_gather_object(both, (seconds, extra, ok))
                if rank == 0:
                    records.append({"round": rnd, "mode": mode, "system": system,
                                    "seconds": max(b[0] for b in both), "rss_extra_mib": max(b[1] for b in both),
                                    "verified": all(b[2] for b in both)})
    if rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump({"records": records, "local_bytes": local_bytes}, f)
    dist.barrier()
    dist.destroy_process_group()


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--shard-mib", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "other"))
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory(dir=os.environ.get("HF_COMPARE_TMP")) as tmp:
        files = write_hf(os.path.join(tmp, "hf"), args.layers, args.dim, args.shard_mib)
        cfg = {"world": world, "dim": args.dim, "layers": args.layers, "rounds": args.rounds,
               "dir": os.path.join(tmp, "hf"), "files": files, "init": f"file://{tmp}/rendezvous",
               "result": os.path.join(tmp, "result.json")}
        mp.spawn(worker, args=(cfg,), nprocs=world)
        with open(cfg["result"]) as f:
            result = json.load(f)
    records = result["records"]
    rank_mib = result["local_bytes"] / MiB
    goal_mib = 0.10 * rank_mib + 64
    total_mib = args.layers * args.dim * args.dim * 2 / MiB
    rows = {}
    for mode in ("warm", "cold"):
        for system in SYSTEMS:
            mine = [r for r in records if r["mode"] == mode and r["system"] == system]
            rows[(mode, system)] = {
                "seconds": statistics.median(r["seconds"] for r in mine),
                "rss_extra_mib": max(r["rss_extra_mib"] for r in mine),
                "verified": all(r["verified"] for r in mine),
            }
    lines = [
        "# Hugging Face checkpoint into FSDP2: checkpointer vs DCP's HuggingFaceStorageReader",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {git('rev-parse', '--short', 'HEAD')}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"`python benchmarks/hf_compare.py --layers {args.layers} --dim {args.dim} --shard-mib {args.shard_mib} "
        f"--rounds {args.rounds}`.",
        "",
        f"{args.layers} bf16 [{args.dim}, {args.dim}] tensors ({total_mib:.0f} MiB) in {len(files)} shards with an index, "
        f"loaded at world size 2 into FSDP2 ({rank_mib:.0f} MiB per rank); medians of {args.rounds} rounds, the "
        "slowest rank's time; peak extra RSS the largest over ranks and rounds. Cold: every shard dropped from the "
        "page cache with posix_fadvise(DONTNEED) before the load.",
        "",
        "| mode | ours s | DCP s | ours/DCP | goal <= 0.5 | ours peak extra RSS MiB | DCP's | RSS goal (<= "
        f"{goal_mib:.0f} MiB) | verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for mode in ("warm", "cold"):
        o, d = rows[(mode, "ours")], rows[(mode, "dcp")]
        ratio = o["seconds"] / d["seconds"]
        summary[mode] = {"ours_s": o["seconds"], "dcp_s": d["seconds"], "ratio": ratio,
                         "ours_rss_mib": o["rss_extra_mib"], "dcp_rss_mib": d["rss_extra_mib"]}
        lines.append(
            f"| {mode} | {o['seconds']:.3f} | {d['seconds']:.3f} | {ratio:.2f} | {'yes' if ratio <= 0.5 else 'NO'} | "
            f"{o['rss_extra_mib']:.0f} | {d['rss_extra_mib']:.0f} | "
            f"{'yes' if o['rss_extra_mib'] <= goal_mib else 'NO'} | "
            f"{'yes' if o['verified'] and d['verified'] else 'NO'} |")
    lines += ["", "Every round:", "", "| round | mode | system | s | peak extra RSS MiB |", "|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['round']} | {r['mode']} | {r['system']} | {r['seconds']:.3f} | {r['rss_extra_mib']:.0f} |")
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "hf_compare.md").write_text("\n".join(lines) + "\n")
    Path(args.out, "hf_compare.json").write_text(json.dumps({"summary": summary, "records": records}, indent=1))
    print("\n".join(lines[:12 + 2]))
    verified = all(r["verified"] for r in records)
    return 0 if verified else 2


if __name__ == "__main__":
    sys.exit(main())
