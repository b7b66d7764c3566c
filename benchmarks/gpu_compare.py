"""Benchmark checkpointer against torch.distributed.checkpoint (DCP) on CUDA tensors with NCCL.

One model (a stack of ``Linear(d, d, bias=False)``, about ``--size-gb`` GiB of fp32 parameters)
on the device, FSDP2 ``fully_shard`` on a 1-D mesh of ``--world-size`` ranks, and one AdamW
step so that the optimizer holds exp_avg and exp_avg_sq (the checkpoint is about three times
the parameters). The script starts its own workers on a free port of 127.0.0.1: one per GPU
with NCCL, or, with ``--device cpu``, processes on the CPU with gloo (to try the script on a
machine without a GPU). In one run, ours and DCP interleaved (round r runs them in order, the
next round in reverse), medians over ``--rounds`` rounds:

* save with fsync, each round into a fresh directory;
* load at the same world size, in place into the live model and optimizer, warm (the files
  are in the page cache), checked exactly (``torch.equal``) against the saved state;
* async save: the time until the call returns, and until the files are written;
* floors, in the same rounds: a device-to-host copy of each rank's state into freshly
  allocated pageable memory and into preallocated pinned memory; one plain file per rank of
  the same bytes, written and fsynced, then read back (preadv, warm).

For each: seconds, GB/s of checkpoint payload, peak host RSS and peak CUDA memory above the
rank's baseline, and the ours/DCP speed ratio.

Usage::

    python benchmarks/gpu_compare.py                               # every GPU, 2 GiB of parameters
    python benchmarks/gpu_compare.py --device cpu --size-gb 0.25   # gloo on the CPU, no GPU needed

Writes ``gpu_compare.md`` and ``gpu_compare.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from compare import (  # noqa: E402  (compare puts the repository on sys.path)
    GB,
    MiB,
    N_LAYERS,
    PeakProbe,
    _env,
    _fill_buffer,
    _read_streams,
    _write_streams,
    build_model,
    fmt,
    interleaved,
    layer_dim,
    load_dcp,
    load_ours,
    med,
    preload,
    save_dcp,
    save_ours,
    settle_disk,
    start_async_save_dcp,
    state_tensors,
    summarize,
    train_step,
    wait_or_kill,
    zero_state,
)

IO_THREADS = int(os.environ.get("CHECKPOINTER_IO_THREADS", "4"))
SYSTEMS = ["ours", "dcp"]
SAVE = {"ours": save_ours, "dcp": save_dcp}
LOAD = {"ours": load_ours, "dcp": load_dcp}


class SetupError(Exception):
    """A setting this machine cannot run; its message is the whole report."""


# --------------------------------------------------------------------------- worker: one rank


class MemoryProbe:
    """Peak host RSS, and peak CUDA memory allocated, above what the process held at construction."""

    def __init__(self, device: str) -> None:
        import torch

        self.host = PeakProbe()
        self.cuda = device == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.cuda_base = torch.cuda.memory_allocated()

    def rss_mib(self) -> float:
        return self.host.extra_mib()

    def cuda_mib(self) -> float | None:
        import torch

        return max(0, torch.cuda.max_memory_allocated() - self.cuda_base) / MiB if self.cuda else None


class Rank:
    """This worker's place in the job, the benchmark's own collectives (on a gloo group) and its records."""

    def __init__(self, cfg: dict) -> None:
        import torch
        import torch.distributed as dist

        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.device = cfg["device"]
        self.work = cfg["work"]
        timeout = datetime.timedelta(seconds=cfg["pg_timeout_s"])
        if self.device == "cuda":
            local = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", timeout=timeout, device_id=local)
        else:
            torch.set_num_threads(1)
            dist.init_process_group("gloo", timeout=timeout)
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self.records: list[dict] = []
        self.failed: set[tuple[str, str]] = set()

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.control)

    def any_rank(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(flag)])
        dist.all_reduce(t, group=self.control)
        return bool(t.item())

    def timed(self, phase: str, system: str, rnd: int, fn: Callable[[], dict | None]) -> dict:
        """Run ``fn`` on every rank from a barrier, until the device is done; time, memory, error."""
        self.barrier()
        self.sync()
        memory = MemoryProbe(self.device)
        t0 = time.perf_counter()
        error, info = None, {}
        try:
            info = fn() or {}
            self.sync()
        except Exception as ex:  # noqa: BLE001 - recorded, the run goes on
            error = f"{type(ex).__name__}: {ex}"[:600]
            traceback.print_exc()
        elapsed = time.perf_counter() - t0
        any_failed = self.any_rank(error is not None)
        if any_failed:
            self.failed.add((phase, system))
        rec = {"phase": phase, "system": system, "round": rnd, "time_s": elapsed, "rss_extra_mib": memory.rss_mib(),
               "cuda_extra_mib": memory.cuda_mib(), "error": error, "any_failed": any_failed, **info}
        self.records.append(rec)
        if self.rank == 0:
            shown = info.get("blocking_s", info.get("inner_s", elapsed))
            print(f"{phase:>12} {system:>10} r{rnd}: {shown:8.3f} s  +{rec['rss_extra_mib']:.0f} MiB"
                  f"{'  FAILED ' + str(error) if any_failed else ''}", flush=True)
        return rec

    def rm(self, path: str) -> None:
        """Delete a checkpoint (rank 0) and wait for the disk to go idle, outside any timing."""
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            settle_disk(self.work)
        self.barrier()

    def gather_records(self) -> list[dict] | None:
        """Every rank's records merged (rank 0; None elsewhere): times the slowest rank's, memory per rank."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, self.records, group=self.control)
        if self.rank != 0:
            return None
        return [merge_ranks([g[i] for g in gathered]) for i in range(len(self.records))]


def merge_ranks(per_rank: list[dict]) -> dict:
    out = dict(per_rank[0])
    for key in ("time_s", "blocking_s", "inner_s"):
        if key in out:
            out[key] = max(r[key] for r in per_rank)
    for key in ("rss_extra_mib", "cuda_extra_mib"):
        values = [r[key] for r in per_rank]
        out[key + "_per_rank"] = values
        out[key] = None if None in values else max(values)
    out["error"] = next((r["error"] for r in per_rank if r["error"]), None)
    return out


def mismatched_tensors(model, optim, saved: dict[str, Any]) -> list[str]:
    """Names of the state tensors on this rank that differ from ``saved`` (missing or extra ones included)."""
    import torch

    now = dict(state_tensors(model, optim))
    names = sorted(set(now) | set(saved))
    return [n for n in names if n not in now or n not in saved or not torch.equal(now[n], saved[n])]


class HostBuffers:
    """Preallocated host memory (pinned for CUDA tensors) for a copy of ``tensors``, touched once."""

    def __init__(self, tensors: list, device: str) -> None:
        import torch

        pin = device == "cuda"
        self.device = device
        self.pairs = [(t, torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)) for t in tensors]
        self.copy()

    def copy(self) -> float:
        import torch

        t0 = time.perf_counter()
        for t, buf in self.pairs:
            buf.copy_(t, non_blocking=t.is_cuda)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def copy_to_fresh_host_memory(tensors: list) -> float:
    """Seconds to copy ``tensors`` into host memory allocated by the copy (pageable)."""
    t0 = time.perf_counter()
    copies = [t.to("cpu") if t.is_cuda else t.clone() for t in tensors]
    seconds = time.perf_counter() - t0
    del copies
    return seconds


class Bench:
    """The interleaved rounds of one rank."""

    def __init__(self, rank: Rank, cfg: dict, model, optim) -> None:
        self.rank = rank
        self.work = cfg["work"]
        self.rounds = cfg["rounds"]
        self.model, self.optim = model, optim
        self.saved = {name: t.clone() for name, t in state_tensors(model, optim)}
        self.rank_bytes = sum(t.numel() * t.element_size() for t in self.saved.values())
        self.file_source = _fill_buffer(64 * MiB)
        self.checkpoints: dict[str, str] = {}

    def plain_file(self, d: str) -> str:
        return f"{d}/rank_{self.rank.rank}.bin"

    def write_plain_file(self, d: str, writeback: bool) -> dict:
        os.makedirs(d, exist_ok=True)
        return {"inner_s": _write_streams([self.plain_file(d)], self.rank_bytes, self.file_source,
                                          direct=False, fsync=True, writeback=writeback)}

    def read_plain_file(self, d: str) -> dict:
        return {"inner_s": _read_streams([self.plain_file(d)], self.rank_bytes, IO_THREADS)}

    def verify(self, rec: dict, system: str) -> None:
        """Mark ``rec`` with whether every rank's state equals the saved state; loud when not."""
        mismatched = mismatched_tensors(self.model, self.optim, self.saved)
        rec["verified"] = not self.rank.any_rank(bool(mismatched))
        if mismatched:
            rec["mismatched"] = mismatched[:8]
            print(f"!! VERIFY FAILED rank {self.rank.rank}: {rec['phase']} {system} r{rec['round']}: "
                  f"{len(mismatched)} tensors differ from the saved ones, e.g. {mismatched[:3]}", flush=True)

    def load_and_verify(self, phase: str, system: str, rnd: int, d: str) -> None:
        zero_state(self.model, self.optim)
        rec = self.rank.timed(phase, system, rnd, lambda: LOAD[system](d, self.model, self.optim))
        self.verify(rec, system)

    def save_rounds(self) -> None:
        last: dict[str, str] = {}
        for r in range(self.rounds):
            for s in interleaved(SYSTEMS + ["file", "file_writeback"], r):
                if ("save", s) in self.rank.failed:
                    continue
                d = f"{self.work}/{s}/save_r{r}"
                if s.startswith("file"):
                    self.rank.timed("save", s, r, lambda: self.write_plain_file(d, writeback=s == "file_writeback"))
                else:
                    self.rank.timed("save", s, r, lambda: SAVE[s](d, self.model, self.optim))
                if s in last:
                    self.rank.rm(last[s])
                last[s] = d
        self.checkpoints = {s: d for s, d in last.items() if ("save", s) not in self.rank.failed}

    def load_rounds(self) -> None:
        for r in range(self.rounds):
            for s in interleaved(SYSTEMS + ["file"], r):
                if s not in self.checkpoints or ("load", s) in self.rank.failed:
                    continue
                if s == "file":
                    self.rank.timed("load", s, r, lambda: self.read_plain_file(self.checkpoints["file"]))
                else:
                    self.load_and_verify("load", s, r, self.checkpoints[s])
        for d in self.checkpoints.values():
            self.rank.rm(d)

    def async_ours(self, d: str) -> dict:
        import checkpointer

        t0 = time.perf_counter()
        future = checkpointer.async_save_model_and_optim_state(d, self.model, self.optim)
        blocking = time.perf_counter() - t0
        future.result()
        return {"blocking_s": blocking}

    def async_dcp(self, d: str) -> dict:
        t0 = time.perf_counter()
        wait = start_async_save_dcp(d, self.model, self.optim, self.rank.control)
        blocking = time.perf_counter() - t0
        wait()
        return {"blocking_s": blocking}

    def restore_saved_state(self) -> None:
        """Put the saved values back, so that what follows does not depend on the last load."""
        import torch

        with torch.no_grad():
            for name, t in state_tensors(self.model, self.optim):
                t.copy_(self.saved[name])

    def async_rounds(self) -> None:
        """The rounds, then a check of each system's last async checkpoint."""
        self.restore_saved_state()
        last = self.timed_async_rounds()
        for s, d in last.items():
            if ("async", s) not in self.rank.failed:
                self.load_and_verify("async_check", s, 0, d)
            self.rank.rm(d)

    def timed_async_rounds(self) -> dict[str, str]:
        """A first save of each system (it allocates our reusable staging buffers, as in a training
        run after its first checkpoint), then the rounds with the copy floors; the last directories."""
        tensors = [t for _, t in state_tensors(self.model, self.optim)]
        pinned = HostBuffers(tensors, self.rank.device)
        runners: dict[str, Callable[[str], dict]] = {
            "ours": self.async_ours,
            "dcp": self.async_dcp,
            "d2h_fresh": lambda d: {"inner_s": copy_to_fresh_host_memory(tensors)},
            "d2h_pinned": lambda d: {"inner_s": pinned.copy()},
        }
        for s in SYSTEMS:
            d = f"{self.work}/{s}/async_first"
            self.rank.timed("async_warmup", s, -1, lambda: runners[s](d))
            self.rank.rm(d)
        last: dict[str, str] = {}
        for r in range(self.rounds):
            for s in interleaved(list(runners), r):
                if ("async", s) in self.rank.failed:
                    continue
                d = f"{self.work}/{s}/async_r{r}"
                self.rank.timed("async", s, r, lambda: runners[s](d))
                if s in last:
                    self.rank.rm(last[s])
                if s in SYSTEMS:
                    last[s] = d
        return last


def run_worker(cfg_path: str) -> None:
    import torch

    with open(cfg_path) as f:
        cfg = json.load(f)
    rank = Rank(cfg)
    preload(SYSTEMS)
    model, optim = build_model(cfg["dim"], rank.world, fsdp=True, seed=1234 + rank.rank, device=rank.device)
    train_step(model, optim, cfg["dim"], rank.device)
    bench = Bench(rank, cfg, model, optim)
    bytes_per_rank: list[Any] = [None] * rank.world
    torch.distributed.all_gather_object(bytes_per_rank, bench.rank_bytes, group=rank.control)
    bench.save_rounds()
    bench.load_rounds()
    bench.async_rounds()
    records = rank.gather_records()
    if records is not None:
        info = {
            "records": records,
            "rank_state_bytes": bytes_per_rank,
            "payload_bytes": sum(bytes_per_rank),
            "device_name": torch.cuda.get_device_name() if rank.device == "cuda" else "cpu",
            "cuda": torch.version.cuda,
        }
        with open(cfg["result"], "w") as f:
            json.dump(info, f, indent=1)
    torch.distributed.barrier(group=rank.control)
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- orchestrator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(cfg: dict, world: int, ctl: str, timeout_s: float) -> dict | None:
    """Run ``world`` ranks on ``cfg``; rank 0's result, or None if there is none."""
    cfg = {**cfg, "result": f"{ctl}/result.json"}
    cfg_path = f"{ctl}/cfg.json"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    port = str(free_port())
    procs = []
    for r in range(world):
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", cfg_path], env=env))
    codes = wait_or_kill(procs, timeout_s)
    if any(c != 0 for c in codes):
        print(f"!! workers exited with {codes} (None: killed at --timeout-s {timeout_s:.0f})", flush=True)
    if not os.path.exists(cfg["result"]):
        return None
    with open(cfg["result"]) as f:
        return json.load(f)


def resolve_world(device: str, world: int | None) -> int:
    """The world size to run, or a SetupError saying why this machine cannot."""
    if device == "cpu":
        world = 2 if world is None else world
    else:
        import torch

        if not torch.cuda.is_available():
            raise SetupError(f"--device cuda, but CUDA is not available here (torch {torch.__version__}); "
                             "use --device cpu to run on the CPU with gloo")
        gpus = torch.cuda.device_count()
        world = gpus if world is None else world
        if world > gpus:
            raise SetupError(f"--world-size {world} needs {world} GPUs (NCCL puts one rank on each), "
                             f"this machine has {gpus}")
    if world < 1:
        raise SetupError(f"--world-size must be at least 1, not {world}")
    return world


def filesystem_of(path: str) -> str:
    """'type (device)' of the mount holding ``path``, from /proc/mounts."""
    best, found = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, found = mnt, f"{fstype} ({dev} on {mnt})"
    except OSError:
        pass
    return found


# ---- report

LOAD_LABEL = "load, same world size (warm), in place"
FIRST_ASYNC_LABEL = "first async save, until the call returns (once, before the rounds)"
ROWS = [
    # (operation, phase, system, the record's time key)
    ("save, fsync", "save", "ours", "time_s"),
    ("save, fsync", "save", "dcp", "time_s"),
    ("save, fsync", "save", "file", "inner_s"),
    ("save, fsync", "save", "file_writeback", "inner_s"),
    (LOAD_LABEL, "load", "ours", "time_s"),
    (LOAD_LABEL, "load", "dcp", "time_s"),
    (LOAD_LABEL, "load", "file", "inner_s"),
    ("async save, until the call returns", "async", "ours", "blocking_s"),
    ("async save, until the call returns", "async", "dcp", "blocking_s"),
    ("async save, until the call returns", "async", "d2h_fresh", "inner_s"),
    ("async save, until the call returns", "async", "d2h_pinned", "inner_s"),
    ("async save, until written", "async", "ours", "time_s"),
    ("async save, until written", "async", "dcp", "time_s"),
    (FIRST_ASYNC_LABEL, "async_warmup", "ours", "blocking_s"),
    (FIRST_ASYNC_LABEL, "async_warmup", "dcp", "blocking_s"),
]


def system_label(phase: str, system: str, device: str) -> str:
    if system == "ours":
        return "checkpointer"
    if system == "dcp":
        return "DCP"
    if system == "file":
        return ("floor: plain file per rank, buffered write + fsync" if phase == "save"
                else f"floor: plain file per rank, preadv into preallocated memory, {IO_THREADS} threads")
    if system == "file_writeback":
        return "floor: plain file per rank, buffered write starting writeback every 32 MiB (as ours does) + fsync"
    copy = "device-to-host copy" if device == "cuda" else "copy"
    if system == "d2h_fresh":
        return f"floor: {copy} into freshly allocated (pageable) memory"
    return f"floor: {copy} into preallocated {'pinned ' if device == 'cuda' else ''}memory"


def summarize_rows(records: list[dict], device: str) -> list[dict]:
    rows = []
    for operation, phase, system, key in ROWS:
        summary = summarize(records, phase, system, key=key)
        if summary is None:
            continue
        ok = [r for r in records if r["phase"] == phase and r["system"] == system and not r.get("any_failed")]
        if ok:
            summary["cuda_extra_mib"] = med([r["cuda_extra_mib"] for r in ok])
            summary["cuda_extra_mib_per_rank"] = ok[len(ok) // 2].get("cuda_extra_mib_per_rank")
        rows.append({"operation": operation, "phase": phase, "system": system, "key": key,
                     "label": system_label(phase, system, device), **summary})
    for row in rows:
        row["verified"] = verification(records, row) if row["system"] in SYSTEMS else None
    return rows


def verification(records: list[dict], row: dict) -> bool | None:
    """Whether the loads that checked this row's checkpoints found the saved state (None: none checked)."""
    phase = {"save": "load", "load": "load", "async": "async_check"}.get(row["phase"])
    checked = [r.get("verified") for r in records if r["phase"] == phase and r["system"] == row["system"]
               and "verified" in r]
    return all(checked) if checked else None


def speed_ratio(rows: list[dict], row: dict) -> float | None:
    """DCP's median time / ours, for the ours row of an operation."""
    if row["system"] != "ours" or not row.get("ok"):
        return None
    dcp = next((x for x in rows if x["operation"] == row["operation"] and x["system"] == "dcp"), None)
    return dcp["median_s"] / row["median_s"] if dcp and dcp.get("ok") else None


def report_notes(meta: dict) -> list[str]:
    cuda = meta["device"] == "cuda"
    return [
        f"GB/s: the checkpoint payload (parameters + optimizer state of every rank, {meta['payload_bytes'] / GB:.2f} GB; "
        "GB = 1e9 B) / the time, the slowest rank's. ours/DCP speed: DCP's median time / ours.",
        "Peak RSS: VmHWM above the rank's RSS just before the operation (pinned host memory counts). Peak CUDA: "
        "`max_memory_allocated` above `memory_allocated` just before it (after `reset_peak_memory_stats`). Both the "
        "maximum over ranks, the median over rounds (per rank in gpu_compare.json).",
        "Loads are warm: the files are in the page cache (dropping it needs root and is not done), so they measure "
        "reading from memory, not from the disk; so is the plain-file read floor.",
        "Each load is preceded by zeroing the model and optimizer state (untimed) and followed by an exact comparison "
        "(`torch.equal`) of every local parameter and optimizer state tensor with the saved ones; the save rows show "
        "the result of loading their checkpoints, the async rows that of loading each system's last async checkpoint.",
        "Async saves: one first save per system before the rounds (its own row). Ours allocates its staging buffers "
        f"there ({'pinned, ' if cuda else ''}kept for the next saves): that memory stays allocated, and the rounds' "
        f"peak RSS does not count it again. DCP's `async_save` runs with torch {meta['torch']}'s default staging, "
        "through a gloo group (it needs a CPU backend); ours makes its own gloo group.",
        *(["Every timing ends with `torch.cuda.synchronize()`."] if cuda else []),
        "Floors time the operation alone, without the barrier before it. The copies are of each rank's local state "
        "tensors ('freshly allocated': what the allocator returns; new pages for tensors over glibc's mmap "
        "threshold). The plain files are one per rank, of that rank's bytes, all ranks at once, buffered writes "
        "then fsync.",
    ]


def build_report(meta: dict, rows: list[dict]) -> str:
    cuda = meta["device"] == "cuda"
    lines = [
        f"# checkpointer vs DCP: {meta['device']} tensors, {meta['backend']}\n",
        f"{meta['date']}; {meta['device_name']}, {meta['machine']}; torch {meta['torch']}"
        f"{' (CUDA ' + str(meta['cuda']) + ')' if cuda else ''}; {meta['backend']}, world size {meta['world']}; "
        f"model: {N_LAYERS} x Linear({meta['dim']}, {meta['dim']}, bias=False) fp32 = "
        f"{meta['param_bytes'] / 2**30:.2f} GiB of parameters, FSDP2 on a {meta['device']} mesh, AdamW state; "
        f"checkpoint payload {meta['payload_bytes'] / GB:.2f} GB; checkpoints in {meta['work_fs']}; "
        f"{meta['rounds']} rounds, interleaved, medians; the run took {meta['wall_s']:.0f} s.\n",
        "| operation | system | median s | GB/s | ours/DCP speed | peak RSS MiB | peak CUDA MiB | state checked |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if row.get("ok"):
            short = row["rounds"] < meta["rounds"] and row["phase"] != "async_warmup"
            seconds = fmt(row["median_s"], ".3f") + (f" ({row['rounds']} of {meta['rounds']} rounds)" if short else "")
            gbps = fmt(meta["payload_bytes"] / row["median_s"] / GB)
            rss = fmt(row["rss_extra_mib"], ".0f")
            cuda_mib = fmt(row.get("cuda_extra_mib"), ".0f") if cuda else "–"
        else:
            seconds, gbps, rss, cuda_mib = f"n/a: {str(row.get('error'))[:120]}", "–", "–", "–"
        ratio = speed_ratio(rows, row)
        checked = {True: "equal", False: "**DIFFERENT**", None: "–"}[row.get("verified")]
        lines.append(f"| {row['operation']} | {row['label']} | {seconds} | {gbps} | "
                     f"{fmt(ratio) + 'x' if ratio else '–'} | {rss} | {cuda_mib} | {checked} |")
    lines.append("")
    lines += ["Notes:\n", *[f"- {note}" for note in report_notes(meta)], ""]
    problems = [f"- {row['operation']}, {row['label']}: {row.get('error') or '; '.join(row.get('errors', []))}"
                for row in rows if not row.get("ok") or row.get("errors")]
    problems += [f"- {row['operation']}, {row['label']}: **the loaded state differed from the saved state**"
                 for row in rows if row.get("verified") is False]
    if problems:
        lines += ["Failures:\n", *problems, ""]
    lines += ["## Per-round times (s)\n", "| operation | system | rounds | peak RSS MiB per rank | peak CUDA MiB per rank |",
              "|---|---|---|---|---|"]
    for row in rows:
        if row.get("ok"):
            rss = ", ".join(fmt(v, ".0f") for v in row.get("rss_extra_mib_per_rank") or [])
            cuda_mib = ", ".join(fmt(v, ".0f") for v in row.get("cuda_extra_mib_per_rank") or []) if cuda else "–"
            lines.append(f"| {row['operation']} | {row['label']} | {', '.join(fmt(v, '.3f') for v in row['all_s'])} "
                         f"| {rss} | {cuda_mib} |")
    lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: NCCL, one rank per GPU (default); cpu: gloo, for a machine without a GPU")
    ap.add_argument("--size-gb", type=float, default=2.0, help="GiB of fp32 parameters (default 2)")
    ap.add_argument("--world-size", type=int, default=None,
                    help="ranks (default: the number of GPUs for cuda, 2 for cpu)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per measurement (default 3)")
    ap.add_argument("--out", default=str(HERE / "results"),
                    help="directory for gpu_compare.md and gpu_compare.json (default benchmarks/results)")
    ap.add_argument("--work-dir", default=None, help="where checkpoints go (default a temp dir under /tmp)")
    ap.add_argument("--timeout-s", type=float, default=1200, help="limit for the whole worker group (default 1200)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args.worker)
        return 0
    try:
        world = resolve_world(args.device, args.world_size)
    except SetupError as ex:
        print(f"gpu_compare: {ex}", file=sys.stderr)
        return 2

    import torch

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below
    t_start = time.time()
    dim = layer_dim(args.size_gb)
    param_bytes = N_LAYERS * dim * dim * 4
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckpt-gpubench-", dir=args.work_dir)
    ctl = f"{work}/ctl"
    os.makedirs(ctl)
    work_fs = filesystem_of(work)
    print(f"{args.device}, world size {world}, {param_bytes / 2**30:.2f} GiB of parameters (dim {dim}), "
          f"{args.rounds} rounds, work dir {work}: {work_fs}", flush=True)
    if shutil.disk_usage(work).free < 5 * 3 * param_bytes:
        print(f"warning: only {shutil.disk_usage(work).free / GB:.1f} GB free under {work}", flush=True)
    cfg = {"device": args.device, "dim": dim, "rounds": args.rounds, "work": work, "pg_timeout_s": 900}
    try:
        result = spawn_workers(cfg, world, ctl, args.timeout_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if result is None:
        print("gpu_compare: the workers produced no result (see their output above)", file=sys.stderr)
        return 1

    records = result["records"]
    rows = summarize_rows(records, args.device)
    meta = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "device": args.device,
        "device_name": result["device_name"],
        "machine": f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
        "torch": torch.__version__,
        "cuda": result["cuda"],
        "backend": "NCCL" if args.device == "cuda" else "gloo",
        "world": world,
        "dim": dim,
        "param_bytes": param_bytes,
        "payload_bytes": result["payload_bytes"],
        "rank_state_bytes": result["rank_state_bytes"],
        "rounds": args.rounds,
        "work_fs": work_fs,
        "wall_s": time.time() - t_start,
    }
    report = build_report(meta, rows)
    (out_dir / "gpu_compare.md").write_text(report)
    with open(out_dir / "gpu_compare.json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "records": records}, f, indent=1)
    print(report)
    print(f"wrote {out_dir}/gpu_compare.md and gpu_compare.json in {meta['wall_s']:.0f} s")
    wrong = [r for r in rows if r.get("verified") is False]
    ours_failed = [r for r in rows if r["system"] == "ours" and not r.get("ok")]
    if wrong or ours_failed:
        print(f"gpu_compare: FAILED: {len(wrong)} rows with a loaded state different from the saved one, "
              f"{len(ours_failed)} of our operations failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
