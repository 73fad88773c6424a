"""Real-gradient sources shared by the benchmarks, the demo and the examples; no downloads.

Two small models train on data that ships with Python and scikit-learn:

- ``"digits"``: the MLP of :mod:`gradwire.demo` on scikit-learn's bundled 8×8 digits;
- ``"char_transformer"``: :class:`CharTransformer`, a character-level transformer language model on the
  text of Python's own ``pydoc_data.topics`` (about 465 k characters of Python documentation).

:func:`collect_gradients` trains one of them briefly with AdamW and records the gradients of a few
steps, so that codecs are measured on gradients with the structure of real ones (heavy-tailed values,
low-rank matrices, layers of very different scales) rather than on Gaussian noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from .demo import DigitsData, digits_mlp, load_digits

__all__ = [
    "MODELS",
    "CharTransformer",
    "CharVocab",
    "DigitsData",
    "char_batch",
    "collect_gradients",
    "digits_mlp",
    "load_digits",
    "load_pydoc_text",
]

#: Names :func:`collect_gradients` knows.
MODELS = ("digits", "char_transformer")


def load_pydoc_text() -> str:
    """The text of Python's bundled ``pydoc_data.topics``, topics in sorted order (no download)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@dataclass(frozen=True)
class CharVocab:
    """The sorted set of characters of a text, and the mapping to and from token ids."""

    chars: str

    @classmethod
    def of(cls, text: str) -> "CharVocab":
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class CharTransformer(nn.Module):
    """A small decoder-only (causal) transformer over characters.

    Token and learned position embeddings, ``layers`` pre-norm transformer blocks of ``heads`` heads,
    a final layer norm and a linear head to the vocabulary. The defaults (2 layers, d_model 128, 4
    heads, context 64) give about 0.4 M parameters.
    """

    def __init__(self, vocab_size: int, d_model: int = 128, heads: int = 4, layers: int = 2, context: int = 64):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, vocab)`` for token ids ``(batch, time)``, ``time <= context``."""
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        h = self.tok(ids) + self.pos(pos)[None]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def char_batch(tokens: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """``(inputs, targets)``: ``batch`` random windows of ``context`` tokens and the next tokens."""
    start = torch.randint(0, tokens.numel() - context - 1, (batch,), generator=generator)
    offsets = torch.arange(context)
    x = tokens[start[:, None] + offsets]
    y = tokens[start[:, None] + offsets + 1]
    return x, y


def _digits_task(seed: int, batch: int) -> tuple[nn.Module, Callable[[torch.Generator], torch.Tensor]]:
    data: DigitsData = load_digits(seed)
    model = digits_mlp()

    def loss(g: torch.Generator, device) -> torch.Tensor:
        idx = torch.randint(0, len(data.y_train), (batch,), generator=g)
        logits = model(data.x_train[idx].to(device))
        return nn.functional.cross_entropy(logits, data.y_train[idx].to(device))

    return model, loss


def _char_task(seed: int, batch: int) -> tuple[nn.Module, Callable[[torch.Generator], torch.Tensor]]:
    text = load_pydoc_text()
    vocab = CharVocab.of(text)
    tokens = vocab.encode(text)
    model = CharTransformer(len(vocab))

    def loss(g: torch.Generator, device) -> torch.Tensor:
        x, y = char_batch(tokens, batch, model.context, g)
        logits = model(x.to(device))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1))

    return model, loss


_TASKS = {"digits": (_digits_task, 64), "char_transformer": (_char_task, 8)}


def collect_gradients(
    model_name: str,
    steps: int = 40,
    *,
    record_every: int = 4,
    seed: int = 0,
    lr: float = 3e-3,
    device: Optional[torch.device | str] = None,
    progress: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Train ``model_name`` for ``steps`` AdamW steps and return the gradients of every
    ``record_every``-th step (``steps // record_every`` snapshots of ``{parameter name: gradient}``).

    Gradients are detached float32 copies on ``device`` (CPU by default). The same arguments give the
    same gradients on the same machine.
    """
    if model_name not in _TASKS:
        raise ValueError(f"unknown model {model_name!r}; known: {', '.join(MODELS)}")
    if steps < 1 or record_every < 1:
        raise ValueError("steps and record_every must be >= 1")
    build, batch = _TASKS[model_name]
    torch.manual_seed(seed)
    model, loss_fn = build(seed, batch)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    recorded: list[dict[str, torch.Tensor]] = []
    bar = tqdm(range(steps), desc=f"gradients of {model_name}", disable=not progress, leave=False)
    for step in bar:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(g, dev)
        loss.backward()
        if (step + 1) % record_every == 0:
            recorded.append(
                {n: p.grad.detach().to(torch.float32).clone() for n, p in model.named_parameters() if p.grad is not None}
            )
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return recorded
