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

One save is one :func:`checkpointer.save_model_and_optim_state` (or its async form) into
``{dump_folder}/{checkpoint.folder}/step-{N}/``: the model and its optimizer, and as its
``train_state`` the LR schedulers, torchtitan's ``train_state`` (and any other state torchtitan
hands the manager) as job values, and the data loader's position as ``PerRank`` (each rank's own;
ranks that share a data-parallel rank under TP hold equal copies). All of it commits as one, so a
save killed at any point leaves no step that looks complete. ``keep_latest_k`` is
:func:`checkpointer.prune`, which never deletes the newest complete step nor one being written;
a run whose last save is async ends with one step more (that save ends in ``close``, which does
not prune).

As with torchtitan's DCP backend: a run rolled back with ``load_step`` saves over the later
steps it reaches again; ``initial_load_path`` with ``initial_load_model_only=False`` restores the
whole run (schedulers, data position, ``train_state``), not just the model; a model saved alone
(a seed checkpoint, a last step in ``export_dtype``) is cast into the model's dtypes as it loads;
a name in ``exclude_from_loading`` that the job does not have is a ``ValueError``; and ``close``
makes no collective (torchtitan closes a rank that failed while the others wait in a step).

The checkpoint is an ordinary ``checkpointer`` checkpoint: ``load_model_and_optim_state``,
``export_safetensors`` and the ``checkpointer`` command read it outside torchtitan, at any world
size. Resuming at another data-parallel size loads the model, optimizer, LR schedulers and
``train_state`` exactly; the data loader's position cannot move to another size (torchtitan's
own loader refuses to), so it restarts from the beginning and a warning says so.

Hugging Face checkpoints (``initial_load_in_hf``, ``last_save_in_hf``) go through the model's
``state_dict_adapter`` when it only renames keys: its names become the ``key_map`` of
:func:`checkpointer.load_model_and_optim_state`, and the names of the last step's
:func:`checkpointer.export_safetensors`. An adapter that also changes values (llama3's adapter
permutes ``wq``/``wk`` for Hugging Face's rotary layout) is refused by name at start-up: loading
through names alone would give wrong weights. Such jobs use torchtitan's DCP backend for the
Hugging Face step, or convert the checkpoint first.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
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


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointerManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, carried out by ``checkpointer``.

    Built by torchtitan's trainer from :class:`CheckpointerManager.Config` (never by hand). It
    follows ``interval``, ``load_step``, ``folder``, ``keep_latest_k``, ``async_mode``,
    ``last_save_model_only``, ``last_save_in_hf``, ``export_dtype``, ``exclude_from_loading``,
    ``load_only``, ``enable_first_step_checkpoint``, ``create_seed_checkpoint``,
    ``initial_load_path`` (a ``checkpointer`` checkpoint, or a Hugging Face one with
    ``initial_load_in_hf``) and ``initial_load_model_only``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint settings, plus how a save overlaps training."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """"disabled": a save returns once committed. "async" and "async_with_pinned_mem" (the
        same here: host buffers are pinned whenever the tensors are on a GPU): a save writes
        while the next steps train."""

        stage_in_background: bool = True
        """In the async modes: the copy of the model and optimizer to host memory overlaps the next
        step's forward and backward passes, and the trainer waits for it (``maybe_wait_for_staging``)
        just before its optimizer step changes them. False: ``save()`` returns once copied (for a
        loop that changes the model elsewhere)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {self.async_mode}")
            if self.initial_load_in_hf_quantized:
                raise ValueError("CheckpointerManager does not read quantized Hugging Face checkpoints "
                                 "(initial_load_in_hf_quantized)")

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
        self.sd_adapter = sd_adapter
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        # HF name -> model name, when the job reads or writes Hugging Face checkpoints.
        self.hf_names: dict[str, str] | None = None
        if config.initial_load_in_hf or config.last_save_in_hf:
            self.hf_names = _hf_names(self.model, sd_adapter)
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

    def _train_state(self, excluded: frozenset[str] = frozenset()) -> dict[str, Any]:
        """What ``train_state=`` holds: the job's states, and each rank's data loader position."""
        train_state: dict[str, Any] = {}
        if LR_SCHEDULER not in excluded:
            train_state[LR_SCHEDULER] = self.lr_schedulers
        for key, value in self.states.items():
            if key not in (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER) and key not in excluded:
                train_state[key] = value
        if self.dataloader is not None and DATALOADER not in excluded:
            train_state[DATALOADER] = checkpointer.PerRank(_LoaderPosition(self.dataloader))
        return train_state

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
        elif self.config.async_mode == "disabled":
            checkpointer.save_model_and_optim_state(
                step_dir, self.model, self.optimizer, train_state=self._train_state(), save_overwrite=_saved(step_dir)
            )
        else:
            self.save_future = checkpointer.async_save_model_and_optim_state(
                step_dir, self.model, self.optimizer, train_state=self._train_state(),
                stage_in_background=self.config.stage_in_background, save_overwrite=_saved(step_dir),
            )
        self._prune()
        logger.info("checkpointer: step %d %s in %.2f s", curr_step,
                    "saved" if self.save_future is None else "handed to the writer", time.monotonic() - begin)
        return True

    def _save_model_only(self, step_dir: str) -> None:
        """The last step's model alone, in ``export_dtype``: ``step_dir/model/``, or with
        ``last_save_in_hf`` Hugging Face shards (the adapter's names) in ``step_dir``."""
        state = {
            k: v.to(self.export_dtype) if v.is_floating_point() and v.dtype != self.export_dtype else v
            for k, v in self.model.state_dict().items()
        }
        if _saved(step_dir, ("optim",)):  # a whole step saved before a rollback: its optimizer and
            _barrier()        # training state go first, or they would read as this model's
            if _rank() == 0:
                for part in ("optim", "train"):
                    shutil.rmtree(os.path.join(step_dir, part), ignore_errors=True)
            _barrier()
        overwrite = os.path.isfile(os.path.join(step_dir, "model", "metadata.json"))
        if not self.config.last_save_in_hf:
            checkpointer.Checkpointer().save(f"{step_dir}/model", state, save_overwrite=overwrite)
            return
        assert self.hf_names is not None
        hf_state = {hf: state[name] for hf, name in self.hf_names.items()}
        staging = f"{step_dir}/model"
        checkpointer.Checkpointer().save(staging, hf_state, save_overwrite=overwrite)
        checkpointer.export_safetensors(staging, step_dir)
        _barrier()
        if _rank() == 0:
            shutil.rmtree(staging)
        _barrier()

    def _prune(self) -> None:
        """``keep_latest_k``: every rank calls :func:`checkpointer.prune` (rank 0 deletes); a save
        in flight and the newest complete step are never deleted."""
        if self.config.keep_latest_k > 0:
            checkpointer.prune(self.folder, keep_last=self.config.keep_latest_k)

    def _maybe_wait_for_staging(self) -> None:
        """Wait until the async save in flight has copied the model and optimizer to host memory."""
        future = getattr(self, "save_future", None)
        if future is not None:
            future.staged.result()

    def _wait_for_saving(self) -> None:
        """Wait for the async save in flight; its errors are raised here."""
        future, self.save_future = self.save_future, None
        assert future is not None
        future.result()
        self._prune()

    def _close(self) -> None:
        """Finish the async save in flight (a resumed job would otherwise lose its newest step).
        No collective: torchtitan closes a rank that failed while the others wait in a step."""
        future, self.save_future = getattr(self, "save_future", None), None
        if future is not None:
            future.result()

    # --- loading ------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (the newest complete one when -1) from ``folder``, else its seed checkpoint
        (``step-0``, the model alone, from ``--checkpoint.create_seed_checkpoint``), else
        ``initial_load_path`` (or, with ``initial_load_in_hf``, the model's ``hf_assets_path``)."""
        seed = self._step_dir(0)
        latest = checkpointer.latest_checkpoint(self.folder) if os.path.isdir(self.folder) else None
        if step == 0 or (step == -1 and latest is None
                         and os.path.isfile(os.path.join(seed, "model", "metadata.json"))):
            begin = time.monotonic()
            self._load_model_only(seed)
            logger.info("checkpointer: loaded the seed checkpoint %s in %.2f s", seed, time.monotonic() - begin)
            return True
        if step != -1:
            step_dir = self._step_dir(step)
            if not os.path.isfile(os.path.join(step_dir, "optim", "metadata.json")):
                raise FileNotFoundError(f"--checkpoint.load_step={step}: no complete checkpoint at {step_dir}")
        else:
            step_dir = latest
        if step_dir is None:
            return self._initial_load()
        begin = time.monotonic()
        self._load_all(step_dir)
        logger.info("checkpointer: loaded %s in %.2f s", step_dir, time.monotonic() - begin)
        return True

    def _load_all(self, step_dir: str) -> None:
        """The model, the optimizer and the training state, but those ``exclude_from_loading`` names."""
        excluded = frozenset(self.config.exclude_from_loading)
        known = {MODEL, OPTIMIZER, LR_SCHEDULER, *self.states, *([DATALOADER] if self.dataloader is not None else [])}
        for name in sorted(excluded - known):
            raise ValueError(f"{name} not found in state_dict.")  # as torchtitan's DCP backend says it
        optimizer = None if OPTIMIZER in excluded else self.optimizer
        result = checkpointer.load_model_and_optim_state(
            step_dir, self.model, optimizer, train_state=self._train_state(excluded)
        )
        if f"train_state.{DATALOADER}" in result.missing_keys:
            warnings.warn(
                f"{step_dir}: the data loader was saved by fewer ranks than this job has (rank {_rank()} "
                f"has no saved position): it starts from the beginning of the data",
                stacklevel=3,
            )

    def _load_model_only(self, path: str) -> None:
        """The model alone from ``path``: a seed checkpoint or a last step, saved alone in
        ``export_dtype``, is cast into the model's dtypes where they differ (as torchtitan's DCP
        backend casts), through a copy of just those tensors."""
        model_state = self.model.state_dict()
        try:
            saved = checkpointer.Checkpointer().get_metadata(f"{path}/model").tensors
        except (checkpointer.CheckpointError, OSError):
            saved = {}  # not this library's model part (a Hugging Face one, say): loaded as it is
        differ = {k for k, v in model_state.items() if k in saved and saved[k].torch_dtype != v.dtype}
        if not differ:
            checkpointer.load_model_and_optim_state(path, self.model)
            return
        staged = {k: _empty_like(v, saved[k].torch_dtype) if k in differ else v for k, v in model_state.items()}
        checkpointer.Checkpointer().load(f"{path}/model", staged)
        for key in differ:
            _local(model_state[key]).copy_(_local(staged[key]))

    def _initial_load(self) -> bool:
        config = self.config
        path = config.initial_load_path
        if config.initial_load_in_hf and not path:
            path = getattr(self.sd_adapter, "hf_assets_path", None)
        if not path:
            logger.info("checkpointer: no checkpoint in %s, a fresh start", self.folder)
            return False
        begin = time.monotonic()
        if config.initial_load_in_hf:
            assert self.hf_names is not None
            names = self.hf_names
            dtypes = {v.dtype for v in self.model.state_dict().values()}
            checkpointer.load_model_and_optim_state(
                path, self.model, key_map=names.get, dtype=dtypes.pop() if len(dtypes) == 1 else None
            )
        elif config.initial_load_model_only:
            self._load_model_only(path)
        else:  # everything, as torchtitan's DCP backend loads it
            self._load_all(path)
        logger.info("checkpointer: loaded %s in %.2f s", path, time.monotonic() - begin)
        return True


def _saved(step_dir: str, parts: tuple[str, ...] = ("model", "optim")) -> bool:
    """A step saved already (a run rolled back with ``load_step``, or one that goes on past its
    earlier last step, saved as the model alone): saved over, as torchtitan's DCP backend does.
    Every rank sees the same (shared) folder."""
    return any(os.path.isfile(os.path.join(step_dir, part, "metadata.json")) for part in parts)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _empty_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor sharded as ``t`` is, in ``dtype``."""
    if isinstance(t, DTensor):
        local = torch.empty_like(t.to_local(), dtype=dtype)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return torch.empty_like(t, dtype=dtype)


class _LoaderPosition:
    """A data loader's position with the data-parallel rank and size it belongs to; at another
    rank or size it is not restored (torchtitan's own loader refuses that too) and a warning says so.

    torchtitan's loader wraps its state in a pickle; this takes the ``StatefulDataLoader`` state
    underneath it, so that nothing is pickled."""

    def __init__(self, dataloader: Any):
        self.dataloader = dataloader
        self.dp_rank = getattr(dataloader, "dp_rank", _rank())
        self.dp_world_size = getattr(dataloader, "dp_world_size", 1)

    def state_dict(self) -> dict[str, Any]:
        from torchdata.stateful_dataloader import StatefulDataLoader

        state = (StatefulDataLoader.state_dict(self.dataloader) if isinstance(self.dataloader, StatefulDataLoader)
                 else self.dataloader.state_dict())
        return {"dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size, "state": state}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        if (saved["dp_rank"], saved["dp_world_size"]) != (self.dp_rank, self.dp_world_size):
            warnings.warn(
                f"the data loader was saved at data-parallel size {saved['dp_world_size']}, this job has "
                f"{self.dp_world_size} (data-parallel rank {saved['dp_rank']} saved, this is {self.dp_rank}): "
                f"its position is not restored and it starts from the beginning of the data",
                stacklevel=2,
            )
            return
        if isinstance(self.dataloader, StatefulDataLoader):
            StatefulDataLoader.load_state_dict(self.dataloader, saved["state"])
        else:
            self.dataloader.load_state_dict(saved["state"])


def _hf_names(model: nn.Module, sd_adapter: Any) -> dict[str, str]:
    """Hugging Face name -> model name, from ``sd_adapter.to_hf`` applied to the model's keys on
    meta tensors: a value it hands back as it got it was renamed; any other was transformed, and
    that is refused (a key map would load it wrong)."""
    if sd_adapter is None:
        raise ValueError("initial_load_in_hf / last_save_in_hf need the model's state_dict_adapter; "
                         "this model has none")
    probe = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.state_dict().items()}
    by_id = {id(v): k for k, v in probe.items()}
    hf = sd_adapter.to_hf(dict(probe))
    names: dict[str, str] = {}
    transformed: list[str] = []
    for hf_key, value in hf.items():
        if id(value) in by_id:
            names[hf_key] = by_id[id(value)]
        else:
            transformed.append(hf_key)
    if transformed:
        raise ValueError(
            f"{type(sd_adapter).__name__} changes the values of {len(transformed)} tensors, not only their "
            f"names (e.g. {transformed[:3]}): CheckpointerManager reads and writes Hugging Face checkpoints "
            f"through a key map only, which would give these wrong values. Use torchtitan's DCP backend for "
            f"initial_load_in_hf / last_save_in_hf with this model, or convert the checkpoint first"
        )
    return names
