"""A small GPT-style language model and its data, for the tests of real-model habits.

What a user's transformer brings that the MLP of distributed_toys does not: an embedding tied to the
output head (one parameter used twice), LayerNorm and attention, 1-D parameters beside 2-D ones, a frozen
parameter (the position embedding) and a parameter that gets no gradient on some steps (``extra``, used
only on even steps). Sized so a step takes a few milliseconds on one core.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, CONTEXT, HEADS = 96, 32, 16, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied: model.parameters() yields it once
        self.extra = nn.Linear(WIDTH, WIDTH)  # used on even steps only: no gradient on the others

    def forward(self, tokens: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        if use_extra:
            x = x + self.extra(x)
        return self.head(self.ln_f(self.blocks(x)))


def make_gpt(seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyGPT:
    """The same weights on every rank; the position embedding frozen."""
    torch.manual_seed(seed)
    model = TinyGPT().to(dtype)
    model.wpe.weight.requires_grad_(False)
    return model


def token_batches(rank: int, steps: int, micro: int = 2, batch: int = 4, seed: int = 0) -> list[list[torch.Tensor]]:
    """Rank ``rank``'s token batches: ``steps`` lists of ``micro`` micro-batches, a sequence that repeats a
    short pattern (learnable) with noise."""
    g = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    base = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(seed))
    out = []
    for _ in range(steps):
        micros = []
        for _ in range(micro):
            start = torch.randint(0, 8, (batch, 1), generator=g)
            idx = (start + torch.arange(CONTEXT + 1)) % 8
            seq = base[idx]
            noise = torch.rand(seq.shape, generator=g) < 0.1
            micros.append(torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq))
        out.append(micros)
    return out


def lm_loss(model: nn.Module, seq: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
    logits = model(seq[:, :-1], use_extra=use_extra)
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def param_groups(model: nn.Module, lr: float) -> list[dict]:
    """Named parameter groups as users write them: weight decay on 2-D weights at ``lr``, none on 1-D
    parameters (norms, biases) at ``lr / 2``."""
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": 0.01, "lr": lr},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2},
    ]
