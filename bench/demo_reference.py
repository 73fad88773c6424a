"""DeMo's reference implementation (bloc97/DeMo ``demo.py``), rewritten here op for op for the benches.

The benches compare gradwire against what a user would otherwise run: ``demo.py``'s ``TransformDCT``,
``CompressDCT`` and ``DeMo`` optimizer. This module is our own code (no copy of ``demo.py``, and no
``einops``: its rearranges are reshapes), doing the same tensor operations in the same order, so that a
time measured here is the reference's time:

- :class:`TransformDCT`: per dimension size, the largest divisor ≤ the target chunk (64) as the chunk side;
  a 2-D tensor is cut into tiles and transformed by one einsum with the DCT matrix on each side, a 1-D
  tensor into rows transformed by one einsum; the inverse is the same with the inverse matrix.
- :func:`compress`: top-k of ``|x|`` per chunk (``sorted=False``) and a gather of the values: int64
  indices, float values; :func:`decompress`: a ``scatter_reduce_`` mean into zeros;
  :func:`batch_decompress`: every rank's payload concatenated, then :func:`decompress`.
- :class:`DeMoReference`: ``demo.py``'s ``DeMo`` (a ``torch.optim.SGD`` with ``foreach=False`` and no
  momentum): per parameter, decay the delta, add ``lr·grad``, compress, subtract the transmit estimate,
  all-gather indices and values (``torch.distributed`` when a group is initialized), decode the mean of all
  ranks' payloads, take its sign as the gradient; then SGD's step.
- :class:`CodecReference`: the codec alone for one 2-D tensor, as ``bench/dct_codec.py`` times it.

The DCT matrices come from :func:`gradwire.dct.dct_basis` (``demo.py`` builds the same orthonormal
matrices with an FFT once at construction; how they are built is not part of a step).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from gradwire.dct import dct_basis


def smaller_split(n: int, close_to: int) -> int:
    """The largest divisor of ``n`` that is at most ``close_to`` (``demo.py``'s ``_get_smaller_split``)."""
    return max(d for d in range(1, min(n, close_to) + 1) if n % d == 0)


class TransformDCT:
    """The chunked 2-D / 1-D DCT of ``demo.py``: forward matrices ``f`` (= Dᵀ) and inverse ``b`` (= D)
    per chunk side, for every dimension size of ``shapes``."""

    def __init__(self, shapes: Iterable[tuple[int, ...]], target_chunk: int, device, dtype=torch.float32):
        self.side: dict[int, int] = {}
        self.f: dict[int, torch.Tensor] = {}
        self.b: dict[int, torch.Tensor] = {}
        for shape in shapes:
            for s in shape:
                sc = smaller_split(s, target_chunk)
                self.side[s] = sc
                if sc not in self.f:
                    d = dct_basis(sc, device).to(dtype)
                    self.f[sc], self.b[sc] = d.T.contiguous(), d.contiguous()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 1:
            n1, n2 = self.side[x.shape[0]], self.side[x.shape[1]]
            t = x.reshape(x.shape[0] // n1, n1, x.shape[1] // n2, n2)  # "(y h) (x w) -> y h x w"
            return torch.einsum("...ijkl, jb, ld -> ...ikbd", t, self.f[n1], self.f[n2])
        n1 = self.side[x.shape[0]]
        return torch.einsum("...ij, jb -> ...ib", x.reshape(-1, n1), self.f[n1])  # "(x w) -> x w"

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        if c.dim() > 2:
            t = torch.einsum("...ijkl, kb, ld -> ...ibjd", c, self.b[c.shape[2]], self.b[c.shape[3]])
            return t.reshape(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])  # "y h x w -> (y h) (x w)"
        t = torch.einsum("...ij, jb -> ...ib", c, self.b[c.shape[1]])
        return t.reshape(-1)  # "x w -> (x w)"


def compress(c: torch.Tensor, topk: int):
    """``(idx, val, xshape, totalk)``: the ``topk`` largest ``|c|`` of each chunk (unsorted), gathered."""
    xshape = c.shape
    flat = c.reshape(*xshape[:2], -1) if c.dim() > 2 else c  # "y x h w -> y x (h w)"
    totalk = flat.shape[-1]
    topk = max(1, min(topk, totalk))
    idx = torch.topk(flat.abs(), k=topk, dim=-1, largest=True, sorted=False).indices
    return idx, torch.gather(flat, -1, idx), xshape, totalk


def decompress(p: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, xshape, totalk: int) -> torch.Tensor:
    x = torch.zeros(xshape, device=p.device, dtype=p.dtype)
    if len(xshape) > 2:
        x = x.reshape(*xshape[:2], -1)  # "y x h w -> y x (h w)"
    x.scatter_reduce_(dim=-1, index=idx, src=val, reduce="mean", include_self=False)
    if len(xshape) > 2:
        x = x.reshape(xshape)  # "y x (h w) -> y x h w"
    return x


def batch_decompress(p: torch.Tensor, idx: list, val: list, xshape, totalk: int) -> torch.Tensor:
    idx_all = torch.cat(idx, dim=-1).to(device=p.device)
    val_all = torch.cat(val, dim=-1).to(device=p.device)
    return decompress(p, idx_all, val_all, xshape, totalk)


class DeMoReference(torch.optim.SGD):
    """``demo.py``'s ``DeMo`` optimizer (its defaults: decay 0.999, top-32 of each 64×64 chunk)."""

    def __init__(
        self,
        params,
        lr: float,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        process_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(
            params, lr=lr, foreach=False, momentum=0.0, dampening=0.0, nesterov=False, maximize=False, weight_decay=0.0
        )
        self.compression_decay = compression_decay
        self.compression_topk = compression_topk
        self.weight_decay = weight_decay
        self.process_group = process_group
        self.demo_state: dict = {}
        live = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        for p in live:
            self.demo_state[p] = {"step": 0, "delta": torch.zeros_like(p)}
        device = live[0].device if live else torch.device("cpu")
        dtype = live[0].dtype if live else torch.float32
        self.transform = TransformDCT([tuple(p.shape) for p in live], compression_chunk, device, dtype)
        self.data_transmit = self.data_receive = 0

    def _all_gather(self, idx: torch.Tensor, val: torch.Tensor):
        if not (dist.is_available() and dist.is_initialized()):
            return [idx], [val]
        world = dist.get_world_size(self.process_group)
        idx_list = [torch.zeros_like(idx) for _ in range(world)]
        val_list = [torch.zeros_like(val) for _ in range(world)]
        h1 = dist.all_gather(idx_list, idx, group=self.process_group, async_op=True)
        h2 = dist.all_gather(val_list, val, group=self.process_group, async_op=True)
        h1.wait()
        h2.wait()
        return idx_list, val_list

    @torch.no_grad()
    def step(self, closure=None):
        self.data_transmit = self.data_receive = 0
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = self.demo_state[p]
                state["step"] += 1
                if self.weight_decay != 0.0:
                    p.data.mul_(1.0 - lr * self.weight_decay)
                if self.compression_decay != 1:
                    state["delta"].mul_(self.compression_decay)
                state["delta"].add_(p.grad, alpha=lr)
                idx, val, xshape, totalk = compress(self.transform.encode(state["delta"]), self.compression_topk)
                transmit = self.transform.decode(decompress(p, idx, val, xshape, totalk))
                state["delta"].sub_(transmit)
                idx_all, val_all = self._all_gather(idx, val)
                self.data_transmit += idx.nbytes + val.nbytes
                self.data_receive += sum(i.nbytes + v.nbytes for i, v in zip(idx_all, val_all))
                new_grad = self.transform.decode(batch_decompress(p, idx_all, val_all, xshape, totalk))
                if p.grad is None:
                    p.grad = new_grad
                else:
                    p.grad.copy_(new_grad)
                p.grad.sign_()
        return super().step(closure)

    @property
    def bytes_sent(self) -> int:
        """The last step's payload bytes (int64 indices and values), as ``demo.py`` logs them."""
        return self.data_transmit


class CodecReference:
    """The codec of ``demo.py`` for one 2-D tensor, as ``bench/dct_codec.py`` times it."""

    def __init__(self, shape: tuple[int, int], chunk: int, device: torch.device):
        self.transform = TransformDCT([shape], chunk, device)
        self.shape = shape

    def send(self, x: torch.Tensor, k: int):
        """What ``step()`` does to send ``x``: the payload and the transmit estimate."""
        idx, val, xshape, totalk = compress(self.transform.encode(x), k)
        estimate = self.transform.decode(decompress(x, idx, val, xshape, totalk))
        return (idx, val, xshape, totalk), estimate

    def receive(self, payload) -> torch.Tensor:
        idx, val, xshape, totalk = payload
        return self.transform.decode(decompress(payload[1], idx, val, xshape, totalk))
