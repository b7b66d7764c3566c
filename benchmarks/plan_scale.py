"""Planning at scale, simulated without processes: a 70B-like model over 1,024 and 8,192 ranks.

Calls the pure planning functions the engine runs, on inputs shaped like a real FSDP2 run:

* every rank at save: decoding every rank's pieces from the bytes the engine all-gathers
  (one shared structure, one int64 array per rank) and ``build_save_plan`` on them, for the
  model directory (723 parameters) and the optimizer directory (AdamW: ``exp_avg`` and
  ``exp_avg_sq`` sharded like their parameter, ``step`` a replicated scalar, plus
  ``num_param_groups``, ``param_group0``, ``state_keys``); parameters are ``Shard(0)``
  boxes with ``torch.chunk`` semantics (ranks past the rows hold empty pieces);
* ``StorageMetadata.to_json_bytes`` (rank 0 at save; every other rank makes the same plan
  and keeps it) and ``parse_metadata`` (every rank at load): the size of ``metadata.json``
  and the time to read it;
* ``build_load_plan`` for every key, for one rank, after a world-size change (1024 -> 768,
  8192 -> 6144) and without one: what each rank does at load. Timed for a few sample ranks
  (first, middle, last); every rank plans in parallel, so the per-rank time is the wall time,
  and ranks x per-rank is the total CPU time.

Then, for the goal's measure, the planning alone with all 80 layers at every world size: the
save plan, and the load plans on the metadata it made (no ``metadata.json`` text, whose size
keeps the cases above to a subset of layers at 8,192 ranks).

Each (world size, directory) case runs in its own process under an address-space limit
(``--mem-limit-gb``), so a case that needs too much memory reports it instead of taking the
machine down. Goals (report only): planning < 2 s at 1,024 ranks, < 20 s at 8,192.

Usage::

    python benchmarks/plan_scale.py                       # 1024 and 8192 ranks, both directories
    python benchmarks/plan_scale.py --ranks 1024 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HIDDEN, FFN, LAYERS, VOCAB, KV = 8192, 28672, 80, 128256, 1024  # Llama-3-70B: 64 heads, 8 KV heads x 128


def llama70b_params(layers: int = LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of a Llama-3-70B-like model; ``layers`` < 80 keeps the first ``layers`` blocks."""
    params = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}"
        params += [
            (f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.self_attn.k_proj.weight", (KV, HIDDEN)),
            (f"{p}.self_attn.v_proj.weight", (KV, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.mlp.gate_proj.weight", (FFN, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (FFN, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, FFN)),
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
        ]
    params += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return params


def shard0_box(shape: tuple[int, ...], world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """FSDP2 ``Shard(0)``: ``torch.chunk`` of dim 0 (as ``checkpointer.sharding.dtensor_box``)."""
    chunk = math.ceil(shape[0] / world)
    start = min(rank * chunk, shape[0])
    end = min(start + chunk, shape[0])
    return (end - start, *shape[1:]), (start, *([0] * (len(shape) - 1)))


def rank_pieces(params, world: int, rank: int):
    from checkpointer.planning.plan import Piece

    return [Piece(local_shape=ls, global_offset=go) for ls, go in (shard0_box(shape, world, rank) for _, shape in params)]


def columns_for(directory: str, params, world: int) -> list:
    """Every rank's pieces as the engine sends them to rank 0 (``RankPieces``: one shared
    structure, one int64 array per rank), built for all ranks at once."""
    import numpy as np

    from checkpointer.planning.pieces import BOX, RankPieces, Structure

    keys, shapes, dtypes, sharded, kinds = [], [], [], [], []
    if directory == "optim":
        # OLMo's flat layout, sorted keys as the engine gives them
        names = [n for n, _ in params]
        group_bytes = len(json.dumps({"lr": 1e-4, "betas": [0.9, 0.95], "_param_names": names})) + 200
        for key, shape, dtype in [("num_param_groups", (), "I64"), ("param_group0", (group_bytes,), "U8"),
                                  ("state_keys", (40,), "U8")] + [(f"state.{n}.__step", (), "F32") for n in names]:
            keys.append(key), shapes.append(shape), dtypes.append(dtype), sharded.append(False), kinds.append(1)
        for n, shape in params:
            for state in ("exp_avg", "exp_avg_sq"):
                keys.append(f"state.{n}.__{state}"), shapes.append(shape), dtypes.append("F32")
                sharded.append(True), kinds.append(BOX)
    else:
        for n, shape in params:
            keys.append(n), shapes.append(shape), dtypes.append("F32"), sharded.append(True), kinds.append(BOX)
    structure = Structure(keys, shapes, dtypes, sharded, kinds)
    values = np.zeros((world, structure.width), dtype=np.int64)
    ranks = np.arange(world, dtype=np.int64)
    for i, (shape, kind) in enumerate(zip(shapes, kinds)):
        lo, _ = structure.span(i)
        if kind == 1:  # replicated: the whole tensor, flat
            values[:, lo + 1] = math.prod(shape)
            continue
        chunk = -(-shape[0] // world)  # torch.chunk of dim 0
        start = np.minimum(ranks * chunk, shape[0])
        values[:, lo] = np.minimum(start + chunk, shape[0]) - start
        values[:, lo + 1 : lo + len(shape)] = shape[1:]
        values[:, lo + len(shape)] = start
    return [RankPieces(structure, row) for row in values]


def payloads_for(columns: list) -> list[bytes]:
    """What each rank sends (``checkpointer.engine.save``'s wire form: rank 0 sends the structure)."""
    from checkpointer.engine.save import _pieces_payload

    return [_pieces_payload(c, {}, with_structure=r == 0) for r, c in enumerate(columns)]


def decoded_on_rank0(payloads: list[bytes], own_structure) -> list:
    """A rank's decoding of the gathered payloads, as the engine does it (it knows its own structure)."""
    from checkpointer.engine.save import _parse_pieces

    known = {own_structure.digest: own_structure}
    return [_parse_pieces(p, known)[0] for p in payloads]


def wanted_for(directory: str, params, world: int, rank: int, metadata) -> dict[str, list]:
    """The ranges each key's destination on ``rank`` of ``world`` holds (what plan_local_loads asks for)."""
    from checkpointer.planning.pieces import piece_ranges

    out = {}
    pieces = rank_pieces(params, world, rank)
    for (name, shape), piece in zip(params, pieces):
        keys = [name] if directory == "model" else [f"state.{name}.__exp_avg", f"state.{name}.__exp_avg_sq"]
        for k in keys:
            out[k] = piece_ranges(piece, shape)
    if directory == "optim":
        for key, meta in metadata.tensors.items():
            if key not in out:
                out[key] = [(0, meta.numel)] if meta.numel else []
    return out


class Clock:
    """Wall and CPU seconds (the machine is shared: CPU time is what a dedicated core would take)."""

    def __enter__(self):
        self.w, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w
        self.cpu = time.process_time() - self.c


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(world: int, directory: str, target: int, samples: int, profile: bool, layers: int, repeat: int = 1,
             planning_only: bool = False) -> dict:
    from checkpointer.format.metadata import parse_metadata
    from checkpointer.planning.plan import build_save_plan
    from checkpointer.planning.load_plan import build_load_plan

    params = llama70b_params(layers)
    full_keys = len(columns_for(directory, llama70b_params(LAYERS), 1)[0].structure.keys)
    out: dict = {"world": world, "dir": directory, "target_world": target, "layers": layers}
    prof = cProfile.Profile() if profile else None

    def clocked(fn):
        gc.collect()
        if prof:
            prof.enable()
        with Clock() as c:
            value = fn()
        if prof:
            prof.disable()
        return value, c

    def timed_steps(steps) -> list:
        """Run the steps in order (each gets the values of the ones before), ``repeat`` times
        from scratch; record each step's least CPU time (a shared machine only ever adds time).
        Returns the values of the last run."""
        best: dict[str, Clock] = {}
        values: list = []
        for _ in range(repeat):
            values = value = None
            values = []
            for name, fn in steps:
                value, c = clocked(lambda: fn(*values))
                values.append(value)
                if name not in best or c.cpu < best[name].cpu:
                    best[name] = c
        for name, c in best.items():
            out[name + "_s"] = c.cpu
            out[name + "_wall_s"] = c.wall
        return values

    with Clock() as c:
        columns = columns_for(directory, params, world)
        payloads = payloads_for(columns)
        own = columns[0].structure
        columns = None
    out["describe_s"] = c.cpu
    out["descs"] = len(own.keys) * world
    out["keys"] = len(own.keys)
    out["payload_bytes_per_rank"] = len(payloads[0])
    out["scale"] = full_keys / out["keys"]

    if planning_only:
        return _planning_only(out, directory, params, world, target, payloads, own, clocked, repeat)

    # Commit (rank 0, after the writes): every piece's CRC32C per 16 MiB chunk goes into the
    # metadata it planned, which is dumped again; loads parse that final metadata.json.
    import random

    from checkpointer.checksums import ALGORITHM, CHUNK_BYTES
    from checkpointer.format.dtypes import itemsize

    rng = random.Random(0)
    crcs: dict[str, dict[str, list[int]]] = {}
    for key, meta in build_save_plan(decoded_on_rank0(payloads, own)).metadata.tensors.items():
        size = itemsize(meta.dtype)
        for f in meta.shard_spec_per_file:
            chunks = -(-meta.shard_spec_per_file[f].local_numel * size // CHUNK_BYTES)
            crcs.setdefault(f, {})[key] = [rng.getrandbits(32) for _ in range(chunks)]

    # Rank 0 at save, each run from scratch: plan, dump, checksums into the planned metadata, dump.
    plan, data, _, final = timed_steps([
        ("save_plan", lambda: build_save_plan(decoded_on_rank0(payloads, own))),
        ("metadata_json", lambda plan: plan.metadata.to_json_bytes()),
        ("with_checksums", lambda plan, _: plan.metadata.with_checksums(crcs, algorithm=ALGORITHM, chunk_bytes=CHUNK_BYTES)),
        ("metadata_json_final", lambda _p, _d, committed: committed.to_json_bytes()),
    ])
    out["specs"] = sum(len(m.shard_spec_per_file) for m in plan.metadata.tensors.values())
    out["metadata_bytes"] = len(data)
    out["metadata_bytes_final"] = len(final)
    payloads = plan = crcs = None  # type: ignore[assignment]
    data = None  # type: ignore[assignment]
    # Every rank at load.
    timed_steps([("parse_metadata_final", lambda: parse_metadata(final, where="metadata.json"))])

    def load_plans(new_world: int, label: str, n: int) -> None:
        ranks = sorted({0, new_world // 2, new_world - 1})
        ranks = ranks[:1] if n <= 1 else ([ranks[0], ranks[len(ranks) // 2]] if n == 2 else ranks)
        cpu, wall, items = [], [], []
        for r in ranks:
            best = None
            for _ in range(repeat):
                metadata = None
                metadata = parse_metadata(final, where="metadata.json")  # nothing cached from another plan
                wanted = wanted_for(directory, params, new_world, r, metadata)
                reads, c = clocked(
                    lambda: sum(len(build_load_plan(key, metadata.tensors[key], rs).items) for key, rs in wanted.items())
                )
                if best is None or c.cpu < best.cpu:
                    best = c
            cpu.append(best.cpu)
            wall.append(best.wall)
            items.append(reads)
        out[f"load_plan_{label}_s_per_rank"] = cpu
        out[f"load_plan_{label}_wall_s_per_rank"] = wall
        out[f"load_plan_{label}_ranks"] = ranks
        out[f"load_plan_{label}_reads"] = items

    load_plans(target, "reshard", samples)
    load_plans(world, "same", 1)
    out["peak_rss_mib"] = peak_rss_mib()
    if prof:
        sio = io.StringIO()
        pstats.Stats(prof, stream=sio).sort_stats("tottime").print_stats(20)
        out["profile"] = sio.getvalue()
    return out


def _planning_only(out, directory, params, world, target, payloads, own, clocked, repeat) -> dict:
    """The save plan, then one rank's load plans on the metadata it made (as a rank's parse
    would give them: what the planner derives from a layout is forgotten before each rank)."""
    from checkpointer.planning.plan import build_save_plan
    from checkpointer.planning.load_plan import build_load_plan

    best = None
    for _ in range(repeat):
        plan, c = clocked(lambda: build_save_plan(decoded_on_rank0(payloads, own)))
        best = c if best is None or c.cpu < best.cpu else best
    out["save_plan_s"], out["save_plan_wall_s"] = best.cpu, best.wall
    metadata = plan.metadata
    out["specs"] = sum(len(m.shard_spec_per_file) for m in metadata.tensors.values())
    for label, new_world in (("reshard", target), ("same", world)):
        ranks = sorted({0, new_world // 2, new_world - 1})
        cpu = []
        for r in ranks:
            wanted = wanted_for(directory, params, new_world, r, metadata)
            best = None
            for _ in range(repeat):
                for meta in metadata.tensors.values():
                    meta.shard_spec_per_file.layout.memo.pop("source_index", None)
                _, c = clocked(lambda: [build_load_plan(key, metadata.tensors[key], rs) for key, rs in wanted.items()])
                best = c if best is None or c.cpu < best.cpu else best
            cpu.append(best.cpu)
        out[f"load_plan_{label}_s_per_rank"] = cpu
        out[f"load_plan_{label}_ranks"] = ranks
    out["peak_rss_mib"] = peak_rss_mib()
    out["planning_only"] = True
    return out


def child(args) -> int:
    limit = int(args.mem_limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        res = run_case(args.case_world, args.case_dir, args.case_target, args.samples, args.profile, args.case_layers,
                       args.repeat, args.case_planning_only)
    except MemoryError:
        res = {"world": args.case_world, "dir": args.case_dir, "error": f"MemoryError under a {args.mem_limit_gb:g} GiB address-space limit",
               "peak_rss_mib": peak_rss_mib()}
    print("RESULT " + json.dumps(res))
    return 0


def fmt(v, spec=".2f") -> str:
    return "–" if v is None else format(v, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1024,8192", help="world sizes to plan for (default 1024,8192)")
    ap.add_argument("--shrink", type=float, default=0.75, help="load at this fraction of the world size (default 0.75)")
    ap.add_argument("--dirs", default="model,optim", help="directories to plan (default model,optim)")
    ap.add_argument("--samples", type=int, default=2, help="ranks whose resharding load plans are timed (1-3, default 2)")
    ap.add_argument("--full-layers-up-to", type=int, default=1024,
                    help="plan all 80 layers up to this world size; above it, a subset of layers holding the same "
                         "number of pieces as 1024 ranks x 80 layers, times scaled by keys (default 1024)")
    ap.add_argument("--linearity-check", action="store_true",
                    help="also plan the model directory at the smallest world size with the subset of layers, "
                         "to check that scaling by keys holds")
    ap.add_argument("--mem-limit-gb", type=float, default=12.0, help="address-space limit per case (default 12)")
    ap.add_argument("--timeout-s", type=float, default=1800, help="limit per case")
    ap.add_argument("--no-planning-only", action="store_true",
                    help="skip the cases that plan all 80 layers at every world size without metadata.json")
    ap.add_argument("--profile", action="store_true", help="cProfile the planning calls; print the top functions")
    ap.add_argument("--repeat", type=int, default=3,
                    help="run each step this many times from scratch and report the least CPU time (default 3); "
                         "each load plan starts from a fresh parse (a rank plans once)")
    ap.add_argument("--out", default=str(HERE / "results"), help="where plan_scale.json/.md go")
    ap.add_argument("--case-world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--case-dir", help=argparse.SUPPRESS)
    ap.add_argument("--case-target", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--case-layers", type=int, default=LAYERS, help=argparse.SUPPRESS)
    ap.add_argument("--case-planning-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case_world:
        return child(args)

    params = llama70b_params()
    n_params = sum(math.prod(s) for _, s in params)
    print(f"70B-like layout: {len(params)} parameters, {n_params / 1e9:.1f} B elements; "
          f"optimizer: {3 * len(params) + 3} keys", flush=True)
    worlds = [int(x) for x in args.ranks.split(",")]
    cases = []
    for world in worlds:
        layers = LAYERS if world <= args.full_layers_up_to else max(2, round(LAYERS * args.full_layers_up_to / world))
        for d in args.dirs.split(","):
            cases.append((world, d, layers, False))
    if args.linearity_check and any(l < LAYERS for _, _, l, _ in cases):
        sub = min(l for _, _, l, _ in cases)
        cases.append((min(worlds), "model", sub, False))
    if not args.no_planning_only:
        cases += [(world, d, LAYERS, True) for world in worlds for d in args.dirs.split(",")]

    results = []
    for world, d, layers, planning_only in cases:
        target = max(1, int(round(world * args.shrink)))
        cmd = [sys.executable, __file__, "--case-world", str(world), "--case-dir", d, "--case-target", str(target),
               "--case-layers", str(layers), "--samples", str(args.samples), "--mem-limit-gb", str(args.mem_limit_gb),
               "--repeat", str(args.repeat)]
        cmd += ["--profile"] if args.profile else []
        cmd += ["--case-planning-only"] if planning_only else []
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else {"world": world, "dir": d, "layers": layers, "error": (p.stderr or "no result")[-800:]}
        except subprocess.TimeoutExpired:
            res = {"world": world, "dir": d, "layers": layers, "error": f"over {args.timeout_s:.0f} s"}
        res["wall_s"] = time.time() - t0
        results.append(res)
        if "error" in res:
            print(f"{world:>6} {d:>5} ({layers} layers): {res['error']}", flush=True)
        elif planning_only:
            print(f"{world:>6} {d:>5} (all {layers} layers, planning only): save plan {res['save_plan_s']:.2f} s CPU, "
                  f"load plan/rank {max(res['load_plan_reshard_s_per_rank']):.2f} s -> {target}, "
                  f"{max(res['load_plan_same_s_per_rank']):.2f} s same; peak RSS {res['peak_rss_mib']:.0f} MiB "
                  f"[case wall {res['wall_s']:.0f} s]", flush=True)
        else:
            k = res["scale"]
            print(f"{world:>6} {d:>5} ({layers} layers, x{k:.2f}): save plan {res['save_plan_s'] * k:.2f} s CPU, "
                  f"metadata {res['metadata_bytes_final'] * k / 1e6:.0f} MB with checksums (dump {res['metadata_json_s'] * k:.2f} s, "
                  f"parse {res['parse_metadata_final_s'] * k:.2f} s), load plan/rank {max(res['load_plan_reshard_s_per_rank']) * k:.2f} s "
                  f"-> {target}, {max(res['load_plan_same_s_per_rank']) * k:.2f} s same; peak RSS {res['peak_rss_mib']:.0f} MiB "
                  f"[case wall {res['wall_s']:.0f} s]", flush=True)
            if args.profile:
                print(res["profile"], flush=True)

    report = render(results, args, params, n_params)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_scale.md").write_text(report)
    with open(out / "plan_scale.json", "w") as f:
        json.dump(results, f, indent=1)
    print(report)
    return 0


def render(results, args, params, n_params) -> str:
    planning = [r for r in results if r.get("planning_only")]
    results = [r for r in results if not r.get("planning_only")]
    lines = [
        "# Planning at scale (70B-like layout, FSDP2 Shard(0), simulated)\n",
        f"{len(params)} parameters ({n_params / 1e9:.1f} B elements, Llama-3-70B shapes); optimizer directory "
        f"{3 * len(params) + 3} keys (AdamW exp_avg, exp_avg_sq sharded, step replicated). "
        "Seconds of CPU time of the pure planning functions (single-threaded; the machine is shared, so CPU time "
        f"is what a dedicated core takes, the least of {args.repeat} runs; wall times are in plan_scale.json). Every rank makes the save plan "
        "(from the pieces all ranks sent: the same plan everywhere); rank 0 dumps the metadata; every rank parses "
        "it at load, and the load plan runs on every rank in "
        f"parallel, for loading at {args.shrink:g} x the world size ('reshard', max over sampled ranks) and at the "
        "same world size ('same'). Where fewer than 80 layers were planned (marked), times, metadata size and "
        "piece counts are scaled by full keys / planned keys: every planning step is a loop over keys.\n",
        "| ranks | dir | planned | pieces in | specs in metadata | save plan s | dump s "
        "| add checksums s | dump s (final) | metadata.json MB | parse s (at load) | load plan/rank s (reshard) "
        "| load plan/rank s (same) | all ranks CPU s (reshard load plan) | peak RSS MiB |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['world']} | {r['dir']} | {r.get('layers')} layers | {r['error'][:200]} |" + " |" * 12)
            continue
        k = r["scale"]
        planned = "all 80 layers" if r["layers"] == LAYERS else f"{r['layers']} layers, x{k:.2f}"
        tgt = r["target_world"]
        lines.append(
            f"| {r['world']} | {r['dir']} | {planned} | {round(r['descs'] * k):,} | {round(r['specs'] * k):,} | "
            f"{fmt(r['save_plan_s'] * k)} | {fmt(r['metadata_json_s'] * k)} | "
            f"{fmt(r['with_checksums_s'] * k)} | {fmt(r['metadata_json_final_s'] * k)} | "
            f"{r['metadata_bytes_final'] * k / 1e6:.0f} | {fmt(r['parse_metadata_final_s'] * k)} | "
            f"{fmt(max(r['load_plan_reshard_s_per_rank']) * k)} | {fmt(max(r['load_plan_same_s_per_rank']) * k)} | "
            f"{fmt(sum(r['load_plan_reshard_s_per_rank']) / len(r['load_plan_reshard_s_per_rank']) * k * tgt, '.0f')} | "
            f"{r['peak_rss_mib']:.0f} |")
    lines += ["", "Planning per world size (model + optim directories, the full 80-layer model), CPU seconds: "
              "the save plan on rank 0 (decoding what the ranks sent included) and one rank's load plan "
              "after the world-size change, the goal's measure; then the cost of the metadata.json the "
              "format requires (JSON text of every shard spec: dump on rank 0, parse on every rank).", "",
              "| ranks | save plan (rank 0) | load plan (per rank, reshard) | planning total | goal "
              "| metadata.json dump + checksums + dump (rank 0) | metadata.json parse (per rank, at load) |",
              "|---:|---:|---:|---:|---|---:|---:|"]
    dirs = args.dirs.split(",")
    for world in sorted({r["world"] for r in results}):
        by_dir = {}
        for r in (r for r in results if r["world"] == world and "error" not in r):
            if r["dir"] not in by_dir or r["layers"] > by_dir[r["dir"]]["layers"]:
                by_dir[r["dir"]] = r
        if set(by_dir) != set(dirs):
            continue
        rs = list(by_dir.values())
        save = sum(r["save_plan_s"] * r["scale"] for r in rs)
        load = sum(max(r["load_plan_reshard_s_per_rank"]) * r["scale"] for r in rs)
        dump = sum((r["metadata_json_s"] + r["with_checksums_s"] + r["metadata_json_final_s"]) * r["scale"] for r in rs)
        parse = sum(r["parse_metadata_final_s"] * r["scale"] for r in rs)
        goal = 2.0 if world <= 1024 else 20.0
        lines.append(f"| {world} | {save:.2f} | {load:.2f} | {save + load:.2f} | < {goal:g} s | {dump:.1f} | {parse:.1f} |")
    if planning:
        lines += ["", "Planning alone, all 80 layers planned at every world size (no scaling), CPU seconds: the "
                  "save plan on rank 0 (decoding what the ranks sent included), one rank's load plan (max over "
                  "first, middle and last rank; what it derives from a layout is forgotten before each rank) "
                  f"after the world-size change (x{args.shrink:g}) and without one.", "",
                  "| ranks | save plan model | save plan optim | load plan/rank model | load plan/rank optim "
                  "| load plan/rank, same world size (model + optim) | planning total | vs fewest ranks | goal |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        first = None
        for world in sorted({r["world"] for r in planning}):
            rs = {r["dir"]: r for r in planning if r["world"] == world and "error" not in r}
            if set(rs) != {"model", "optim"}:
                lines.append(f"| {world} | incomplete | | | | | | | |")
                continue
            save = {d: rs[d]["save_plan_s"] for d in rs}
            load = {d: max(rs[d]["load_plan_reshard_s_per_rank"]) for d in rs}
            same = sum(max(rs[d]["load_plan_same_s_per_rank"]) for d in rs)
            total = sum(save.values()) + sum(load.values())
            first = first or (world, total)
            growth = f"{total / first[1]:.1f}x time for {world / first[0]:.0f}x ranks"
            goal = 2.0 if world <= 1024 else 20.0
            lines.append(f"| {world} | {save['model']:.2f} | {save['optim']:.2f} | {load['model']:.2f} | "
                         f"{load['optim']:.2f} | {same:.2f} | {total:.2f} | {growth} | < {goal:g} s |")
    lines += ["", "Totals per world size with the metadata.json work (model + optim directories, the full 80-layer model), CPU seconds:", "",
              "| ranks | save, rank 0: plan + dump + checksums + dump | save, other ranks: plan "
              "| load, every rank: parse + load plan (reshard) | largest metadata.json MB | goal |",
              "|---:|---:|---:|---:|---:|---|"]
    dirs = args.dirs.split(",")
    for world in sorted({r["world"] for r in results}):
        rs = [r for r in results if r["world"] == world and "error" not in r]
        # The scaling-check case is an extra model-dir row at a world that also has a full one: prefer full.
        by_dir = {}
        for r in rs:
            if r["dir"] not in by_dir or r["layers"] > by_dir[r["dir"]]["layers"]:
                by_dir[r["dir"]] = r
        if set(by_dir) != set(dirs):
            lines.append(f"| {world} | incomplete (see above) | | | | |")
            continue
        rs = list(by_dir.values())
        rank0 = sum((r["save_plan_s"] + r["metadata_json_s"] + r["with_checksums_s"] + r["metadata_json_final_s"])
                    * r["scale"] for r in rs)
        others = sum(r["save_plan_s"] * r["scale"] for r in rs)
        load = sum((r["parse_metadata_final_s"] + max(r["load_plan_reshard_s_per_rank"])) * r["scale"] for r in rs)
        biggest = max(r["metadata_bytes_final"] * r["scale"] for r in rs)
        goal = 2.0 if world <= 1024 else 20.0
        lines.append(f"| {world} | {rank0:.1f} | {others:.1f} | {load:.1f} | {biggest / 1e6:.0f} | < {goal:g} s |")
    check = [r for r in results if "error" not in r and r["dir"] == "model"]
    by_world = {}
    for r in check:
        by_world.setdefault(r["world"], []).append(r)
    for world, rs in by_world.items():
        if len(rs) >= 2:
            full = max(rs, key=lambda r: r["layers"])
            sub = min(rs, key=lambda r: r["layers"])
            lines += ["", f"Scaling check at {world} ranks, model directory: {sub['layers']} layers scaled x{sub['scale']:.2f} "
                      f"vs all 80 layers: save plan {sub['save_plan_s'] * sub['scale']:.2f} vs {full['save_plan_s']:.2f} s, "
                      f"parse {sub['parse_metadata_final_s'] * sub['scale']:.2f} vs {full['parse_metadata_final_s']:.2f} s, "
                      f"load plan/rank {max(sub['load_plan_reshard_s_per_rank']) * sub['scale']:.2f} vs "
                      f"{max(full['load_plan_reshard_s_per_rank']):.2f} s."]
    from checkpointer.engine.load import MAX_METADATA_BYTES

    over = [f"{r['world']} ranks, {r['dir']} ({r['metadata_bytes_final'] * r['scale'] / 2**30:.2f} GiB)"
            for r in results if "error" not in r and r["metadata_bytes_final"] * r["scale"] > MAX_METADATA_BYTES]
    lines += ["", f"The loader refuses a metadata.json over {MAX_METADATA_BYTES / 2**30:g} GiB "
              "(checkpointer/engine/load.py MAX_METADATA_BYTES)"
              + (": over it here: " + "; ".join(over) + "." if over else "; every case here is under it.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
