"""checkpointer demo: checkpoint an FSDP2 job on 2 processes, resume it on 3, same losses.

Run it with ``make demo`` (or ``.venv/bin/python examples/demo.py``); CPU only, about 30 s.

1. Run A, 2 processes: train a small transformer LM (FSDP2 + AdamW) for steps 0..23,
   calling ``save_model_and_optim_state`` before step 12. The job keeps going after the
   save, so its losses are the reference curve of an uninterrupted run.
2. Run B, 3 processes: a freshly initialised model (another seed) and a fresh AdamW,
   filled in place by ``load_model_and_optim_state`` from the step-12 checkpoint (resharded
   from 2 ways to 3), then trained for steps 12..23 and saved again.
3. The two loss curves over steps 12..23 must agree to float rounding. Every world size
   sees the same global batch (each rank takes its slice), so the math is identical and only
   the order of float additions differs.
4. ``export_safetensors`` turns run B's last checkpoint into one ``model.safetensors``
   (``unshard_model_state`` gives the same tensors in memory); a plain ``nn.Module``
   loaded from that file must give the loss the FSDP2 model gave.

Everything is written under demo_out/ in the repository root, emptied first.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import json
import shutil
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import checkpointer
from model import ModelConfig, TinyLM, get_batch, make_corpus

OUT = Path(__file__).resolve().parents[1] / "demo_out"  # in the repository root
IPC = OUT / "ipc"  # rendezvous files and the results each run hands back
CFG = ModelConfig()
GLOBAL_BATCH = 12  # sequences per step; divisible by both world sizes
TOTAL_STEPS = 24
SAVE_STEP = 12
LR = 3e-3
EVAL_STEP = 1_000_000  # the eval batch is the batch of a step we never train on
TOLERANCE = 1e-5  # max |loss difference|: float reordering gives ~1e-7, a lost optimizer state ~1e-3
CKPT_A = OUT / "A" / f"step{SAVE_STEP}"  # written by run A, read by run B
CKPT_B = OUT / "B" / f"step{TOTAL_STEPS}"  # written by run B, unsharded at the end


# --------------------------------------------------------------------------------------
# What every rank runs
# --------------------------------------------------------------------------------------


def build(seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A TinyLM sharded with FSDP2 (one unit per block, plus the root) and its AdamW."""
    torch.manual_seed(seed)  # same seed on every rank: each keeps its shard of one model
    model = TinyLM(CFG)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, optim


def my_slice(batch: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch."""
    rows = len(batch) // dist.get_world_size()
    return batch[dist.get_rank() * rows : (dist.get_rank() + 1) * rows]


def global_mean(local_mean: torch.Tensor) -> float:
    """Mean over the global batch of a per-rank mean (every rank holds as many rows)."""
    total = local_mean.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, corpus: torch.Tensor, step: int) -> float:
    inputs, targets = get_batch(corpus, step, GLOBAL_BATCH, CFG.seq_len)
    loss = model.loss(my_slice(inputs), my_slice(targets))
    loss.backward()  # FSDP2 averages gradients over ranks: the gradient of the global mean
    optim.step()
    optim.zero_grad()
    return global_mean(loss)


def timed(fn, *args) -> float:
    """Seconds ``fn(*args)`` takes on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, world_size: int, run: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{IPC / f'rendezvous_{run}'}", rank=rank, world_size=world_size
    )
    corpus = make_corpus()
    result: dict = {"losses": {}}

    if run == "A":  # fresh start, checkpoint at SAVE_STEP, train on to the end
        model, optim = build(seed=0, world_size=world_size)
        first_step = 0
    else:  # run B: another init, every element of it overwritten by the checkpoint
        model, optim = build(seed=1234, world_size=world_size)
        result["load_s"] = timed(checkpointer.load_model_and_optim_state, CKPT_A, model, optim)
        first_step = SAVE_STEP

    train_s = 0.0
    for step in range(first_step, TOTAL_STEPS):
        if run == "A" and step == SAVE_STEP:
            result["save_s"] = timed(checkpointer.save_model_and_optim_state, CKPT_A, model, optim)
        start = time.perf_counter()
        result["losses"][step] = train_step(model, optim, corpus, step)
        train_s += time.perf_counter() - start
    result["train_s"] = train_s
    result["train_steps"] = TOTAL_STEPS - first_step

    if run == "B":  # save the final state, and measure the loss the unsharded model must match
        result["save_s"] = timed(checkpointer.save_model_and_optim_state, CKPT_B, model, optim)
        inputs, targets = get_batch(corpus, EVAL_STEP, GLOBAL_BATCH, CFG.seq_len)
        with torch.no_grad():
            result["eval_loss"] = global_mean(model.loss(my_slice(inputs), my_slice(targets)))

    if rank == 0:
        (IPC / f"{run}.json").write_text(json.dumps(result))
    # Every rank leaves together: a rank that destroys its group while another is still in
    # a collective can abort a process at exit ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# The driver: launches the runs, checks and prints
# --------------------------------------------------------------------------------------


def launch(run: str, world_size: int) -> tuple[dict, float]:
    start = time.perf_counter()
    mp.spawn(worker, args=(world_size, run), nprocs=world_size, join=True)
    result = json.loads((IPC / f"{run}.json").read_text())
    result["losses"] = {int(step): loss for step, loss in result["losses"].items()}
    return result, time.perf_counter() - start


def rel(path: Path) -> str:
    return str(path.relative_to(OUT.parent))


def describe_run(result: dict, wall_s: float) -> None:
    steps, train_s = result["train_steps"], result["train_s"]
    timings = [f"train {steps} steps {train_s:.2f} s ({1000 * train_s / steps:.0f} ms/step)"]
    if "load_s" in result:
        timings.insert(0, f"load {result['load_s']:.3f} s")
    timings.append(f"save {result['save_s']:.3f} s")
    print(f"      {', '.join(timings)}; whole run with process start-up {wall_s:.1f} s")


def describe_checkpoint(ckpt: Path) -> None:
    for part in ("model", "optim"):
        files = sorted(f for f in (ckpt / part).iterdir() if f.is_file())
        size = sum(f.stat().st_size for f in files)
        print(f"      {rel(ckpt / part)}/ {size:>10,} bytes: {', '.join(f.name for f in files)}")


def compare_curves(a: dict, b: dict) -> bool:
    print(f"      {'step':>4}  {'A: 2 procs, uninterrupted':>26}  {'B: 3 procs, resumed':>20}  {'|A - B|':>8}")
    max_diff = 0.0
    for step, loss_a in sorted(a["losses"].items()):
        if step not in b["losses"]:
            print(f"      {step:>4}  {loss_a:>26.6f}")
            continue
        diff = abs(loss_a - b["losses"][step])
        max_diff = max(max_diff, diff)
        print(f"      {step:>4}  {loss_a:>26.6f}  {b['losses'][step]:>20.6f}  {diff:>8.1e}")
    ok = max_diff <= TOLERANCE
    print(f"      max |A - B| = {max_diff:.2e} (tolerance {TOLERANCE:.0e}): {'OK' if ok else 'MISMATCH'}")
    return ok


def unshard_and_check(fsdp_eval_loss: float) -> bool:
    out_file = OUT / "model.safetensors"
    start = time.perf_counter()
    checkpointer.export_safetensors(CKPT_B, out_file)  # streams one tensor at a time
    export_s = time.perf_counter() - start
    with safe_open(out_file, framework="pt") as f:  # an ordinary safetensors file
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    print(
        f"      export_safetensors {export_s:.3f} s -> {rel(out_file)}: {out_file.stat().st_size:,} bytes,"
        f" {len(shapes)} tensors, e.g. tok_emb.weight {shapes['tok_emb.weight']}"
    )

    start = time.perf_counter()
    state = checkpointer.unshard_model_state(CKPT_B)  # the same full tensors, as a dict in memory
    unshard_s = time.perf_counter() - start
    from_file = load_file(out_file)
    same = state.keys() == from_file.keys() and all(torch.equal(state[k], from_file[k]) for k in state)
    verdict = "equal to the file's" if same else "NOT EQUAL to the file's"
    print(f"      unshard_model_state {unshard_s:.3f} s: {len(state)} tensors, {verdict}")

    plain = TinyLM(CFG)  # no FSDP, no process group
    plain.load_state_dict(from_file)  # strict: every key, every shape
    inputs, targets = get_batch(make_corpus(), EVAL_STEP, GLOBAL_BATCH, CFG.seq_len)
    with torch.no_grad():
        plain_loss = plain.loss(inputs, targets).item()
    diff = abs(plain_loss - fsdp_eval_loss)
    ok = same and diff <= TOLERANCE
    print(
        f"      eval loss: plain nn.Module from the file {plain_loss:.6f},"
        f" FSDP2 model on 3 procs {fsdp_eval_loss:.6f} (|diff| {diff:.1e}): {'OK' if ok else 'MISMATCH'}"
    )
    return ok


def main() -> int:
    t_start = time.perf_counter()
    shutil.rmtree(OUT, ignore_errors=True)
    IPC.mkdir(parents=True)
    n_params = sum(p.numel() for p in TinyLM(CFG).parameters())
    print(
        f"TinyLM: {CFG.n_layers} layers, d_model {CFG.d_model}, {CFG.n_heads} heads, vocab {CFG.vocab_size},"
        f" tied embeddings, {n_params:,} parameters; AdamW; FSDP2 on CPU (gloo)."
    )
    print(f"Each step trains on one global batch of {GLOBAL_BATCH} x {CFG.seq_len} bytes, split over the ranks.\n")

    last = TOTAL_STEPS - 1
    print(f"[1/4] run A, 2 processes: train steps 0..{last}, save_model_and_optim_state before step {SAVE_STEP}")
    a, wall = launch("A", 2)
    describe_run(a, wall)
    describe_checkpoint(CKPT_A)

    print("\n[2/4] run B, 3 processes: fresh model (another seed) + AdamW,")
    print(f"      load_model_and_optim_state({rel(CKPT_A)}), train steps {SAVE_STEP}..{last}, save at the end")
    b, wall = launch("B", 3)
    describe_run(b, wall)
    describe_checkpoint(CKPT_B)

    print("\n[3/4] loss curves")
    curves_ok = compare_curves(a, b)

    print(f"\n[4/4] unshard {rel(CKPT_B)} into one safetensors file, load it into a plain nn.Module")
    unshard_ok = unshard_and_check(b["eval_loss"])

    ok = curves_ok and unshard_ok
    print(f"\n{'PASS' if ok else 'FAIL'} in {time.perf_counter() - t_start:.1f} s; outputs in {rel(OUT)}/")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
