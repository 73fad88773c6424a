"""All of a simulated run's nodes in one tensor per parameter (``bench/convergence.py --batched``).

``bench/convergence.py`` simulates N nodes by looping over N models: each node's forward, backward and
optimizer step are separate calls. On a GPU that loop is bound by kernel launches (a 64-node step of the
byte LM is a few thousand small kernels), so a 64-node run takes about as long there as on one CPU core.
Here every parameter is one ``[N, ...]`` stack: one ``torch.func.vmap`` call computes every node's loss and
gradient, and one optimizer step moves every node (AdamW is elementwise, so ``torch.optim.AdamW`` on the
stacks is each node's AdamW; Muon orthogonalizes each node's matrix with batched matmuls).

Measured on this repository's 2-core CPU (byte LM, d 64, 8 sequences per node): the vmap call costs about what
the loop does per node (24.7 against 26.5 ms), because a node's batch already fills the caches. The batched
path is for the GPU; on the CPU it gives the looped path's results to float rounding, no faster.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

__all__ = ["BatchedMuon", "NodeBatch", "dense_batched_grads"]


def _muon_defaults() -> dict:
    """``torch.optim.Muon``'s defaults in this torch (Newton–Schulz coefficients, steps, eps), read from it."""
    return torch.optim.Muon([torch.zeros(2, 2)], lr=1.0).defaults


class BatchedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s step on ``[N, A, B]`` stacks, one ``A × B`` matrix per node.

    The same update as the per-node ``torch.optim.Muon`` of :class:`gradwire.torch.MuonAdamW` (momentum 0.95,
    Nesterov, Newton–Schulz in bfloat16 on the wider orientation, each node's matrix scaled by its own norm,
    lr scaled by ``0.2·sqrt(max(A, B))`` to match AdamW's update RMS), with the matmuls batched over the nodes.
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0):
        d = _muon_defaults()
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                weight_decay=weight_decay,
                ns_coefficients=tuple(d["ns_coefficients"]),
                ns_steps=d["ns_steps"],
                eps=d["eps"],
            ),
        )
        for g in self.param_groups:
            for p in g["params"]:
                if p.dim() != 3:
                    raise ValueError(f"BatchedMuon takes [nodes, A, B] stacks, got shape {tuple(p.shape)}")

    @staticmethod
    def orthogonalize(update: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float) -> torch.Tensor:
        """Newton–Schulz on each ``[A, B]`` matrix of ``update`` (``torch.optim.Muon``'s iteration, batched)."""
        a, b, c = coefficients
        x = update.to(dtype=torch.bfloat16, copy=True)
        tall = update.size(-2) > update.size(-1)
        if tall:
            x = x.mT
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)  # bfloat16, as torch's
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.mT if tall else x

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - g["momentum"])
                update = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
                update = self.orthogonalize(update, g["ns_coefficients"], g["ns_steps"], g["eps"])
                rows, cols = p.shape[-2:]
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(update, alpha=-g["lr"] * 0.2 * math.sqrt(max(rows, cols)))
        return None


class NodeBatch:
    """``n`` copies of ``template``'s parameters as ``[n, ...]`` stacks on ``device``, trained together.

    :meth:`grads` sets every stack's ``.grad`` to each node's gradient on its own batch and returns the
    nodes' losses; :meth:`tensors` and :meth:`muon_and_adamw` give the inner optimizers the stacks;
    :meth:`node` reads one node's weights and :meth:`load` sets every node's (after a sync).
    """

    def __init__(self, template: nn.Module, n: int, device: str | torch.device = "cpu"):
        self.n = n
        self.device = torch.device(device)
        self.names = [nm for nm, _ in template.named_parameters()]
        self.stacks = {
            nm: p.detach().to(self.device).unsqueeze(0).repeat(n, *([1] * p.dim())).contiguous()
            for nm, p in template.named_parameters()
        }
        self.buffers = {nm: b.to(self.device) for nm, b in template.named_buffers()}
        self._skeleton = copy.deepcopy(template).to("meta")  # the module structure; weights come from the stacks
        self._template = template

    def forward_fn(self, params: Mapping[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The model as a function of ``x`` with one node's ``params`` (what ``task.loss`` calls as a model)."""
        return lambda x: functional_call(self._skeleton, ({**params, **self.buffers}), (x,))

    def grads(self, loss: Callable, batches: Sequence[tuple]) -> list[float]:
        """Every node's loss on its batch (``loss(model, batch)``, as ``Task.loss``), gradients into ``.grad``."""
        xs, ys = (torch.stack([b[j] for b in batches]).to(self.device) for j in (0, 1))

        def one(params, x, y):
            return loss(self.forward_fn(params), (x, y))

        with warnings.catch_warnings():  # attention has no batching rule yet: it loops over the nodes, correctly
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            g, values = vmap(grad_and_value(one))(self.stacks, xs, ys)
        for nm, t in self.stacks.items():
            t.grad = g[nm]
        return values.detach().cpu().tolist()

    def tensors(self) -> list[torch.Tensor]:
        """The stacks in the template's parameter order (what an elementwise optimizer such as AdamW takes:
        on a stack it is each node's own AdamW)."""
        return [self.stacks[nm] for nm in self.names]

    def muon_and_adamw(self, lr: float, exclude: Sequence[nn.Module] = ()) -> list[torch.optim.Optimizer]:
        """The stacked form of :class:`gradwire.torch.MuonAdamW`: :class:`BatchedMuon` on the matrices that
        :func:`gradwire.torch.muon_split` gives Muon (``exclude`` as there), ``torch.optim.AdamW`` on the rest."""
        from gradwire.torch import muon_split

        matrices, _ = muon_split(self._template, exclude=exclude)
        muon_ids = {id(p) for p in matrices}
        params = dict(self._template.named_parameters())
        muon_names = [nm for nm in self.names if id(params[nm]) in muon_ids]
        others = [self.stacks[nm] for nm in self.names if nm not in muon_names]
        opts: list[torch.optim.Optimizer] = [BatchedMuon([self.stacks[nm] for nm in muon_names], lr=lr)]
        if others:
            opts.append(torch.optim.AdamW(others, lr=lr, weight_decay=0.0))
        return opts

    def node(self, i: int) -> dict[str, torch.Tensor]:
        """Node ``i``'s weights, on the CPU (where the codecs and the frames are)."""
        return {nm: t[i].detach().cpu() for nm, t in self.stacks.items()}

    @torch.no_grad()
    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Every node's weights set to ``weights`` (the synchronized model after an outer step)."""
        for nm, t in self.stacks.items():
            t.copy_(weights[nm].to(self.device).unsqueeze(0).expand_as(t))


def dense_batched_grads(model: nn.Module, loss: Callable, batches: Sequence[tuple]) -> list[float]:
    """Dense training's gradient, batched: the mean of every node's gradient on its own batch (one vmapped
    forward over the nodes with shared weights, one backward) into ``model``'s ``.grad``; the nodes' losses."""
    device = next(model.parameters()).device
    xs, ys = (torch.stack([b[j] for b in batches]).to(device) for j in (0, 1))
    params = {nm: p for nm, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def one(x, y):
        return loss(lambda inp: functional_call(model, ({**params, **buffers}), (inp,)), (x, y))

    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*batching rule.*")
        values = vmap(one)(xs, ys)
        values.mean().backward()
    return values.detach().cpu().tolist()
