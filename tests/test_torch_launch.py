"""gradwire.torch.launch: a process group started through gradwire is really gone after
destroy_process_group(), even once torch has lazily imported its dynamo stack (which it does the first
time an optimizer is built). A group that outlives it keeps gloo's worker threads running into the
interpreter's finalization, where they can abort the process at exit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    import gradwire.torch as gt

    def threads():
        return len(os.listdir("/proc/self/task"))

    before = threads()
    gt.init_from_env("gloo")
    during = threads()
    torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())  # torch imports torch._dynamo here
    assert "torch.distributed.nn.functional" in sys.modules
    dist.barrier()
    dist.destroy_process_group()
    print(before, during, threads())
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_destroy_process_group_stops_gloo_threads_after_an_optimizer_is_built():
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    before, during, after = map(int, done.stdout.split()[-3:])
    assert during > before, (before, during, after)  # gloo started its threads ...
    assert after == before, (before, during, after)  # ... and destroy_process_group() joined them all
