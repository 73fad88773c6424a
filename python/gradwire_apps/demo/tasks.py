"""What the demo trains: the data sets and models, and the two tasks built on them; no downloads.

Data and models:

- scikit-learn's bundled 8×8 digits (:func:`load_digits`) and a small MLP (:func:`digits_mlp`);
- the text of Python's own ``pydoc_data.topics`` (:func:`load_pydoc_text`, about 465 k characters of
  Python documentation), its characters (:class:`CharVocab`) and a small causal transformer over them
  (:class:`CharTransformer`), with random next-character windows (:func:`char_batch`).

A task (:class:`DigitsTask`, :class:`CharTask`; :func:`make_task` by the name ``gradwire demo --model``
takes) builds the model, cuts the training data into one shard per worker (plain tensors, written as
safetensors for the worker processes), computes one batch's loss on a shard, and evaluates a model on
held-out data. Workers rebuild the task from its ``worker_args``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "TASKS",
    "CharTask",
    "CharTransformer",
    "CharVocab",
    "DigitsData",
    "DigitsTask",
    "char_batch",
    "digits_mlp",
    "evaluate",
    "load_digits",
    "load_pydoc_text",
    "make_task",
]


# ---------------------------------------------------------------------------------------------
# Digits: scikit-learn's bundled images and an MLP.


@dataclass
class DigitsData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits(seed: int = 0, test_fraction: float = 0.25) -> DigitsData:
    """scikit-learn's bundled 8×8 digits (1797 images, no download), scaled to [0, 1], split at random."""
    from sklearn.datasets import load_digits as _load

    bunch = _load()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return DigitsData(x[train], y[train], x[test], y[test])


def digits_mlp(hidden: int = 128) -> nn.Module:
    """64 → hidden → hidden → 10 with ReLUs: about 26 k parameters at the default width."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def evaluate(model: nn.Module, data: DigitsData) -> tuple[float, float]:
    """Test loss and accuracy of a digits classifier."""
    model.eval()
    with torch.no_grad():
        logits = model(data.x_test)
        loss = nn.functional.cross_entropy(logits, data.y_test).item()
        acc = (logits.argmax(1) == data.y_test).float().mean().item()
    model.train()
    return loss, acc


# ---------------------------------------------------------------------------------------------
# Characters: pydoc text and a small transformer.


def load_pydoc_text() -> str:
    """The text of Python's bundled ``pydoc_data.topics``, topics in sorted order (no download)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@dataclass(frozen=True)
class CharVocab:
    """The sorted set of characters of a text, and the mapping to and from token ids."""

    chars: str

    @classmethod
    def of(cls, text: str) -> CharVocab:
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


# ---------------------------------------------------------------------------------------------
# The tasks the distributed demo trains.


class DigitsTask:
    """The digits MLP on scikit-learn's digits; shards are interleaved slices of the training split."""

    name = "digits"

    def __init__(self, hidden: int = 128, data_seed: int = 0, data: DigitsData | None = None):
        self.hidden = hidden
        self.data_seed = data_seed
        self._data = data

    @property
    def data(self) -> DigitsData:
        if self._data is None:
            self._data = load_digits(self.data_seed)
        return self._data

    @property
    def title(self) -> str:
        return "digits MLP"

    def worker_args(self) -> list[str]:
        return ["--model", self.name, "--hidden", str(self.hidden)]

    def build(self) -> nn.Module:
        return digits_mlp(self.hidden)

    def shards(self, n: int) -> list[dict[str, torch.Tensor]]:
        d = self.data
        return [{"x": d.x_train[i::n].contiguous(), "y": d.y_train[i::n].contiguous()} for i in range(n)]

    def batch_loss(
        self, model: nn.Module, shard: Mapping[str, torch.Tensor], batch_size: int, gen: torch.Generator
    ) -> torch.Tensor:
        x, y = shard["x"], shard["y"]
        idx = torch.randint(0, len(y), (min(batch_size, len(y)),), generator=gen)
        return nn.functional.cross_entropy(model(x[idx]), y[idx])

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """Test loss and accuracy."""
        return evaluate(model, self.data)


class CharTask:
    """A small character-level transformer on Python's bundled pydoc_data text (no download).

    The first 90 % of the text is cut into one contiguous shard per worker; the rest is held out.
    Accuracy is next-character accuracy on fixed held-out windows.
    """

    name = "transformer"
    held_out = 0.1
    eval_windows = 64

    def __init__(self, d_model: int = 128):
        self.d_model = d_model
        text = load_pydoc_text()
        self.vocab = CharVocab.of(text)
        self.tokens = self.vocab.encode(text)
        self.split = int(len(self.tokens) * (1 - self.held_out))

    @property
    def title(self) -> str:
        return f"char transformer (vocab {len(self.vocab)})"

    def worker_args(self) -> list[str]:
        return ["--model", self.name, "--hidden", str(self.d_model)]

    def build(self) -> nn.Module:
        return CharTransformer(len(self.vocab), d_model=self.d_model)

    def shards(self, n: int) -> list[dict[str, torch.Tensor]]:
        bounds = [self.split * i // n for i in range(n + 1)]
        return [{"tokens": self.tokens[bounds[i] : bounds[i + 1]].clone()} for i in range(n)]

    def batch_loss(
        self, model: nn.Module, shard: Mapping[str, torch.Tensor], batch_size: int, gen: torch.Generator
    ) -> torch.Tensor:
        x, y = char_batch(shard["tokens"], batch_size, model.context, gen)
        logits = model(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """Held-out loss and next-character accuracy."""
        held = self.tokens[self.split :]
        x, y = char_batch(held, self.eval_windows, model.context, torch.Generator().manual_seed(0))
        model.eval()
        with torch.no_grad():
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
            acc = (logits.argmax(-1) == y).float().mean().item()
        model.train()
        return loss, acc


#: Tasks by the name ``gradwire demo --model`` takes.
TASKS = {DigitsTask.name: DigitsTask, CharTask.name: CharTask}


def make_task(name: str, hidden: int | None = None):
    """The task called ``name`` (``digits`` or ``transformer``); ``hidden`` is its width if given."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown demo model {name!r}; known: {', '.join(TASKS)}") from None
    if hidden is None:
        return cls()
    return cls(hidden) if cls is DigitsTask else cls(d_model=hidden)
