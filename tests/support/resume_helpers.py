"""A realistic training loop for exact-resume tests: FSDP2 with dropout, AdamW, a warmup+cosine
``LambdaLR``, gradient clipping, and a ``DistributedSampler`` + ``DataLoader``, checkpointed with
``train_state`` (step, data position, scheduler, each rank's RNG)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import checkpointer
from checkpointer import RNGState

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4: every world size sees the same global batches
SAMPLES = 60  # 5 batches an epoch
WARMUP, TOTAL = 3, 40


class DropoutNet(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.inp(x))))


def _lr_lambda(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (TOTAL - WARMUP))))


@dataclass
class Job:
    model: nn.Module
    optim: torch.optim.Optimizer
    sched: Any
    sampler: DistributedSampler
    loader: DataLoader
    data: dict[str, int] = field(default_factory=lambda: {"step": 0, "epoch": 0, "batch": 0})

    def train_state(self) -> dict[str, Any]:
        return {"sched": self.sched, "data": dict(self.data), "rng": RNGState()}


def build_job(world_size: int, *, seed: int, p: float = 0.3) -> Job:
    """Every object a run makes at its start; ``seed`` seeds the generators first (a resumed run
    uses another, to show that the checkpoint, not the seed, decides what follows)."""
    torch.manual_seed(seed)
    random.seed(seed)
    model = DropoutNet(p)
    if world_size > 1:
        from dist_helpers import mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.inp, mesh=mesh((world_size,)))
        fully_shard(model, mesh=mesh((world_size,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_lambda)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g))
    rank = dist.get_rank() if dist.is_initialized() else 0
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)
    return Job(model, optim, sched, sampler, loader)


def _global_mean(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
        return total.item() / dist.get_world_size()
    return total.item()


def run(job: Job, until: int, *, save_at: int | None = None, ckpt: str | None = None,
        rng_after_iter: dict[str, Any] | None = None) -> dict[int, float]:
    """Train to step ``until``; before step ``save_at``, save to ``ckpt`` with the train state.
    ``rng_after_iter``: a saved RNG state to restore once the data iterator is made (a resume)."""
    losses: dict[int, float] = {}
    while job.data["step"] < until:
        job.sampler.set_epoch(job.data["epoch"])
        batches = iter(job.loader)  # draws from torch's global generator
        for _ in range(job.data["batch"]):
            next(batches)
        if rng_after_iter is not None:
            RNGState().load_state_dict(rng_after_iter)
            rng_after_iter = None
        for x, y in batches:
            if job.data["step"] == save_at:
                checkpointer.save_model_and_optim_state(ckpt, job.model, job.optim, train_state=job.train_state())
            loss = nn.functional.cross_entropy(job.model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(job.model.parameters(), 1.0)
            job.optim.step()
            job.sched.step()
            job.optim.zero_grad()
            losses[job.data["step"]] = _global_mean(loss)
            job.data["step"] += 1
            job.data["batch"] += 1
            if job.data["step"] == until:
                return losses
        job.data["epoch"] += 1
        job.data["batch"] = 0
    return losses


def resume(world_size: int, ckpt: str, *, seed: int = 1234, p: float = 0.3) -> tuple[Job, dict[str, Any], checkpointer.LoadResult]:
    """A fresh job filled from ``ckpt``: model, optimizer and scheduler in place, the data position
    from the train state, and the RNG state to restore after ``iter(loader)``."""
    job = build_job(world_size, seed=seed, p=p)
    result = checkpointer.load_model_and_optim_state(ckpt, job.model, job.optim, train_state={"sched": job.sched})
    job.data = dict(result.train_state["data"])
    return job, result.train_state.get("rng"), result
