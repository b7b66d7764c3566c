"""A tiny torchtitan-like job built around either checkpoint manager, in this process (a world of
one, gloo): a small model, AdamW behind torchtitan's flat optimizer state dict, an LR scheduler, a
``StatefulDataLoader`` and a trainer's ``train_state``. For checks of ``CheckpointerManager``
against torchtitan's own DCP ``CheckpointManager`` that need no trainer launch."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, init_optim_state, load_flat_optim_state_dict

from checkpointer.integrations.torchtitan import CheckpointerManager

__all__ = ["Job", "ensure_process_group"]


def ensure_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)


class _Optimizers:
    """What the managers use of torchtitan's ``OptimizersContainer``."""

    def __init__(self, model: nn.Module):
        self.optimizers = [torch.optim.AdamW(list(model.named_parameters()), lr=1e-2)]

    def state_dict(self) -> dict:
        init_optim_state(self.optimizers[0])
        return get_flat_optim_state_dict(self.optimizers[0])

    def load_state_dict(self, state: dict) -> None:
        init_optim_state(self.optimizers[0])
        load_flat_optim_state_dict(self.optimizers[0], state)


class _Schedulers:
    def __init__(self, optimizers: _Optimizers):
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizers.optimizers[0], lambda s: 1.0 / (1 + s))]

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedulers[0].load_state_dict(state.copy())


class _TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class Job:
    """``backend``: ``"dcp"`` (torchtitan's) or ``"checkpointer"``; ``config``: the manager's
    ``--checkpoint.*`` settings; ``sd_adapter``: the model's ``state_dict_adapter``, if any."""

    def __init__(self, backend: str, folder: str, seed: int = 0, sd_adapter=None, **config):
        ensure_process_group()
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        self.optimizers = _Optimizers(self.model)
        self.schedulers = _Schedulers(self.optimizers)
        self.train_state = _TrainState()
        self.loader = StatefulDataLoader(list(range(1000)), batch_size=2)
        self.batches = iter(self.loader)
        manager = CheckpointManager if backend == "dcp" else CheckpointerManager
        self.ckpt = manager(manager.Config(enable=True, **config), dataloader=self.loader, model_parts=[self.model],
                            optimizers=self.optimizers, lr_schedulers=self.schedulers,
                            states={"train_state": self.train_state}, sd_adapter=sd_adapter, base_folder=folder)

    def step(self) -> None:
        self.train_state.step += 1
        first = int(next(self.batches)[0])
        self.model(torch.randn(2, 4, generator=torch.Generator().manual_seed(first))).sum().backward()
        self.ckpt.maybe_wait_for_staging()
        self.optimizers.optimizers[0].step()
        self.optimizers.optimizers[0].zero_grad()
        self.schedulers.schedulers[0].step()

    def train(self, steps: int, *, save: bool = True) -> None:
        for _ in range(steps):
            self.step()
            if save:
                self.ckpt.save(self.train_state.step)

    def finish(self) -> None:
        """Wait for the save in flight (torchtitan's DCP backend does not at ``close``), then close."""
        future = getattr(self.ckpt, "save_future", None)
        if future is not None:
            future.result()
        self.ckpt.close()

    def where(self) -> dict:
        """Where the run stands: its step, schedule, next batch, and weights."""
        loader = StatefulDataLoader(list(range(1000)), batch_size=2)
        loader.load_state_dict(self.loader.state_dict())
        return {"step": self.train_state.step, "last_epoch": self.schedulers.schedulers[0].last_epoch,
                "next_batch": int(next(iter(loader))[0]), "optimizer_states": len(self.optimizers.optimizers[0].state),
                "weights": [p.detach().clone() for p in self.model.parameters()]}
