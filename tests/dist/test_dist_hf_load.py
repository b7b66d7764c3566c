"""Hugging Face checkpoints written by transformers, loaded in place into sharded models.

A tiny ``GPT2LMHeadModel`` is written with ``save_pretrained(safe_serialization=True)``, as one
file and in shards. It loads with ``key_map`` into a GPT-2-shaped model of our own under FSDP2
at 1, 2 and 3 ranks (both strategies), under tensor parallelism (1-D and 2-D meshes), and unmapped into a
``GPT2LMHeadModel`` under FSDP2, whose logits must then be the original's bit for bit. Then the
refusals (an optimizer, key differences with ``strict``, a dtype without ``dtype=``), each on
every rank, and what ``strict=False``, a skipping ``key_map`` and ``dtype=`` do.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import catch, full, mesh
from hf_helpers import OwnGPT2, gpt2_key_map, hf_gpt2, hf_gpt2_names, own_to_hf, save_hf, zero_

from checkpointer import load_model_and_optim_state
from checkpointer.models.hf_load import load_hf

transformers = pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The reference model and its two HF directories: ``one`` (model.safetensors), ``sharded``."""
    model = hf_gpt2(seed=3)
    top = tmp_path_factory.mktemp("hf")
    dirs = {kind: save_hf(model, str(top / kind), sharded=kind == "sharded") for kind in ("one", "sharded")}
    return model, dirs


def _reference(model) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: state[k].clone() for k in hf_gpt2_names()}


def _own_fsdp(world_size: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(99)
    model = zero_(OwnGPT2())
    m = mesh((world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=m)
    fully_shard(model, mesh=m)
    return model


def load_own_fsdp(rank, world_size, dirs, strategies):
    """Every directory with every strategy into a fresh FSDP2 model: the full state by HF names."""
    out = {}
    for kind, path in dirs.items():
        for strategy in strategies:
            model = _own_fsdp(world_size)
            result = load_model_and_optim_state(path, model, key_map=gpt2_key_map, strategy=strategy)
            assert (result.missing_keys, result.unexpected_keys) == ([], [])
            state = {k: full(v) for k, v in model.state_dict().items()}
            assert state["head.weight"].data_ptr() == state["tok.weight"].data_ptr() or torch.equal(
                state["head.weight"], state["tok.weight"])
            out[(kind, strategy)] = own_to_hf(state)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gpt2_into_our_fsdp2_model(written, run_distributed, world_size):
    model, dirs = written
    expected = _reference(model)
    strategies = ["default", "two_stage"] if world_size > 1 else ["default"]
    for per_rank in run_distributed(load_own_fsdp, world_size, dirs, strategies, timeout=240):
        assert len(per_rank) == 2 * len(strategies)
        for loaded in per_rank.values():
            assert sorted(loaded) == sorted(expected)
            for key, tensor in expected.items():
                assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key


def load_own_tp(rank, world_size, path, strategy, shape):
    """Our model with every weight a DTensor: on a 1-D mesh, Conv1D weights by column, embeddings
    by row, the rest replicated (read once and shared under two_stage); on a 2-D mesh, matrices
    cut both ways ([Shard(0), Shard(1)]), vectors by the first mesh dimension."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    m = mesh(shape)
    model = zero_(OwnGPT2())
    for module in list(model.modules()):
        for pname, p in list(module.named_parameters(recurse=False)):
            if module is model.head:
                continue
            if len(shape) == 2:
                placements = [Shard(0), Shard(1)] if p.dim() == 2 else [Shard(0), Replicate()]
            elif pname == "weight" and p.dim() == 2:
                placements = [Shard(0) if isinstance(module, torch.nn.Embedding) else Shard(1)]
            else:
                placements = [Replicate()]
            setattr(module, pname, torch.nn.Parameter(distribute_tensor(p.detach(), m, placements)))
    model.head.weight = model.tok.weight
    load_model_and_optim_state(path, model, key_map=gpt2_key_map, strategy=strategy)
    return own_to_hf({k: full(v) for k, v in model.state_dict().items()})


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["tp", "2d"])
def test_gpt2_into_tensor_parallel_model(written, run_distributed, shape):
    model, dirs = written
    expected = _reference(model)
    for strategy in ("default", "two_stage"):
        world_size = 1
        for n in shape:
            world_size *= n
        for loaded in run_distributed(load_own_tp, world_size, dirs["sharded"], strategy, shape, timeout=240):
            for key, tensor in expected.items():
                assert torch.equal(loaded[key], tensor), (strategy, key)


def logits_of_fsdp_transformers(rank, world_size, path, ids):
    """A GPT2LMHeadModel of other weights under FSDP2, filled from ``path`` by its own names."""
    from torch.distributed.fsdp import fully_shard

    model = hf_gpt2(seed=11)
    m = mesh((world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=m)
    fully_shard(model, mesh=m)
    result = load_model_and_optim_state(path, model)
    with torch.no_grad():
        logits = model(ids).logits
    return result.missing_keys, result.unexpected_keys, logits


def test_transformers_model_under_fsdp2_gives_the_original_logits(written, run_distributed):
    model, dirs = written
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids).logits
    for missing, unexpected, logits in run_distributed(logits_of_fsdp_transformers, 2, dirs["sharded"], ids):
        assert (missing, unexpected) == ([], [])  # lm_head.weight is tied to wte: not missing
        assert torch.equal(logits, expected)


class Extra(OwnGPT2):
    """Our GPT-2 with one more parameter, which no checkpoint holds."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((4,), 7.0))


def refusals_and_options(rank, world_size, path, bf16_path):
    from torch.distributed.fsdp import fully_shard

    m = mesh((world_size,))
    out = {}
    model = _own_fsdp(world_size)
    out["optim"] = catch(load_model_and_optim_state, path, model, torch.optim.SGD(model.parameters(), lr=0.1),
                         key_map=gpt2_key_map)
    out["train_state"] = catch(load_model_and_optim_state, path, model, train_state={"x": 1}, key_map=gpt2_key_map)
    # strict: the model's extra key, and the checkpoint's keys a dict key_map leaves unmapped
    extra = zero_(Extra())
    fully_shard(extra, mesh=m)
    out["missing"] = catch(load_model_and_optim_state, path, extra, key_map=gpt2_key_map)
    out["unexpected"] = catch(load_model_and_optim_state, path, _own_fsdp(world_size),
                              key_map={"transformer.wte.weight": "tok.weight"})
    result = load_model_and_optim_state(path, extra, key_map=gpt2_key_map, strict=False)
    out["lenient"] = (result.missing_keys, result.unexpected_keys, full(extra.scale), own_to_hf(
        {k: full(v) for k, v in extra.state_dict().items() if k != "scale"}))
    # a callable skipping the blocks: strict=False loads the rest and reports both sides
    skip = _own_fsdp(world_size)
    result = load_model_and_optim_state(
        path, skip, key_map=lambda k: None if ".h." in k else gpt2_key_map(k), strict=False)
    out["skipped"] = (result.missing_keys, result.unexpected_keys, full(skip.tok.weight), full(skip.blocks[0].qkv.weight))
    # dtypes: bf16 files into fp32 masters only with dtype=; fp32 files into a bf16 model likewise
    fp32 = _own_fsdp(world_size)
    out["no_cast"] = catch(load_model_and_optim_state, bf16_path, fp32, key_map=gpt2_key_map)
    load_model_and_optim_state(bf16_path, fp32, key_map=gpt2_key_map, dtype=torch.float32)
    out["cast_up"] = own_to_hf({k: full(v) for k, v in fp32.state_dict().items()})
    batched = _own_fsdp(world_size)  # buffers of 4 KiB at a time: one load per few tensors
    load_hf(bf16_path, batched, key_map=gpt2_key_map, dtype=torch.float32, cast_batch_bytes=4096, strategy="two_stage")
    out["cast_batched"] = own_to_hf({k: full(v) for k, v in batched.state_dict().items()})
    bf16 = _own_fsdp(world_size).to(torch.bfloat16)
    load_model_and_optim_state(path, bf16, key_map=gpt2_key_map, dtype=torch.bfloat16, strategy="two_stage")
    out["cast_down"] = own_to_hf({k: full(v) for k, v in bf16.state_dict().items()})
    out["wrong_dest"] = catch(load_model_and_optim_state, path, _own_fsdp(world_size), key_map=gpt2_key_map,
                              dtype=torch.bfloat16)
    return out


def test_refusals_on_every_rank_and_load_options(written, run_distributed, tmp_path):
    model, dirs = written
    expected = _reference(model)
    bf16_path = save_hf(hf_gpt2(seed=3).to(torch.bfloat16), str(tmp_path / "bf16"), sharded=True)
    bf16_expected = {k: v.to(torch.bfloat16) for k, v in expected.items()}
    for out in run_distributed(refusals_and_options, 2, dirs["sharded"], bf16_path, timeout=240):
        for what in ("optim", "train_state"):
            assert out[what]["type"] == "ValueError" and "Hugging Face checkpoint" in out[what]["msg"], out[what]
        assert out["missing"]["type"] == "CheckpointMismatchError"
        assert "'scale'" in out["missing"]["msg"] and "strict=False" in out["missing"]["msg"]
        assert out["unexpected"]["type"] == "CheckpointMismatchError"
        assert "transformer.h.0.attn.c_attn.bias" in out["unexpected"]["msg"]
        missing, unexpected, scale, state = out["lenient"]
        assert (missing, unexpected) == (["scale"], [])
        assert torch.equal(scale, torch.zeros(4))  # zeroed before the load, left untouched
        assert all(torch.equal(state[k], expected[k]) for k in expected)
        missing, unexpected, tok, qkv = out["skipped"]
        assert missing and all(k.startswith("blocks.") for k in missing)
        assert unexpected == []  # skipped by key_map: neither loaded nor unexpected
        assert torch.equal(tok, expected["transformer.wte.weight"]) and not qkv.any()
        assert out["no_cast"]["type"] == "CheckpointMismatchError" and "dtype=torch.float32" in out["no_cast"]["msg"]
        for key, tensor in bf16_expected.items():
            assert out["cast_up"][key].dtype == torch.float32
            assert torch.equal(out["cast_up"][key], tensor.float()), key
            assert torch.equal(out["cast_batched"][key], tensor.float()), key
            assert out["cast_down"][key].dtype == torch.bfloat16
            assert torch.equal(out["cast_down"][key], tensor), key
        assert out["wrong_dest"]["type"] == "CheckpointMismatchError" and "bfloat16" in out["wrong_dest"]["msg"]
