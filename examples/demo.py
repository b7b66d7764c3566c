"""checkpointer demo: a training run stopped and resumed exactly, then at another world size.

Run it with ``make demo`` (or ``.venv/bin/python examples/demo.py``); CPU only, about a minute.

The job: a small transformer LM with dropout, FSDP2 on CPU (gloo), AdamW, a warmup + cosine
``LambdaLR``, gradient clipping, and a ``DistributedSampler`` + ``DataLoader`` that shuffles
each epoch. Every rank seeds its own dropout generator.

1. Run A, 2 processes: trains steps 0..23 uninterrupted, saving every 8 steps in the background
   (``async_save_model_and_optim_state`` with ``train_state``: scheduler, data position, each
   rank's RNG). Its losses are the reference curve.
2. Run B, 2 fresh processes (another seed): resumes from ``latest_checkpoint`` (step 16) and
   trains on. Its losses must equal run A's bit for bit. The same processes then resume once
   more with dropout off, the reference for run C.
3. Run C, 3 processes, dropout off: resumes from the same checkpoint, resharded 2 -> 3. Model,
   optimizer, scheduler and step are exact (checked against the checkpoint); the losses agree
   with B's dropout-off curve to float rounding (the order of float additions differs).
4. ``prune`` keeps the newest checkpoint of run A; ``export_safetensors`` writes run C's final
   checkpoint as one ``model.safetensors``, which a plain ``nn.Module`` loads to the same loss.

Everything is written under demo_out/ in the repository root, emptied first.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import json
import math
import shutil
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import checkpointer
from checkpointer import RNGState
from model import ModelConfig, TinyLM, Windows, get_batch, make_corpus

OUT = Path(__file__).resolve().parents[1] / "demo_out"  # in the repository root
IPC = OUT / "ipc"  # rendezvous files and the results each run hands back
CFG = ModelConfig(dropout=0.1)
GLOBAL_BATCH = 12  # sequences per step, divisible by both world sizes
SAMPLES = 60  # 5 steps an epoch: step 16 is in the middle of epoch 3
TOTAL_STEPS, SAVE_EVERY, WARMUP = 24, 8, 4
TOLERANCE = 1e-5  # max |loss difference| across world sizes: float reordering gives ~1e-7
RUN_A = OUT / "A"


# --------------------------------------------------------------------------------------
# What every rank runs
# --------------------------------------------------------------------------------------


def lr_at(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (TOTAL_STEPS - WARMUP)))


class Job:
    """Everything a run makes at its start, and the loop that trains it."""

    def __init__(self, world_size: int, dropout: float, seed: int) -> None:
        torch.manual_seed(seed)  # the same on every rank: each keeps its shard of one model
        self.model = TinyLM(replace(CFG, dropout=dropout))
        mesh = init_device_mesh("cpu", (world_size,))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lr_at)
        self.sampler = DistributedSampler(Windows(make_corpus(), SAMPLES, CFG.seq_len), shuffle=True, seed=0)
        self.loader = DataLoader(self.sampler.dataset, batch_size=GLOBAL_BATCH // world_size, sampler=self.sampler)
        self.data = {"step": 0, "epoch": 0, "batch": 0}
        torch.manual_seed(seed + 1000 + dist.get_rank())  # each rank its own dropout masks

    def resume(self, ckpt: str) -> dict:
        """Fill the model, optimizer and scheduler in place; the RNG waits for ``iter(loader)``."""
        result = checkpointer.load_model_and_optim_state(ckpt, self.model, self.optim, train_state={"sched": self.sched})
        self.data = dict(result.train_state["data"])
        return result.train_state

    def train(self, until: int, *, run_dir: Path | None = None, rng: dict | None = None) -> dict[int, float]:
        losses, saves = {}, []
        while self.data["step"] < until:
            self.sampler.set_epoch(self.data["epoch"])
            batches = iter(self.loader)  # draws from torch's generator: restore the RNG after it
            for _ in range(self.data["batch"]):
                next(batches)
            if rng is not None:
                RNGState().load_state_dict(rng)
                rng = None
            for inputs, targets in batches:
                step = self.data["step"]
                if run_dir is not None and step and step % SAVE_EVERY == 0:
                    state = {"sched": self.sched, "data": dict(self.data), "rng": RNGState()}
                    saves.append(checkpointer.async_save_model_and_optim_state(f"{run_dir}/step{step}", self.model, self.optim, train_state=state))
                loss = self.model.loss(inputs, targets)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optim.step()
                self.sched.step()
                self.optim.zero_grad()
                losses[step] = global_mean(loss)
                self.data["step"] += 1
                self.data["batch"] += 1
                if self.data["step"] == until:
                    break
            else:
                self.data["epoch"] += 1
                self.data["batch"] = 0
        for future in saves:
            future.result()
        return losses


def global_mean(local_mean: torch.Tensor) -> float:
    total = local_mean.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def full_state(job: Job) -> dict[str, torch.Tensor]:
    """The model's and the optimizer's full tensors by name (every rank gathers them)."""
    names = {id(p): n for n, p in job.model.named_parameters()}
    out = {n: p.full_tensor() for n, p in job.model.named_parameters()}
    for p, state in job.optim.state.items():
        for key, value in state.items():
            out[f"optim.{names[id(p)]}.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def exact_against_checkpoint(job: Job, ckpt: str, saved: dict) -> bool:
    """Model, optimizer, scheduler and step equal what the checkpoint holds, bit for bit."""
    mine = full_state(job)
    model = checkpointer.unshard_model_state(ckpt)
    optim = checkpointer.unshard_optim_state(ckpt)
    names = [n for g in optim["param_groups"] for n in g["param_names"]]
    ids = [i for g in optim["param_groups"] for i in g["params"]]
    expected = {n: model[n] for n, _ in job.model.named_parameters()}
    for name, pid in zip(names, ids):
        expected.update({f"optim.{name}.{k}": v for k, v in optim["state"].get(pid, {}).items()})
    same = mine.keys() == expected.keys() and all(torch.equal(mine[k], expected[k]) for k in mine)
    return same and job.sched.state_dict() == saved["sched"] and job.data == saved["data"]


def worker(rank: int, world_size: int, run: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{IPC / f'rendezvous_{run}'}", rank=rank, world_size=world_size)
    result: dict = {}
    if run == "A":
        result["losses"] = Job(world_size, CFG.dropout, seed=0).train(TOTAL_STEPS, run_dir=RUN_A)
    else:
        latest = checkpointer.latest_checkpoint(str(RUN_A))
        result["latest"] = latest
        if run == "B":  # the same world size, dropout on: bitwise
            job = Job(world_size, CFG.dropout, seed=1234)
            saved = job.resume(latest)
            result["losses"] = job.train(TOTAL_STEPS, rng=saved["rng"])
        job = Job(world_size, 0.0, seed=99)  # dropout off: comparable across world sizes
        saved = job.resume(latest)
        result["exact"] = exact_against_checkpoint(job, latest, saved)
        # At 3 ranks, rank 2 has no saved RNG (a warning says so): with dropout off none is drawn.
        result["losses_no_dropout"] = job.train(TOTAL_STEPS, rng=saved.get("rng"))
        if run == "C":
            final = str(OUT / "C" / f"step{TOTAL_STEPS}")
            checkpointer.save_model_and_optim_state(final, job.model, job.optim, train_state={"sched": job.sched, "data": job.data})
            inputs, targets = get_batch(make_corpus(), 10**6, GLOBAL_BATCH, CFG.seq_len)
            job.model.eval()
            with torch.no_grad():
                result["eval_loss"] = global_mean(job.model.loss(inputs, targets))
    if rank == 0:
        (IPC / f"{run}.json").write_text(json.dumps(result))
    dist.barrier()  # every rank leaves together
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# The driver: launches the runs, checks and prints
# --------------------------------------------------------------------------------------


def launch(run: str, world_size: int) -> dict:
    start = time.perf_counter()
    mp.spawn(worker, args=(world_size, run), nprocs=world_size, join=True)
    result = json.loads((IPC / f"{run}.json").read_text())
    for key in ("losses", "losses_no_dropout"):
        if key in result:
            result[key] = {int(step): loss for step, loss in result[key].items()}
    print(f"      ({time.perf_counter() - start:.1f} s with process start-up)")
    return result


def rel(path: str | Path) -> str:
    return str(Path(path).relative_to(OUT.parent))


def compare(title: str, a: dict[int, float], b: dict[int, float], tolerance: float) -> bool:
    print(f"      {'step':>4}  {title}")
    worst = 0.0
    for step in sorted(b):
        worst = max(worst, abs(a[step] - b[step]))
        print(f"      {step:>4}  {a[step]:>12.8f}  {b[step]:>12.8f}  {abs(a[step] - b[step]):>8.1e}")
    ok = worst <= tolerance if tolerance else all(a[s] == b[s] for s in b)
    what = "bitwise equal" if tolerance == 0 else f"tolerance {tolerance:.0e}"
    print(f"      max |difference| {worst:.1e} ({what}): {'OK' if ok else 'MISMATCH'}")
    return ok


def export_and_check(ckpt: Path, fsdp_eval_loss: float) -> bool:
    out_file = OUT / "model.safetensors"
    checkpointer.export_safetensors(str(ckpt), str(out_file))
    plain = TinyLM(CFG)  # no FSDP, no process group
    plain.load_state_dict(load_file(out_file))
    plain.eval()
    inputs, targets = get_batch(make_corpus(), 10**6, GLOBAL_BATCH, CFG.seq_len)
    with torch.no_grad():
        loss = plain.loss(inputs, targets).item()
    ok = abs(loss - fsdp_eval_loss) <= TOLERANCE
    print(f"      export_safetensors -> {rel(out_file)} ({out_file.stat().st_size:,} bytes); a plain nn.Module")
    print(f"      loads it: eval loss {loss:.6f}, the FSDP2 model on 3 procs {fsdp_eval_loss:.6f}: {'OK' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    t_start = time.perf_counter()
    shutil.rmtree(OUT, ignore_errors=True)
    IPC.mkdir(parents=True)
    n_params = sum(p.numel() for p in TinyLM(CFG).parameters())
    print(f"TinyLM, {n_params:,} parameters, dropout {CFG.dropout}; FSDP2 on CPU; AdamW, warmup + cosine LambdaLR,")
    print(f"grad clipping; DistributedSampler + DataLoader ({SAMPLES // GLOBAL_BATCH} steps an epoch), per-rank RNG.\n")

    print(f"[1/4] run A, 2 processes: steps 0..{TOTAL_STEPS - 1}, async save with train_state every {SAVE_EVERY} steps")
    a = launch("A", 2)
    print(f"      saved: {', '.join(sorted(p.name for p in RUN_A.iterdir()))}")

    print("\n[2/4] run B, 2 fresh processes (another seed): resume from latest_checkpoint, train on")
    b = launch("B", 2)
    print(f"      resumed from {rel(b['latest'])}")
    ok = compare("A: uninterrupted   B: resumed  |A - B|", a["losses"], b["losses"], 0.0)

    print("\n[3/4] run C, 3 processes, dropout off: resume the same checkpoint resharded 2 -> 3")
    c = launch("C", 3)
    exact = b["exact"] and c["exact"]
    print(f"      model, optimizer, scheduler and step equal the checkpoint's on 2 and 3 procs: {'OK' if exact else 'MISMATCH'}")
    ok &= exact & compare("B: 2 procs        C: 3 procs   |B - C|", b["losses_no_dropout"], c["losses_no_dropout"], TOLERANCE)

    print("\n[4/4] prune run A to its newest checkpoint; export run C's final one")
    deleted = checkpointer.prune(str(RUN_A), keep_last=1)
    print(f"      prune(keep_last=1) deleted {', '.join(rel(p) for p in deleted)}; kept {rel(checkpointer.latest_checkpoint(str(RUN_A)))}")
    ok &= [Path(p).name for p in deleted] == [f"step{SAVE_EVERY}"]
    ok &= export_and_check(OUT / "C" / f"step{TOTAL_STEPS}", c["eval_loss"])

    print(f"\n{'PASS' if ok else 'FAIL'} in {time.perf_counter() - t_start:.1f} s; outputs in {rel(OUT)}/")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
