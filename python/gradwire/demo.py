"""The local demo: one model trained twice on scikit-learn's digits, dense and compressed.

Both runs use AdamW with the same seed, data order and initial weights. The compressed run passes every
step's gradients through a codec with error feedback, as bytes: encode a bundle frame, decode it, and
step on what was decoded. Bytes per step are frame lengths, so the dense baseline pays the same framing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from .codecs import Codec, IdentityCodec
from .feedback import ErrorFeedback
from .frame import decode_bundle

__all__ = ["DigitsData", "RunResult", "digits_mlp", "load_digits", "train_digits"]


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
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@dataclass
class RunResult:
    label: str
    losses: list[float] = field(default_factory=list)
    bytes_per_step: list[int] = field(default_factory=list)
    test_accuracy: float = 0.0
    test_loss: float = 0.0

    @property
    def mean_bytes_per_step(self) -> float:
        return sum(self.bytes_per_step) / max(1, len(self.bytes_per_step))


def evaluate(model: nn.Module, data: DigitsData) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(data.x_test)
        loss = nn.functional.cross_entropy(logits, data.y_test).item()
        acc = (logits.argmax(1) == data.y_test).float().mean().item()
    model.train()
    return loss, acc


def train_digits(
    codec: Optional[Codec],
    *,
    label: str,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-2,
    seed: int = 0,
    data: Optional[DigitsData] = None,
    progress: bool = True,
    on_step: Optional[Callable[[int, float], None]] = None,
) -> RunResult:
    """Train the digits MLP for ``steps`` AdamW steps; ``codec=None`` sends dense fp32 gradients."""
    data = data or load_digits(seed)
    torch.manual_seed(seed)
    model = digits_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    feedback = ErrorFeedback(codec if codec is not None else IdentityCodec())
    g = torch.Generator().manual_seed(seed + 1)
    result = RunResult(label)
    bar = tqdm(range(steps), desc=label, disable=not progress, leave=False)
    for step in bar:
        idx = torch.randint(0, len(data.y_train), (batch_size,), generator=g)
        loss = nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        frame = feedback.encode_bundle(grads, round=step)
        decoded = decode_bundle(frame)
        for name, p in model.named_parameters():
            p.grad.copy_(decoded[name])
        opt.step()
        result.losses.append(loss.item())
        result.bytes_per_step.append(len(frame))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", bytes=len(frame))
        if on_step is not None:
            on_step(step, loss.item())
    result.test_loss, result.test_accuracy = evaluate(model, data)
    return result
