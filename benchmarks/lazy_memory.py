"""Peak memory of ``lazy_load``: one tensor at a time, whatever the checkpoint's size.

Writes a checkpoint of about ``--size-gib`` GiB (several tensors, the largest ``--largest-mib``)
in each format ``lazy_load`` reads, then iterates it in a fresh subprocess per format and TP
setting, and reports that process's peak RSS (``resource.getrusage(...).ru_maxrss``) above
its RSS before the first tensor, against the bound ``2 x largest tensor (/ tp_size) + 64 MiB``
(the tensor the caller holds while the next one is read, plus slack).

A torch pickle read without ``mmap`` is loaded whole by ``torch.load``: that row shows the
format's own limit, not the loader's. With ``mmap=True`` the file's pages that were touched
count in RSS (they are file-backed and reclaimable, but ``ru_maxrss`` includes them).

Usage::

    python benchmarks/lazy_memory.py [--size-gib 1] [--largest-mib 128] [--dir /tmp/x] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

MiB = 1 << 20
SLACK_MIB = 64


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(path: str, tp_size: int, mmap: bool) -> dict:
    """Run in the child: iterate lazy_load, holding one tensor at a time, report peak RSS."""
    import torch

    from checkpointer import lazy_load

    torch.set_num_threads(1)
    before = _rss_mib()
    start = time.perf_counter()
    count, nbytes, largest = 0, 0, 0
    # Every tensor sharded along dim 1: the costly direction (a range per row).
    shard_dims = {"embed.weight": 1, **{f"layers.{i}.weight": 1 for i in range(4096)}}
    for key, tensor in lazy_load(path, shard_dims, tp_rank=tp_size - 1, tp_size=tp_size, mmap=mmap):
        count += 1
        size = tensor.numel() * tensor.element_size()
        nbytes += size
        largest = max(largest, size)
        float(tensor.sum())  # read every element (for mmap: fault every page in)
        del tensor
    seconds = time.perf_counter() - start
    return {"before_mib": before, "peak_mib": _rss_mib(), "tensors": count, "bytes": nbytes,
            "largest": largest, "seconds": seconds}


def write_all(root: str, size_gib: float, largest_mib: int) -> dict[str, str]:
    import torch
    from safetensors.torch import save_file

    from checkpointer import Checkpointer

    cols = 1024
    total = int(size_gib * 1024 * MiB)
    tensors: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    tensors["embed.weight"] = torch.randn(largest_mib * MiB // 4 // cols, cols, generator=g)
    remaining = total - largest_mib * MiB
    i = 0
    while remaining > 0:
        mib = min(64, remaining // MiB) or 1
        tensors[f"layers.{i}.weight"] = torch.randn(mib * MiB // 4 // cols, cols, generator=g)
        remaining -= mib * MiB
        i += 1
    paths = {}
    paths["checkpoint dir"] = os.path.join(root, "ck")
    Checkpointer().save(paths["checkpoint dir"], tensors)
    paths["single safetensors"] = os.path.join(root, "model.safetensors")
    save_file(tensors, paths["single safetensors"])
    hf = os.path.join(root, "hf")
    os.makedirs(hf)
    keys = list(tensors)
    weight_map = {}
    for s in range(4):
        name = f"model-{s + 1:05d}-of-00004.safetensors"
        save_file({k: tensors[k] for k in keys[s::4]}, os.path.join(hf, name))
        weight_map.update({k: name for k in keys[s::4]})
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    paths["hf index dir"] = hf
    paths["torch .pt"] = os.path.join(root, "model.pt")
    torch.save(tensors, paths["torch .pt"])
    return paths


def _child(args: list[str]) -> str:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args],
        check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--largest-mib", type=int, default=128)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--measure", nargs=3, metavar=("PATH", "TP_SIZE", "MMAP"), help=argparse.SUPPRESS)
    p.add_argument("--write", metavar="ROOT", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure:
        path, tp, mm = a.measure
        print(json.dumps(measure(path, int(tp), mm == "1")))
        return
    if a.write:
        print(json.dumps(write_all(a.write, a.size_gib, a.largest_mib)))
        return

    root = a.dir or tempfile.mkdtemp(prefix="lazy-memory-")
    os.makedirs(root, exist_ok=True)
    try:
        # Children only: this process stays small, and a child's ru_maxrss starts from the RSS
        # of the process that started it (Linux carries it over the exec).
        t = time.perf_counter()
        paths = json.loads(_child(["--write", root, "--size-gib", str(a.size_gib), "--largest-mib", str(a.largest_mib)]))
        print(f"wrote {a.size_gib} GiB in 4 formats under {root} in {time.perf_counter() - t:.1f}s")
        header = f"{'format':<20} {'tp':>3} {'mmap':>5} {'tensors':>8} {'peak-base MiB':>14} {'bound MiB':>10} {'ok':>4} {'GiB/s':>6}"
        print(header)
        print("-" * len(header))
        runs = [(f, tp, False) for f in paths for tp in (1, 2)] + [("torch .pt", 1, True), ("torch .pt", 2, True)]
        for fmt, tp, mm in runs:
            r = json.loads(_child(["--measure", paths[fmt], str(tp), "1" if mm else "0"]))
            used = r["peak_mib"] - r["before_mib"]
            bound = 2 * a.largest_mib / tp + SLACK_MIB
            rate = r["bytes"] / (1 << 30) / r["seconds"] if r["seconds"] else 0.0
            print(f"{fmt:<20} {tp:>3} {str(mm):>5} {r['tensors']:>8} {used:>14.0f} {bound:>10.0f} "
                  f"{'yes' if used <= bound else 'NO':>4} {rate:>6.2f}")
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
