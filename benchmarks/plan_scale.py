"""Metadata and planning at scale (issue 27), simulated without processes: a 70B-like model in
FSDP2, HSDP and TP+FSDP layouts over 1,024, 8,192 and 16,384 ranks.

For each (layout, world size, part: model or optim) case, in its own process under an
address-space limit (``--mem-limit-gb``), the pure functions the engine runs, on inputs shaped
like the real run (every rank's pieces as the engine all-gathers them):

1. **first save, every rank**: the bytes it receives to plan (the all-reduce that confirms every
   rank's layouts agree), and the planning from layouts (``planning.layouts``: every rank's pieces
   computed per distinct layout, this rank's own checked, ``plan_from_layouts``). At
   ``--exchange-ranks`` (default 1,024) also the fallback, every rank's pieces all-gathered
   (``planning.pieces.pieces_payload``) and ``build_save_plan``, and whether both plans agree
   (``same_as_exchange``: metadata, writers, copies);
2. **rank 0 at commit**: the committed metadata (``checksums_in_files``, one ``file_id``) as
   ``metadata.json`` text: its size and the time to make it;
3. **load, every rank**: read ``metadata.json`` from a file, ``parse_metadata``, and
   ``build_load_plan`` of every key for one rank after a world-size change (x0.75, the same
   layout), timed for the first, middle and last rank; the extra memory is tracemalloc's peak over
   the same steps (run again, apart from the timing).

At 1,024 ranks the same cases also run in format 1 (every piece listed, with its checksums and
each file's id), for reference: ``metadata.json`` size and parse time.

Layouts (rank order as ``init_device_mesh`` gives it, outer mesh dim first):

* ``fsdp2``: mesh (W,), every parameter ``Shard(0)``;
* ``hsdp``: mesh (W/64, 64), ``(Replicate, Shard(0))``: 64-way sharding, W/64 replicas;
* ``tp_fsdp``: mesh (W/8, 8), 8-way tensor parallel: embedding, q/k/v, gate/up and the head
  ``Shard(0)`` over TP (column-parallel), o and down ``Shard(1)`` (row-parallel), norms replicated
  over TP; FSDP2 over the outer dim shards dim 0 of each TP piece (``_StridedShard``).

CPU seconds (single-threaded, the least of ``--repeat`` runs: the machine is shared, and a shared
machine only adds time). Goals (issue 27, per part): metadata.json <= 8 MB and < 1.5x growth
from 1,024 to 16,384 ranks; rank-0 metadata work <= 1 s; load read + parse + plan <= 1 s and
<= 64 MiB per rank; first-save bytes received per rank <= 4 MB.

Usage::

    python benchmarks/plan_scale.py                             # every case (about 15 minutes)
    python benchmarks/plan_scale.py --ranks 1024 --layouts fsdp2 --parts model
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HIDDEN, FFN, LAYERS, VOCAB, KV = 8192, 28672, 80, 128256, 1024  # Llama-3-70B: 64 heads, 8 KV heads x 128
HSDP_SHARD, TP = 64, 8
LAYOUTS = ("fsdp2", "hsdp", "tp_fsdp")
ROW_PARALLEL = ("o_proj", "down_proj")
GOALS = {"metadata_mb": 8.0, "growth": 1.5, "save_s": 1.0, "load_s": 1.0, "load_mib": 64.0, "received_mb": 4.0}


def llama70b_params() -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of a Llama-3-70B-like model (723 tensors)."""
    params = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
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


def _chunk(n, parts, index):
    """``torch.chunk`` of ``n`` into ``parts``: (start, length) of chunk ``index`` (numpy arrays ok)."""
    import numpy as np

    size = -(-n // parts)
    start = np.minimum(index * size, n)
    return start, np.minimum(start + size, n) - start


def boxes(layout: str, name: str, shape: tuple[int, ...], world: int, ranks):
    """Each rank's box of one parameter: (local shape per dim, offset per dim), arrays over ``ranks``."""
    import numpy as np

    ones = np.ones_like(ranks)
    local = [ones * s for s in shape]
    offset = [ranks * 0 for _ in shape]
    if layout == "fsdp2":
        offset[0], local[0] = _chunk(shape[0], world, ranks)
    elif layout == "hsdp":
        shard = min(HSDP_SHARD, world)
        offset[0], local[0] = _chunk(shape[0], shard, ranks % shard)
    else:
        dp, tp = ranks // TP, ranks % TP
        outer = world // TP
        if len(shape) == 1:  # norms: replicated over TP, FSDP over dim 0
            offset[0], local[0] = _chunk(shape[0], outer, dp)
        elif any(k in name for k in ROW_PARALLEL):
            offset[1], local[1] = _chunk(shape[1], TP, tp)
            offset[0], local[0] = _chunk(shape[0], outer, dp)
        else:  # column-parallel: TP cuts dim 0, FSDP cuts each TP piece's rows again
            t_start, t_len = _chunk(shape[0], TP, tp)
            size = -(-t_len // outer)
            d_start = np.minimum(dp * size, t_len)
            offset[0], local[0] = t_start + d_start, np.minimum(d_start + size, t_len) - d_start
    return local, offset


def part_keys(part: str, params) -> list[tuple[str, tuple[int, ...], str, bool, str | None]]:
    """``(key, shape, dtype, sharded, parameter)`` of a part, in the engine's sorted-key order for optim."""
    if part == "model":
        return [(n, s, "F32", True, n) for n, s in params]
    names = [n for n, _ in params]
    group_bytes = len(json.dumps({"lr": 1e-4, "betas": [0.9, 0.95], "_param_names": names})) + 200
    out = [("num_param_groups", (), "I64", False, None), ("param_group0", (group_bytes,), "U8", False, None),
           ("state_keys", (40,), "U8", False, None)]
    out += [(f"state.{n}.__step", (), "F32", False, None) for n in names]
    for n, s in params:
        out += [(f"state.{n}.__{k}", s, "F32", True, n) for k in ("exp_avg", "exp_avg_sq")]
    return out


def columns_for(layout: str, part: str, params, world: int) -> list:
    """Every rank's pieces as the engine sends them (``RankPieces``: one shared structure, one
    int64 row per rank), built for all ranks at once."""
    import numpy as np

    from checkpointer.planning.pieces import BOX, RankPieces, Structure

    keys = part_keys(part, params)
    structure = Structure([k for k, *_ in keys], [s for _, s, *_ in keys], [d for _, _, d, *_ in keys],
                          [sh for *_, sh, _ in keys], [BOX if p else 1 for *_, p in keys])
    shapes = dict(params)
    values = np.zeros((world, structure.width), dtype=np.int64)
    ranks = np.arange(world, dtype=np.int64)
    for i, (key, shape, _, _, param) in enumerate(keys):
        lo, _ = structure.span(i)
        if param is None:  # replicated: the whole tensor, flat
            values[:, lo + 1] = math.prod(shape)
            continue
        local, offset = boxes(layout, param, shapes[param], world, ranks)
        for d in range(len(shape)):
            values[:, lo + d] = local[d]
            values[:, lo + len(shape) + d] = offset[d]
    return [RankPieces(structure, row) for row in values]


def wanted_for(layout: str, part: str, params, world: int, rank: int, metadata) -> dict:
    """What ``rank`` of ``world`` loads, per key: a box (``Piece``) or the whole tensor."""
    import numpy as np

    from checkpointer.planning.pieces import Piece

    shapes = dict(params)
    out = {}
    for key, shape, _, _, param in part_keys(part, params):
        if param is None:
            numel = metadata.tensors[key].numel
            out[key] = [(0, numel)] if numel else []
            continue
        local, offset = boxes(layout, param, shapes[param], world, np.array([rank]))
        out[key] = Piece(local_shape=tuple(int(x[0]) for x in local), global_offset=tuple(int(x[0]) for x in offset))
    return out


def payloads_for(columns: list) -> list[bytes]:
    from checkpointer.planning.pieces import pieces_payload

    return [pieces_payload(c, {}, with_structure=r == 0) for r, c in enumerate(columns)]


def plan_from(payloads: list[bytes], own, compact: bool):
    """The exchange (the fallback): a rank's decoding of the gathered payloads and its save plan,
    as ``engine.save._plan_from``."""
    from checkpointer.planning.pieces import parse_pieces
    from checkpointer.planning.plan import build_save_plan

    known = {own.digest: own}
    return build_save_plan([parse_pieces(p, known)[0] for p in payloads], compact=compact)


def layout_of(layout: str, name: str, shape: tuple[int, ...], world: int) -> tuple:
    """A parameter's layout as ``sharding.describe`` gives it (``planning.layouts``)."""
    if layout == "fsdp2":
        return ((world,), (("S", 0),))
    if layout == "hsdp":
        shard = min(HSDP_SHARD, world)
        return ((world // shard, shard), (("R",), ("S", 0)))
    mesh = (world // TP, TP)
    if len(shape) == 1:
        return (mesh, (("S", 0), ("R",)))
    if any(k in name for k in ROW_PARALLEL):
        return (mesh, (("S", 0), ("S", 1)))
    return (mesh, (("T", 0, TP), ("S", 0)))


def plan_from_layouts(layout: str, part: str, params, world: int, compact: bool):
    """Rank 0's first-save planning, as ``engine.save._plan_from_layouts``: its layouts, every
    rank's pieces computed from them (its own checked), the digest the all-reduce compares, the plan."""
    import numpy as np

    from checkpointer.planning import layouts as lay
    from checkpointer.planning.pieces import Piece

    shapes = dict(params)
    items, own = [], {}
    for key, shape, dtype, sharded, param in part_keys(part, params):
        if param is None:
            items.append((key, shape, dtype, sharded, ()))
            own[key] = Piece.whole(shape)
            continue
        items.append((key, shape, dtype, sharded, layout_of(layout, param, shapes[param], world)))
        local, offset = boxes(layout, param, shapes[param], world, np.array([0]))
        own[key] = Piece(local_shape=tuple(int(x[0]) for x in local), global_offset=tuple(int(x[0]) for x in offset))
    described = lay.describe_layouts(items, own, {}, world=world, rank=0, form=str(compact))
    if described is None:
        raise RuntimeError("the layouts do not give rank 0 its pieces")
    return lay.plan_from_layouts(described.entries, described.classes, world, compact=compact)


ALL_REDUCE_BYTES = 2 * 3 * 8
"""What a rank receives for the layouts' all-reduce of three int64 (a ring all-reduce receives
about twice the tensor)."""


def committed_json(plan, compact: bool, crcs=None) -> bytes:
    """Rank 0 at commit: the metadata as ``engine.save.write_and_commit`` completes it, as text."""
    from checkpointer.checksums import ALGORITHM, CHUNK_BYTES

    metadata = plan.metadata
    if compact:
        metadata = metadata.model_copy(update={
            "checksum_algorithm": ALGORITHM, "checksum_chunk_bytes": CHUNK_BYTES,
            "checksums_in_files": True, "file_id": "0123456789abcdef",
        })
    else:
        metadata = metadata.with_checksums(crcs, algorithm=ALGORITHM, chunk_bytes=CHUNK_BYTES)
        metadata = metadata.with_file_ids({name: f"{i:016x}" for i, name in enumerate(metadata.files())})
    return metadata.to_json_bytes()


def random_crcs(plan) -> dict:
    from checkpointer.checksums import CHUNK_BYTES
    from checkpointer.format.dtypes import itemsize

    rng = random.Random(0)
    crcs: dict[str, dict[str, list[int]]] = {}
    for key, meta in plan.metadata.tensors.items():
        size = itemsize(meta.dtype)
        for f, spec in meta.shard_spec_per_file.items():
            crcs.setdefault(f, {})[key] = [rng.getrandbits(32) for _ in range(-(-spec.local_numel * size // CHUNK_BYTES))]
    return crcs


def cpu_best(fn, repeat: int):
    """``(value of the last run, least CPU seconds, its wall seconds)`` over ``repeat`` runs."""
    best = None
    value = None
    for _ in range(repeat):
        value = None
        gc.collect()
        w, c = time.perf_counter(), time.process_time()
        value = fn()
        c, w = time.process_time() - c, time.perf_counter() - w
        if best is None or c < best[0]:
            best = (c, w)
    return value, best[0], best[1]


def run_case(layout: str, part: str, world: int, compact: bool, repeat: int, shrink: float, exchange: bool) -> dict:
    from checkpointer.format.metadata_parse import parse_metadata
    from checkpointer.planning.load_plan import build_load_plan

    params = llama70b_params()
    out: dict = {"layout": layout, "part": part, "world": world, "format": 2 if compact else 1}
    if exchange:  # the fallback: every rank's pieces all-gathered
        columns = columns_for(layout, part, params, world)
        own = columns[0].structure
        payloads = payloads_for(columns)
        columns = None
        out["exchange_received_bytes"] = sum(len(p) for p in payloads)  # every rank receives every payload
        exchanged, out["exchange_plan_s"], out["exchange_plan_wall_s"] = cpu_best(
            lambda: plan_from(payloads, own, compact), repeat)
        payloads = own = None
    out["received_bytes"] = ALL_REDUCE_BYTES
    plan, out["plan_s"], out["plan_wall_s"] = cpu_best(
        lambda: plan_from_layouts(layout, part, params, world, compact), repeat)
    out["keys"] = len(plan.keys)
    if exchange:
        out["same_as_exchange"] = bool(
            plan.metadata.to_json_bytes() == exchanged.metadata.to_json_bytes() and plan.keys == exchanged.keys
            and (plan.writes == exchanged.writes).all() and plan.shared == exchanged.shared)
        exchanged = None
    crcs = None if compact else random_crcs(plan)
    data, out["commit_json_s"], out["commit_json_wall_s"] = cpu_best(lambda: committed_json(plan, compact, crcs), repeat)
    out["metadata_bytes"] = len(data)
    out["rules"] = sum(1 for m in plan.metadata.tensors.values() if getattr(m.shard_spec_per_file, "rule", None) is not None)
    out["explicit_specs"] = sum(len(m.shard_spec_per_file) for m in plan.metadata.tensors.values()
                                if getattr(m.shard_spec_per_file, "rule", None) is None)
    plan = crcs = None
    gc.collect()
    with tempfile.NamedTemporaryFile(prefix="plan_scale_", suffix=".json", delete=False) as f:
        f.write(data)
        path = f.name
    data = None
    try:
        target = max(1, int(round(world * shrink)))
        target -= target % (TP if layout == "tp_fsdp" else 1)
        out["target_world"] = target

        def load(rank: int) -> int:
            with open(path, "rb") as fh:
                raw = fh.read()
            metadata = parse_metadata(raw, where="metadata.json")
            raw = None
            wanted = wanted_for(layout, part, params, target, rank, metadata)
            return sum(len(build_load_plan(key, metadata.tensors[key], w).items) for key, w in wanted.items())

        ranks = sorted({0, target // 2, target - 1})
        out["load_ranks"] = ranks
        out["load_s"], out["load_wall_s"], out["load_reads"] = [], [], []
        for r in ranks:
            reads, c, w = cpu_best(lambda: load(r), repeat)
            out["load_s"].append(c)
            out["load_wall_s"].append(w)
            out["load_reads"].append(reads)
        if compact:
            out["load_mib"] = []
            for r in ranks:
                gc.collect()
                tracemalloc.start()
                load(r)
                out["load_mib"].append(tracemalloc.get_traced_memory()[1] / 2**20)
                tracemalloc.stop()
    finally:
        os.unlink(path)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def child(args) -> int:
    limit = int(args.mem_limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    case = dict(layout=args.case_layout, part=args.case_part, world=args.case_world, compact=args.case_format == 2)
    try:
        res = run_case(**case, repeat=args.repeat, shrink=args.shrink, exchange=args.case_world in args.exchange)
    except MemoryError:
        res = {**case, "format": args.case_format, "error": f"MemoryError under a {args.mem_limit_gb:g} GiB limit"}
    print("RESULT " + json.dumps(res))
    return 0


def mb(n: float) -> str:
    return f"{n / 1e6:.2f}" if n < 1e7 else f"{n / 1e6:.0f}"


def met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def header_lines(args) -> list[str]:
    """The commit measured, the date and the machine (benchmarks/results/HISTORY.md asks for them)."""
    import platform

    import torch

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return [
        f"- commit: `{commit}`{dirty}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.machine()}, torch {torch.__version__} "
        "(shared with other jobs: CPU times, not wall times, are reported)",
        f"- command: `python benchmarks/plan_scale.py {' '.join(sys.argv[1:])}`".replace(" `", " `", 1),
        "",
    ]


def render(results: list[dict], args) -> str:
    params = llama70b_params()
    ok = [r for r in results if "error" not in r]
    two = [r for r in ok if r["format"] == 2]
    one = {(r["layout"], r["part"], r["world"]): r for r in ok if r["format"] == 1}
    lines = [
        "# Metadata and planning at scale (70B-like model, simulated)\n",
        *header_lines(args),
        f"{len(params)} parameters (Llama-3-70B shapes); optimizer part {len(part_keys('optim', params))} keys "
        "(AdamW exp_avg, exp_avg_sq sharded like their parameter, step replicated). Layouts: `fsdp2` (Shard(0) over "
        f"every rank), `hsdp` ({HSDP_SHARD}-way Shard(0), the rest replicas), `tp_fsdp` ({TP}-way TP: column-parallel "
        "Shard(0), row-parallel Shard(1), norms replicated; FSDP2 over the outer mesh dim cuts each TP piece's rows). "
        f"CPU seconds, the least of {args.repeat} runs (single-threaded, machine shared; wall times in plan_scale.json). "
        f"Load: a world-size change to x{args.shrink:g} in the same layout, the worst of the first, middle and last rank.\n",
        "Columns: **received** = bytes each rank receives to plan its first save (the layouts' all-reduce of three int64; "
        "the fallback, every rank's pieces all-gathered, is in plan_scale.json as exchange_received_bytes where run); "
        "**plan** = rank 0's layouts, every rank's pieces computed from them, `plan_from_layouts`; **commit** = rank 0 making metadata.json's text; "
        "**save rank 0** = plan + commit; **load** = read + parse + load plan per rank; **load MiB** = tracemalloc peak of the same.\n",
        "| layout | part | ranks | metadata.json MB | x vs 1,024 | rules / explicit specs | received MB | plan s | commit s "
        "| save rank 0 s | load s | load MiB | format 1 metadata.json MB | format 1 parse + plan s |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {(r["layout"], r["part"]): r["metadata_bytes"] for r in two if r["world"] == min(x["world"] for x in two)}
    for r in sorted(two, key=lambda r: (LAYOUTS.index(r["layout"]), r["part"], r["world"])):
        ref = one.get((r["layout"], r["part"], r["world"]))
        growth = r["metadata_bytes"] / base[(r["layout"], r["part"])] if (r["layout"], r["part"]) in base else float("nan")
        lines.append(
            f"| {r['layout']} | {r['part']} | {r['world']:,} | {mb(r['metadata_bytes'])} | {growth:.2f} | "
            f"{r['rules']} / {r['explicit_specs']:,} | {mb(r['received_bytes'])} | {r['plan_s']:.2f} | "
            f"{r['commit_json_s']:.3f} | {r['plan_s'] + r['commit_json_s']:.2f} | {max(r['load_s']):.3f} | "
            f"{max(r['load_mib']):.1f} | {mb(ref['metadata_bytes']) if ref else '–'} | "
            f"{format(max(ref['load_s']), '.2f') if ref else '–'} |")
    for r in results:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['part']} | {r['world']:,} | format {r['format']}: {r['error']} |" + " |" * 10)
    lines += ["", "## Goals (issue 27, per part, every layout and world size above)", "",
              "| goal | worst case | met |", "|---|---|---|"]

    def worst(field, fn):
        r = max(two, key=fn)
        return f"{fn(r):.3g} ({r['layout']} {r['part']} at {r['world']:,})"

    if two:
        rows = [
            ("metadata.json <= 8 MB", worst("metadata", lambda r: r["metadata_bytes"] / 1e6),
             all(r["metadata_bytes"] <= GOALS["metadata_mb"] * 1e6 for r in two)),
            ("growth 1,024 -> 16,384 < 1.5x", worst("growth", lambda r: r["metadata_bytes"] / base.get((r["layout"], r["part"]), r["metadata_bytes"])),
             all(r["metadata_bytes"] < GOALS["growth"] * base.get((r["layout"], r["part"]), r["metadata_bytes"]) for r in two)),
            ("save, rank 0 metadata work <= 1 s", worst("save", lambda r: r["plan_s"] + r["commit_json_s"]),
             all(r["plan_s"] + r["commit_json_s"] <= GOALS["save_s"] for r in two)),
            ("load, read + parse + plan <= 1 s per rank", worst("load", lambda r: max(r["load_s"])),
             all(max(r["load_s"]) <= GOALS["load_s"] for r in two)),
            ("load, <= 64 MiB extra per rank", worst("mem", lambda r: max(r["load_mib"])),
             all(max(r["load_mib"]) <= GOALS["load_mib"] for r in two)),
            ("first save, <= 4 MB received per rank", worst("recv", lambda r: r["received_bytes"] / 1e6),
             all(r["received_bytes"] <= GOALS["received_mb"] * 1e6 for r in two)),
        ]
        lines += [f"| {g} | {w} | {met(m)} |" for g, w, m in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1024,8192,16384", help="world sizes (default 1024,8192,16384)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"layouts (default {','.join(LAYOUTS)})")
    ap.add_argument("--parts", default="model,optim", help="parts (default model,optim)")
    ap.add_argument("--format1-ranks", default="1024", help="world sizes also run in format 1, for reference (default 1024)")
    ap.add_argument("--exchange-ranks", default="1024", help="world sizes whose first save is also planned by the "
                    "exchange of every rank's pieces (the fallback), and compared (default 1024)")
    ap.add_argument("--shrink", type=float, default=0.75, help="load at this fraction of the world size (default 0.75)")
    ap.add_argument("--repeat", type=int, default=2, help="least CPU time of this many runs (default 2)")
    ap.add_argument("--mem-limit-gb", type=float, default=10.0, help="address-space limit per case (default 10)")
    ap.add_argument("--timeout-s", type=float, default=1200, help="limit per case")
    ap.add_argument("--out", default=str(HERE / "results"), help="where plan_scale.json/.md go")
    ap.add_argument("--case-layout", help=argparse.SUPPRESS)
    ap.add_argument("--case-part", help=argparse.SUPPRESS)
    ap.add_argument("--case-world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--case-format", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.exchange = {int(x) for x in args.exchange_ranks.split(",") if x}
    if args.case_world:
        return child(args)

    worlds = [int(x) for x in args.ranks.split(",")]
    f1 = {int(x) for x in args.format1_ranks.split(",") if x}
    cases = [(lay, part, w, fmt) for lay in args.layouts.split(",") for part in args.parts.split(",")
             for w in worlds for fmt in ((2, 1) if w in f1 else (2,))]
    results = []
    for layout, part, world, fmt in cases:
        cmd = [sys.executable, __file__, "--case-layout", layout, "--case-part", part, "--case-world", str(world),
               "--case-format", str(fmt), "--repeat", str(args.repeat), "--shrink", str(args.shrink),
               "--mem-limit-gb", str(args.mem_limit_gb), "--exchange-ranks", args.exchange_ranks]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else {"error": (p.stderr or "no result")[-600:]}
        except subprocess.TimeoutExpired:
            res = {"error": f"over {args.timeout_s:.0f} s"}
        res.update(layout=layout, part=part, world=world, format=fmt, case_wall_s=time.time() - t0)
        results.append(res)
        if "error" in res:
            print(f"{layout:>8} {part:>5} {world:>6} f{fmt}: {res['error']}", flush=True)
        else:
            print(f"{layout:>8} {part:>5} {world:>6} f{fmt}: metadata {mb(res['metadata_bytes'])} MB, received "
                  f"{mb(res['received_bytes'])} MB, plan {res['plan_s']:.2f} s, commit {res['commit_json_s']:.3f} s, "
                  f"load {max(res['load_s']):.3f} s" + (f" {max(res['load_mib']):.1f} MiB" if "load_mib" in res else "")
                  + f", peak RSS {res['peak_rss_mib']:.0f} MiB [{res['case_wall_s']:.0f} s]", flush=True)
    report = render(results, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_scale.md").write_text(report)
    with open(out / "plan_scale.json", "w") as f:
        json.dump(results, f, indent=1)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
