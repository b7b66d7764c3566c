"""torchtitan's trainer with checkpointer's backend against its own DCP backend, in the same run.

torchtitan 0.3.0 trains its llama3 debug model (widened by ``--dim`` / ``--layers``) with FSDP on
``--world-size`` CPU ranks (gloo), launched by ``tests/support/titan_launcher.py``. For each save
mode (``--modes``: ``async``, ``disabled``) and each backend, in turn (DCP first, then ours):

1. a training launch of ``--steps`` steps, saving every ``--interval`` steps, stopped one step
   after the last interval save (the LR schedule is built from ``--steps`` in every launch); a
   save blocks the trainer for its ``save()`` call plus the ``maybe_wait_for_staging()`` calls
   before the following optimizer steps (where a backend copies the state to host memory while
   the next forward and backward run), both measured inside the trainer;
2. ``--resume-launches`` resume launches from the same folder (the backends alternating, DCP
   first in even rounds), each of which loads the newest step ``--load-repeats`` times (each in
   place) and stops; the time each ``load()`` blocks is measured the same way. A launch's load
   time is the median of its loads, its first load is its first; the report gives the median of
   each over the launches. Before each, the folder's files are dropped from the page cache (``fsync``,
   then ``posix_fadvise(DONTNEED)``), so each backend's first load reads from the disk, as a
   resume in a new job does (without this, DCP's files were still cached and ours, written with
   ``O_DIRECT``, were not); the later loads are warm for both.

Both backends train the same model from the same seed; the losses of the two training launches
must be equal (checked), and rank 0's full model, optimizer and LR scheduler state right after
each backend's load is compared with ``torch.equal`` (a difference exits with status 2).
Ratios are ours / DCP (below 1: ours blocks for less). Goals (issue 29): async blocking <= 0.5x,
load <= 0.4x.

Usage (in the torchtitan venv: ``make bench-torchtitan``)::

    python benchmarks/torchtitan_compare.py                      # dim 1024, 8 layers, async+disabled
    python benchmarks/torchtitan_compare.py --dim 512 --layers 4 --modes async

Writes ``torchtitan_compare.md`` and ``.json`` to ``--out`` (default ``benchmarks/results/other``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))

import titan_launcher  # noqa: E402

CONFIGS = {"dcp": "debugmodel_dcp", "ours": "debugmodel_checkpointer"}


def _launch(args, root: Path, backend: str, mode: str, what: str, stop: int, assets) -> dict:
    name = f"{backend}-{mode}"
    timing = root / f"{name}-{what}.timings"
    losses = root / f"{name}-{what}.losses"
    env = {"TITAN_TIMINGS": str(timing), "TITAN_LOSSES": str(losses), "TITAN_STOP_AFTER": str(stop),
           "TITAN_DIM": str(args.dim), "TITAN_LAYERS": str(args.layers), "OMP_NUM_THREADS": str(args.threads)}
    if what.startswith("load"):
        env["TITAN_DUMP_LOADED"] = str(root / f"{name}.loaded.pt")
        env["TITAN_LOAD_REPEATS"] = str(args.load_repeats)
    tokenizer, data = assets
    extra = ["--checkpoint.interval", str(args.interval), "--checkpoint.async_mode", mode,
             "--checkpoint.keep_latest_k", "0"]
    cli = titan_launcher.train_args(tokenizer=tokenizer, data=data, dump=root / name, steps=args.steps,
                                    extra=extra, config=CONFIGS[backend])
    begin = time.perf_counter()
    titan_launcher.launch(args.world_size, cli, env, log=root / f"{name}-{what}.log", timeout=1200)
    wall = time.perf_counter() - begin
    ranks = [json.loads(Path(f"{timing}.{r}").read_text()) for r in range(args.world_size)]

    def blocked(rank: dict, i: int) -> float:
        """Save ``i``'s call, plus the waits for its staging before the next optimizer steps."""
        return rank["save"][i] + sum(dt for n, dt in rank.get("staging_wait", []) if n == i + 1)

    loss_file = Path(f"{losses}.0")
    return {
        "wall_s": wall,
        # the slowest rank blocks the job
        "save_s": [max(blocked(r, i) for r in ranks) for i in range(len(ranks[0]["save"]))],
        "save_call_s": [max(r["save"][i] for r in ranks) for i in range(len(ranks[0]["save"]))],
        "save_steps": ranks[0]["save_steps"],
        # every load() of the launch, the slowest rank's; the first reads files written just before
        "load_all_s": [max(r["load"][i] for r in ranks) for i in range(len(ranks[0]["load"]))],
        "losses": json.loads(loss_file.read_text()) if loss_file.exists() else [],
    }


def _drop_from_page_cache(folder: Path) -> int:
    """Write back and drop every file under ``folder`` from the page cache; returns their bytes."""
    nbytes = 0
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                nbytes += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return nbytes


def _same(a, b, where: str) -> list[str]:
    import torch

    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) else [where]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys differ"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="training.steps (the LR schedule)")
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3, help="interval saves per training launch")
    parser.add_argument("--modes", default="async,disabled")
    parser.add_argument("--load-repeats", type=int, default=5, help="loads per resume launch (median)")
    parser.add_argument("--resume-launches", type=int, default=1,
                        help="resume launches per backend and mode, alternating backends (median over them)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "other"))
    parser.add_argument("--name", default="torchtitan_compare")
    args = parser.parse_args()
    import torch

    stop = args.interval * args.saves
    if stop + 1 >= args.steps:
        parser.error("--interval * --saves + 1 must be below --steps (the last step saves differently)")
    results: dict = {"args": vars(args), "runs": {}}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="titan-bench-") as tmp:
        root = Path(tmp)
        assets = titan_launcher.write_assets(root / "assets")
        for mode in args.modes.split(","):
            loaded = {}
            for backend in ("dcp", "ours"):
                # one step past the last save: its staging wait (if any) is counted too
                train = _launch(args, root, backend, mode, "train", stop + 1, assets)
                results["runs"][f"{backend}-{mode}"] = {"train": train, "load": {"launches": []}}
                print(f"{backend:4} {mode:8} saves {['%.3f' % s for s in train['save_s']]} s", flush=True)
            for i in range(args.resume_launches):
                for backend in ("dcp", "ours") if i % 2 == 0 else ("ours", "dcp"):
                    _drop_from_page_cache(root / f"{backend}-{mode}")
                    launch = _launch(args, root, backend, mode, f"load{i}", stop, assets)
                    results["runs"][f"{backend}-{mode}"]["load"]["launches"].append(launch)
                    loaded[backend] = torch.load(root / f"{backend}-{mode}.loaded.pt", weights_only=True)
                    print(f"{backend:4} {mode:8} resume {i}: loads {['%.3f' % s for s in launch['load_all_s']]} s",
                          flush=True)
                    failures += [f"{mode}: {backend}'s resume {i} loaded state differs from DCP's at {d}"
                                 for d in (_same(loaded["dcp"], loaded["ours"], "state") if len(loaded) == 2 else [])]
            for backend in ("dcp", "ours"):
                load = results["runs"][f"{backend}-{mode}"]["load"]
                load["load_s"] = statistics.median(statistics.median(x["load_all_s"]) for x in load["launches"])
                load["first_load_s"] = statistics.median(x["load_all_s"][0] for x in load["launches"])
            if results["runs"][f"dcp-{mode}"]["train"]["losses"] != results["runs"][f"ours-{mode}"]["train"]["losses"]:
                failures.append(f"{mode}: the training losses differ between the backends")
    lines = [f"# torchtitan: checkpointer's backend vs DCP ({args.world_size} CPU ranks, gloo)", "",
             f"llama3 debug model widened to dim {args.dim}, {args.layers} layers; saves every "
             f"{args.interval} steps, {args.saves} per launch; times are the slowest rank's; loads: "
             f"{args.resume_launches} resume launch(es) per backend and mode, {args.load_repeats} loads each "
             f"(medians over the launches of each launch's median and of its first load).", "",
             "| mode | DCP save blocks (median) | ours | ratio | DCP load (median) | ours | ratio | DCP first load (cold) | ours | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in args.modes.split(","):
        d, o = results["runs"][f"dcp-{mode}"], results["runs"][f"ours-{mode}"]
        ds, os_ = statistics.median(d["train"]["save_s"]), statistics.median(o["train"]["save_s"])
        dl, ol = d["load"]["load_s"], o["load"]["load_s"]
        df, of = d["load"]["first_load_s"], o["load"]["first_load_s"]
        results[mode] = {"save_ratio": os_ / ds, "load_ratio": ol / dl, "first_load_ratio": of / df}
        lines.append(f"| {mode} | {ds:.3f} s | {os_:.3f} s | {os_ / ds:.2f}x | {dl:.3f} s | {ol:.3f} s | {ol / dl:.2f}x "
                     f"| {df:.3f} s | {of:.3f} s | {of / df:.2f}x |")
    lines += ["", "Every save's blocking time, then every load's (s), in order:", ""]
    for key, run in results["runs"].items():
        launches = " | ".join(", ".join("%.3f" % s for s in x["load_all_s"]) for x in run["load"]["launches"])
        lines.append(f"- {key}: saves {', '.join('%.3f' % s for s in run['train']['save_s'])}; loads {launches}")
    if failures:
        lines += ["", "**Check failed:**", *[f"- {f}" for f in failures]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
