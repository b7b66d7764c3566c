"""A tiny byte-level transformer language model and a deterministic synthetic corpus.

Nothing here knows about checkpointing or distributed training; ``demo.py`` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 3
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn_out = nn.Linear(cfg.d_model, cfg.d_model)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.attn_out(attn.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class TinyLM(nn.Module):
    """GPT-style language model whose output projection is tied to the token embedding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        nn.init.normal_(self.tok_emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        # Tied embeddings: the logits reuse tok_emb.weight, so there is one tensor to checkpoint.
        return F.linear(self.norm(x), self.tok_emb.weight)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy over every position of the batch."""
        logits = self(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_corpus(n_bytes: int = 100_000, seed: int = 0) -> torch.Tensor:
    """Deterministic 'text': sentences of made-up words, as a 1-D uint8 tensor of bytes."""
    g = torch.Generator().manual_seed(seed)
    letters = "etaoinshrdlucmfwypvbgk"
    words = [
        "".join(letters[i] for i in torch.randint(len(letters), (int(n),), generator=g))
        for n in torch.randint(2, 8, (64,), generator=g)
    ]
    text = []
    size = 0
    while size < n_bytes:
        n_words = int(torch.randint(3, 12, (1,), generator=g))
        picks = torch.randint(len(words), (n_words,), generator=g)
        sentence = " ".join(words[i] for i in picks).capitalize() + ". "
        text.append(sentence)
        size += len(sentence)
    return torch.tensor(list("".join(text)[:n_bytes].encode("ascii")), dtype=torch.uint8)


class Windows(torch.utils.data.Dataset):
    """``n`` fixed windows of the corpus as (inputs, targets) pairs, for a ``DataLoader``."""

    def __init__(self, corpus: torch.Tensor, n: int, seq_len: int) -> None:
        self.corpus, self.n, self.seq_len = corpus, n, seq_len
        self.stride = (len(corpus) - seq_len - 1) // n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.corpus[i * self.stride : i * self.stride + self.seq_len + 1].long()
        return window[:-1], window[1:]


def get_batch(
    corpus: torch.Tensor, step: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` as (inputs, targets): a function of the step number alone."""
    g = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(len(corpus) - seq_len - 1, (batch_size,), generator=g)
    window = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return window[:, :-1], window[:, 1:]
