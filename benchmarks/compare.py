"""Benchmark checkpointer against torch.distributed.checkpoint (DCP) and the seed (OLMo-core 0.1.0).

One model (a stack of ``Linear(d, d, bias=False)``, about ``--size-gb`` GiB of fp32 parameters)
plus its AdamW state (so about three times that in the checkpoint), FSDP2 on a CPU mesh with
gloo. In one run, with the systems interleaved (round r runs them in order, then in reverse
order in the next round), medians over ``--rounds`` rounds:

* save at ``--world-size`` (every system's files made durable: ours and DCP fsync; the seed
  does not, so the benchmark fsyncs the files it created, inside the timing);
* load at the same world size, in place into the live model;
* load at world sizes 1 (a plain module, no FSDP) and 3 (FSDP2): resharding;
* unshard to files in one process (ours ``export_safetensors``; DCP ``dcp_to_torch_save``;
  the seed ``Checkpointer.unshard`` + safetensors ``save_file``), outputs fsynced;
* async save: the time until the call returns (and until the write is done), against a
  plain memory copy of the rank's state into preallocated tensors (and DCP's ``async_save``).

For each: seconds, GB/s of checkpoint payload, peak RSS above the process's baseline per
rank (VmHWM after ``clear_refs``), and our/DCP ratio. Machine ceilings are measured in the
same run: buffered, buffered with early writeback (as our saves write) and O_DIRECT
write+fsync of plain files of the same total bytes, a buffered write without fsync (page
cache), and ``preadv`` into preallocated tensors. The ceilings are also timed inside the save
and load phases, interleaved with the rounds by the same processes: plain writes + fsync of
the save's bytes (a file per rank, ``O_DIRECT`` or early writeback; and one file of every
byte), and ``preadv`` of our checkpoint's own files (each rank its 1/W of every file, and one
process reading all of it). This host's disk and page-cache speeds drift by tens of percent
over minutes, so an operation's fraction of its ceiling is taken against those timed beside it.

Every load is checked: the model and optimizer are zeroed before it (untimed) and compared
with the saved values' sums after it.

Usage::

    python benchmarks/compare.py                     # 1 GiB of parameters, world size 2, 3 rounds
    python benchmarks/compare.py --size-gb 0.1 --rounds 3 --out benchmarks/results

Writes ``compare.md``, ``compare.json`` and ``compare.png`` to ``--out``. Needs matplotlib for
the chart and, optionally, ``ai2-olmo-core==0.1.0`` for the seed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

MiB = 1 << 20
GB = 1e9
N_LAYERS = 16
SYSTEM_LABELS = {"ours": "checkpointer", "dcp": "DCP", "seed": "seed (OLMo-core 0.1.0)"}


# --------------------------------------------------------------------------- memory probes


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_kib() -> int:
    return _status_kib("VmRSS")


def hwm_kib() -> int:
    return _status_kib("VmHWM")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PeakProbe:
    """Peak RSS above the RSS at construction."""

    def __init__(self) -> None:
        gc.collect()
        self.base = rss_kib()
        reset_peak()

    def extra_mib(self) -> float:
        return max(0, hwm_kib() - self.base) / 1024


# --------------------------------------------------------------------------- model


def layer_dim(size_gb: float) -> int:
    """``d`` such that N_LAYERS layers of d x d fp32 hold about ``size_gb`` GiB (a multiple of 64)."""
    d = 4096 * math.sqrt(size_gb)
    return max(64, int(round(d / 64)) * 64)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def build_model(dim: int, world: int, fsdp: bool, seed: int, device: str = "cpu"):
    import torch
    import torch.nn as nn

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(N_LAYERS)])
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            _local(p).normal_(0.0, 0.02, generator=g)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, optim


def train_step(model, optim, dim: int, device: str = "cpu") -> None:
    """One real forward/backward/AdamW step, so the optimizer has its state."""
    import torch

    x = torch.randn(4, dim, generator=torch.Generator().manual_seed(7)).to(device)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def state_tensors(model, optim):
    """(name, local tensor) of every parameter and optimizer state tensor on this rank."""
    out = []
    for name, p in model.named_parameters():
        out.append((name, _local(p)))
        for k, v in optim.state.get(p, {}).items():
            out.append((f"{name}.{k}", _local(v)))
    return out


def fingerprint(model, optim) -> dict[str, float]:
    """Global sums of the parameters and of each optimizer state key (step: summed locally, replicated)."""
    import torch
    import torch.distributed as dist

    sums = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    step = 0.0
    with torch.no_grad():
        for p in model.parameters():
            sums["param"] += float(_local(p).sum(dtype=torch.float64))
            st = optim.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    sums[k] += float(_local(st[k]).sum(dtype=torch.float64))
            if "step" in st:
                step += float(_local(st["step"]).sum(dtype=torch.float64))
    t = torch.tensor([sums["param"], sums["exp_avg"], sums["exp_avg_sq"]], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return {"param": float(t[0]), "exp_avg": float(t[1]), "exp_avg_sq": float(t[2]), "step": step}


def fingerprint_matches(got: dict, ref: dict) -> tuple[bool, str]:
    for k, v in ref.items():
        g = got.get(k, float("nan"))
        if not (abs(g - v) <= 1e-6 * abs(v) + 1e-6):
            return False, f"{k}: got {g!r}, saved {v!r}"
    return True, ""


def zero_state(model, optim) -> None:
    import torch

    with torch.no_grad():
        for _, t in state_tensors(model, optim):
            t.zero_()


def payload_bytes(model, optim) -> tuple[int, int]:
    """(global checkpoint payload bytes, bytes of the largest single tensor), from global shapes."""
    total, largest = 0, 0
    for p in model.parameters():
        n = p.numel() * p.element_size()
        total += n
        largest = max(largest, n)
        for v in optim.state.get(p, {}).values():
            m = v.numel() * v.element_size()
            total += m
            largest = max(largest, m)
    return total, largest


# --------------------------------------------------------------------------- the systems


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` and the directories (for systems that do not)."""
    for root, dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _disk_counters(path: str) -> list[int] | None:
    """The /proc/diskstats counters of the device holding ``path`` (None if not found)."""
    dev = os.stat(path).st_dev
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if (int(fields[0]), int(fields[1])) == (os.major(dev), os.minor(dev)):
                    return [int(x) for x in fields[3:]]
    except OSError:
        pass
    return None


def settle_disk(path: str, quiet_s: float = 0.3, limit_s: float = 15.0) -> None:
    """After deleting a checkpoint: flush, then wait until the disk is idle.

    Freed blocks are discarded (TRIM) when the file system commits its journal; without
    this, that burst of I/O lands in whatever is timed next, and slows the system that is
    bound by the disk (one deletion of 3 GB cost a following save a quarter of its speed here).
    """
    os.sync()
    start = last_change = time.perf_counter()
    before = _disk_counters(path)
    if before is None:
        time.sleep(1.0)
        return
    while time.perf_counter() - start < limit_s:
        time.sleep(0.05)
        now = _disk_counters(path)
        if now != before or (now is not None and now[8] > 0):  # counters moved, or I/O in flight
            before, last_change = now, time.perf_counter()
        elif time.perf_counter() - last_change >= quiet_s:
            return


def warm_page_cache(root: str) -> None:
    """Read every file under ``root`` once (untimed), so a load after it is warm. Our saves
    leave nothing in the page cache (``O_DIRECT``, or writeback then dropped); DCP's leave all
    of it there."""
    buf = bytearray(8 << 20)
    for f in sorted(Path(root).rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


class ReadCeiling:
    """Plain ``preadv`` of our checkpoint's files into preallocated (touched) tensors, timed in
    the same rounds as the loads, by the same processes: a read ceiling measured at the same
    moment (this host's read speed drifts by tens of percent over minutes).

    ``mine``: each rank reads its 1/W of every file on ``CHECKPOINTER_IO_THREADS`` threads (what
    a load of W ranks does at best); ``one``: rank 0 reads every byte on W times as many threads."""

    SPLIT = 32 * MiB  # as our load splits reads

    def __init__(self, root: str, rank: int, world: int) -> None:
        import torch

        self.rank = rank
        self.threads = int(os.environ.get("CHECKPOINTER_IO_THREADS", "4"))
        self.world = world
        paths = sorted(str(p) for p in Path(root).rglob("*.safetensors"))
        sizes = [os.path.getsize(p) for p in paths]
        self.total = sum(sizes)
        self.fds = [os.open(p, os.O_RDONLY) for p in paths]
        self.tasks_one: list[tuple[int, int, int, int]] = []  # (file, file offset, buffer offset, bytes)
        self.tasks_mine: list[tuple[int, int, int, int]] = []
        at = mine_at = 0
        for i, n in enumerate(sizes):
            self.tasks_one += self._split(i, 0, at, n)
            lo, hi = n * rank // world, n * (rank + 1) // world
            self.tasks_mine += self._split(i, lo, mine_at, hi - lo)
            at += n
            mine_at += hi - lo
        # Rank 0's share reuses the start of its buffer for every byte.
        self.buf = torch.ones(self.total if rank == 0 else mine_at, dtype=torch.uint8)
        self.view = memoryview(self.buf.numpy())

    def _split(self, i: int, off: int, at: int, n: int) -> list[tuple[int, int, int, int]]:
        return [(i, off + k, at + k, min(self.SPLIT, n - k)) for k in range(0, n, self.SPLIT)]

    def _one(self, task: tuple[int, int, int, int]) -> None:
        i, off, at, n = task
        done = 0
        while done < n:
            got = os.preadv(self.fds[i], [self.view[at + done : at + n]], off + done)
            if got <= 0:
                raise OSError(f"short read at {off + done}")
            done += got

    def _read(self, tasks: list, threads: int) -> None:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(self._one, tasks))

    def read_mine(self) -> None:
        self._read(self.tasks_mine, self.threads)

    def read_one(self) -> None:
        if self.rank == 0:
            self._read(self.tasks_one, self.threads * self.world)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        del self.view, self.buf


CEILING_SYSTEMS = ("preadv_mine", "preadv_one")


class WriteCeiling:
    """Plain writes + fsync of the save's bytes, timed in the same rounds as the saves, by the
    same processes (the disk's speed drifts as much as the page cache's): each rank its own
    bytes to its own file, with ``O_DIRECT`` or buffered with early writeback; and rank 0 every
    byte to one file with ``O_DIRECT`` (the issue's one plain file)."""

    KINDS = ("write_direct_mine", "write_writeback_mine", "write_direct_one")

    def __init__(self, work: str, rank: int, rank_bytes: int, total_bytes: int) -> None:
        self.rank = rank
        self.dir = f"{work}/ceiling_in_rounds"
        self.mine = -(-rank_bytes // MiB) * MiB  # whole MiB: O_DIRECT lengths
        self.all = -(-total_bytes // MiB) * MiB
        self.src = _fill_buffer(64 * MiB)

    def run(self, kind: str) -> None:
        os.makedirs(self.dir, exist_ok=True)
        if kind == "write_direct_one":
            if self.rank == 0:
                _write_streams([f"{self.dir}/all.bin"], self.all, self.src, direct=True, fsync=True)
            return
        path = f"{self.dir}/rank{self.rank}.bin"
        if kind == "write_direct_mine":
            _write_streams([path], self.mine, self.src, direct=True, fsync=True)
        else:
            _write_streams([path], self.mine, self.src, direct=False, fsync=True, writeback=_sync_file_range() is not None)

    def close(self) -> None:
        self.src.close()


def fsync_files(paths) -> None:
    dirs = set()
    for p in paths:
        p = str(p)
        if os.path.isfile(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(os.path.dirname(p))
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_ours(d, model, optim):
    import checkpointer

    checkpointer.save_model_and_optim_state(d, model, optim)


def load_ours(d, model, optim):
    import checkpointer

    checkpointer.load_model_and_optim_state(d, model, optim)


def save_dcp(d, model, optim):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)  # FileSystemWriter, sync_files=True


def load_dcp(d, model, optim):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=d)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def start_async_save_dcp(d, model, optim, group) -> Callable[[], Any]:
    """Start DCP's ``async_save`` through ``group`` (it needs a CPU backend); returns the wait
    until the files are written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=d, process_group=group)
    return fut.upload_completion.result if hasattr(fut, "upload_completion") else fut.result


def save_seed(d, model, optim):
    from _seed_compat import patch_seed

    oc = patch_seed()
    files = oc.save_model_and_optim_state(d, model, optim)
    # The seed writes without fsync; make its files durable like the others', inside the timing.
    fsync_files(files)


def load_seed(d, model, optim):
    from _seed_compat import patch_seed

    oc = patch_seed()
    oc.load_model_and_optim_state(d, model, optim)


SAVE = {"ours": save_ours, "dcp": save_dcp, "seed": save_seed}
LOAD = {"ours": load_ours, "dcp": load_dcp, "seed": load_seed, "native": load_ours}


def _export_fn():
    try:
        from checkpointer import export_safetensors  # type: ignore[attr-defined]

        return export_safetensors, "checkpointer.export_safetensors"
    except ImportError:
        pass
    try:
        from checkpointer.tools.export import export_safetensors

        return export_safetensors, "checkpointer.tools.export.export_safetensors"
    except ImportError:
        return None, "Checkpointer().unshard + safetensors.torch.save_file"


def unshard_ours(d, out) -> dict:
    fn, how = _export_fn()
    if fn is not None:
        files = []
        for part in ("model", "optim"):
            files += fn(f"{d}/{part}", f"{out}/{part}.safetensors")
        fsync_files([f"{out}/model.safetensors", f"{out}/optim.safetensors"])
        return {"method": how}
    from safetensors.torch import save_file

    import checkpointer

    for part in ("model", "optim"):
        full = checkpointer.Checkpointer().unshard(f"{d}/{part}", no_dist=True)
        save_file(full, f"{out}/{part}.safetensors")
        del full
    fsync_files([f"{out}/model.safetensors", f"{out}/optim.safetensors"])
    return {"method": how}


def unshard_dcp(d, out) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(d, f"{out}/full.pt")
    fsync_files([f"{out}/full.pt"])
    return {"method": "torch.distributed.checkpoint.format_utils.dcp_to_torch_save"}


def unshard_seed(d, out) -> dict:
    from safetensors.torch import save_file

    from _seed_compat import patch_seed

    oc = patch_seed()
    for part in ("model", "optim"):
        full = oc.Checkpointer().unshard(f"{d}/{part}", no_dist=True)
        save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/{part}.safetensors")
        del full
    fsync_files([f"{out}/model.safetensors", f"{out}/optim.safetensors"])
    return {"method": "olmo_core Checkpointer().unshard + safetensors.torch.save_file"}


UNSHARD = {"ours": unshard_ours, "dcp": unshard_dcp, "seed": unshard_seed}


def interleaved(items: list[str], r: int) -> list[str]:
    """A B C in even rounds, C B A in odd ones."""
    return list(items) if r % 2 == 0 else list(reversed(items))


# --------------------------------------------------------------------------- worker: a process group


class Group:
    def __init__(self, cfg: dict, rank: int):
        import torch
        import torch.distributed as dist

        self.cfg = cfg
        self.rank = rank
        self.world = cfg["world"]
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=cfg["init"],
            rank=rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=cfg["pg_timeout_s"]),
        )
        self.records: list[dict] = []
        self.failed: set[tuple[str, str]] = set()
        self.slow_op_s = float(cfg.get("slow_op_s", 1e12))

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def agree_failed(self, failed: bool) -> bool:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if failed else 0])
        dist.all_reduce(t)
        return bool(t.item())

    def max_over_ranks(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(self, phase: str, system: str, rnd: int, fn: Callable[[], dict | None]) -> dict:
        """Run ``fn`` on every rank between barriers; time, peak RSS above baseline, error.

        The probe's ``gc.collect()`` runs before the opening barrier: after it, ranks whose
        collection took longer would start late and the slowest rank's time would include it."""
        probe = PeakProbe()
        self.barrier()
        t0 = time.perf_counter()
        error = None
        info: dict = {}
        try:
            info = fn() or {}
        except Exception as ex:  # noqa: BLE001 - recorded, the run goes on
            error = f"{type(ex).__name__}: {ex}"[:600]
            traceback.print_exc()
        t_op_end = time.perf_counter()
        any_failed = self.agree_failed(error is not None)  # also the closing barrier
        dt = time.perf_counter() - t0
        if self.max_over_ranks(dt) > self.slow_op_s and not any_failed:
            # The same decision on every rank: skip this system's further rounds of the phase.
            info["slow_skip"] = True
            self.failed.add((phase, system))
        rec = {
            "phase": phase,
            "system": system,
            "round": rnd,
            "loadavg_1m": os.getloadavg()[0],
            "time_s": dt,
            "t_start": t0,
            "t_op_end": t_op_end,
            "rss_extra_mib": probe.extra_mib(),
            "error": error,
            "any_failed": any_failed,
            **info,
        }
        if any_failed:
            self.failed.add((phase, system))
        self.records.append(rec)
        if self.rank == 0:
            print(f"[w{self.world}] {phase:>10} {system:>5} r{rnd}: {dt:8.2f} s  "
                  f"+{rec['rss_extra_mib']:.0f} MiB{'  FAILED ' + str(error) if any_failed else ''}", flush=True)
        return rec

    def rm(self, path: str) -> None:
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            settle_disk(os.path.dirname(path.rstrip("/")) or ".")
        self.barrier()

    def finish(self, extra: dict) -> None:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, self.records)
        if self.rank == 0:
            merged = []
            for i, rec in enumerate(gathered[0]):
                per_rank = [g[i] for g in gathered]
                out = dict(rec)
                out["time_s"] = max(r["time_s"] for r in per_rank)
                if "t_start" in rec:
                    out["t_start_per_rank"] = [r["t_start"] for r in per_rank]
                    out["t_op_end_per_rank"] = [r["t_op_end"] for r in per_rank]
                out["rss_extra_mib_per_rank"] = [r["rss_extra_mib"] for r in per_rank]
                out["rss_extra_mib"] = max(out["rss_extra_mib_per_rank"])
                for key in ("blocking_s", "rss_blocking_mib", "memcpy_s"):
                    if key in rec:
                        out[key] = max(r[key] for r in per_rank)
                        out[key + "_per_rank"] = [r[key] for r in per_rank]
                out["error"] = next((r["error"] for r in per_rank if r["error"]), None)
                merged.append(out)
            with open(self.cfg["result"], "w") as f:
                json.dump({"records": merged, **extra}, f, indent=1)
        dist.barrier()
        dist.destroy_process_group()


def preload(systems) -> None:
    """Import everything the timed operations use, so no timing includes an import."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.format_utils  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import checkpointer  # noqa: F401

    _export_fn()
    if "seed" in systems:
        from _seed_compat import patch_seed

        patch_seed()


def run_group(cfg: dict, rank: int) -> None:
    import torch
    import torch.distributed as dist

    g = Group(cfg, rank)
    preload(cfg["systems"])
    world, dim, rounds = cfg["world"], cfg["dim"], cfg["rounds"]
    systems = cfg["systems"]
    work = cfg["work"]
    model, optim = build_model(dim, world, fsdp=world > 1 or cfg.get("fsdp_at_1", False), seed=1234 + rank)
    train_step(model, optim, dim)
    total, largest = payload_bytes(model, optim)
    rank_bytes = sum(t.numel() * t.element_size() for _, t in state_tensors(model, optim))
    rank_bytes_all: list[Any] = [None] * world
    dist.all_gather_object(rank_bytes_all, rank_bytes)
    ref = cfg.get("reference") or fingerprint(model, optim)
    extra: dict[str, Any] = {
        "world": world,
        "payload_bytes": total,
        "largest_tensor_bytes": largest,
        "rank_state_bytes": rank_bytes_all,
        "reference": ref,
        "ckpt_bytes": {},
    }
    verified: dict[str, list] = {}

    def check(system: str, phase: str, rnd: int) -> None:
        ok, why = fingerprint_matches(fingerprint(model, optim), ref)
        g.records[-1]["verified"] = ok
        if not ok:
            g.records[-1]["verify_error"] = why
            if rank == 0:
                print(f"[w{world}] VERIFY FAILED {phase} {system} r{rnd}: {why}", flush=True)
        verified.setdefault(f"{phase}:{system}", []).append(ok)

    # ---- save at this world size
    if "save" in cfg["phases"]:
        last: dict[str, str] = {}
        writes = WriteCeiling(work, rank, rank_bytes, sum(rank_bytes_all))
        for r in range(rounds):
            for s in interleaved(list(systems) + list(WriteCeiling.KINDS), r):
                if s in WriteCeiling.KINDS:
                    g.timed("save", s, r, lambda: writes.run(s))
                    g.rm(writes.dir)
                    continue
                if ("save", s) in g.failed:
                    continue
                d = f"{work}/{s}/w{world}_save_r{r}"
                g.timed("save", s, r, lambda: SAVE[s](d, model, optim))
                if s in last:
                    g.rm(last[s])
                last[s] = d
        writes.close()
        g.barrier()
        if rank == 0:
            for s, d in last.items():
                extra["ckpt_bytes"][s] = sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())
        extra["checkpoints"] = {s: d for s, d in last.items() if ("save", s) not in g.failed}

    # ---- load (same or different world size), in place, verified
    if "load" in cfg["phases"]:
        ckpts = dict(cfg.get("checkpoints") or extra.get("checkpoints", {}))
        phase = cfg.get("load_phase", "load")
        if "native" in systems and "ours" in ckpts:
            # Same-topology baseline at this world size: restore the saved values (our resharding
            # load, untimed), save them with our library at this world size, and load that back
            # in the rounds below like the others.
            g.timed("native_prep", "ours", -1, lambda: LOAD["ours"](ckpts["ours"], model, optim))
            ckpts["native"] = f"{work}/ours/w{world}_native"
            g.timed(f"save_w{world}", "ours", 0, lambda: SAVE["ours"](ckpts["native"], model, optim))
        if g.rank == 0:
            for d in ckpts.values():
                warm_page_cache(d)
        g.barrier()
        ceiling = ReadCeiling(ckpts["ours"], rank, world) if "ours" in ckpts else None
        reads = {"preadv_mine": ceiling.read_mine, "preadv_one": ceiling.read_one} if ceiling else {}
        for r in range(rounds):
            for s in interleaved(list(systems) + list(reads), r):
                if s in reads:
                    g.timed(phase, s, r, reads[s])
                    continue
                if s not in ckpts or (phase, s) in g.failed:
                    continue
                zero_state(model, optim)
                g.timed(phase, s, r, lambda: LOAD[s](ckpts[s], model, optim))
                check(s, phase, r)
        if ceiling is not None:
            ceiling.close()

    # ---- async save blocking time vs a plain memory copy of this rank's state
    if "async" in cfg["phases"]:
        run_async(g, cfg, model, optim)

    # Leave the model as the reference so nothing downstream depends on the last system loaded.
    extra["verified"] = verified
    g.finish(extra)


def run_async(g: Group, cfg: dict, model, optim) -> None:
    import torch
    import torch.distributed as dist

    import checkpointer

    rounds, work, world = cfg["rounds"], cfg["work"], cfg["world"]
    pairs = [(t, torch.empty_like(t)) for _, t in state_tensors(model, optim)]
    for t, buf in pairs:  # touch the destination pages once: "preallocated"
        buf.copy_(t)

    def memcpy() -> dict:
        t0 = time.perf_counter()
        for t, buf in pairs:
            buf.copy_(t)
        return {"memcpy_s": time.perf_counter() - t0}

    def async_ours(d: str) -> dict:
        probe = PeakProbe()
        t0 = time.perf_counter()
        fut = checkpointer.async_save_model_and_optim_state(d, model, optim)
        blocking = time.perf_counter() - t0
        rss_blocking = probe.extra_mib()
        fut.result()
        return {"blocking_s": blocking, "rss_blocking_mib": rss_blocking}

    dcp_group = dist.new_group(backend="gloo")

    def async_dcp(d: str) -> dict:
        probe = PeakProbe()
        t0 = time.perf_counter()
        wait = start_async_save_dcp(d, model, optim, dcp_group)
        blocking = time.perf_counter() - t0
        rss_blocking = probe.extra_mib()
        wait()
        return {"blocking_s": blocking, "rss_blocking_mib": rss_blocking}

    runners = {"ours": async_ours, "dcp": async_dcp}
    # Warm-up (not counted): allocates our reusable staging buffers, as in a training run
    # after its first checkpoint.
    for s in ("ours", "dcp"):
        d = f"{work}/{s}/w{world}_async_warmup"
        g.timed("async_warmup", s, -1, lambda: runners[s](d))
        g.rm(d)
    for r in range(rounds):
        for s in interleaved(["ours", "dcp", "memcpy"], r):
            if s == "memcpy":
                g.timed("memcpy", "memcpy", r, memcpy)
                continue
            if ("async", s) in g.failed:
                continue
            d = f"{work}/{s}/w{world}_async_r{r}"
            g.timed("async", s, r, lambda: runners[s](d))
            g.rm(d)
    del pairs


def run_unshard(cfg: dict) -> None:
    import torch

    torch.set_num_threads(1)
    system, src, out = cfg["system"], cfg["src"], cfg["out_dir"]
    os.makedirs(out, exist_ok=True)
    preload([system])
    warm_page_cache(src)
    probe = PeakProbe()
    t0 = time.perf_counter()
    error, info = None, {}
    try:
        info = UNSHARD[system](src, out)
    except Exception as ex:  # noqa: BLE001
        error = f"{type(ex).__name__}: {ex}"[:600]
        traceback.print_exc()
    dt = time.perf_counter() - t0
    out_bytes = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
    rec = {
        "phase": "unshard",
        "system": system,
        "round": cfg["round"],
        "time_s": dt,
        "rss_extra_mib": probe.extra_mib(),
        "rss_extra_mib_per_rank": [probe.extra_mib()],
        "error": error,
        "any_failed": error is not None,
        "out_bytes": out_bytes,
        **info,
    }
    with open(cfg["result"], "w") as f:
        json.dump(rec, f)


def worker_main(cfg_path: str, rank: int) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg["role"] == "group":
        run_group(cfg, rank)
    else:
        run_unshard(cfg)


# --------------------------------------------------------------------------- orchestrator


def _env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def wait_or_kill(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Exit codes of ``procs`` (None: still running at the deadline, then killed)."""
    deadline = time.time() + timeout_s
    codes: list[int | None] = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:  # timed out, or the orchestrator is being stopped: no orphans
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def spawn(cfg: dict, nprocs: int, tmp: str, name: str, timeout_s: float) -> dict | None:
    """Run ``nprocs`` workers on ``cfg``; the parsed result file of rank 0, or None on failure."""
    cfg = dict(cfg)
    cfg["result"] = f"{tmp}/{name}.result.json"
    cfg["init"] = f"file://{tmp}/{name}.init"
    path = f"{tmp}/{name}.cfg.json"
    with open(path, "w") as f:
        json.dump(cfg, f)
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", path, "--rank", str(r)], env=_env())
        for r in range(nprocs)
    ]
    codes = wait_or_kill(procs, timeout_s)
    if any(c != 0 for c in codes):
        print(f"!! worker group {name} exited with {codes}", flush=True)
    if os.path.exists(cfg["result"]):
        with open(cfg["result"]) as f:
            return json.load(f)
    return None


# ---- machine ceilings


def _fill_buffer(n: int) -> mmap.mmap:
    buf = mmap.mmap(-1, n)  # page aligned: usable for O_DIRECT
    block = os.urandom(1 << 20)
    for off in range(0, n, len(block)):
        buf[off : off + len(block)] = block[: n - off]
    return buf


def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn


def _write_streams(
    paths: list[str], per_file: int, src: mmap.mmap, *, direct: bool, fsync: bool, writeback: bool = False
) -> float:
    """Plain writes of ``per_file`` bytes to each path in parallel. ``writeback``: after every
    32 MiB, ask the kernel to start writing them out (``sync_file_range(SYNC_FILE_RANGE_WRITE)``)."""
    view = memoryview(src)
    start_writeback = _sync_file_range() if writeback else None

    def one(path: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o644)
        try:
            left, done, flushed = per_file, 0, 0
            while left:
                n = os.write(fd, view[: min(left, len(view), 32 * MiB if start_writeback else len(view))])
                left -= n
                done += n
                if start_writeback is not None and done - flushed >= 32 * MiB:
                    start_writeback(fd, flushed, done - flushed, 2)
                    flushed = done
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as ex:
        list(ex.map(one, paths))
    return time.perf_counter() - t0


def _read_streams(paths: list[str], per_file: int, threads: int | None = None) -> float:
    """preadv of whole files, in requests of at most 64 MiB, straight into preallocated (touched)
    tensors, on ``threads`` threads (default one per file; more split each file into ranges)."""
    import torch

    threads = threads or len(paths)
    dests = [torch.zeros(per_file, dtype=torch.uint8) for _ in paths]
    views = [memoryview(d.numpy()) for d in dests]
    parts = max(1, threads // len(paths))
    step = -(-per_file // parts)
    tasks = [(i, lo, min(lo + step, per_file)) for i in range(len(paths)) for lo in range(0, per_file, step)]
    fds = [os.open(p, os.O_RDONLY) for p in paths]

    def one(task: tuple[int, int, int]) -> None:
        i, off, end = task
        while off < end:
            n = os.preadv(fds[i], [views[i][off : min(end, off + 64 * MiB)]], off)
            if n <= 0:
                raise OSError(f"short read of {paths[i]}")
            off += n

    try:
        with ThreadPoolExecutor(threads) as ex:
            # One untimed pass first: the loads it is compared with read files already read once
            # (the first read after a write is markedly slower here), then the timed pass.
            list(ex.map(one, tasks))
            t0 = time.perf_counter()
            list(ex.map(one, tasks))
            dt = time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)
    del views, dests
    return dt


def measure_ceilings(work: str, total: int, world: int, label: str) -> dict[str, float]:
    """One round of every plain-file ceiling on ``total`` bytes (times in seconds)."""
    d = f"{work}/ceiling"
    os.makedirs(d, exist_ok=True)
    io_threads = int(os.environ.get("CHECKPOINTER_IO_THREADS", "4"))  # what our load uses per rank
    align = 1 * MiB
    src = _fill_buffer(64 * MiB)
    out: dict[str, float] = {}
    try:
        for streams in sorted({1, world}):
            per_file = -(-total // streams // align) * align
            paths = [f"{d}/s{streams}_{i}.bin" for i in range(streams)]
            out[f"write_buffered_fsync_x{streams}"] = _write_streams(paths, per_file, src, direct=False, fsync=True)
            for p in paths:
                os.unlink(p)
            settle_disk(d)
            if _sync_file_range() is not None:
                out[f"write_writeback_fsync_x{streams}"] = _write_streams(
                    paths, per_file, src, direct=False, fsync=True, writeback=True
                )
            out[f"read_preadv_x{streams}"] = _read_streams(paths, per_file)
            if streams == world and io_threads > 1:
                out[f"read_preadv_x{world * io_threads}"] = _read_streams(paths, per_file, world * io_threads)
            for p in paths:
                os.unlink(p)
            settle_disk(d)
            try:
                out[f"write_odirect_fsync_x{streams}"] = _write_streams(paths, per_file, src, direct=True, fsync=True)
            except OSError as ex:
                print(f"O_DIRECT write not possible here: {ex}", flush=True)
            for p in paths:
                if os.path.exists(p):
                    os.unlink(p)
            settle_disk(d)
        per_file = -(-total // align) * align
        path = f"{d}/pagecache.bin"
        out["write_buffered_nofsync_x1"] = _write_streams([path], per_file, src, direct=False, fsync=False)
        fsync_files([path])  # flush outside the timing before the next measurement
        os.unlink(path)
    finally:
        src.close()
        shutil.rmtree(d, ignore_errors=True)
        settle_disk(work)
    out["loadavg_1m"] = os.getloadavg()[0]
    print(f"[ceiling {label}] " + "  ".join(f"{k}={total / v / GB:.2f}GB/s" for k, v in out.items() if k != "loadavg_1m")
          + f"  (load average {out['loadavg_1m']:.1f})", flush=True)
    return out


# ---- aggregation and reports


def med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(records: list[dict], phase: str, system: str, key: str = "time_s") -> dict | None:
    rs = [r for r in records if r["phase"] == phase and r["system"] == system]
    if not rs:
        return None
    ok = [r for r in rs if not r.get("any_failed")]
    errors = sorted({r["error"] for r in rs if r.get("error")})
    if not ok:
        return {"ok": False, "error": errors[0] if errors else "failed", "rounds": len(rs)}
    return {
        "ok": True,
        "median_s": med([r[key] for r in ok]),
        "all_s": [r[key] for r in ok],
        "rss_extra_mib": med([r["rss_extra_mib"] for r in ok]),
        "rss_extra_mib_max": max(r["rss_extra_mib"] for r in ok),
        "rss_extra_mib_per_rank": ok[len(ok) // 2].get("rss_extra_mib_per_rank"),
        "verified": all(r.get("verified", True) for r in ok),
        "errors": errors,
        "rounds": len(ok),
        **({"total_median_s": med([r["time_s"] for r in ok])} if key != "time_s" else {}),
        **({"rss_blocking_mib": med([r["rss_blocking_mib"] for r in ok])} if "rss_blocking_mib" in ok[0] else {}),
        **({"method": ok[0]["method"]} if "method" in ok[0] else {}),
    }


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def _la(x: dict | None) -> str:
    return "–" if not x else f"median {x['median']:.1f} (min {x['min']:.1f}, max {x['max']:.1f})"


def build_report(meta: dict, ops: list[dict], ceilings: dict, goals: list[dict], seed_note: str) -> str:
    lines = []
    lines.append("# checkpointer vs DCP vs the seed (OLMo-core 0.1.0)\n")
    lines.append(
        f"{meta['date']}; {meta['machine']}; torch {meta['torch']}; "
        f"model: {N_LAYERS} x Linear({meta['dim']}, {meta['dim']}, bias=False) fp32 = "
        f"{meta['param_bytes'] / 2**30:.2f} GiB of parameters, AdamW state; checkpoint payload "
        f"{meta['payload_bytes'] / GB:.2f} GB; FSDP2 on a CPU mesh, gloo, world size {meta['world']}; "
        f"{meta['rounds']} rounds, systems interleaved, medians. Seed: {seed_note}. "
        f"1-minute load average during the operations (other jobs share the machine): "
        f"{_la(meta.get('loadavg_1m_per_op'))}.\n"
    )
    lines.append(
        "| operation | ours s | ours GB/s | DCP s | DCP GB/s | seed s | ours/DCP speed ratio "
        "| ours peak RSS MiB | DCP peak RSS MiB | fraction of ceiling |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op in ops:
        o, d, s = op.get("ours"), op.get("dcp"), op.get("seed")

        def t(x):
            if x is None:
                return "–"
            if not x.get("ok"):
                err = str(x.get("error") or "")
                return "not finished" if err.startswith("did not finish") else "failed"
            cell = fmt(x["median_s"])
            if x["rounds"] < meta["rounds"]:
                cell += f" ({x['rounds']} round{'s' if x['rounds'] > 1 else ''})"
            return cell

        def bw(x):
            return fmt(op["bytes"] / x["median_s"] / GB) if x and x.get("ok") else "–"

        def mem(x):
            return fmt(x["rss_extra_mib"], ".0f") if x and x.get("ok") else "–"

        ratio = (d["median_s"] / o["median_s"]) if (o and d and o.get("ok") and d.get("ok")) else None
        seed_cell = t(s) if s is not None else (op.get("seed_na") or "–")
        lines.append(
            f"| {op['label']} | {t(o)} | {bw(o)} | {t(d)} | {bw(d)} | {seed_cell} | "
            f"{fmt(ratio)}{'x' if ratio else ''} | {mem(o)} | {mem(d)} | {op.get('fraction_text', '–')} |"
        )
    lines.append("")
    lines.append("Notes: GB/s is checkpoint payload bytes (parameters + optimizer state) / time, GB = 1e9 B. "
                 "Peak RSS is VmHWM above the process's RSS just before the operation (after resetting the "
                 "peak via /proc/self/clear_refs), the maximum over ranks, the median over rounds; it counts "
                 "file pages mapped into the process. Loads are warm (every checkpoint file is read once, untimed, before the rounds: in the page "
                 "cache, as are the ceiling's). Every load was checked against the saved values "
                 "(state zeroed before it). "
                 "Seed saves and every unshard output are fsynced inside the timing (ours and DCP saves fsync "
                 "on their own). After deleting a checkpoint or a ceiling's file, the benchmark flushes and "
                 "waits for the disk to go idle before timing anything (the file system discards freed "
                 "blocks at its next journal commit; that I/O would otherwise slow whatever is timed next). "
                 "The async 'DCP' figure is DCP's `async_save` (thread) for reference. "
                 "Async saves are measured after one warm-up save (not counted) that allocates our reusable "
                 "staging buffers"
                 + (f" (that first save: {meta['async_first_save_blocking_s']:.2f} s blocking, "
                    f"+{meta['async_first_save_rss_mib']:.0f} MiB per rank, kept for the next saves)"
                    if meta.get("async_first_save_blocking_s") is not None else "")
                 + ".\n")
    failures = []
    for op in ops:
        for sname in ("ours", "dcp", "seed"):
            x = op.get(sname)
            if x and (not x.get("ok") or x.get("errors")):
                failures.append(f"- {op['label']}, {sname}: {x.get('error') or '; '.join(x.get('errors', []))}")
            if x and x.get("ok") and x["rounds"] < meta["rounds"]:
                failures.append(f"- {op['label']}, {sname}: {x['rounds']} of {meta['rounds']} rounds "
                                "(a round took longer than the limit for that system; see compare.json)")
            if x and x.get("ok") and not x.get("verified", True):
                failures.append(f"- {op['label']}, {sname}: **loaded values did not match the saved ones**")
    if failures:
        lines.append("Failures and shortened measurements:\n")
        lines += failures
        lines.append("")
    lines.append("## Machine ceilings (same run, same total bytes)\n")
    lines.append("| measurement | median s | GB/s |")
    lines.append("|---|---:|---:|")
    for k, v in ceilings.items():
        lines.append(f"| {v['label']} | {fmt(v['median_s'])} | {fmt(v['gbps'])} |")
    lines.append("")
    lines.append("## Goals (measured, not asserted)\n")
    lines.append("| goal | target | measured | met |")
    lines.append("|---|---|---|---|")
    for gl in goals:
        met = "–" if gl["met"] is None else ("yes" if gl["met"] else "**no**")
        lines.append(f"| {gl['goal']} | {gl['target']} | {gl['measured']} | {met} |")
    lines.append("")
    lines.append("## Per-round times (s)\n")
    lines.append("| operation | system | rounds | peak RSS MiB per rank (median round) |")
    lines.append("|---|---|---|---|")
    for op in ops:
        for s in ("ours", "dcp", "seed"):
            x = op.get(s)
            if x and x.get("ok"):
                per = x.get("rss_extra_mib_per_rank") or []
                lines.append(f"| {op['label']} | {s} | {', '.join(fmt(v) for v in x['all_s'])} | "
                             f"{', '.join(fmt(v, '.0f') for v in per)} |")
            elif x:
                lines.append(f"| {op['label']} | {s} | failed: {x.get('error')} | |")
    lines.append("")
    return "\n".join(lines)


def plot(path: str, ops: list[dict], ceilings: dict) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no chart"
    systems = [("ours", "checkpointer", "#1f77b4"), ("dcp", "DCP", "#ff7f0e"), ("seed", "seed", "#2ca02c")]
    labels = [op["label"] for op in ops]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    width = 0.27
    for ax, what in zip(axes, ("GB/s", "peak RSS MiB")):
        for i, (key, name, color) in enumerate(systems):
            vals = []
            for op in ops:
                x = op.get(key)
                if x and x.get("ok"):
                    vals.append(op["bytes"] / x["median_s"] / GB if what == "GB/s" else x["rss_extra_mib"])
                else:
                    vals.append(0)
            xs = [j + (i - 1) * width for j in range(len(ops))]
            ax.bar(xs, vals, width, label=name, color=color)
        ax.set_xticks(range(len(ops)))
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(what)
        ax.grid(axis="y", alpha=0.3)
    if "write_fsync_best" in ceilings:
        axes[0].axhline(ceilings["write_fsync_best"]["gbps"], ls="--", color="gray", lw=1, label="write+fsync ceiling")
    if "read_best" in ceilings:
        axes[0].axhline(ceilings["read_best"]["gbps"], ls=":", color="black", lw=1, label="preadv read ceiling")
    axes[0].set_title("throughput (higher is better)")
    axes[1].set_title("peak RSS above baseline, max over ranks (lower is better)")
    axes[1].set_yscale("symlog")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="GiB of fp32 parameters (default 1.0)")
    ap.add_argument("--world-size", type=int, default=2, help="world size of the save (default 2)")
    ap.add_argument("--reshard-worlds", default="1,3", help="world sizes to load at besides the save's (default 1,3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per measurement, >= 3 recommended (default 3)")
    ap.add_argument("--out", default=str(HERE / "results"), help="output directory (default benchmarks/results)")
    ap.add_argument("--work-dir", default=None, help="where checkpoints go (default a temp dir under /tmp)")
    ap.add_argument("--no-seed", action="store_true", help="skip the seed even if installed")
    ap.add_argument("--timeout-s", type=float, default=3600, help="limit per worker group")
    ap.add_argument("--seed-timeout-s", type=float, default=600, help="limit for each of the seed's resharding-load groups")
    ap.add_argument("--seed-slow-s", type=float, default=120, help="a seed resharding load slower than this ends its rounds")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.rank)
        return 0

    import signal

    import torch

    from _seed_compat import seed_available

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below
    t_start = time.time()
    W = args.world_size
    dim = layer_dim(args.size_gb)
    param_bytes = N_LAYERS * dim * dim * 4
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.work_dir)
    tmp = f"{work}/ctl"
    os.makedirs(tmp)
    if args.no_seed:
        seed_ok, seed_note = False, "not run (--no-seed)"
    else:
        seed_ok, seed_note = seed_available()
        seed_note = (seed_note + ", patched for torch 2.13 (benchmarks/_seed_compat.py)") if seed_ok else f"not run: {seed_note}"
    systems = ["ours", "dcp"] + (["seed"] if seed_ok else [])
    print(f"size {param_bytes / 2**30:.2f} GiB params (dim {dim}), world {W}, rounds {args.rounds}, "
          f"systems {systems}, work dir {work}", flush=True)
    free = shutil.disk_usage(work).free
    if free < 6 * 3 * param_bytes:
        print(f"warning: only {free / GB:.1f} GB free under {work}", flush=True)

    payload_est = 3 * param_bytes
    base_cfg = {"dim": dim, "rounds": args.rounds, "systems": systems, "work": work, "pg_timeout_s": 900}
    ceil_rounds: list[dict] = []
    first_half = (args.rounds + 1) // 2
    try:
        for r in range(first_half):
            ceil_rounds.append(measure_ceilings(work, payload_est, W, f"round {r}"))

        main_res = spawn({**base_cfg, "role": "group", "world": W, "phases": ["save", "load", "async"],
                          "load_phase": "load"}, W, tmp, f"w{W}", args.timeout_s)
        if main_res is None:
            print("the main worker group produced no result", flush=True)
            return 1
        records = list(main_res["records"])
        payload = main_res["payload_bytes"]
        ckpts = main_res.get("checkpoints", {})
        ref = main_res["reference"]

        reshard_worlds = [int(x) for x in args.reshard_worlds.split(",") if x.strip()]
        reshard_res = {}
        for w2 in reshard_worlds:
            res = spawn({**base_cfg, "role": "group", "world": w2, "phases": ["load"], "load_phase": f"load_w{w2}",
                         "checkpoints": ckpts, "reference": ref,
                         "systems": [s for s in ("ours", "dcp") if s in ckpts] + (["native"] if "ours" in ckpts else [])},
                        w2, tmp, f"w{w2}", args.timeout_s)
            if res is not None:
                records += res["records"]
                reshard_res[w2] = {k: v for k, v in res.items() if k != "records"}
        # The seed's resharding load is slow (per-row Python loops): its own group afterwards,
        # with a limit, a round over --seed-slow-s ending its rounds.
        for w2 in reshard_worlds:
            if "seed" not in ckpts:
                continue
            res = spawn({**base_cfg, "role": "group", "world": w2, "phases": ["load"], "load_phase": f"load_w{w2}",
                         "checkpoints": ckpts, "reference": ref, "systems": ["seed"], "slow_op_s": args.seed_slow_s},
                        w2, tmp, f"w{w2}_seed", args.seed_timeout_s)
            if res is not None:
                records += res["records"]
                reshard_res[f"{w2}_seed"] = {k: v for k, v in res.items() if k != "records"}
            else:
                records.append({"phase": f"load_w{w2}", "system": "seed", "round": 0, "time_s": None,
                                "rss_extra_mib": None, "any_failed": True,
                                "error": f"did not finish within {args.seed_timeout_s:.0f} s (killed)"})

        for r in range(args.rounds):
            for s in interleaved([s for s in systems if s in ckpts], r):
                outd = f"{work}/unshard_out/{s}_r{r}"
                res = spawn({"role": "unshard", "system": s, "src": ckpts[s], "out_dir": outd, "round": r},
                            1, tmp, f"unshard_{s}_r{r}", args.timeout_s)
                if res is not None:
                    records.append(res)
                    print(f"[unshard] {s:>5} r{r}: {res['time_s']:8.2f} s  +{res['rss_extra_mib']:.0f} MiB"
                          f"{'  FAILED ' + str(res['error']) if res.get('error') else ''}", flush=True)
                shutil.rmtree(outd, ignore_errors=True)
                settle_disk(work)

        for r in range(first_half, args.rounds):
            ceil_rounds.append(measure_ceilings(work, payload_est, W, f"round {r}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    # ---- ceilings: medians, scaled to the exact payload
    ceilings: dict[str, dict] = {}
    names = {
        "write_buffered_fsync_x1": "buffered write + fsync, 1 file",
        f"write_buffered_fsync_x{W}": f"buffered write + fsync, {W} files in parallel",
        "write_odirect_fsync_x1": "O_DIRECT write + fsync, 1 file",
        f"write_odirect_fsync_x{W}": f"O_DIRECT write + fsync, {W} files in parallel",
        "write_writeback_fsync_x1": "buffered write, writeback started every 32 MiB, + fsync, 1 file",
        f"write_writeback_fsync_x{W}": f"buffered write, writeback started every 32 MiB, + fsync, {W} files in parallel",
        "write_buffered_nofsync_x1": "buffered write, no fsync (page cache), 1 file",
        "read_preadv_x1": "preadv into preallocated tensors (warm), 1 file",
        f"read_preadv_x{W}": f"preadv into preallocated tensors (warm), {W} files in parallel",
        f"read_preadv_x{W * 4}": f"preadv into preallocated tensors (warm), {W} files, {W * 4} threads "
                                 "(our load's thread count)",
    }
    for key, label in names.items():
        vals = [c[key] for c in ceil_rounds if key in c]
        if vals:
            m = med(vals) * payload / payload_est
            ceilings[key] = {"label": label, "median_s": m, "gbps": payload / m / GB, "all_s": vals}
    writes = [k for k in ceilings if k.startswith("write_") and "nofsync" not in k]
    reads = [k for k in ceilings if k.startswith("read_")]
    if writes:
        best = min(writes, key=lambda k: ceilings[k]["median_s"])
        ceilings["write_fsync_best"] = {**ceilings[best], "label": f"best write+fsync ceiling ({ceilings[best]['label']})"}
    if reads:
        best = min(reads, key=lambda k: ceilings[k]["median_s"])
        ceilings["read_best"] = {**ceilings[best], "label": f"best read ceiling ({ceilings[best]['label']})"}
    memcpy = summarize(records, "memcpy", "memcpy", key="memcpy_s")
    if memcpy and memcpy.get("ok"):
        rank_bytes = max(main_res["rank_state_bytes"])
        ceilings["memcpy"] = {"label": f"memory copy of one rank's state into preallocated tensors ({rank_bytes / GB:.2f} GB, max over ranks)",
                              "median_s": memcpy["median_s"], "gbps": rank_bytes / memcpy["median_s"] / GB,
                              "all_s": memcpy["all_s"]}

    # ---- operations
    ops: list[dict] = []

    def add(label: str, phase: str, key: str = "time_s", **kw) -> dict:
        op = {"label": label, "phase": phase, "bytes": payload}
        for s in ("ours", "dcp", "seed"):
            x = summarize(records, phase, s, key=key)
            if x is not None:
                op[s] = x
        if not seed_ok:
            op["seed_na"] = "not run"
        op.update(kw)
        ops.append(op)
        return op

    def same_rounds_read(phase: str, worlds: int) -> str | None:
        """The faster of the plain reads timed in ``phase``'s own rounds (a ceilings entry)."""
        found = []
        for s in CEILING_SYSTEMS:
            x = summarize(records, phase, s)
            if x and x.get("ok"):
                threads = int(os.environ.get("CHECKPOINTER_IO_THREADS", "4"))
                how = (f"each of {worlds} processes its 1/{worlds} of every file, {threads} threads each"
                       if s == "preadv_mine" else f"one process every byte, {threads * worlds} threads")
                key = f"read_same_rounds_{phase}_{s}"
                ceilings[key] = {"label": f"preadv of our checkpoint's files into preallocated tensors (warm), {how}; "
                                          f"timed in the rounds of '{phase}', between the loads",
                                 "median_s": x["median_s"], "gbps": payload / x["median_s"] / GB, "all_s": x["all_s"]}
                found.append(key)
        return min(found, key=lambda k: ceilings[k]["median_s"]) if found else None

    def read_fraction(op: dict, phase: str, worlds: int) -> None:
        """``op``'s fraction of the read ceiling timed in its own rounds, and of the best read
        ceiling timed apart (between phases)."""
        key = same_rounds_read(phase, worlds)
        op["fraction"] = frac(op, key) if key else None
        op["fraction_apart"] = frac(op, "read_best")
        parts = []
        if op["fraction"] is not None:
            parts.append(f"{fmt(op['fraction'])} of preadv read (same rounds)")
        if op["fraction_apart"] is not None:
            parts.append(f"{fmt(op['fraction_apart'])} of best preadv read (apart)")
        op["fraction_text"] = "; ".join(parts) or "–"

    def frac(op: dict, ceiling_key: str, extra_s: float = 0.0) -> float | None:
        o = op.get("ours")
        if not (o and o.get("ok") and ceiling_key in ceilings):
            return None
        return (ceilings[ceiling_key]["median_s"] + extra_s) / o["median_s"]

    save = add(f"save (W={W}, fsync)", "save")
    write_labels = {
        "write_direct_mine": f"O_DIRECT write + fsync, each of {W} processes its own bytes to its own file",
        "write_writeback_mine": f"buffered write, writeback started every 32 MiB, + fsync, each of {W} processes its own bytes",
        "write_direct_one": "O_DIRECT write + fsync of every byte to one file, one process",
    }
    same_writes = {}
    for kind, label in write_labels.items():
        x = summarize(records, "save", kind)
        if x and x.get("ok"):
            key = f"same_rounds_{kind}"
            ceilings[key] = {"label": f"{label}; timed in the rounds of 'save', between the saves",
                             "median_s": x["median_s"], "gbps": payload / x["median_s"] / GB, "all_s": x["all_s"]}
            same_writes[kind] = key
    save["fraction"] = frac(save, min(same_writes.values(), key=lambda k: ceilings[k]["median_s"])) if same_writes else None
    save["fraction_one_file"] = frac(save, same_writes["write_direct_one"]) if "write_direct_one" in same_writes else None
    save["fraction_apart"] = frac(save, "write_fsync_best")
    save["fraction_text"] = "; ".join(
        t for t in (
            f"{fmt(save['fraction'])} of best write+fsync (same rounds)" if save["fraction"] is not None else "",
            f"{fmt(save['fraction_apart'])} of best write+fsync (apart)" if save["fraction_apart"] is not None else "",
        ) if t
    ) or "–"
    load = add(f"load, same W={W}", "load")
    read_fraction(load, "load", W)
    reshard_ops = []
    for w2 in reshard_worlds:
        op = add(f"load {W}->{w2} (reshard)", f"load_w{w2}")
        read_fraction(op, f"load_w{w2}", w2)
        native = summarize(records, f"load_w{w2}", "native")
        if native is not None:
            nop = {"label": f"load {w2}->{w2} (ours, same topology: baseline for {W}->{w2})", "phase": f"load_w{w2}",
                   "bytes": payload, "ours": native, "seed_na": "–"}
            read_fraction(nop, f"load_w{w2}", w2)
            ops.append(nop)
            op["native"] = native
        reshard_ops.append((w2, op))
    uns = add("unshard to file (1 process)", "unshard")
    if "read_best" in ceilings and "write_fsync_best" in ceilings:
        f = frac(uns, "read_best", ceilings["write_fsync_best"]["median_s"])
        uns["fraction"] = f
        uns["fraction_text"] = f"{fmt(f)} of read+write+fsync" if f else "–"
    asy = add(f"async save, blocking (W={W})", "async", key="blocking_s")
    if asy.get("seed") is None:
        asy["seed_na"] = "n/a"
    if "memcpy" in ceilings and asy.get("ours", {}).get("ok"):
        f = ceilings["memcpy"]["median_s"] / asy["ours"]["median_s"]
        asy["fraction"] = f
        asy["fraction_text"] = f"memcpy/blocking = {fmt(f)}"
    asy_total = add(f"async save, until written (W={W})", "async", key="time_s")
    if asy_total.get("seed") is None:
        asy_total["seed_na"] = "n/a"

    # ---- goals
    def ratio(op: dict) -> float | None:
        o, d = op.get("ours"), op.get("dcp")
        if o and d and o.get("ok") and d.get("ok"):
            return d["median_s"] / o["median_s"]
        return None

    def ge(v, target):
        return None if v is None else v >= target

    def le(v, target):
        return None if v is None else v <= target

    goals = []
    r = ratio(save)
    goals.append({"goal": "save speed vs DCP", "target": ">= 1.5x", "measured": f"{fmt(r)}x", "met": ge(r, 1.5)})
    goals.append({"goal": "save vs best plain write+fsync (timed in the save's own rounds: O_DIRECT or early "
                          "writeback, a file per process or one file)", "target": ">= 0.90",
                  "measured": fmt(save.get("fraction")), "met": ge(save.get("fraction"), 0.9)})
    goals.append({"goal": "save vs one plain file's O_DIRECT write+fsync, timed in the save's own rounds (the issue's ceiling)",
                  "target": ">= 0.90", "measured": fmt(save.get("fraction_one_file")), "met": ge(save.get("fraction_one_file"), 0.9)})
    goals.append({"goal": "(for reference) save vs best plain write+fsync timed apart, between phases",
                  "target": "–", "measured": fmt(save.get("fraction_apart")), "met": None})
    # The issue's own ceiling, as timed apart: the faster of one plain file written buffered or
    # with O_DIRECT, + fsync.
    plain = [ceilings[k]["median_s"] for k in ("write_buffered_fsync_x1", "write_odirect_fsync_x1") if k in ceilings]
    if plain and save.get("ours", {}).get("ok"):
        f = min(plain) / save["ours"]["median_s"]
        goals.append({"goal": "(for reference) save vs the faster of one plain file's buffered or O_DIRECT write+fsync, timed apart",
                      "target": "–", "measured": fmt(f), "met": None})
        if save.get("dcp", {}).get("ok"):
            need = min(plain) / (save["dcp"]["median_s"] / 1.5)
            goals.append({"goal": "(for reference) what 1.5x DCP asks, as a fraction of that plain-file ceiling",
                          "target": "–", "measured": fmt(need), "met": None})
    r = ratio(load)
    goals.append({"goal": "load (same W) speed vs DCP", "target": ">= 2.5x", "measured": f"{fmt(r)}x", "met": ge(r, 2.5)})
    goals.append({"goal": "load (same W) vs preadv read ceiling (the faster plain read of the same files, timed in the "
                          "load's own rounds)", "target": ">= 0.60",
                  "measured": fmt(load.get("fraction")), "met": ge(load.get("fraction"), 0.6)})
    goals.append({"goal": "(for reference) load (same W) vs the best preadv read ceiling timed apart, between phases",
                  "target": "–", "measured": fmt(load.get("fraction_apart")), "met": None})
    for w2, op in reshard_ops:
        r = ratio(op)
        goals.append({"goal": f"load {W}->{w2} speed vs DCP", "target": ">= 2.5x", "measured": f"{fmt(r)}x", "met": ge(r, 2.5)})
        native = op.get("native")
        rel = (op["ours"]["median_s"] / native["median_s"]) if (op.get("ours", {}).get("ok") and native and native.get("ok")) else None
        op["vs_same_topology"] = rel
        goals.append({"goal": f"load {W}->{w2} time / same-topology load time ({w2}->{w2}, ours)", "target": "<= 1.2",
                      "measured": fmt(rel), "met": le(rel, 1.2)})
        rel2 = (op["ours"]["median_s"] / load["ours"]["median_s"]) if (op.get("ours", {}).get("ok") and load.get("ours", {}).get("ok")) else None
        op["vs_save_world_load"] = rel2
        goals.append({"goal": f"(for reference) load {W}->{w2} time / load {W}->{W} time", "target": "–",
                      "measured": fmt(rel2), "met": None})
    r = ratio(uns)
    goals.append({"goal": "unshard speed vs DCP", "target": ">= 3x", "measured": f"{fmt(r)}x", "met": ge(r, 3.0)})
    largest = main_res["largest_tensor_bytes"]
    u = uns.get("ours")
    if u and u.get("ok"):
        goals.append({"goal": "unshard peak extra memory vs largest tensor", "target": f"<= one tensor ({largest / MiB:.0f} MiB; +5 % +16 MiB allowed for the interpreter)",
                      "measured": f"{u['rss_extra_mib_max']:.0f} MiB", "met": u["rss_extra_mib_max"] <= largest / MiB * 1.05 + 16})
    for label, op, worlds in [(f"load same W={W}", load, W)] + [(f"load {W}->{w2}", op, w2) for w2, op in reshard_ops]:
        o = op.get("ours")
        if not (o and o.get("ok")):
            continue
        rank_ckpt_mib = payload / worlds / MiB
        limit = 0.10 * rank_ckpt_mib + 64
        goals.append({"goal": f"peak extra memory per rank, {label}", "target": f"<= {limit:.0f} MiB (10% of {rank_ckpt_mib:.0f} MiB + 64)",
                      "measured": f"{o['rss_extra_mib_max']:.0f} MiB (max over rounds and ranks)", "met": o["rss_extra_mib_max"] <= limit})
    if "memcpy" in ceilings and asy.get("ours", {}).get("ok"):
        rel = asy["ours"]["median_s"] / ceilings["memcpy"]["median_s"]
        goals.append({"goal": "async save blocking time / plain memory copy", "target": "<= 1.3",
                      "measured": f"{fmt(rel)} ({fmt(asy['ours']['median_s'], '.3f')} s vs {fmt(ceilings['memcpy']['median_s'], '.3f')} s)",
                      "met": rel <= 1.3})

    meta = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
                   f"load average at start {os.getloadavg()[0]:.1f}",
        "torch": torch.__version__,
        "dim": dim,
        "param_bytes": param_bytes,
        "payload_bytes": payload,
        "world": W,
        "rounds": args.rounds,
        "size_gb": args.size_gb,
        "wall_s": time.time() - t_start,
        "loadavg_1m_per_op": {"min": min(la), "median": med(la), "max": max(la)} if (la := [r["loadavg_1m"] for r in records if r.get("loadavg_1m") is not None]) else None,
    }
    warm = [r for r in records if r["phase"] == "async_warmup" and r["system"] == "ours" and not r.get("any_failed")]
    if warm:
        meta["async_first_save_rss_mib"] = warm[0]["rss_extra_mib"]
        meta["async_first_save_blocking_s"] = warm[0].get("blocking_s")
    report = build_report(meta, ops, ceilings, goals, seed_note)
    (out_dir / "compare.md").write_text(report)
    chart_note = plot(str(out_dir / "compare.png"), ops, ceilings)
    with open(out_dir / "compare.json", "w") as fjson:
        json.dump({"meta": meta, "seed": seed_note, "operations": ops, "ceilings": ceilings, "goals": goals,
                   "checkpoint_bytes_on_disk": main_res.get("ckpt_bytes"), "reshard_groups": reshard_res,
                   "verified": {"main": main_res.get("verified"), **{f"w{k}": v.get("verified") for k, v in reshard_res.items()}},
                   "records": records, "chart": chart_note or "compare.png"}, fjson, indent=1)
    print(report)
    print(f"wrote {out_dir}/compare.md, compare.json{', compare.png' if not chart_note else ''} in {meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
