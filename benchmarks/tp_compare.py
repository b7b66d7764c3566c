"""Tensor-parallel layouts: checkpointer against torch.distributed.checkpoint (DCP).

Flat state dicts of DTensors on CPU meshes (gloo, 127.0.0.1, a free port), the same data
saved by both systems in the same run, rounds interleaved (ours first in even rounds, DCP
first in odd ones), medians over ``--rounds`` rounds; ratios are ours/DCP time (below 1: we
are faster). Only the public API is used: ``Checkpointer().save/.load/.unshard`` and
``lazy_load``.

Cases (saved at world size 2, loaded at world size 4, unless stated):

* ``mix_same``: 64 fp32 [1024, 1024] matrices, even keys Shard(0), odd keys Shard(1), 1-D
  mesh; loaded with the same placements.
* ``mix_swapped``: the same checkpoint, every placement swapped (Shard(0) <-> Shard(1)).
* ``mesh2d``: the same checkpoint onto a 2x2 mesh as [Shard(0), Shard(1)].
* ``fsdp_tp``: the same checkpoint onto a 2x2 mesh as FSDP2 over tensor parallelism lays a
  weight out: ``[_StridedShard(d, split_factor=2), Shard(d)]``, d alternating 0 and 1.
* ``interleaved``: the same checkpoint onto a 2x2 mesh as ``[Shard(1), _StridedShard(1,
  split_factor=2)]``: every rank's piece is two runs of columns per row (stored as flattened
  ranges when saved; here wanted as such).
* ``moe_dim1`` / ``moe_dim2``: 4 MoE-like [8, 1024, 1024] fp32 weights, Shard(1) / Shard(2)
  at save and at load.
* ``bf16``: ``mix_same`` in bfloat16.
* ``many_small``: 1,024 fp32 [64, 64] matrices, S0/S1 alternating as ``mix_same`` (16 KiB
  each: the norms, biases and small projections of a large model, where a load's work per
  tensor, not its bytes, sets the time).
* ``save``: the save of ``mix_same``'s checkpoint at world size 2 (ours, DCP, and a plain
  write of the same bytes: each rank its local bytes to one file, buffered, fsync), timed in
  the same rounds.
* ``shard2_tiny``: one [256, 256, 2] fp32 tensor (``--full-shard2``: [1024, 1024, 2]) saved
  as Shard(2) at world size 2; in one process with no process group: ``unshard`` (DCP: a load
  into a freshly allocated full tensor), a load into a plain tensor, and (ours only)
  ``lazy_load``; each op in its own process, killed after ``--case-timeout-s``.

With ``--device cuda`` the DTensors live on the GPU (every rank on GPU 0, the process group
still gloo): the loads and saves go between the files and CUDA memory, each timed op ends with
``torch.cuda.synchronize()``, and the plain write includes its device-to-host copy.
``shard2_tiny`` stays on the CPU.

Loads are warm for both systems (every checkpoint file is read once, untimed, before the
rounds; the page cache is not dropped). Every load is checked: the targets are zeroed before
it and every local tensor is compared with ``torch.equal`` to the expected values after it; a
mismatch is printed, marked in the table, and the script exits with status 2.

Usage::

    python benchmarks/tp_compare.py                       # all cases, 3 rounds
    python benchmarks/tp_compare.py --cases mix_same,bf16 --rounds 5 --scale 0.5
    python benchmarks/tp_compare.py --full-shard2 --profile
    python benchmarks/tp_compare.py --cases interleaved --profile interleaved
    python benchmarks/tp_compare.py --strategy two_stage   # our loads read once and share
    python benchmarks/tp_compare.py --device cuda --cases mix_same,bf16   # CUDA destinations

Writes ``<name>.md`` and ``<name>.json`` (``--name``, default ``tp_compare``) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

# The FSDP benchmark's helpers: process-group worker with timed ops (barriers, peak RSS above
# the pre-op RSS via /proc/self/clear_refs + VmHWM, failures agreed across ranks), disk
# settling after deletions, page-cache warming, subprocess environment and kill-on-timeout.
from compare import (  # noqa: E402
    Group,
    PeakProbe,
    _env,
    fmt,
    interleaved,
    med,
    settle_disk,
    summarize,
    wait_or_kill,
    warm_page_cache,
)

MiB = 1 << 20
LOAD_CASES = ("mix_same", "mix_swapped", "mesh2d", "fsdp_tp", "interleaved", "moe_dim1", "moe_dim2", "bf16", "many_small")
ALL_CASES = LOAD_CASES + ("save", "shard2_tiny")
SYSTEMS = ("ours", "dcp")
DCP_WRONG = {
    "interleaved": "DCP returns wrong values here (torch 2.13: it places a _StridedShard after a Shard as a "
                   "contiguous chunk); its time is shown, not counted as a failure",
}


# --------------------------------------------------------------------------- data


def checkpoint_specs(scale: float, full_shard2: bool) -> dict[str, dict]:
    """Checkpoints by name: key count, shape, dtype, and the save placement of key i (a dim)."""
    n_mat = max(2, 2 * round(32 * scale))
    n_moe = max(1, round(4 * scale))
    return {
        "mix": {"n": n_mat, "shape": [1024, 1024], "dtype": "float32", "save_dims": "alt01"},
        "bf16": {"n": n_mat, "shape": [1024, 1024], "dtype": "bfloat16", "save_dims": "alt01"},
        "moe1": {"n": n_moe, "shape": [8, 1024, 1024], "dtype": "float32", "save_dims": 1},
        "moe2": {"n": n_moe, "shape": [8, 1024, 1024], "dtype": "float32", "save_dims": 2},
        "small": {"n": max(2, 2 * round(512 * scale)), "shape": [64, 64], "dtype": "float32", "save_dims": "alt01"},
        "shard2": {"n": 1, "shape": [1024, 1024, 2] if full_shard2 else [256, 256, 2], "dtype": "float32",
                   "save_dims": 2},
    }


# Load cases: the checkpoint, the load mesh, and the placements of key i (as dims per mesh dim).
LOAD_LAYOUTS = {
    "mix_same": ("mix", [4], "alt01"),
    "mix_swapped": ("mix", [4], "alt10"),
    "mesh2d": ("mix", [2, 2], [0, 1]),
    "fsdp_tp": ("mix", [2, 2], "fsdp_tp"),
    "interleaved": ("mix", [2, 2], "interleaved"),
    "moe_dim1": ("moe1", [4], 1),
    "moe_dim2": ("moe2", [4], 2),
    "bf16": ("bf16", [4], "alt01"),
    "many_small": ("small", [4], "alt01"),
}
CASE_CKPTS = {"save": ["mix"], "shard2_tiny": ["shard2"], **{c: [v[0]] for c, v in LOAD_LAYOUTS.items()}}


def placements_of(rule: Any, i: int, mesh_ndim: int) -> list[Any]:
    """Placements (one per mesh dim) of key ``i`` under ``rule``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if rule == "fsdp_tp":
        return [_StridedShard(i % 2, split_factor=2), Shard(i % 2)]
    if rule == "interleaved":
        return [Shard(1), _StridedShard(1, split_factor=2)]
    return [Shard(d) for d in dims_of(rule, i, mesh_ndim)]


def dims_of(rule: Any, i: int, mesh_ndim: int) -> list[int]:
    """Shard dims (one per mesh dim) of key ``i`` under ``rule``."""
    if rule == "alt01":
        d = [0 if i % 2 == 0 else 1]
    elif rule == "alt10":
        d = [1 if i % 2 == 0 else 0]
    elif isinstance(rule, int):
        d = [rule]
    else:
        d = list(rule)
    assert len(d) == mesh_ndim, (rule, mesh_ndim)
    return d


def full_tensor(spec: dict, i: int):
    """Key ``i``'s full value, the same on every rank: distinct integers below 2**23 (exact in
    fp32, so a misplaced element cannot go unnoticed), cast to the spec's dtype."""
    import torch

    shape = spec["shape"]
    numel = 1
    for s in shape:
        numel *= s
    x = torch.arange(numel, dtype=torch.int64)
    x.mul_(2654435761).add_(i * 40503 + 17).remainder_(1 << 23)  # an odd multiplier: a bijection mod 2**23
    return x.to(getattr(torch, spec["dtype"])).reshape(shape)


def key_name(i: int) -> str:
    return f"w{i:03d}"


def synced(fn):
    """``fn`` then, where CUDA is in use, a wait for the GPU: a timed op ends when its copies have."""
    import torch

    def run() -> None:
        fn()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()

    return run


def build_state(spec: dict, mesh, rule: Any) -> tuple[dict, dict]:
    """(state dict of DTensors holding the values, expected local tensors) on ``mesh``."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    state, expected = {}, {}
    for i in range(spec["n"]):
        full = full_tensor(spec, i)
        placements = placements_of(rule, i, mesh.ndim)
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None)  # no communication
        local = dt.to_local().contiguous().clone()  # own storage: no view keeps `full` alive
        state[key_name(i)] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                shape=full.shape, stride=full.stride())
        expected[key_name(i)] = local
        del full, dt
    return state, expected


def zeros_like_state(state: dict) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    return {k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                  run_check=False, shape=v.shape, stride=v.stride())
            for k, v in state.items()}


def local_bytes(state: dict) -> int:
    return sum(v.to_local().numel() * v.to_local().element_size() for v in state.values())


def mismatches(state: dict, expected: dict) -> list[str]:
    import torch

    return [k for k, v in state.items() if not torch.equal(v.to_local(), expected[k])]


# --------------------------------------------------------------------------- the systems


def save_ours(d: str, state: dict) -> None:
    import checkpointer

    checkpointer.Checkpointer().save(d, state)


def save_dcp(d: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=d)  # FileSystemWriter: sync_files=True


def load_ours(d: str, state: dict, strategy: str = "default") -> None:
    import checkpointer

    checkpointer.Checkpointer().load(d, state, strategy=strategy)


def load_dcp(d: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=d)


SAVE = {"ours": save_ours, "dcp": save_dcp}
LOAD = {"ours": load_ours, "dcp": load_dcp}


def plain_write(path: str, locals_: list) -> None:
    """This rank's local bytes, one file, buffered writes + fsync (file and directory)."""
    import torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in locals_:
            mv = memoryview(t.cpu().view(-1).view(torch.uint8).numpy())
            done = 0
            while done < len(mv):
                done += os.write(fd, mv[done: done + (64 * MiB)])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def preload() -> None:
    """Import what the timed operations use, so no timing includes an import."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict_loader  # noqa: F401
    import torch.distributed.checkpoint.state_dict_saver  # noqa: F401

    import checkpointer  # noqa: F401
    import checkpointer.tools.lazy  # noqa: F401


# --------------------------------------------------------------------------- workers


def _mesh(shape: list[int], device: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, tuple(shape))


def run_save_group(cfg: dict, rank: int) -> None:
    """World 2: the timed saves of ``mix`` (ours, DCP, plain write; rounds interleaved), then
    one save per system of every other checkpoint the cases need."""
    import torch

    g = Group(cfg, rank)
    preload()
    specs, work, rounds = cfg["specs"], cfg["work"], cfg["rounds"]
    mesh = _mesh([g.world], cfg["device"])
    dirs: dict[str, dict[str, str]] = {}
    extra: dict[str, Any] = {"rank_bytes": {}}
    for name in cfg["ckpts"]:
        spec = specs[name]
        state, _ = build_state(spec, mesh, spec["save_dims"])
        rb: list[Any] = [None] * g.world
        torch.distributed.all_gather_object(rb, local_bytes(state))
        extra["rank_bytes"][name] = rb
        dirs[name] = {}
        if name == "mix" and cfg["time_save"]:
            locals_ = [v.to_local() for v in state.values()]
            last: dict[str, str] = {}
            for r in range(rounds):
                for s in interleaved(list(SYSTEMS) + ["plain"], r):
                    if s == "plain":
                        path = f"{work}/plain/rank{rank}.bin"
                        g.timed("save", "plain", r, lambda: plain_write(path, locals_))
                        g.rm(f"{work}/plain")
                        continue
                    if ("save", s) in g.failed:
                        continue
                    d = f"{work}/{s}/{name}_r{r}"
                    g.timed("save", s, r, synced(lambda: SAVE[s](d, state)))
                    if s in last:
                        g.rm(last[s])
                    last[s] = d
            dirs[name] = {s: d for s, d in last.items() if ("save", s) not in g.failed}
            del locals_
        else:
            for s in SYSTEMS:
                d = f"{work}/{s}/{name}"
                rec = g.timed(f"save_{name}", s, 0, lambda: SAVE[s](d, state))
                if not rec["any_failed"]:
                    dirs[name][s] = d
        del state
    extra["dirs"] = dirs
    g.finish(extra)


def run_load_group(cfg: dict, rank: int) -> None:
    """World 4: every load case, rounds interleaved across cases and systems, each load verified."""
    import torch

    g = Group(cfg, rank)
    preload()
    specs, dirs, rounds = cfg["specs"], cfg["dirs"], cfg["rounds"]
    meshes: dict[tuple, Any] = {}
    cases: dict[str, dict] = {}
    extra: dict[str, Any] = {"rank_bytes": {}, "verify_failures": []}
    for case in cfg["cases"]:
        ckpt, mesh_shape, rule = LOAD_LAYOUTS[case]
        mesh = meshes.setdefault(tuple(mesh_shape), _mesh(mesh_shape, cfg["device"]))
        ref, expected = build_state(specs[ckpt], mesh, rule)
        cases[case] = {"ckpt": ckpt, "expected": expected, "targets": {s: zeros_like_state(ref) for s in SYSTEMS}}
        del ref
        rb: list[Any] = [None] * g.world
        torch.distributed.all_gather_object(rb, local_bytes(cases[case]["targets"]["ours"]))
        extra["rank_bytes"][case] = rb
    if rank == 0:  # warm: our saves leave nothing in the page cache, DCP's leave it all
        for per in dirs.values():
            for d in per.values():
                warm_page_cache(d)
    g.barrier()

    def verify(case: str, system: str, rnd: int) -> None:
        bad = mismatches(cases[case]["targets"][system], cases[case]["expected"])
        any_bad = g.agree_failed(bool(bad))
        g.records[-1]["verified"] = not any_bad
        if any_bad and system == "dcp" and case in DCP_WRONG:
            return  # known: shown in the table, not a failure of this run
        if any_bad:
            msg = (f"VERIFY FAILED: {case} {system} round {rnd} rank {rank}: {len(bad)} keys differ, e.g. {bad[:3]}"
                   if bad else f"VERIFY FAILED: {case} {system} round {rnd} on another rank")
            print("!!!! " + msg, flush=True)
            g.records[-1]["verify_error"] = msg
            extra["verify_failures"].append(msg)

    for r in range(rounds):
        for case in cfg["cases"]:
            ckpt = cases[case]["ckpt"]
            for s in interleaved(list(SYSTEMS), r):
                if s not in dirs.get(ckpt, {}) or (case, s) in g.failed:
                    continue
                target = cases[case]["targets"][s]
                for v in target.values():  # untimed; pages stay touched
                    v.to_local().zero_()
                load = functools.partial(load_ours, strategy=cfg["strategy"]) if s == "ours" else LOAD[s]
                rec = g.timed(case, s, r, synced(lambda: load(dirs[ckpt][s], target)))
                if not rec["any_failed"]:
                    verify(case, s, r)

    profiled = cfg.get("profile")
    if profiled and profiled in cases and "ours" in dirs.get(LOAD_LAYOUTS[profiled][0], {}):
        import cProfile
        import io
        import pstats

        target = cases[profiled]["targets"]["ours"]
        for v in target.values():
            v.to_local().zero_()
        g.barrier()
        prof = cProfile.Profile() if rank == 0 else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        load_ours(dirs[LOAD_LAYOUTS[profiled][0]]["ours"], target, cfg["strategy"])
        if prof:
            prof.disable()
        dt = time.perf_counter() - t0
        verify(profiled, "ours", -1)
        if prof:
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.sort_stats("cumulative").print_stats(25)
            out2 = io.StringIO()
            pstats.Stats(prof, stream=out2).sort_stats("tottime").print_stats(15)
            extra["profile"] = {"wall_s": dt, "cumulative": out.getvalue(), "tottime": out2.getvalue()}
        g.barrier()
    g.finish(extra)


def run_single(cfg: dict) -> None:
    """One shard2 op in this process alone (no process group), timed with its peak extra RSS."""
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP alone, as intended
    preload()
    import checkpointer
    import torch.distributed.checkpoint as dcp

    spec, src, op, system = cfg["spec"], cfg["src"], cfg["op"], cfg["system"]
    warm_page_cache(src)
    expected = full_tensor(spec, 0)
    target = torch.zeros_like(expected) if op == "load_w1" else None
    key = key_name(0)
    probe = PeakProbe()
    t0 = time.perf_counter()
    error, got = None, None
    try:
        if op == "unshard" and system == "ours":
            got = checkpointer.Checkpointer().unshard(src)[key]
        elif op == "unshard" and system == "dcp":  # DCP has no unshard to memory: load into a new full tensor
            got = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
            dcp.load({key: got}, checkpoint_id=src)
        elif op == "lazy_load" and system == "ours":
            got = dict(checkpointer.lazy_load(src))[key]
        elif op == "load_w1":
            LOAD[system](src, {key: target})
            got = target
        else:
            raise ValueError(f"no {op} for {system}")
    except Exception as ex:  # noqa: BLE001
        error = f"{type(ex).__name__}: {ex}"[:600]
        traceback.print_exc()
    dt = time.perf_counter() - t0
    rss = probe.extra_mib()
    verified = None if got is None else bool(torch.equal(got, expected))
    if verified is False:
        print(f"!!!! VERIFY FAILED: shard2_tiny {op} {system}", flush=True)
    rec = {"phase": f"shard2_tiny:{op}", "system": system, "round": cfg["round"], "time_s": dt,
           "rss_extra_mib": rss, "rss_extra_mib_per_rank": [rss], "error": error, "any_failed": error is not None,
           "verified": verified}
    with open(cfg["result"], "w") as f:
        json.dump(rec, f)


def worker_main(cfg_path: str, rank: int) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    {"save": lambda: run_save_group(cfg, rank), "load": lambda: run_load_group(cfg, rank),
     "single": lambda: run_single(cfg)}[cfg["role"]]()


# --------------------------------------------------------------------------- orchestrator


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cfg: dict, nprocs: int, tmp: str, name: str, timeout_s: float) -> tuple[dict | None, str | None]:
    """Run ``nprocs`` workers on ``cfg``: (rank 0's result, None) or (partial result or None, why not)."""
    cfg = dict(cfg, result=f"{tmp}/{name}.result.json", init=f"tcp://127.0.0.1:{free_port()}")
    path = f"{tmp}/{name}.cfg.json"
    with open(path, "w") as f:
        json.dump(cfg, f)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", path, "--rank", str(r)], env=_env())
             for r in range(nprocs)]
    codes = wait_or_kill(procs, timeout_s)
    why = None
    if any(c is None for c in codes):
        why = f"timed out (> {timeout_s:.0f} s, killed)"
    elif any(c != 0 for c in codes):
        why = f"exit codes {codes}"
    if why:
        print(f"!! {name}: {why}", flush=True)
    res = None
    if os.path.exists(cfg["result"]):
        with open(cfg["result"]) as f:
            res = json.load(f)
    return res, why


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def row(records: list[dict], phase: str) -> dict:
    out = {}
    for s in ("ours", "dcp", "plain"):
        x = summarize(records, phase, s)
        if x is not None:
            out[s] = x
    return out


def build_report(meta: dict, rows: list[dict]) -> str:
    L = [f"# Tensor-parallel layouts: checkpointer vs DCP ({meta['name']})", ""]
    L.append(f"- commit: `{meta['commit']}`{' (working tree dirty)' if meta['dirty'] else ''} on `{meta['branch']}`")
    L.append(f"- date: {meta['date']}")
    L.append(f"- machine: {meta['machine']}; torch {meta['torch']}; tensors on {meta.get('device', 'cpu')}")
    L.append(f"- command: `{meta['command']}`")
    L.append(f"- {meta['rounds']} rounds, systems interleaved (ours first in even rounds), medians; "
             f"wall time {meta['wall_s']:.0f} s; 1-minute load average during the run: {meta['loadavg']}")
    L.append("")
    L.append("| case | layout | rank MiB | ours s | DCP s | ours/DCP | ours peak extra RSS/rank MiB | DCP's | "
             "RSS goal met | verified | notes |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---|---|---|")

    def t(x: dict | None) -> str:
        if x is None:
            return "–"
        if not x.get("ok"):
            return x.get("error", "failed")[:40]
        return f"{x['median_s']:.3f}"

    def m(x: dict | None) -> str:
        return f"{x['rss_extra_mib_max']:.0f}" if x and x.get("ok") else "–"

    for r in rows:
        o, d = r.get("ours"), r.get("dcp")
        ratio = (o["median_s"] / d["median_s"]) if (o and d and o.get("ok") and d.get("ok")) else None
        r["ratio"] = ratio
        ver = [x.get("verified") for x in (o, d) if x and x.get("ok")]
        vtxt = "–" if not ver or all(v is None for v in ver) else ("yes" if all(v is not False for v in ver)
                                                                     else "**NO: WRONG VALUES**")
        if r["case"] in DCP_WRONG and o and o.get("ok") and o.get("verified") is True and d and d.get("verified") is False:
            vtxt, r["notes"] = "ours yes; DCP no (known)", DCP_WRONG[r["case"]]
        goal = r.get("rss_goal_mib")
        gtxt = "–"
        if goal is not None and o and o.get("ok"):
            r["rss_goal_met"] = o["rss_extra_mib_max"] <= goal
            gtxt = f"{'yes' if r['rss_goal_met'] else 'NO'} (<= {goal:.0f})"
        rb = r.get("rank_mib")
        L.append(f"| {r['case']} | {r['layout']} | {fmt(rb, '.0f' if rb >= 10 else '.2f') if rb is not None else '–'} | {t(o)} | {t(d)} | "
                 f"{fmt(ratio)} | {m(o)} | {m(d)} | {gtxt} | {vtxt} | {r.get('notes', '')} |")
    L.append("")
    L.append(
        "Times: seconds, the slowest rank, median over rounds. ours/DCP: below 1 means checkpointer is faster. "
        "Peak extra RSS: VmHWM above the RSS just before the operation (peak reset through "
        "/proc/self/clear_refs), the maximum over ranks and rounds; the targets are allocated and touched "
        "before it, so it is what the load itself adds. RSS goal: <= 10% of the rank's bytes + 64 MiB. "
        "Loads are warm for both systems: every checkpoint file is read once, untimed, before the rounds "
        "(the page cache cannot be dropped here; our saves leave nothing in the page cache (O_DIRECT, or writeback then dropped) and would otherwise be cold, "
        "DCP's warm). Every load was checked with torch.equal of every local tensor against the expected "
        "values (targets zeroed before each load). A fresh `Checkpointer()` per operation (no cached save "
        "plan). Loads run 4 processes on this machine's cores, saves 2.")
    if meta.get("notes"):
        L.append("")
        L.extend(f"- {n}" for n in meta["notes"])
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per measurement (default 3)")
    ap.add_argument("--cases", default=",".join(ALL_CASES), help=f"comma-separated subset of {','.join(ALL_CASES)}")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the number of tensors per case (default 1)")
    ap.add_argument("--full-shard2", action="store_true", help="shard2_tiny at [1024,1024,2] instead of [256,256,2]")
    ap.add_argument("--case-timeout-s", type=float, default=120, help="limit per shard2_tiny op (default 120)")
    ap.add_argument("--group-timeout-s", type=float, default=900, help="limit per save/load process group (default 900)")
    ap.add_argument("--profile", nargs="?", const="mix_same", default=None, metavar="CASE",
                    help="after the rounds, cProfile rank 0 of one extra (untimed) load of CASE (default mix_same)")
    ap.add_argument("--strategy", choices=("default", "two_stage"), default="default",
                    help="our loads' strategy (default: each rank reads its own bytes; two_stage: each stored piece read once and sent)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the DTensors live (default cpu; cuda: every rank on GPU 0, gloo)")
    ap.add_argument("--out", default=str(HERE / "results"), help="output directory (default benchmarks/results)")
    ap.add_argument("--name", default="tp_compare", help="output file stem (default tp_compare)")
    ap.add_argument("--work-dir", default=None, help="where checkpoints go (default a temp dir)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.rank)
        return 0

    import signal

    import torch

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below
    t_start = time.time()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in ALL_CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {ALL_CASES}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    specs = checkpoint_specs(args.scale, args.full_shard2)
    needed = []
    for c in cases:
        for k in CASE_CKPTS[c]:
            if k not in needed:
                needed.append(k)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tp-bench-", dir=args.work_dir)
    tmp = f"{work}/ctl"
    os.makedirs(tmp)
    print(f"cases {cases}; checkpoints {needed}; rounds {args.rounds}; work dir {work}", flush=True)
    base = {"specs": specs, "rounds": args.rounds, "work": work, "pg_timeout_s": args.group_timeout_s,
            "device": args.device, "strategy": args.strategy}
    records: list[dict] = []
    notes: list[str] = []
    loadavgs: list[float] = []
    rank_bytes: dict[str, Any] = {}
    profile = None
    failures: list[str] = []
    try:
        # ---- saves at world 2
        dirs: dict[str, dict[str, str]] = {}
        if needed:
            res, why = spawn({**base, "role": "save", "world": 2, "ckpts": needed, "time_save": "save" in cases},
                             2, tmp, "save_w2", args.group_timeout_s)
            if res is None:
                print(f"the save group produced no result ({why})", flush=True)
                return 1
            records += res["records"]
            dirs = res["dirs"]
            rank_bytes.update({f"save:{k}": v for k, v in res["rank_bytes"].items()})
        loadavgs.append(os.getloadavg()[0])

        # ---- loads at world 4
        load_cases = [c for c in cases if c in LOAD_LAYOUTS]
        if load_cases:
            res, why = spawn({**base, "role": "load", "world": 4, "cases": load_cases, "dirs": dirs,
                              "profile": args.profile, "slow_op_s": args.case_timeout_s},
                             4, tmp, "load_w4", args.group_timeout_s)
            if res is None:
                notes.append(f"the world-4 load group produced no result: {why}")
            else:
                records += res["records"]
                rank_bytes.update(res["rank_bytes"])
                failures += res.get("verify_failures", [])
                profile = res.get("profile")
                if why:
                    notes.append(f"the world-4 load group: {why}")
        loadavgs.append(os.getloadavg()[0])

        # ---- shard2_tiny: single processes, each op under the per-case timeout
        if "shard2_tiny" in cases:
            src = dirs.get("shard2", {})
            ops = [("unshard", "ours"), ("unshard", "dcp"), ("load_w1", "ours"), ("load_w1", "dcp"),
                   ("lazy_load", "ours")]
            timed_out: set[tuple[str, str]] = set()
            for r in range(args.rounds):
                for op, s in (ops if r % 2 == 0 else ops[::-1]):
                    if s not in src or (op, s) in timed_out:
                        continue
                    res, why = spawn({"role": "single", "spec": specs["shard2"], "src": src[s], "op": op,
                                      "system": s, "round": r}, 1, tmp, f"shard2_{op}_{s}_r{r}", args.case_timeout_s)
                    if res is None:
                        res = {"phase": f"shard2_tiny:{op}", "system": s, "round": r, "time_s": None,
                               "rss_extra_mib": None, "any_failed": True,
                               "error": "timed out" if why and why.startswith("timed out") else (why or "no result")}
                        if why and why.startswith("timed out"):
                            timed_out.add((op, s))
                            notes.append(f"shard2_tiny {op} ({s}) round {r}: timed out after {args.case_timeout_s:.0f} s "
                                         f"(killed); its later rounds skipped")
                    records.append(res)
                    if res.get("verified") is False:
                        failures.append(f"shard2_tiny {op} {s} round {r}: wrong values")
                    print(f"[w1] shard2_tiny:{op:>9} {s:>5} r{r}: "
                          f"{fmt(res.get('time_s'), '8.3f')} s  +{fmt(res.get('rss_extra_mib'), '.0f')} MiB"
                          f"{'  FAILED ' + str(res['error']) if res.get('any_failed') else ''}", flush=True)
        loadavgs.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    # ---- rows
    rows: list[dict] = []
    layout_text = {
        "mix_same": "S0/S1 alternating @2 -> same @4",
        "mix_swapped": "S0/S1 alternating @2 -> swapped @4",
        "mesh2d": "S0/S1 alternating @2 -> [S0,S1] @2x2",
        "fsdp_tp": "S0/S1 alternating @2 -> [_StridedShard(d,2),S(d)] @2x2",
        "interleaved": "S0/S1 alternating @2 -> [S1,_StridedShard(1,2)] @2x2",
        "moe_dim1": "[E,d,f] S1 @2 -> S1 @4",
        "moe_dim2": "[E,d,f] S2 @2 -> S2 @4",
        "bf16": "bf16, S0/S1 alternating @2 -> same @4",
        "many_small": "S0/S1 alternating @2 -> same @4",
    }
    for c in cases:
        if c in LOAD_LAYOUTS:
            ckpt = LOAD_LAYOUTS[c][0]
            rb = max(rank_bytes.get(c) or [0])
            spec = specs[ckpt]
            rows.append({"case": c, "layout": f"{spec['n']} x {spec['shape']} {spec['dtype']}; {layout_text[c]}",
                         "rank_mib": rb / MiB, "rss_goal_mib": 0.10 * rb / MiB + 64, **row(records, c)})
        elif c == "save":
            spec = specs["mix"]
            rb = max(rank_bytes.get("save:mix") or [0])
            r = {"case": "save (mix_same @2)", "layout": f"{spec['n']} x {spec['shape']} {spec['dtype']}; save @2",
                 "rank_mib": rb / MiB, **row(records, "save")}
            p, o = r.get("plain"), r.get("ours")
            if p and p.get("ok"):
                r["ours_over_plain"] = o["median_s"] / p["median_s"] if o and o.get("ok") else None
                r["notes"] = (f"plain fsync'd write of the same bytes (a file per rank): {p['median_s']:.3f} s; "
                              f"ours/plain {fmt(r['ours_over_plain'])}")
            rows.append(r)
        elif c == "shard2_tiny":
            spec = specs["shard2"]
            tb = 4
            for s_ in spec["shape"]:
                tb *= s_
            for op, what in (("unshard", "Checkpointer().unshard (DCP: load into a new full tensor)"),
                             ("load_w1", "load into a plain tensor, 1 process"),
                             ("lazy_load", "dict(lazy_load(dir)), ours only")):
                rows.append({"case": f"shard2_tiny {op}", "layout": f"{spec['shape']} fp32 S2 @2 -> {what}",
                             "rank_mib": tb / MiB, "rss_goal_mib": 0.10 * tb / MiB + 64,
                             **row(records, f"shard2_tiny:{op}")})
    for x in records:
        if x.get("loadavg_1m") is not None:
            loadavgs.append(x["loadavg_1m"])
    wall = time.time() - t_start
    meta = {
        "name": args.name,
        "commit": git("rev-parse", "HEAD"),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} cores (nproc), "
                   f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
        "torch": torch.__version__,
        "device": args.device if args.device == "cpu" else f"cuda ({torch.cuda.get_device_name(0)}), every rank on GPU 0",
        "command": " ".join(["python", os.path.relpath(__file__, REPO)] + sys.argv[1:]),
        "rounds": args.rounds,
        "scale": args.scale,
        "full_shard2": args.full_shard2,
        "wall_s": wall,
        "loadavg": f"median {med(loadavgs):.1f} (min {min(loadavgs):.1f}, max {max(loadavgs):.1f})" if loadavgs else "?",
        "notes": notes + [f"VERIFY FAILED: {f}" for f in failures],
    }
    report = build_report(meta, rows)
    if profile:
        report += (f"\n## cProfile of rank 0's load of {args.profile} (one extra untimed load, {profile['wall_s']:.2f} s "
                   f"under the profiler), top entries by cumulative time\n\n```\n{profile['cumulative']}\n```\n")
    (out_dir / f"{args.name}.md").write_text(report)
    with open(out_dir / f"{args.name}.json", "w") as f:
        json.dump({"meta": meta, "specs": specs, "rows": rows, "rank_bytes": rank_bytes, "profile": profile,
                   "verify_failures": failures, "records": records}, f, indent=1)
    print(report)
    print(f"wrote {out_dir}/{args.name}.md, {args.name}.json in {wall:.0f} s", flush=True)
    if failures:
        print("!!!! SOME LOADS RETURNED WRONG VALUES:\n  " + "\n  ".join(failures), flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
