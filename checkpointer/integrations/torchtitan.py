"""A torchtitan checkpoint backend: torchtitan jobs save and resume through ``checkpointer``.

torchtitan (0.3.0 and later) picks its checkpoint manager by the type of
``Trainer.Config.checkpoint``. A config function that sets it to :class:`CheckpointerManager.Config`
switches a job over; the usual ``--checkpoint.*`` flags keep working::

    # my_configs.py, passed as --module my_configs --config llama3_8b_checkpointer
    from torchtitan.models.llama3.config_registry import llama3_8b
    from checkpointer.integrations.torchtitan import CheckpointerManager

    def llama3_8b_checkpointer():
        config = llama3_8b()
        config.checkpoint = CheckpointerManager.Config(enable=True, interval=500, async_mode="async")
        return config

    torchrun --nproc-per-node 8 -m torchtitan.train --module my_configs --config llama3_8b_checkpointer

What one save writes, in ``{dump_folder}/{checkpoint.folder}/step-{N}/``, in this order:

1. ``titan/``: the LR schedulers, ``train_state`` (and any other state torchtitan hands the
   manager) as ``job.json`` from rank 0, and each data-parallel rank's data loader as
   ``dataloader.dp{r}.json``. JSON only: no pickle is written or read.
2. ``model/`` and ``optim/``: :func:`checkpointer.save_model_and_optim_state` (or its async form)
   of the model and its optimizer, committed last. A step counts as complete (for
   :func:`checkpointer.latest_checkpoint`, and so for resuming) only once both committed, so a
   save killed at any point leaves no step that looks complete without its ``titan/`` state.

The checkpoint is an ordinary ``checkpointer`` checkpoint: ``load_model_and_optim_state``,
``export_safetensors`` and the ``checkpointer`` command read it outside torchtitan, at any world
size. Resuming at another data-parallel size loads the model, optimizer, LR schedulers and
``train_state`` exactly; the data loader's position cannot move to another size (torchtitan's
own loader refuses to), so it restarts from the beginning and a warning says so.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
)
from torchtitan.config import TORCH_DTYPE_MAP

import checkpointer

__all__ = ["CheckpointerManager"]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
_JOB_FILE = "job.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointerManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, carried out by ``checkpointer``.

    Built by torchtitan's trainer from :class:`CheckpointerManager.Config` (never by hand). It
    follows ``interval``, ``load_step``, ``folder``, ``keep_latest_k``, ``async_mode``,
    ``last_save_model_only``, ``export_dtype``, ``exclude_from_loading``, ``load_only``,
    ``enable_first_step_checkpoint`` and ``initial_load_path`` (a ``checkpointer`` checkpoint).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint settings, plus how a save overlaps training."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """"disabled": a save returns once committed. "async" and "async_with_pinned_mem" (the
        same here: host buffers are pinned whenever the tensors are on a GPU): a save returns once
        the state is copied to host memory, and writes while the next steps train."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {self.async_mode}")
            if self.initial_load_in_hf or self.last_save_in_hf:
                raise ValueError(
                    "CheckpointerManager does not read or write Hugging Face checkpoints yet "
                    "(initial_load_in_hf / last_save_in_hf); use checkpointer.export_safetensors "
                    "on a saved step instead"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        """Called by torchtitan's trainer with the objects a checkpoint holds."""
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future | None = None
        self.config = config
        self.folder = os.path.join(base_folder, config.folder)
        if len(model_parts) != 1 or len(getattr(optimizers, "optimizers", [None])) != 1:
            raise ValueError(
                f"CheckpointerManager saves one model part with one optimizer; this job has "
                f"{len(model_parts)} model parts (pipeline parallelism is not supported yet)"
            )
        self.model = model_parts[0]
        self.optimizer = optimizers.optimizers[0]
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.dataloader = dataloader
        self.states = states
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._saving_step: int | None = None
        logger.info("checkpointer: checkpoints are loaded from and saved to %s", self.folder)

    def __del__(self) -> None:
        self.close()

    # --- saving -------------------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save ``curr_step`` when the interval (or the last step) says so; True if it did."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        begin = time.monotonic()
        step_dir = self._step_dir(curr_step)
        if last_step and self.config.last_save_model_only:
            self._save_model_only(step_dir)
        else:
            self._write_titan_state(step_dir)
            if self.config.async_mode == "disabled":
                checkpointer.save_model_and_optim_state(step_dir, self.model, self.optimizer)
            else:
                self.save_future = checkpointer.async_save_model_and_optim_state(
                    step_dir, self.model, self.optimizer
                )
                self._saving_step = curr_step
        if self.save_future is None:
            self._purge()
        logger.info("checkpointer: step %d %s in %.2f s", curr_step,
                    "saved" if self.save_future is None else "staged", time.monotonic() - begin)
        return True

    def _save_model_only(self, step_dir: str) -> None:
        """The last step's model alone, in ``export_dtype``: ``step_dir/model/``."""
        state = {
            k: v.to(self.export_dtype) if v.is_floating_point() and v.dtype != self.export_dtype else v
            for k, v in self.model.state_dict().items()
        }
        checkpointer.Checkpointer().save(f"{step_dir}/model", state)

    def _write_titan_state(self, step_dir: str) -> None:
        """``step_dir/titan/``: the job's states from rank 0, the data loader from every rank."""
        titan_dir = os.path.join(step_dir, "titan")
        os.makedirs(titan_dir, exist_ok=True)
        if self.dataloader is not None:
            dp_rank = getattr(self.dataloader, "dp_rank", _rank())
            state = {
                "dp_world_size": getattr(self.dataloader, "dp_world_size", 1),
                "state": _loader_state(self.dataloader),
            }
            _write_json(os.path.join(titan_dir, f"dataloader.dp{dp_rank}.json"), state)
        if _rank() == 0:
            job = {LR_SCHEDULER: self.lr_schedulers.state_dict()}
            for key, value in self.states.items():
                if key not in (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER):
                    job[key] = value.state_dict()
            _write_json(os.path.join(titan_dir, _JOB_FILE), job)

    def _purge(self) -> None:
        """Keep the newest ``keep_latest_k`` complete steps; rank 0 deletes the rest below them."""
        keep = self.config.keep_latest_k
        if keep <= 0 or _rank() != 0 or not os.path.isdir(self.folder):
            return
        steps = sorted(
            (int(m.group(1)), name)
            for name in os.listdir(self.folder)
            if (m := _STEP_DIR.match(name)) is not None
        )
        complete = [s for s, name in steps if _is_complete(os.path.join(self.folder, name))]
        if len(complete) <= keep:
            return
        oldest_kept = complete[-keep]
        for step, name in steps:
            if step < oldest_kept and step != self._saving_step:
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an async save returns once its state is staged in host memory."""

    def _wait_for_saving(self) -> None:
        """Wait for the async save in flight; its errors are raised here."""
        future, self.save_future = self.save_future, None
        assert future is not None
        try:
            future.result()
        finally:
            self._saving_step = None
        self._purge()

    def _close(self) -> None:
        """Finish the async save in flight (a resumed job would otherwise lose its newest step)."""
        if getattr(self, "save_future", None) is not None:
            self._wait_for_saving()

    # --- loading ------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (the newest complete one when -1) from ``folder``, else its seed checkpoint
        (``step-0``, the model alone, from ``--checkpoint.create_seed_checkpoint``), else
        ``initial_load_path``."""
        config = self.config
        seed = self._step_dir(0)
        if step == 0 or (step == -1 and os.path.isfile(os.path.join(seed, "model", "metadata.json"))
                         and not _has_complete_step(self.folder)):
            begin = time.monotonic()
            checkpointer.load_model_and_optim_state(seed, self.model)
            logger.info("checkpointer: loaded the seed checkpoint %s in %.2f s", seed, time.monotonic() - begin)
            return True
        if step != -1:
            step_dir = self._step_dir(step)
            if not _is_complete(step_dir):
                raise FileNotFoundError(f"--checkpoint.load_step={step}: no complete checkpoint at {step_dir}")
        else:
            step_dir = checkpointer.latest_checkpoint(self.folder) if os.path.isdir(self.folder) else None
        if step_dir is None:
            if not config.initial_load_path:
                logger.info("checkpointer: no checkpoint in %s, a fresh start", self.folder)
                return False
            begin = time.monotonic()
            model_only = config.initial_load_model_only
            checkpointer.load_model_and_optim_state(
                config.initial_load_path, self.model, None if model_only else self.optimizer
            )
            logger.info("checkpointer: loaded %s in %.2f s", config.initial_load_path, time.monotonic() - begin)
            return True
        begin = time.monotonic()
        excluded = set(config.exclude_from_loading)
        optimizer = None if OPTIMIZER in excluded else self.optimizer
        checkpointer.load_model_and_optim_state(step_dir, self.model, optimizer)
        self._read_titan_state(step_dir, excluded)
        logger.info("checkpointer: loaded %s in %.2f s", step_dir, time.monotonic() - begin)
        return True

    def _read_titan_state(self, step_dir: str, excluded: set[str]) -> None:
        titan_dir = os.path.join(step_dir, "titan")
        job = _read_json(os.path.join(titan_dir, _JOB_FILE))
        if LR_SCHEDULER not in excluded:
            self.lr_schedulers.load_state_dict(job[LR_SCHEDULER])
        for key, value in self.states.items():
            if key in (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER) or key in excluded:
                continue
            if key not in job:
                raise KeyError(f"{step_dir}: the checkpoint has no {key!r} state")
            value.load_state_dict(job[key])
        if self.dataloader is None or DATALOADER in excluded:
            return
        dp_rank = getattr(self.dataloader, "dp_rank", _rank())
        dp_world_size = getattr(self.dataloader, "dp_world_size", 1)
        path = os.path.join(titan_dir, f"dataloader.dp{dp_rank}.json")
        saved = _read_json(path) if os.path.exists(path) else None
        if saved is None or saved["dp_world_size"] != dp_world_size:
            warnings.warn(
                f"{step_dir}: the data loader was saved at data-parallel size "
                f"{None if saved is None else saved['dp_world_size']}, this job has {dp_world_size}: "
                f"its position is not restored and it starts from the beginning of the data",
                stacklevel=2,
            )
            return
        _load_loader_state(self.dataloader, saved["state"])


# --- the adapter until train_state= lands: JSON files beside model/ and optim/ --------------


def _is_complete(step_dir: str) -> bool:
    """Whether ``step_dir`` holds a committed model and optimizer (what ``latest_checkpoint`` counts)."""
    return all(os.path.isfile(os.path.join(step_dir, part, "metadata.json")) for part in ("model", "optim"))


def _has_complete_step(folder: str) -> bool:
    return os.path.isdir(folder) and checkpointer.latest_checkpoint(folder) is not None


def _loader_state(dataloader: Any) -> Any:
    """The data loader's own state, without the pickle torchtitan's wrapper puts around it."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    if isinstance(dataloader, StatefulDataLoader):
        return StatefulDataLoader.state_dict(dataloader)
    return dataloader.state_dict()


def _load_loader_state(dataloader: Any, state: Any) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    if isinstance(dataloader, StatefulDataLoader):
        StatefulDataLoader.load_state_dict(dataloader, state)
    else:
        dataloader.load_state_dict(state)


def _to_json(value: Any) -> Any:
    """Plain JSON, with tuples, bytes and tensors tagged so that they come back as they were."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return {"__dict__": [[_to_json(k), _to_json(v)] for k, v in value.items()]}
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot save a {type(value).__name__} in a torchtitan checkpoint's JSON state")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(_from_json(v) for v in value["__tuple__"])
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if "__dict__" in value:
        return {_from_json(k): _from_json(v) for k, v in value["__dict__"]}
    return {k: _from_json(v) for k, v in value.items()}


def _write_json(path: str, value: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(_to_json(value), f)
    os.replace(tmp, path)


def _read_json(path: str) -> Any:
    with open(path) as f:
        return _from_json(json.load(f))
