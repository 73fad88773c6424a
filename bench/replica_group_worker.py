"""One replica group of the fault-tolerant tests and bench (a process of its own): a small regression model
trained with SparseLoCo (or, with ``algorithm`` ``"demo"``, DeMo: a round every step) under
gradwire.torch.FaultTolerant, one JSON line per committed round.

``python bench/replica_group_worker.py '<json>'``: ``lighthouse``, ``replica_id``, ``log`` (the JSON-lines
file), ``stop`` (a file holding the step to stop at), ``timeouts`` (ReplicaTimeouts fields), ``sync_every``,
``pause`` (seconds slept per step), ``seed`` (this group's data), ``groups`` (the full membership),
``width``/``depth`` (the MLP's hidden width and layers), ``exchange`` (``"all_gather"``, the default, or
``"sharded"``, its pieces cut for ``cut_for`` groups, default ``groups``), ``algorithm`` (``"sparseloco"``,
the default, or ``"demo"``, with ``lr`` its learning rate), ``leave_at`` (leave cleanly once the run has
committed that many rounds: a membership change without a fault); counted
in rounds of the full membership from this process's start: ``die_at_sync`` (SIGKILL itself inside that
round's exchange, after the lengths went out), ``die_at_step`` (SIGKILL itself at that step after the first
such round), ``hostile_at`` (send garbage instead of its frame in that round); ``wait_for``: a file this
process waits for, imported and built, before it joins (a warm standby).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions

from gradwire.torch import DeMo, FaultTolerant, ReplicaTimeouts, SparseLoCo
from gradwire.torch.state_bytes import state_to_bytes


def model_hash(module: nn.Module, opt: SparseLoCo | DeMo) -> str:
    """The weights' hash, with SparseLoCo's anchor (DeMo's momenta are each group's own: not hashed)."""
    h = hashlib.sha256()
    anchor = list(opt.node.anchor.values()) if isinstance(opt, SparseLoCo) else []
    for t in list(module.state_dict().values()) + anchor:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(cfg: dict) -> None:
    module = build_model(cfg)
    exchange = cfg.get("exchange", "all_gather")
    if cfg.get("algorithm", "sparseloco") == "demo":
        opt = DeMo(module.parameters(), lr=cfg.get("lr", 3e-3), exchange=exchange)
    else:
        inner = torch.optim.AdamW(module.parameters(), lr=1e-2)
        opt = SparseLoCo(module, inner, sync_every=cfg.get("sync_every", 2), exchange=exchange)
    if cfg.get("wait_for"):  # a warm standby: imported and built, it joins once the file appears
        with open(cfg["log"], "a") as log:
            log.write(json.dumps({"replica": cfg["replica_id"], "pid": os.getpid(), "standby": time.time()}) + "\n")
        while not os.path.exists(cfg["wait_for"]):
            time.sleep(0.01)
    ft = FaultTolerant(
        opt,
        module,
        lighthouse=cfg["lighthouse"],
        replica_id=cfg["replica_id"],
        timeouts=ReplicaTimeouts(**cfg["timeouts"]),
        min_replicas=cfg.get("min_replicas", 1),
        groups=cfg.get("cut_for", cfg.get("groups")) if exchange == "sharded" else None,
    )
    ex = ft.exchange
    log = open(cfg["log"], "a")

    def write(row: dict) -> None:
        log.write(json.dumps({"replica": cfg["replica_id"], "pid": os.getpid(), **row}) + "\n")
        log.flush()

    write(
        {
            "ready": time.time(),
            "state_bytes": len(state_to_bytes(ft._state())),
            "model_bytes": 4 * sum(p.numel() for p in module.parameters()),
        }
    )
    # Faults count what this process saw, in rounds of the full membership (``groups`` groups): a restarted or
    # late process heals to the others' step, so the step itself says nothing about when it is.
    full = cfg.get("groups", 1)
    seen = {"rounds": 0, "steps": 0, "hostile": None}
    if exchange == "sharded":
        hook_sharded(ex, cfg, full, seen, write, ft)
    else:
        hook_all_gather(ex, cfg, full, seen, write, ft)
    gen = torch.Generator().manual_seed(1000 + 10 * cfg.get("run_seed", 0) + cfg.get("seed", 0))
    w_true = torch.linspace(-1, 1, 16)
    started = time.time()
    last = ft.commits
    while True:
        try:
            stop = int(open(cfg["stop"]).read())
        except (OSError, ValueError):
            stop = None
        if stop is not None and ft.commits >= stop and ft.at_interval_start():
            break
        leave = cfg.get("leave_at")
        if leave is not None and ft.commits >= leave and ft.at_interval_start():
            write({"left": time.time(), "step": ft.commits})  # between quorums: the others drop it at their next
            ft.shutdown()
            log.close()
            return
        batch_loss(module, gen, w_true).backward()
        ft.step()
        ft.zero_grad()
        if seen["rounds"] >= 1:
            seen["steps"] += 1
            if seen["steps"] == cfg.get("die_at_step"):  # between syncs (a step that does not send)
                write({"died": time.time(), "step": ft.commits})
                os.kill(os.getpid(), signal.SIGKILL)
        if ft.commits != last and ft.at_interval_start():
            last = ft.commits
            row = {
                "step": ft.commits,
                "hash": model_hash(module, opt),
                "groups": ft.manager.num_participants(),
                "kept": ex.kept_last,
                "refused_steps": sorted({step for step, _, _ in ex.refusals}),
                "hostile_step": seen["hostile"],
                "healed": ft.healed,
                "time": time.time(),
                "since_start": time.time() - started,
                "downloaded": ft.transport.bytes_downloaded,
                "bytes_sent": ex.bytes_sent,
                "bytes_received": ex.bytes_received,
                "local_steps": opt.steps,
                "raw_state": raw_state_bytes(ft._state()),
            }
            write(row)
        time.sleep(cfg.get("pause", 0.0))
    held = torch.Generator().manual_seed(99)
    hx = torch.randn(512, 16, generator=held)
    with torch.no_grad():
        held_out = nn.functional.mse_loss(module(hx), target(hx, w_true)).item()
    write({"final": True, "step": ft.commits, "held_out": held_out, "hash": model_hash(module, opt)})
    ft.shutdown()


def hook_all_gather(ex, cfg: dict, full: int, seen: dict, write, ft) -> None:
    """The faults of ``cfg`` in the all-gather exchange: death inside a round, a garbage frame."""
    gather, own = ex._all_gather, ex._own_frame

    def all_gather(frame: bytes) -> list[bytes]:
        if ex.world() >= full:
            seen["rounds"] += 1
            if seen["rounds"] == cfg.get("die_at_sync"):
                ex.pg.allgather(  # the lengths go out, then this group dies inside the round
                    [[torch.zeros(1, dtype=torch.int64) for _ in range(ex.world())]],
                    [torch.tensor([len(frame)], dtype=torch.int64)],
                    AllgatherOptions(),
                )
                write({"died": time.time(), "step": ft.commits})
                os.kill(os.getpid(), signal.SIGKILL)
        return gather(frame)

    def own_frame(entries, step, rank):
        if ex.world() >= full and seen["rounds"] + 1 == cfg.get("hostile_at") and seen["hostile"] is None:
            seen["hostile"] = step
            return b"\x00hostile" * 64
        return own(entries, step, rank)

    ex._all_gather, ex._own_frame = all_gather, own_frame


def hook_sharded(ex, cfg: dict, full: int, seen: dict, write, ft) -> None:
    """The same faults in the sharded exchange: death inside a round's phase 1 (after the lengths went
    out), garbage in place of its records to every other owner."""
    to_all = ex._all_to_all

    def all_to_all(payloads):
        if ex.world() >= full:
            seen["rounds"] += 1
            if seen["rounds"] == cfg.get("die_at_sync"):
                ex._allgather(torch.tensor([len(p) for p in payloads], dtype=torch.int64))
                write({"died": time.time(), "step": ft.commits})
                os.kill(os.getpid(), signal.SIGKILL)
            if seen["rounds"] == cfg.get("hostile_at") and seen["hostile"] is None:
                seen["hostile"] = int(ex.manager.current_step())
                payloads = [b"\x00hostile" * 64 if p else p for p in payloads]
        return to_all(payloads)

    ex._all_to_all = all_to_all


def raw_state_bytes(state) -> int:
    """The bytes of every tensor in a state (weights plus the algorithm's state), without any format."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(raw_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(raw_state_bytes(v) for v in state)
    return 0


def target(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A smooth nonlinear regression target (a linear one is learned in a few steps by anyone)."""
    return (torch.sin(2 * x @ w) + 0.5 * torch.tanh(x[:, :4].sum(1))).unsqueeze(1)


def build_model(cfg: dict) -> nn.Module:
    """The bench's MLP (``width``, ``depth`` hidden layers), the same initial weights on every group (``run_seed``;
    torchft's init_sync anyway)."""
    torch.manual_seed(cfg.get("run_seed", 0))
    width = cfg.get("width", 32)
    hidden = [nn.Linear(16, width), nn.Tanh()]
    for _ in range(cfg.get("depth", 1) - 1):
        hidden += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*hidden, nn.Linear(width, 1))


def batch_loss(module: nn.Module, gen: torch.Generator, w_true: torch.Tensor) -> torch.Tensor:
    """The MSE of ``module`` on one batch of 8 fresh samples of the target, drawn from ``gen``."""
    x = torch.randn(8, 16, generator=gen)
    y = target(x, w_true) + 0.01 * torch.randn(8, 1, generator=gen)
    return nn.functional.mse_loss(module(x), y)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
