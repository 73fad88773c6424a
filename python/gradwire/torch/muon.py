"""Muon on a model's hidden matrices and AdamW on the rest, as one ``torch.optim.Optimizer``: an inner
optimizer for :class:`gradwire.torch.SparseLoCo` (MuLoCo) that takes one lr and one lr scheduler.

Why it is here: with AdamW as the inner optimizer the averaged pseudo-gradient of many nodes loses to dense
AdamW as the node count grows (docs/reencode-design.md, "The local-step floor"). With Muon's orthogonalized
steps on the weight matrices, one bit both ways at 16 nodes comes within 2 % of dense AdamW's held-out loss
(docs/reencode-design.md, "The codec is not the gap"). The optimizers themselves are torch's
(``torch.optim.Muon``, ``torch.optim.AdamW``); this module only splits the parameters and joins the two.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["MuonAdamW", "muon_split"]


def muon_split(model: nn.Module, exclude: Sequence[nn.Module] = ()) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(matrices, others)``: the trainable parameters Muon should take — every 2-D weight matrix outside an
    ``nn.Embedding`` and outside the modules in ``exclude`` (the output head, as Muon's authors advise) — and all
    the others (embeddings, biases, norms, the head, convolution kernels), each once (a tied weight is listed
    once, with AdamW if any module it belongs to is an embedding or excluded)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"muon_split takes an nn.Module, got {type(model).__name__}")
    adamw_ids = set()
    for m in model.modules():
        if isinstance(m, nn.Embedding) or any(m is e for e in exclude):
            adamw_ids.update(id(p) for p in m.parameters())
    for e in exclude:
        if not any(e is m for m in model.modules()):
            raise ValueError(f"exclude names a {type(e).__name__} that is not a submodule of the model")
    matrices, others, seen = [], [], set()
    for p in model.parameters():  # model.parameters() already lists a shared parameter once
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (matrices if p.dim() == 2 and id(p) not in adamw_ids else others).append(p)
    if not matrices:
        raise ValueError("muon_split: the model has no weight matrix for Muon outside embeddings and exclude")
    return matrices, others


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``matrices`` and ``torch.optim.AdamW`` on ``others``, stepped together.

    Muon's lr is scaled to match AdamW's update RMS (``adjust_lr_fn="match_rms_adamw"``), so one ``lr``
    serves both. ``param_groups`` are the two optimizers' own group dicts (Muon's first), so an lr scheduler
    built on this optimizer — or :class:`gradwire.torch.SparseLoCo` handed it as ``inner`` — sets the lr
    both use. ``state`` reads both optimizers' per-parameter state; ``state_dict()`` holds both.

    >>> matrices, others = muon_split(model, exclude=[model.head])          # doctest: +SKIP
    >>> inner = MuonAdamW(matrices, others, lr=1e-2)                        # doctest: +SKIP
    """

    def __init__(
        self,
        matrices: Iterable[nn.Parameter],
        others: Iterable[nn.Parameter],
        *,
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"MuonAdamW needs torch.optim.Muon (torch >= 2.9); this torch is {torch.__version__}")
        matrices, others = list(matrices), list(others)
        flat = [p for p in matrices if p.dim() != 2]
        if flat:
            raise ValueError(
                f"Muon takes 2-D matrices; got a parameter of shape {tuple(flat[0].shape)} "
                f"(reshape it, or give it to AdamW with others)"
            )
        if not matrices:
            raise ValueError("MuonAdamW needs at least one matrix for Muon")
        if {id(p) for p in matrices} & {id(p) for p in others}:
            raise ValueError("a parameter is in both matrices and others")
        self.muon = torch.optim.Muon(
            matrices,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = (
            torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps) if others else None
        )
        parts = [self.muon] + ([self.adamw] if self.adamw is not None else [])
        self._parts = None
        super().__init__([p for o in parts for g in o.param_groups for p in g["params"]], {"lr": lr})
        # The two optimizers' own dicts: a scheduler's writes to these groups reach the steps they take.
        self.param_groups = [g for o in parts for g in o.param_groups]
        self.state = ChainMap(*(o.state for o in parts))  # type: ignore[assignment]
        self._parts: list[torch.optim.Optimizer] | None = parts

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_parts", None) is None:  # torch.optim.Optimizer.__init__ adds the first group
            return super().add_param_group(param_group)
        raise ValueError("MuonAdamW's groups are its two optimizers' own: build a new MuonAdamW to add parameters")

    def step(self, closure: Callable[[], Any] | None = None):
        """One step of each half; ``closure`` (if any) is evaluated once, by the first."""
        loss = self._parts[0].step(closure)
        for o in self._parts[1:]:
            o.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"matrices": self.muon.state_dict(), "others": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"matrices", "others"}:
            raise ValueError(f"not a MuonAdamW state dict: keys {sorted(state_dict)}")
        if (state_dict["others"] is None) != (self.adamw is None):
            raise ValueError("the saved MuonAdamW and this one differ in whether AdamW has parameters")
        self.muon.load_state_dict(state_dict["matrices"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["others"])
        # load_state_dict replaces each optimizer's groups with new dicts: take them up again.
        self.param_groups = [g for o in self._parts for g in o.param_groups]
        self.state = ChainMap(*(o.state for o in self._parts))  # type: ignore[assignment]
