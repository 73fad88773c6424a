"""The server process keeps what a close frees (gradwire_server.memory), and owns its master weights.

Each malloc probe runs in a fresh interpreter: the settings are process-wide and must precede threads.
"""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradwire.state import state_to_bytes

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the settings are glibc's malloc's"
)

PROBE = """
import ctypes, resource, sys, threading
{setup}
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def work():
    # a close's temporaries: model-sized blocks under the 32 MiB mmap threshold, freed at the end
    blocks = [torch.ones(3_000_000) for _ in range(20)]
    del blocks

{reserve}
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = threading.Thread(target=work)
t.start()
t.join()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
# page faults the work took (every thread), and the heap held afterwards (mallinfo2 sums every arena)
print(faults, libc.mallinfo2().arena)
"""


def _probe(setup: str = "", reserve: str = "", **env: str) -> tuple[int, int]:
    environ = {k: v for k, v in os.environ.items() if k != "GRADWIRE_KEEP_FREED_MEMORY"}
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(setup=setup, reserve=reserve)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    faults, heap = (int(x) for x in out.stdout.split())
    return faults, heap


KEEP = "from gradwire_server.memory import keep_freed_memory; assert keep_freed_memory()"
RESERVE = "from gradwire_server.memory import reserve; assert reserve(300 << 20) >= 240_000_000"


@glibc_only
def test_after_a_reserve_a_threads_close_sized_work_finds_its_heap_touched_and_keeps_it():
    faults, heap = _probe(setup=KEEP, reserve=RESERVE)
    # 240 MB (58,600 pages) were allocated and freed on another thread: the reserved heap served them,
    # in the one arena, without faulting pages in, and the freed memory stayed in the heap.
    assert faults < 2_000, faults
    assert heap >= 240_000_000, heap


@glibc_only
def test_without_a_reserve_the_same_work_grows_the_heap_page_by_page():
    faults, heap = _probe(setup=KEEP)
    # the control of the test above: the probe sees the work's 240 MB arrive as fresh pages
    assert faults >= 50_000, faults


@glibc_only
def test_the_opt_out_leaves_malloc_alone():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from gradwire_server.memory import keep_freed_memory, reserve, retained_bytes\n"
            "print(keep_freed_memory(), reserve(1 << 20), retained_bytes())",
        ],
        env={**os.environ, "GRADWIRE_KEEP_FREED_MEMORY": "0"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["False", "0", "0"]


@glibc_only
def test_a_reserve_is_capped_by_reserve_max():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from gradwire_server import memory\n"
            "memory.RESERVE_MAX = 64 << 20\n"
            "assert memory.keep_freed_memory()\n"
            "print(memory.reserve(10 << 30), memory.retained_bytes())",
        ],
        env={k: v for k, v in os.environ.items() if k != "GRADWIRE_KEEP_FREED_MEMORY"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    touched, retained = (int(x) for x in out.stdout.split())
    assert touched == 64 << 20 and retained == 64 << 20


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings")
def test_an_uploaded_state_is_copied_so_no_mapping_of_the_spooled_file_outlives_it(tmp_path):
    from gradwire_server.rounds import _parse_state

    path = tmp_path / "upload.safetensors"
    state = {"w": torch.randn(512, 1024), "b": torch.randn(1024).to(torch.bfloat16)}
    path.write_bytes(state_to_bytes(state))
    master = _parse_state(path)
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    path.unlink()
    assert str(path) not in maps, "the master weights are still pages of the uploaded file"
    assert torch.equal(master["w"], state["w"]) and master["b"].dtype == torch.float32
    master["w"].add_(1.0)  # writable memory of the server's own
    assert torch.equal(master["w"], state["w"] + 1.0)
