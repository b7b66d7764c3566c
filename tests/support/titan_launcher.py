"""Runs torchtitan 0.3.0's trainer on CPU with gloo, for the torchtitan tests and benchmark.

torchtitan targets CUDA; this launcher makes it train on this machine's CPUs without editing
anything in site-packages. Recipe:

1. ``write_assets(dir)`` (in the test process): a tiny byte-level tokenizer made with the
   ``tokenizers`` library, and a synthetic JSON-lines dataset in the format torchtitan's
   ``c4_test`` loader reads (``{"text": ...}`` per line).
2. ``launch(world_size, args, env)`` starts ``torchrun`` on this file; each rank calls
   ``apply_shims()`` *before* torchtitan is imported, then ``torchtitan.train.main()`` with the
   usual ``--module PKG --config FN`` arguments and ``--checkpoint.*`` flags.
3. The shims (all at run time):
   - device type: ``torch._utils._get_available_device_type`` says "cpu", and the few
     ``torch.cpu`` memory/device-name calls of torchtitan's metrics get stand-ins;
   - FlexAttention runs uncompiled (no compiled CPU backward), without its CPU-backward check;
   - gloo has no ``PREMUL_SUM``: where FSDP's divide factor is set, sum reduction is forced;
   - ``dist.barrier(device_ids=["cpu"])`` drops the non-int ids; ``dist.set_timeout`` (missing
     in torch 2.13) is ``distributed_c10d._set_pg_timeout``;
   - ``HF_HUB_OFFLINE=1``.
4. Test hooks, each set by an environment variable of the launch:
   - ``TITAN_LOSSES``: a JSON file per rank (``{path}.{rank}``) of every step's exact loss;
   - ``TITAN_STOP_AFTER``: training stops after that step (a job killed after its save), with
     ``training.steps``, and so the LR schedule, unchanged;
   - ``TITAN_DUMP_END`` / ``TITAN_DUMP_LOADED``: rank 0 writes the full model, optimizer and LR
     scheduler state (``torch.save`` of plain tensors) at the end of training / right after the
     checkpoint load;
   - ``TITAN_LOAD_REPEATS``: the trainer's checkpoint load runs that many times (each in place,
     each timed), for the benchmark's medians;
   - ``TITAN_PROFILE_LOAD``: a cProfile of each rank's ``load()`` call (``{path}.{rank}``);
   - ``TITAN_PROFILE_SAVE``: a cProfile of each rank's saving ``save()`` calls (``{path}.{rank}.step{N}``);
   - ``TITAN_TIMINGS``: a JSON file per rank of the seconds each ``save()`` and ``load()`` call
     blocked the trainer, whether each save returned with its write in a Future (async), and
     the seconds each ``maybe_wait_for_staging()`` after a save blocked it (the async copy);
   - ``TITAN_FOLDERS``: rank 0 records, right after each ``save()`` returns (an async save may
     still be writing), the checkpoint folder's step directories and which of them are complete.

The config functions the tests pass (``--module titan_launcher --config NAME``) are at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SEQ_LEN = 256
VOCAB = 2048


def write_assets(root: Path, *, documents: int = 400, seed: int = 0) -> tuple[Path, Path]:
    """Write a tiny tokenizer and a synthetic dataset under ``root``; return (tokenizer, data) dirs."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok_dir = root / "tokenizer"
    data_dir = root / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(600)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(80, 400))) for _ in range(documents)]
    with open(data_dir / "train.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "add_bos_token": True, "add_eos_token": True,
    }))
    return tok_dir, data_dir


def launch(world_size: int, args: list[str], env: dict[str, str], *, log: Path,
           timeout: float = 300) -> None:
    """Run the trainer on ``world_size`` CPU ranks under torchrun; raise with the log's tail on failure."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    support = str(Path(__file__).resolve().parent)
    repo = str(Path(__file__).resolve().parents[2])
    full_env = {**os.environ, **env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "PYTHONPATH": os.pathsep.join([repo, support, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}",
           "--master-addr=127.0.0.1", f"--master-port={port}", "--tee=3",
           __file__, *args]
    with open(log, "w") as out:
        proc = subprocess.run(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = log.read_text()[-6000:]
        raise RuntimeError(f"torchtitan launch failed (exit {proc.returncode}), log {log}:\n{tail}")


def train_args(*, tokenizer: Path, data: Path, dump: Path, steps: int, extra: list[str] = (),
               config: str = "debugmodel_checkpointer") -> list[str]:
    """The command-line arguments of one run of the debug model."""
    return ["--module", "titan_launcher", "--config", config,
            "--hf_assets_path", str(tokenizer), "--dataloader.dataset_path", str(data),
            "--dump_folder", str(dump), "--training.steps", str(steps), *extra]


# --- the shims (run in each rank before torchtitan is imported) -----------------------------


def apply_shims() -> None:
    """Make torchtitan 0.3.0 run on CPU with gloo; see the module docstring."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch._utils._get_available_device_type = lambda: "cpu"

    class _Props:
        total_memory = 64 * 1024**3

    stubs = {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: _Props(),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
    }
    for name, fn in stubs.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)

    import torch.nn.attention.flex_attention as fa

    fa._validate_device = lambda *a, **k: None

    from torch.distributed.fsdp import FSDPModule

    original_divide = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        original_divide(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor

    original_barrier = dist.barrier

    def barrier(*args: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        if device_ids is not None:
            device_ids = [d for d in device_ids if isinstance(d, int)] or None
        return original_barrier(*args, device_ids=device_ids, **kwargs)

    dist.barrier = barrier
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = c10d._set_pg_timeout

    import torchtitan.models.common.attention as attention

    attention.FlexAttention._compiled_flex_attn = fa.flex_attention
    attention._compiled_create_block_mask = fa.create_block_mask


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _plain(value: Any) -> Any:
    """A state dict with every DTensor made whole and every tensor a CPU copy."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _dump(trainer: Any, path: str) -> None:
    import torch

    state = {
        "model": _plain({k: v for m in trainer.model_parts for k, v in m.state_dict().items()}),
        "optimizer": _plain(trainer.optimizers.state_dict()),
        "lr_scheduler": _plain(trainer.lr_schedulers.state_dict()),
        "step": trainer.step,
    }
    if _rank() == 0:
        torch.save(state, path)


def _folder_listing(folder: str, step: int) -> dict[str, Any]:
    import checkpointer

    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    complete = [n for n in names if all(os.path.isfile(os.path.join(folder, n, part, "metadata.json"))
                                        for part in ("model", "optim", "train"))]
    latest = checkpointer.latest_checkpoint(folder) if names else None
    return {"step": step, "dirs": names, "complete": complete, "latest": latest and os.path.basename(latest)}


def _install_hooks() -> None:
    import torch
    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    losses: list[tuple[int, float]] = []
    timings: dict[str, list] = {"save": [], "load": [], "save_steps": [], "returned_future": [], "staging_wait": []}
    loss_path = os.environ.get("TITAN_LOSSES")
    timing_path = os.environ.get("TITAN_TIMINGS")
    folders_path = os.environ.get("TITAN_FOLDERS")
    folders: list[dict[str, Any]] = []

    original_log = MetricsProcessor.log

    def log(self, step, global_avg_loss, *args, **kwargs):
        losses.append((step, float(global_avg_loss)))
        if loss_path:
            Path(f"{loss_path}.{_rank()}").write_text(json.dumps(losses))
        return original_log(self, step, global_avg_loss, *args, **kwargs)

    MetricsProcessor.log = log

    original_save = BaseCheckpointManager.save
    original_load = BaseCheckpointManager.load

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        profile_path = os.environ.get("TITAN_PROFILE_SAVE")
        if profile_path:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        begin = time.perf_counter()
        saved = original_save(self, curr_step, last_step)
        if profile_path:
            profiler.disable()
            if saved:
                profiler.dump_stats(f"{profile_path}.{_rank()}.step{curr_step}")
        if saved:
            timings["save"].append(time.perf_counter() - begin)
            timings["save_steps"].append(curr_step)
            future = getattr(self, "save_future", None)
            timings["returned_future"].append(future is not None)
            if folders_path and _rank() == 0:
                folders.append(_folder_listing(self.folder, curr_step))
                Path(folders_path).write_text(json.dumps(folders))
            if timing_path:
                Path(f"{timing_path}.{_rank()}").write_text(json.dumps(timings))
        return saved

    def load(self, step: int = -1) -> bool:
        profile_path = os.environ.get("TITAN_PROFILE_LOAD")
        if profile_path:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        begin = time.perf_counter()
        loaded = original_load(self, step)
        if profile_path:
            profiler.disable()
            profiler.dump_stats(f"{profile_path}.{_rank()}")
        timings["load"].append(time.perf_counter() - begin)
        if timing_path:
            Path(f"{timing_path}.{_rank()}").write_text(json.dumps(timings))
        return loaded

    original_wait_for_staging = BaseCheckpointManager.maybe_wait_for_staging

    def maybe_wait_for_staging(self) -> None:
        begin = time.perf_counter()
        original_wait_for_staging(self)
        if timings["save"]:  # (the saves so far, the seconds this wait blocked the trainer)
            timings["staging_wait"].append((len(timings["save"]), time.perf_counter() - begin))
            if timing_path:
                Path(f"{timing_path}.{_rank()}").write_text(json.dumps(timings))

    BaseCheckpointManager.save = save
    BaseCheckpointManager.load = load
    BaseCheckpointManager.maybe_wait_for_staging = maybe_wait_for_staging

    stop_after = os.environ.get("TITAN_STOP_AFTER")
    if stop_after:
        original_continue = Trainer.should_continue_training

        def should_continue_training(self) -> bool:
            return self.step < int(stop_after) and original_continue(self)

        Trainer.should_continue_training = should_continue_training

    original_train = Trainer.train
    dump_loaded = os.environ.get("TITAN_DUMP_LOADED")
    dump_end = os.environ.get("TITAN_DUMP_END")

    repeats = int(os.environ.get("TITAN_LOAD_REPEATS", "1"))

    def train(self) -> None:
        if dump_loaded or repeats > 1:
            inner_load = self.checkpointer.load

            def load_then_dump(step: int = -1) -> bool:
                for _ in range(repeats):
                    loaded = inner_load(step)
                if dump_loaded:
                    _dump(self, dump_loaded)
                return loaded

            self.checkpointer.load = load_then_dump
        original_train(self)
        if dump_end:
            _dump(self, dump_end)
        torch.distributed.barrier()

    Trainer.train = train


# --- the config functions (``--module titan_launcher --config NAME``) -----------------------


def _cpu_debugmodel() -> Any:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.data_parallel_shard_degree = -1
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = 2
    config.debug.seed = 7
    config.validator.enable = False
    config.metrics.log_freq = 1
    return config


def _sized(config: Any) -> Any:
    """The debug model at ``TITAN_DIM`` x ``TITAN_LAYERS`` (for the benchmark), else unchanged."""
    import dataclasses

    if "TITAN_DIM" not in os.environ:
        return config
    import torchtitan.models.llama3 as llama3

    dim, n_layers, n_heads = int(os.environ["TITAN_DIM"]), int(os.environ.get("TITAN_LAYERS", "6")), 16
    model = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=llama3.Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                               param_init=llama3._EMBEDDING_INIT),
        norm=llama3.RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=llama3.Linear.Config(in_features=dim, out_features=VOCAB,
                                     param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads,
            hidden_dim=llama3.compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=llama3.ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000,
                                           scaling="llama"),
            attn_backend="flex",
        ),
    )
    config.model_spec = dataclasses.replace(config.model_spec, model=model)
    return config


def debugmodel_dcp() -> Any:
    """llama3 debugmodel on CPU with torchtitan's own DCP checkpoint backend."""
    from torchtitan.components.checkpointer import CheckpointManager

    config = _sized(_cpu_debugmodel())
    config.checkpoint = CheckpointManager.Config(enable=True, interval=2, last_save_model_only=False)
    return config


def debugmodel_checkpointer() -> Any:
    """llama3 debugmodel on CPU with checkpointer's backend."""
    from checkpointer.integrations.torchtitan import CheckpointerManager

    config = _sized(_cpu_debugmodel())
    config.checkpoint = CheckpointerManager.Config(enable=True, interval=2,
                                                   last_save_model_only=False)
    return config


def debugmodel_checkpointer_hf_names() -> Any:
    """As ``debugmodel_checkpointer``, with a Hugging Face adapter that only renames: llama3's own
    also permutes wq/wk, which ``CheckpointerManager`` refuses for Hugging Face loads and saves."""
    import dataclasses

    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    class RenamingAdapter(Llama3StateDictAdapter):
        def _permute(self, w, *args, **kwargs):
            return w

        def _reverse_permute(self, w, *args, **kwargs):
            return w

    config = debugmodel_checkpointer()
    config.model_spec = dataclasses.replace(config.model_spec, state_dict_adapter=RenamingAdapter)
    return config


if __name__ == "__main__":
    apply_shims()
    _install_hooks()
    from torchtitan.train import main

    main()
