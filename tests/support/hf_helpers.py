"""Helpers of the Hugging Face load tests: a tiny transformers GPT-2 written as HF safetensors, and
a GPT-2-shaped model of our own whose names differ (so loading it needs ``key_map``).

``OwnGPT2`` holds the same tensors as ``GPT2LMHeadModel`` (Conv1D weights are ``[in, out]``),
its output head tied to the token embedding, under names of its own: :func:`gpt2_key_map` maps
the checkpoint's names to them, :func:`own_to_hf` back.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F



@dataclass(frozen=True)
class Dims:
    vocab: int = 96
    positions: int = 32
    embed: int = 32
    layers: int = 2
    heads: int = 2


TINY = Dims()
LARGER = Dims(vocab=4096, positions=64, embed=128, layers=2, heads=4)
"""About 3.7 MB of fp32: each rank's share dwarfs the requests' own bytes (the byte-counting test)."""


def tiny_config(dims: Dims = TINY):
    import transformers

    return transformers.GPT2Config(vocab_size=dims.vocab, n_positions=dims.positions, n_embd=dims.embed,
                                   n_layer=dims.layers, n_head=dims.heads, bos_token_id=0, eos_token_id=0)


def hf_gpt2(seed: int = 0, dims: Dims = TINY):
    """A tiny ``GPT2LMHeadModel`` with random weights (biases and norms too), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(tiny_config(dims))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_hf(model, path: str, *, sharded: bool, max_shard_size: str = "16KB") -> str:
    """``save_pretrained(safe_serialization=True)``, as one file or in shards of ``max_shard_size``."""
    options = {"max_shard_size": max_shard_size} if sharded else {}
    model.save_pretrained(path, safe_serialization=True, **options)
    return path


_RENAMES = [
    (r"^transformer\.wte\.", "tok."),
    (r"^transformer\.wpe\.", "pos."),
    (r"^transformer\.ln_f\.", "norm."),
    (r"^transformer\.h\.(\d+)\.ln_1\.", r"blocks.\1.ln1."),
    (r"^transformer\.h\.(\d+)\.ln_2\.", r"blocks.\1.ln2."),
    (r"^transformer\.h\.(\d+)\.attn\.c_attn\.", r"blocks.\1.qkv."),
    (r"^transformer\.h\.(\d+)\.attn\.c_proj\.", r"blocks.\1.attn_out."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_fc\.", r"blocks.\1.mlp_in."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_proj\.", r"blocks.\1.mlp_out."),
]


def gpt2_key_map(key: str) -> str | None:
    """Hugging Face GPT-2 name -> :class:`OwnGPT2` name; None for anything else (skipped)."""
    for pattern, repl in _RENAMES:
        name, n = re.subn(pattern, repl, key)
        if n:
            return name
    return None


def own_to_hf(state: dict[str, torch.Tensor], dims: Dims = TINY) -> dict[str, torch.Tensor]:
    """An :class:`OwnGPT2` state by Hugging Face names (the tied head dropped)."""
    back = {}
    for key in hf_gpt2_names(dims):
        back[key] = state[gpt2_key_map(key)]
    return back


def hf_gpt2_names(dims: Dims = TINY) -> list[str]:
    names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"]
    for i in range(dims.layers):
        for part in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            names += [f"transformer.h.{i}.{part}.weight", f"transformer.h.{i}.{part}.bias"]
    return names


class Conv1D(nn.Module):
    """GPT-2's linear layer: ``x @ weight + bias`` with ``weight`` of shape ``[in, out]``."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Block(nn.Module):
    def __init__(self, dims: Dims):
        super().__init__()
        e = dims.embed
        self.heads = dims.heads
        self.ln1 = nn.LayerNorm(e)
        self.qkv = Conv1D(e, 3 * e)
        self.attn_out = Conv1D(e, e)
        self.ln2 = nn.LayerNorm(e)
        self.mlp_in = Conv1D(e, 4 * e)
        self.mlp_out = Conv1D(4 * e, e)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.attn_out((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x)), approximate="tanh"))


class OwnGPT2(nn.Module):
    """GPT-2 under other names; ``head.weight`` is ``tok.weight`` (tied, as in GPT-2)."""

    def __init__(self, dims: Dims = TINY):
        super().__init__()
        self.tok = nn.Embedding(dims.vocab, dims.embed)
        self.pos = nn.Embedding(dims.positions, dims.embed)
        self.blocks = nn.ModuleList(Block(dims) for _ in range(dims.layers))
        self.norm = nn.LayerNorm(dims.embed)
        self.head = nn.Linear(dims.embed, dims.vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def zero_(model: nn.Module) -> nn.Module:
    """Every parameter set to zero (so a load that skips one is seen)."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model
