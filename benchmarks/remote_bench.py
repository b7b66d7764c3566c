"""Save and load throughput against ``moto_server`` (S3 on loopback), next to boto3's own
``upload_file`` / ``download_file`` of the same bytes, and the bytes each rank fetches.

Everything runs on 127.0.0.1: the script starts ``moto_server`` on a free port with test-only
credentials, and nothing else is contacted.

1. **One process** (no process group): a flat state dict of ``--size-mb`` MiB of fp32 in
   ``--tensors`` tensors. Per round, interleaved (the order flips every round):

   * ``Checkpointer.save`` to ``s3://`` (rank file + metadata.json, save lock included), and
     again through an ``S3Storage`` with ``--alt-part-mb`` MiB parts and ``--alt-concurrency``
     parallel parts (default 8 x 10, boto3's ``TransferConfig``; ours is 16 MiB x 8);
   * boto3 ``upload_file`` of the very rank file (a local copy of it, same bytes), with a
     client made beforehand (not timed) and the default ``TransferConfig``; and
     ``upload_fileobj`` of the same bytes from memory;
   * ``Checkpointer.load`` into preallocated tensors (in place), checked afterwards;
   * boto3 ``download_file`` of the same object to a local file, and ``download_fileobj``
     into memory.

   Medians over ``--rounds``; the goal is at least 0.9x the throughput of boto3's
   ``upload_file`` / ``download_file``. Beside wall time, the CPU seconds of this process
   (client) and of ``moto_server`` (server) per operation: on a small machine the two compete
   for the cores, so client CPU is time taken from the server. Each round's objects are
   deleted after it (untimed), so that ``moto_server``'s memory stays flat.
2. **Several processes** (gloo): the same tensors sharded on dim 0 (``DTensor``), saved at
   ``--save-ws`` ranks, then loaded at ``--load-ws`` ranks, each rank through its own
   loopback proxy that counts the bytes it sends back: bytes fetched per rank against the
   rank's share (goal: at most 1.1x plus ``metadata.json``). The load is run once more
   without proxies for its time.

The report (markdown) goes to ``--out`` (default ``benchmarks/results/remote.md``).

Usage::

    python benchmarks/remote_bench.py                       # 256 MiB, 5 rounds, 4 -> 3 ranks
    python benchmarks/remote_bench.py --size-mb 512 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (REPO, REPO / "tests" / "support"):  # remote_proxy, storage_servers
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

MiB = 1 << 20
BUCKET = "remote-bench"
SETTINGS = {
    "AWS_ACCESS_KEY_ID": "bench-access-key",
    "AWS_SECRET_ACCESS_KEY": "bench-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
}
UNSET = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "AWS_PROFILE",
         "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL")


def point_at(endpoint: str) -> None:
    """This process talks to ``endpoint`` only, with test credentials."""
    for name in UNSET:
        os.environ.pop(name, None)
    os.environ.update(SETTINGS)
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint


# --------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_moto(workdir: str) -> tuple[subprocess.Popen, str]:
    exe = Path(sys.executable).parent / "moto_server"
    cmd = str(exe) if exe.exists() else shutil.which("moto_server")
    if not cmd:
        raise SystemExit("moto_server is not installed: pip install 'moto[server]'")
    port = free_port()
    proc = subprocess.Popen([cmd, "-H", "127.0.0.1", "-p", str(port)], cwd=workdir,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"moto_server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto_server did not start")


def boto_client():
    import boto3

    return boto3.session.Session().client("s3")


# --------------------------------------------------------------------------- tensors


def full_tensors(size_mb: int, n: int) -> dict[str, Any]:
    """``n`` fp32 tensors of 1024 columns, about ``size_mb`` MiB in all (row counts uneven)."""
    import torch

    rows = max(1, size_mb * MiB // (4 * 1024 * n))
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows + i, 1024, generator=g) for i in range(n)}


def payload(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- one process


def single_process(args: argparse.Namespace, endpoint: str, work: str, server_pid: int) -> dict[str, Any]:
    import io

    import torch

    from checkpointer import Checkpointer
    from checkpointer.storage.s3 import S3Storage

    point_at(endpoint)
    state = full_tensors(args.size_mb, args.tensors)
    nbytes = payload(state)
    client = boto_client()
    local = os.path.join(work, "rank_0.safetensors")
    back = os.path.join(work, "downloaded.safetensors")
    dest = {k: torch.empty_like(v) for k, v in state.items()}

    # The bytes boto3 moves are those of our rank file.
    Checkpointer().save(f"s3://{BUCKET}/single/first", state)
    client.download_file(BUCKET, "single/first/rank_0.safetensors", local)
    file_bytes = os.path.getsize(local)
    with open(local, "rb") as f:
        in_memory = f.read()

    def ours_save(rnd: int) -> None:
        Checkpointer().save(f"s3://{BUCKET}/single/r{rnd}", state)

    def ours_save_parts(rnd: int) -> None:
        storage = S3Storage(f"s3://{BUCKET}/single/p{rnd}", part_size=args.alt_part_mb * MiB,
                            max_concurrency=args.alt_concurrency)
        Checkpointer().save(storage, state)

    def ours_load(rnd: int) -> None:
        Checkpointer().load(f"s3://{BUCKET}/single/r{rnd}", dest)

    def boto_upload(rnd: int) -> None:
        client.upload_file(local, BUCKET, f"boto/r{rnd}/rank_0.safetensors")

    def boto_upload_mem(rnd: int) -> None:
        client.upload_fileobj(io.BytesIO(in_memory), BUCKET, f"boto/m{rnd}/rank_0.safetensors")

    def boto_download(rnd: int) -> None:
        client.download_file(BUCKET, f"boto/r{rnd}/rank_0.safetensors", back)

    def boto_download_mem(rnd: int) -> None:
        client.download_fileobj(BUCKET, f"boto/r{rnd}/rank_0.safetensors", io.BytesIO())

    def before_load() -> None:
        for t in dest.values():
            t.zero_()

    def after_load() -> None:
        bad = [k for k in state if not torch.equal(state[k], dest[k])]
        if bad:
            raise SystemExit(f"load check failed for {bad}")

    def before_download() -> None:
        if os.path.exists(back):
            os.remove(back)

    # (name, fn, untimed setup, untimed check); loads follow the saves they read.
    # Clients are built once per setting and shared; build the alternative row's now, untimed,
    # as boto3's client is.
    S3Storage(f"s3://{BUCKET}/warm-up", part_size=args.alt_part_mb * MiB, max_concurrency=args.alt_concurrency)

    def clean_round() -> None:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            for obj in page.get("Contents", ()):
                if not obj["Key"].startswith("single/first/"):
                    client.delete_object(Bucket=BUCKET, Key=obj["Key"])

    saves = [("ours save", ours_save, None, None), ("boto3 upload_file", boto_upload, None, None),
             (f"ours save, {args.alt_part_mb} MiB parts x {args.alt_concurrency}", ours_save_parts, None, None),
             ("boto3 upload_fileobj (memory)", boto_upload_mem, None, None)]
    loads = [("ours load", ours_load, before_load, after_load), ("boto3 download_file", boto_download, before_download, None),
             ("boto3 download_fileobj (memory)", boto_download_mem, None, None)]
    names = [name for name, *_ in saves + loads]
    times: dict[str, list[float]] = {name: [] for name in names}
    client_cpu: dict[str, list[float]] = {name: [] for name in names}
    server_cpu: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(args.rounds):
        order = saves + loads if rnd % 2 == 0 else saves[::-1] + loads[::-1]
        for name, fn, setup, check in order:
            if setup:
                setup()
            c0, s0 = time.process_time(), cpu_seconds(server_pid)
            times[name].append(timed(lambda: fn(rnd)))
            client_cpu[name].append(time.process_time() - c0)
            server_cpu[name].append(cpu_seconds(server_pid) - s0)
            if check:
                check()
        clean_round()
        print(f"  round {rnd}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"payload_bytes": nbytes, "file_bytes": file_bytes, "times": times, "median_s": med,
            "client_cpu_s": {k: statistics.median(v) for k, v in client_cpu.items()},
            "server_cpu_s": {k: statistics.median(v) for k, v in server_cpu.items()}}


# --------------------------------------------------------------------------- several processes


def _rank_main(rank: int, world: int, init_file: str, envs: list[dict[str, str]], task: dict, out: str) -> None:
    """One rank: save or load its Shard(0) pieces; writes its timings and share to ``out``."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from checkpointer import Checkpointer

    torch.set_num_threads(1)
    for name in UNSET:
        os.environ.pop(name, None)
    os.environ.update(envs[rank])
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init_file}",
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors(task["size_mb"], task["tensors"])
    state = {}
    for key, t in full.items():
        chunks = torch.chunk(t, world, dim=0)
        local = chunks[rank].clone() if rank < len(chunks) else t.new_empty(0, t.shape[1])
        if task["op"] == "load":
            local = torch.zeros_like(local)
        state[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())
    share = sum(v.to_local().numel() * 4 for v in state.values())
    dist.barrier()
    t0 = time.perf_counter()
    if task["op"] == "save":
        Checkpointer().save(task["url"], state, save_overwrite=True)
    else:
        Checkpointer().load(task["url"], state)
    seconds = time.perf_counter() - t0
    if task["op"] == "load":
        for key, t in full.items():
            chunks = torch.chunk(t, world, dim=0)
            if rank < len(chunks) and not torch.equal(state[key].to_local(), chunks[rank]):
                raise SystemExit(f"rank {rank}: {key} differs after the load")
    dist.barrier()
    with open(out, "w") as f:
        json.dump({"rank": rank, "seconds": seconds, "share": share}, f)
    dist.destroy_process_group()


def run_ranks(world: int, envs: list[dict[str, str]], task: dict, work: str) -> list[dict]:
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(dir=work)
    outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
    procs = []
    ctx = mp.get_context("spawn")
    for rank in range(world):
        p = ctx.Process(target=_rank_main, args=(rank, world, os.path.join(tmp, "rdzv"), envs, task, outs[rank]))
        p.start()
        procs.append(p)
    for p in procs:
        p.join(600)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        for p in procs:
            if p.is_alive():
                p.kill()
        raise SystemExit(f"{task['op']} at world size {world}: rank(s) {failed} failed")
    return [json.load(open(o)) for o in outs]


def several_processes(args: argparse.Namespace, endpoint: str, work: str) -> dict[str, Any]:
    from remote_proxy import CountingProxy

    client = boto_client()
    url = f"s3://{BUCKET}/sharded"
    env = dict(SETTINGS, AWS_ENDPOINT_URL_S3=endpoint)
    task = {"size_mb": args.size_mb, "tensors": args.tensors, "url": url}
    saved = run_ranks(args.save_ws, [env] * args.save_ws, dict(task, op="save"), work)
    loaded = run_ranks(args.load_ws, [env] * args.load_ws, dict(task, op="load"), work)
    proxies = [CountingProxy(endpoint) for _ in range(args.load_ws)]
    try:
        envs = [dict(SETTINGS, AWS_ENDPOINT_URL_S3=p.url) for p in proxies]
        counted = run_ranks(args.load_ws, envs, dict(task, op="load"), work)
        fetched = [p.bytes_out for p in proxies]
        requests = [len(p.exchanges) for p in proxies]
    finally:
        for p in proxies:
            p.close()
    metadata_bytes = int(client.head_object(Bucket=BUCKET, Key="sharded/metadata.json")["ContentLength"])
    total = payload(full_tensors(args.size_mb, args.tensors))
    return {
        "payload_bytes": total,
        "metadata_bytes": metadata_bytes,
        "save_s": max(r["seconds"] for r in saved),
        "load_s": max(r["seconds"] for r in loaded),
        "per_rank": [
            {"rank": r["rank"], "share": r["share"], "fetched": f, "requests": n,
             "ratio": f / r["share"] if r["share"] else None,
             "within_goal": f <= 1.1 * r["share"] + metadata_bytes}
            for r, f, n in zip(counted, fetched, requests)
        ],
    }


# --------------------------------------------------------------------------- report


def machine_line(load_start: float, loads: list[float]) -> str:
    import boto3
    import botocore
    import moto
    import torch

    return (f"{datetime.datetime.now():%Y-%m-%d %H:%M}; {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, boto3 {boto3.__version__}, botocore {botocore.__version__}, "
            f"moto {moto.__version__}; 1-minute load average at start {load_start:.1f}, at the end "
            f"{loads[-1]:.1f} (other jobs share the machine).")


def report(args: argparse.Namespace, single: dict, multi: dict, machine: str) -> str:
    mb = 1e6
    med = single["median_s"]
    n, f = single["payload_bytes"], single["file_bytes"]
    lines = [
        "# remote_bench: S3 (moto_server on loopback) against boto3's own transfers",
        "",
        machine,
        "",
        f"Command: `python benchmarks/remote_bench.py {' '.join(sys.argv[1:])}`".replace("  ", " "),
        "",
        f"## One process: {n / mb:.0f} MB payload ({f / mb:.1f} MB rank file), median of {args.rounds} rounds, "
        "operations interleaved (the order flips every round)",
        "",
        "| operation | seconds | MB/s (file bytes) | vs boto3 upload_file / download_file | client CPU s | moto_server CPU s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t in med.items():
        ref = med["boto3 upload_file"] if ("save" in name or "upload" in name) else med["boto3 download_file"]
        lines.append(f"| {name} | {t:.2f} | {f / t / mb:.0f} | {ref / t:.2f}x | "
                     f"{single['client_cpu_s'][name]:.2f} | {single['server_cpu_s'][name]:.2f} |")
    lines.append("")
    for ours, theirs in (("ours save", "boto3 upload_file"), ("ours load", "boto3 download_file")):
        ratio = med[theirs] / med[ours]
        lines.append(f"- {ours} / {theirs} throughput: {ratio:.2f}x (goal >= 0.9x: {'met' if ratio >= 0.9 else 'NOT met'})")
    t = multi["payload_bytes"]
    lines += [
        "",
        f"## {args.save_ws} ranks save, {args.load_ws} ranks load (gloo, Shard(0) DTensors, {t / mb:.0f} MB)",
        "",
        f"save at {args.save_ws}: {multi['save_s']:.2f} s ({t / multi['save_s'] / mb:.0f} MB/s aggregate); "
        f"load at {args.load_ws}: {multi['load_s']:.2f} s ({t / multi['load_s'] / mb:.0f} MB/s aggregate)",
        "",
        f"| rank | share (bytes) | fetched (bytes, via proxy) | requests | fetched / share | "
        f"<= 1.1x share + metadata.json ({multi['metadata_bytes']} B) |",
        "|---|---|---|---|---|---|",
    ]
    for r in multi["per_rank"]:
        lines.append(f"| {r['rank']} | {r['share']:,} | {r['fetched']:,} | {r['requests']} | {r['ratio']:.4f} | "
                     f"{'yes' if r['within_goal'] else 'no'} |")
    lines += [
        "",
        "Notes: ratios are throughputs (boto3's seconds / ours), so above 1x is faster than boto3. "
        "The boto3 rows move the bytes of our rank file with a client made beforehand and the default "
        "TransferConfig (8 MiB parts, 10 threads, CRC32 declared). Ours: 16 MiB parts, 8 in flight, "
        "CRC32 declared likewise, parts sent from tensor memory (no copy). Client CPU is this process's "
        "(all its threads) during the operation. 'fetched' counts every byte a rank's "
        "proxy sent back (status lines and headers included); a rank's share is the bytes of its "
        "pieces; the ranks read the header of each rank file they need (64 KiB at most) besides.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=256, help="payload in MiB (default 256)")
    p.add_argument("--tensors", type=int, default=8, help="number of tensors (default 8)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--save-ws", type=int, default=4)
    p.add_argument("--load-ws", type=int, default=3)
    p.add_argument("--alt-part-mb", type=int, default=8,
                   help="part size of the extra 'ours save' row (an S3Storage passed to Checkpointer.save)")
    p.add_argument("--alt-concurrency", type=int, default=10, help="parallel parts of the extra 'ours save' row")
    p.add_argument("--out", default=str(HERE / "results" / "remote.md"), help="the markdown report ('-': none)")
    p.add_argument("--json", help="also write the figures as JSON here")
    args = p.parse_args(argv)

    load_start = os.getloadavg()[0]
    work = tempfile.mkdtemp(prefix="remote-bench-")
    proc, endpoint = start_moto(work)
    try:
        point_at(endpoint)
        boto_client().create_bucket(Bucket=BUCKET)
        print(f"moto_server at {endpoint}; {args.size_mb} MiB in {args.tensors} tensors", flush=True)
        single = single_process(args, endpoint, work, proc.pid)
        print(f"{args.save_ws} -> {args.load_ws} ranks ...", flush=True)
        multi = several_processes(args, endpoint, work)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    text = report(args, single, multi, machine_line(load_start, [os.getloadavg()[0]]))
    print("\n" + text)
    if args.out != "-":
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"\nwrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "single": single, "multi": multi}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
