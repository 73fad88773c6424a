"""What one optimizer step asks of a GPU, counted on the CPU: dispatched operations, host round trips, float64 bytes.

A GPU step is slow when it launches many small kernels, when it waits on copies between the device and the
host, and when it computes in float64 (1/64 of the float32 rate on consumer GPUs). This bench counts all
three for ONE step of each optimizer, without a GPU, by running the library's **device code path** on the
CPU:

- :class:`EmulatedDevice` (a ``TorchFunctionMode``) marks the model's tensors as "on the device": they
  report ``device == cuda:0`` (``is_cuda``, ``is_cpu`` likewise), so every ``x.device.type != "cpu"`` test
  in the library takes the branch it takes on a GPU. ``device=cuda`` arguments of factory functions and
  ``.to()`` are rewritten to the CPU, and every result computed from a device tensor (or created for the
  device) is marked as on the device in turn, so the mark follows the data as a GPU's placement would.
  No library switch is needed: the library's own device tests decide, wherever they are.
- It counts each **device-to-host copy** (``.cpu()``, ``.to("cpu")``, ``.numpy()``, ``np.asarray``,
  ``.item()``, ``.tolist()``, ``float()``/``int()``/``bool()`` of a device tensor, ``torch.equal``,
  ``copy_`` into a host tensor) and each **host-to-device copy** (``.to(device)``/``.cuda()`` of a host
  tensor, ``torch.tensor``/``as_tensor`` of host data for the device, ``copy_`` from a host tensor). A
  ``.numpy()`` of a device tensor would raise on a GPU; it is counted as a copy and listed apart.
- :class:`OpCounter` (a ``TorchDispatchMode``) counts the aten operations dispatched while a device
  computation runs (each is a kernel launch on a GPU; host-side bookkeeping such as AdamW's CPU step
  counters is not counted) and the bytes of float64 they write (view ops write nothing).

Rows: ``torch.optim.AdamW`` (foreach), DeMo's reference (``bench/demo_reference.py``), gradwire's DeMo,
gradwire's SparseLoCo local step, sync step and the mean over its cycle of 8. Cases: models of N
``nn.Linear(W, W)`` layers with biases (``--cases 10x128,100x128``: 10 and 100 tensors; ``20x1024`` is the
issue's 10.5 M-parameter, 50-record model). One process, no process group: the optimizers run as a group of
one, so their exchange writes, reads and decodes every frame but no collective moves bytes (a multi-rank
NCCL group adds the collectives' own copies of the frames).

Targets printed as met / missed lines: operations per step at 100 tensors ≤ 1.2× those at 10 tensors; at
most 2 host transfers per exchange phase (one copy of the packed payload to the host, one of what arrives
back to the device; the sharded exchange has 2 phases per DeMo step or SparseLoCo sync, a local step none);
0 float64 bytes on the device path.

Usage: python bench/step_ops.py [--cases 10x128,100x128] [--rows adamw,reference,demo,sparseloco] [--top N]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gradwire.torch as gt
from demo_reference import DeMoReference  # bench/ is the script's folder, first on sys.path
from gradwire.dct import set_exact_decode

DEVICE = torch.device("cuda", 0)
HOST = torch.device("cpu")
_TAG = "_step_ops_on_device"
_GETTERS = {
    torch._C.TensorBase.device: "device",
    torch._C.TensorBase.is_cuda: "is_cuda",
    torch._C.TensorBase.is_cpu: "is_cpu",
}
#: Calls that bring a device tensor's data to the host (a copy and a sync on a GPU).
_TO_HOST = {
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__array__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.equal,
    torch.allclose,
    torch.is_nonzero,
}
_NUMPY = {torch.Tensor.numpy, torch.Tensor.__array__}


def _caller() -> str:
    """``module:line`` of the innermost library (or bench) frame that made the call."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if ("/gradwire/" in name or "demo_reference" in name) and "step_ops" not in name:
            return f"{name.split('/python/')[-1].split('/bench/')[-1]}:{f.f_lineno}"
        f = f.f_back
    return "?"


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _TAG, False)


def mark(t: torch.Tensor, where: bool = True) -> torch.Tensor:
    setattr(t, _TAG, where)
    return t


def _as_device(d):
    """``True`` for a device argument naming the (emulated) device, ``False`` for the host, else ``None``."""
    if isinstance(d, torch.device):
        return d.type != "cpu"
    if isinstance(d, str):
        try:
            return torch.device(d).type != "cpu"
        except RuntimeError:
            return None
    return None


@dataclass
class Counts:
    ops: int = 0
    views: int = 0
    f64_bytes: int = 0
    d2h: int = 0
    h2d: int = 0
    numpy_on_device: int = 0
    by_op: collections.Counter = field(default_factory=collections.Counter)
    transfers: collections.Counter = field(default_factory=collections.Counter)
    f64_sites: collections.Counter = field(default_factory=collections.Counter)  # bytes by op and caller

    def scaled(self, other: Counts, a: float, b: float) -> Counts:
        """``a·self + b·other`` (a cycle's mean of two kinds of step)."""
        out = Counts()
        for f in ("ops", "views", "f64_bytes", "d2h", "h2d", "numpy_on_device"):
            setattr(out, f, a * getattr(self, f) + b * getattr(other, f))
        return out


class EmulatedDevice(TorchFunctionMode):
    """Tensors marked with :func:`mark` behave as on ``cuda:0`` for the library's device tests; see the module
    docstring. ``counts`` is where copies are tallied while ``counting`` is set."""

    def __init__(self):
        super().__init__()
        self.counts = Counts()
        self.counting = False
        self.device_call = False  # whether the torch call now running computes on the device

    def _copy(self, kind: str, func) -> None:
        if self.counting:
            setattr(self.counts, kind, getattr(self.counts, kind) + 1)
            self.counts.transfers[f"{kind} {getattr(func, '__name__', func)} at {_caller()}"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__name__", "") == "__get__" and getattr(func, "__self__", None) in _GETTERS:
            what, dev = _GETTERS[func.__self__], on_device(args[0])
            return (DEVICE if dev else HOST) if what == "device" else (dev if what == "is_cuda" else not dev)
        flat, _ = tree_flatten((args, kwargs))
        src_dev = any(on_device(t) for t in flat)
        target = None
        if "device" in kwargs:
            target = _as_device(kwargs["device"])
            if target:
                kwargs["device"] = HOST
        if func is torch.Tensor.to:
            rest = []
            for a in args[1:]:
                d = _as_device(a)
                if isinstance(a, torch.Tensor):
                    d = on_device(a)
                if d is not None:
                    target = d
                    if isinstance(a, (torch.device, str)):
                        a = HOST
                rest.append(a)
            args = (args[0], *rest)
            if target is True and not on_device(args[0]):
                self._copy("h2d", func)
            elif target is False and on_device(args[0]):
                self._copy("d2h", func)
        elif func is torch.Tensor.cuda:
            target = True
            if not on_device(args[0]):
                self._copy("h2d", func)
            func, args, kwargs = torch.Tensor.clone, (args[0],), {}
        elif func in (torch.tensor, torch.as_tensor) and target:
            if not on_device(args[0] if args else kwargs.get("data")):
                self._copy("h2d", func)
        elif func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            if on_device(dst) and isinstance(src, torch.Tensor) and not on_device(src):
                self._copy("h2d", func)
            elif not on_device(dst) and on_device(src):
                self._copy("d2h", func)
        elif func in _TO_HOST and src_dev:
            self._copy("d2h", func)
            if func in _NUMPY and self.counting:
                self.counts.numpy_on_device += 1
        if func in (torch.Tensor.cpu, torch.from_numpy, torch.frombuffer):
            target = False
        before, self.device_call = self.device_call, (target is True) or (target is None and src_dev)
        try:
            out = func(*args, **kwargs)
        finally:
            self.device_call = before
        where = target if target is not None else src_dev
        first = args[0] if args else None
        if out is first and isinstance(out, torch.Tensor) and target is not None and on_device(out) != target:
            # A copy between host and device; on the CPU .cpu() / .to() hand back the same tensor.
            out = out.clone()
        if where or target is False:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t is not first:
                    mark(t, bool(where))
        return out


class OpCounter(TorchDispatchMode):
    """Counts the aten operations of device computations (see :class:`EmulatedDevice`) and their float64 bytes."""

    def __init__(self, emu: EmulatedDevice):
        super().__init__()
        self.emu = emu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        emu = self.emu
        if emu.counting and emu.device_call:
            c = emu.counts
            c.by_op[func.overloadpacket.__name__] += 1
            if func.is_view:
                c.views += 1  # metadata only: no kernel, no bytes
            else:
                c.ops += 1
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                        c.f64_bytes += t.numel() * 8
                        c.f64_sites[f"{func.overloadpacket.__name__} at {_caller()}"] += t.numel() * 8
            if func is torch.ops.aten._local_scalar_dense.default:
                c.transfers["aten._local_scalar_dense"] += 1
        return out


@contextlib.contextmanager
def emulated_device():
    """Within the block, tensors :func:`mark` ed take the device path; yields the :class:`EmulatedDevice`."""
    emu = EmulatedDevice()
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: 0  # the emulated device is cuda:0
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        with emu, OpCounter(emu):
            yield emu
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


@contextlib.contextmanager
def counting(emu: EmulatedDevice):
    """Count into a fresh :class:`Counts` within the block (read it from ``emu.counts`` afterwards)."""
    emu.counts, emu.counting = Counts(), True
    try:
        yield emu.counts
    finally:
        emu.counting = False


def build_model(tensors: int, width: int) -> nn.Module:
    """``tensors // 2`` layers ``nn.Linear(width, width)`` with biases, marked as on the device."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(max(1, tensors // 2))))
    for p in model.parameters():
        mark(p)
        p.grad = mark(torch.randn(p.shape) * 1e-3)
    return model


#: Per row: the optimizer, and the exchange phases of one step (each may copy to the host and back once).
ROWS = ("adamw", "reference", "demo", "sparseloco")


def _optimizer(row: str, model: nn.Module):
    params = list(model.parameters())
    if row == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if row == "reference":
        return DeMoReference(params, lr=1e-3)
    if row == "demo":
        return gt.DeMo(params, lr=1e-3)
    return gt.SparseLoCo(params, torch.optim.AdamW(params, lr=1e-3, foreach=True))


def _phases(opt) -> int:
    return 2 if getattr(opt, "exchange", None) == "sharded" else 1


def count_case(tensors: int, width: int, rows=ROWS) -> list[dict]:
    """One step of each row on a fresh model of ``tensors`` tensors, counted; SparseLoCo gives three rows."""
    out = []
    with emulated_device() as emu:
        for row in rows:
            model = build_model(tensors, width)
            opt = _optimizer(row, model)
            base = dict(tensors=tensors, width=width, numel=sum(p.numel() for p in model.parameters()))
            if row != "sparseloco":
                opt.step()  # warm-up: state allocated, caches filled
                with counting(emu) as c:
                    opt.step()
                phases = _phases(opt) if row == "demo" else 0  # the reference's all-gathers are collectives
                records = len(opt._pieces) if getattr(opt, "_pieces", None) is not None else tensors
                out.append(dict(base, row=row, counts=c, phases=phases, records=records))
                continue
            cycle = opt.sync_every
            for _ in range(cycle + 1):  # a whole cycle and one local step of warm-up
                opt.step()
            with counting(emu) as local:
                opt.step()
            for _ in range(cycle - 3):
                opt.step()
            with counting(emu) as sync:
                opt.step()  # the cycle's last step: the sync
            assert opt.syncs == 2, opt.syncs
            records = len(opt._pieces) if opt._pieces is not None else tensors
            out.append(dict(base, row="sparseloco_local", counts=local, phases=0, records=records))
            out.append(dict(base, row="sparseloco_sync", counts=sync, phases=_phases(opt), records=records))
            mean = local.scaled(sync, (cycle - 1) / cycle, 1 / cycle)
            out.append(dict(base, row="sparseloco_mean", counts=mean, phases=_phases(opt) / cycle, records=records))
    return out


NAMES = {
    "adamw": "torch AdamW (foreach)",
    "reference": "DeMo reference (demo.py)",
    "demo": "gradwire DeMo",
    "sparseloco_local": "gradwire SparseLoCo, local step",
    "sparseloco_sync": "gradwire SparseLoCo, sync step",
    "sparseloco_mean": "gradwire SparseLoCo, mean step (1 sync in 8)",
}


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def table(results: list[dict]) -> list[str]:
    lines = [
        "| tensors | parameters | records | optimizer | ops / step | view ops | D2H copies | H2D copies | "
        "exchange phases | float64 bytes written |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        c = r["counts"]
        lines.append(
            f"| {r['tensors']} | {r['numel'] / 1e6:.2f} M | {r['records']} | {NAMES[r['row']]} | "
            f"{_num(c.ops)} | {_num(c.views)} | {_num(c.d2h)} | {_num(c.h2d)} | {_num(r['phases'])} | "
            f"{_num(c.f64_bytes)} |"
        )
    return lines


def targets(results: list[dict]) -> list[str]:
    out = []
    by = {(r["tensors"], r["width"], r["row"]): r for r in results}
    sizes = sorted({(r["tensors"], r["width"]) for r in results})
    for t, w in sizes:
        for t2, w2 in sizes:
            if w2 == w and t2 == 10 * t:
                for row in NAMES:
                    if row in ("adamw", "reference") or (t, w, row) not in by:
                        continue
                    a, b = by[(t, w, row)]["counts"].ops, by[(t2, w, row)]["counts"].ops
                    ratio = b / a if a else float("inf")
                    out.append(
                        f"target ops per step, {t2} tensors / {t} tensors, {NAMES[row]}: {ratio:.2f}× "
                        f"({_num(b)} / {_num(a)}; ≤ 1.2×) — {'met' if ratio <= 1.2 else 'missed'}"
                    )
    for r in results:
        if r["row"] in ("adamw", "reference", "sparseloco_mean"):
            continue
        c, phases = r["counts"], r["phases"]
        label = f"{NAMES[r['row']]}, {r['tensors']} tensors"
        moved = c.d2h + c.h2d
        out.append(
            f"target host transfers, {label}: {_num(moved)} in {_num(phases)} phase(s) (≤ 2 per phase) — "
            f"{'met' if moved <= 2 * phases else 'missed'}"
        )
        out.append(
            f"target float64 bytes on the device path, {label}: {_num(c.f64_bytes)} (0) — "
            f"{'met' if c.f64_bytes == 0 else 'missed'}"
        )
    return out


def parse_cases(text: str) -> list[tuple[int, int]]:
    out = []
    for token in filter(None, text.split(",")):
        t, _, w = token.partition("x")
        out.append((int(t), int(w)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases",
        default="10x128,100x128",
        help="TENSORSxWIDTH, comma-separated (20x1024: the issue's 10.5 M-parameter model)",
    )
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--top", type=int, default=0, help="also list each row's N most frequent operations and its copies")
    ap.add_argument(
        "--exact-decode",
        choices=("integer", "float64"),
        default="integer",
        help="the exact decode's route on the device path (a GPU measures both and keeps the faster: "
        "gradwire.dct.route_choice; the emulated device cannot, so the bench names one)",
    )
    a = ap.parse_args()
    set_exact_decode(a.exact_decode)
    rows = a.rows.split(",")
    for r in rows:
        if r not in ROWS:
            ap.error(f"unknown row {r!r}; one of {', '.join(ROWS)}")
    results = []
    for tensors, width in parse_cases(a.cases):
        print(f"counting {tensors} tensors of width {width} …", flush=True)
        results += count_case(tensors, width, rows)
    lines = (
        [
            "One step of each optimizer, the device code path run on the CPU (bench/step_ops.py), "
            f"torch {torch.__version__}, the exact decode by its {a.exact_decode} route.",
            "",
        ]
        + table(results)
        + [""]
        + targets(results)
    )
    print("\n".join(lines))
    bad = [r for r in results if r["counts"].numpy_on_device]
    for r in bad:
        print(
            f"note: {NAMES[r['row']]} ({r['tensors']} tensors) called .numpy() on a device tensor "
            f"{_num(r['counts'].numpy_on_device)} times (a GPU would raise; counted as copies)"
        )
    if a.top:
        for r in results:
            c = r["counts"]
            if not hasattr(c, "by_op") or not c.by_op:
                continue
            print(
                f"\n{NAMES[r['row']]}, {r['tensors']} tensors: "
                + ", ".join(f"{n} {k}" for n, k in c.by_op.most_common(a.top))
            )
            if c.transfers:
                print("  copies: " + ", ".join(f"{n} ×{k}" for n, k in c.transfers.most_common()))
            if c.f64_sites:
                print("  float64 bytes: " + ", ".join(f"{n} {_num(k)}" for n, k in c.f64_sites.most_common(a.top)))


if __name__ == "__main__":
    main()
