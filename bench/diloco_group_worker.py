"""One replica group running torchft's own DiLoCo (uncompressed, ``torchft.local_sgd.DiLoCo``) for
bench/elastic.py's comparison row: the same model, data, inner optimizer, outer step (SGD, learning rate 1.0,
as the SparseLoCo groups), sync interval and membership trace as bench/replica_group_worker.py, and the same
JSON lines, so the bench reads both alike.

``python bench/diloco_group_worker.py '<json>'``: the fields of replica_group_worker.py (``die_at_sync``
SIGKILLs this group as its round's all-reduce starts; no ``die_at_step``, no ``hostile_at``). The state a
joiner downloads crosses as gradwire's state bytes too (StateBytesTransport: torchft's default transport
pickles). Bytes: the fp32 pseudo-gradients torchft all-reduces, counted as a ring all-reduce moves them
(2 (n-1)/n of the tensor's bytes out and in per group, n the round's participants): gloo's own wire bytes
are not read.
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

from gradwire.torch import ReplicaTimeouts
from gradwire.torch.state_bytes import state_to_bytes
from gradwire.torch.state_transport import StateBytesTransport
from replica_group_worker import batch_loss, build_model, raw_state_bytes, target


def model_hash(module: nn.Module) -> str:
    h = hashlib.sha256()
    for t in module.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(cfg: dict) -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    module = build_model(cfg)
    inner = torch.optim.AdamW(module.parameters(), lr=1e-2)
    outer = torch.optim.SGD(module.parameters(), lr=1.0)
    sync_every = cfg.get("sync_every", 2)
    if cfg.get("wait_for"):
        with open(cfg["log"], "a") as log:
            log.write(json.dumps({"replica": cfg["replica_id"], "pid": os.getpid(), "standby": time.time()}) + "\n")
        while not os.path.exists(cfg["wait_for"]):
            time.sleep(0.01)
    t = ReplicaTimeouts(**cfg["timeouts"])
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    transport = StateBytesTransport("127.0.0.1", state_download=t.state_download)
    pg = ProcessGroupGloo(timeout=t.delta("process_group"))
    healed = [0]

    def user_state() -> dict:
        return {"module": module.state_dict(), "inner": inner.state_dict()}

    def load_user_state(state: dict) -> None:
        module.load_state_dict(state["module"])
        inner.load_state_dict(state["inner"])
        healed[0] += 1

    manager = Manager(
        pg=pg,
        load_state_dict=load_user_state,
        state_dict=user_state,
        min_replica_size=cfg.get("min_replicas", 1),
        use_async_quorum=False,
        timeout=t.delta("operation"),
        quorum_timeout=t.delta("quorum"),
        connect_timeout=t.delta("connect"),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=cfg["lighthouse"],
        replica_id=cfg["replica_id"],
        hostname="127.0.0.1",
        heartbeat_interval=t.delta("heartbeat_interval"),
        checkpoint_transport=transport,
        init_sync=True,
    )
    log = open(cfg["log"], "a")

    def write(row: dict) -> None:
        log.write(json.dumps({"replica": cfg["replica_id"], "pid": os.getpid(), **row}) + "\n")
        log.flush()

    full = cfg.get("groups", 1)
    seen = {"rounds": 0, "sent": 0, "groups": 1}
    allreduce = manager.allreduce

    def counted_allreduce(tensor, *args, **kwargs):
        n = max(1, int(manager.num_participants()))
        if n >= full and seen.get("round_of") != manager.current_step():
            seen["round_of"] = manager.current_step()
            seen["rounds"] += 1
            if seen["rounds"] == cfg.get("die_at_sync"):
                write({"died": time.time(), "step": manager.current_step()})
                os.kill(os.getpid(), signal.SIGKILL)
        seen["pending"] = seen.get("pending", 0) + round(2 * (n - 1) / n * tensor.numel() * tensor.element_size())
        seen["groups"] = n
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counted_allreduce
    diloco = DiLoCo(manager, [module], inner, outer, sync_every=sync_every)

    def full_state() -> dict:
        return {k: fn() for k, fn in manager._user_state_dicts.items()}  # "default" (ours) and DiLoCo's

    write(
        {
            "ready": time.time(),
            "state_bytes": len(state_to_bytes(full_state())),
            "model_bytes": 4 * sum(p.numel() for p in module.parameters()),
        }
    )
    gen = torch.Generator().manual_seed(1000 + 10 * cfg.get("run_seed", 0) + cfg.get("seed", 0))
    w_true = torch.linspace(-1, 1, 16)
    local_steps = 0
    last = manager.current_step()
    with diloco:
        while True:
            try:
                stop = int(open(cfg["stop"]).read())
            except (OSError, ValueError):
                stop = None
            at_boundary = local_steps % sync_every == 0
            if stop is not None and manager.current_step() >= stop and at_boundary:
                break
            leave = cfg.get("leave_at")
            if leave is not None and manager.current_step() >= leave and at_boundary:
                write({"left": time.time(), "step": manager.current_step()})
                manager.shutdown(wait=False)
                log.close()
                return
            batch_loss(module, gen, w_true).backward()
            inner.step()
            inner.zero_grad()
            local_steps += 1
            if local_steps % sync_every == 0:
                step = manager.current_step()
                if step != last:  # committed: the bytes of that round count
                    seen["sent"] += seen.get("pending", 0)
                    last = step
                    write(
                        {
                            "step": step,
                            "hash": model_hash(module),
                            "groups": seen["groups"],
                            "kept": seen["groups"],
                            "healed": healed[0],
                            "time": time.time(),
                            "downloaded": transport.bytes_downloaded,
                            "bytes_sent": seen["sent"],
                            "bytes_received": seen["sent"],
                            "local_steps": local_steps,
                            "raw_state": raw_state_bytes(full_state()),
                        }
                    )
                seen["pending"] = 0
            time.sleep(cfg.get("pause", 0.0))
    held = torch.Generator().manual_seed(99)
    hx = torch.randn(512, 16, generator=held)
    with torch.no_grad():
        held_out = nn.functional.mse_loss(module(hx), target(hx, w_true)).item()
    write({"final": True, "step": manager.current_step(), "held_out": held_out, "hash": model_hash(module)})
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
