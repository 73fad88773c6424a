"""Real gradients to measure codecs on (for the benchmarks and experiments); no downloads.

:func:`collect_gradients` trains one of the demo's models briefly with AdamW and records the gradients
of a few steps, so that codecs are measured on gradients with the structure of real ones (heavy-tailed
values, low-rank matrices, layers of very different scales) rather than on Gaussian noise:

- ``"digits"``: the MLP of :mod:`gradwire_apps.demo.tasks` on scikit-learn's bundled 8×8 digits;
- ``"char_transformer"``: :class:`~gradwire_apps.demo.tasks.CharTransformer` on the text of Python's own
  ``pydoc_data.topics``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .demo.tasks import CharTransformer, CharVocab, char_batch, digits_mlp, load_digits, load_pydoc_text
from .progress import progress as progress_bar

__all__ = ["MODELS", "collect_gradients"]

#: Names :func:`collect_gradients` knows.
MODELS = ("digits", "char_transformer")


def _digits_task(seed: int, batch: int) -> tuple[nn.Module, Callable[[torch.Generator], torch.Tensor]]:
    data = load_digits(seed)
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
    device: torch.device | str | None = None,
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
    bar = progress_bar(range(steps), desc=f"gradients of {model_name}", unit="step", enabled=progress, leave=False)
    for step in bar:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(g, dev)
        loss.backward()
        if (step + 1) % record_every == 0:
            recorded.append(
                {
                    n: p.grad.detach().to(torch.float32).clone()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
            )
        opt.step()
        bar.set_postfix_str(f"train loss {loss.item():.3f}")  # this batch's
    return recorded
