"""The HF output of ``checkpointer unshard`` loads in transformers, tied embeddings included,
with no missing keys and the trained model's exact logits."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from cli_helpers import assert_same_tensors, cli
from safetensors.torch import load_file

import checkpointer
from checkpointer import save_model_and_optim_state, unshard_model_state

transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def tiny_config():
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama with tied input/output embeddings after a few AdamW steps, and its checkpoint."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 12))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    model.eval()
    dir = str(tmp_path_factory.mktemp("llama") / "ckpt")
    save_model_and_optim_state(dir, model, optim)
    return model, dir


def test_hf_shards_load_with_from_pretrained(trained, capsys, tmp_path, caplog):
    model, dir = trained
    out = str(tmp_path / "hf")
    code, _, err = cli(capsys, "unshard", dir, out, "--max-shard-size", "4KB")
    assert (code, err) == (0, "")
    shards = [n for n in os.listdir(out) if n.endswith(".safetensors")]
    assert len(shards) > 3
    model.config.save_pretrained(out)

    with caplog.at_level(logging.WARNING, logger="transformers"):
        loaded, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: list(v) for k, v in info.items()} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    assert not [r.getMessage() for r in caplog.records if "newly initialized" in r.getMessage() or "not used" in r.getMessage()]
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    loaded.eval()
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    got = {}
    for name in shards:
        got.update(load_file(os.path.join(out, name)))
    assert_same_tensors(got, want)
    if hasattr(checkpointer, "lazy_load"):
        assert_same_tensors(dict(checkpointer.lazy_load(out)), want)


def test_hf_single_file_equals_unshard_model_state(trained, capsys, tmp_path):
    model, dir = trained
    out = str(tmp_path / "model.safetensors")
    assert cli(capsys, "unshard", dir, out, "-q") == (0, "", "")
    full = unshard_model_state(dir, no_dist=True)
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    assert_same_tensors(load_file(out), {k: v for k, v in full.items() if k != "lm_head.weight"})
