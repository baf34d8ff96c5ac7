"""A small character-level GPT (nanoGPT-shaped) and the demo's deterministic data, shared by
train.py (the engine or real DeepSpeed) and evaluate.py (plain PyTorch on the consolidated file)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

CORPUS = Path(__file__).resolve().parents[2] / "fixtures" / "corpus.txt"
VOCAB = [chr(i) for i in range(32, 127)] + ["\n"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = len(VOCAB)
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.out = nn.Linear(4 * c.n_embd, c.n_embd)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(e, dim=2)
        q, k, v = (z.view(b, t, self.n_head, e // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, e))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two modules
        self.register_buffer("pos", torch.arange(c.block_size, dtype=torch.int64))
        for n, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * c.n_layer) if n.endswith("out.weight") else 1))

    def reset_parameters(self) -> None:
        """Refill the position buffer (a model built on the meta device gets it back uninitialised)."""
        with torch.no_grad():
            self.pos.copy_(torch.arange(self.pos.numel(), device=self.pos.device))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(self.pos[:t])
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def encoded_corpus() -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([index.get(ch, 0) for ch in CORPUS.read_text()], dtype=torch.int64)


def global_batch(
    data: torch.Tensor, step: int, batch: int, block: int, seed: int = 1234
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: depends on the step only, never on the world size, so a run resumed
    on another rank count sees the same data."""
    g = torch.Generator().manual_seed(seed + step)
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
    x = torch.stack([data[s : s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts.tolist()])
    return x, y


EVAL_STEP = -1_000_000  # the fixed evaluation batch
