"""bench/step_ops.py: its counters count what happens (a known sequence of operations gives known counts, a
deliberate .item() is a device-to-host copy), the emulated device sends the library down its GPU branch,
and the bench prints every row and target at tiny sizes on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench_modules import BENCH_DIR, load_bench

BENCH = BENCH_DIR / "step_ops.py"


_bench = load_bench


@pytest.fixture(scope="module")
def step_ops():
    _bench("demo_reference")
    return _bench("step_ops")


def test_a_known_sequence_of_device_operations_gives_known_counts(step_ops):
    with step_ops.emulated_device() as emu:
        x = step_ops.mark(torch.arange(10, dtype=torch.float32))
        host = torch.ones(10)
        with step_ops.counting(emu) as c:
            y = x * 2  # 1 op
            z = y.add_(1).reshape(2, 5)  # 1 op, 1 view
            d = z.to(torch.float64)  # 1 op writing 80 bytes of float64
            host.mul_(3)  # on the host: not a device operation
        assert (c.ops, c.views, c.f64_bytes, c.d2h, c.h2d) == (3, 1, 80, 0, 0)
        assert y.device == torch.device("cuda", 0) and y.is_cuda and not y.is_cpu
        assert d.device.type == "cuda" and host.device.type == "cpu"


def test_copies_between_host_and_device_are_counted_as_the_gpu_would_make_them(step_ops):
    with step_ops.emulated_device() as emu:
        x = step_ops.mark(torch.arange(4, dtype=torch.float32))
        with step_ops.counting(emu) as c:
            s = x.sum().item()  # a deliberate round trip: one copy to the host
        assert s == 6.0 and (c.d2h, c.h2d) == (1, 0)
        assert c.transfers["aten._local_scalar_dense"] == 1
        with step_ops.counting(emu) as c:
            back = x.cpu()  # a copy to the host, a tensor of its own there
            arr = back.numpy()  # of a host tensor: no copy
            up = torch.from_numpy(arr).to(x.device)  # one copy to the device
            made = torch.zeros(3, device="cuda")  # made on the device: no copy
            from_list = torch.tensor([1.0, 2.0], device=x.device)  # host data: one copy
        assert (c.d2h, c.h2d, c.numpy_on_device) == (1, 2, 0)
        assert back is not x and back.device.type == "cpu"
        assert up.is_cuda and made.is_cuda and from_list.is_cuda
        with step_ops.counting(emu) as c:
            x.numpy()  # would raise on a GPU: counted, and listed apart
        assert (c.d2h, c.numpy_on_device) == (1, 1)


def test_the_emulated_device_sends_the_library_down_its_gpu_branch(step_ops):
    """DCTCodec.compress_bundle batches tensors that are not on the CPU: under the emulation two tensors of one
    chunk shape are compressed together, so their payload (positions, values, scales, mins) goes to the host in
    one copy, where two records compressed one by one would take 8."""
    import gradwire

    codec = gradwire.DCTCodec(chunk_shape=(8, 8), topk=4, mode="tiles")
    with step_ops.emulated_device() as emu:
        tensors = {
            n: step_ops.mark(torch.randn(16, 16, generator=torch.Generator().manual_seed(i)))
            for i, n in enumerate(("a", "b"))
        }
        codec.compress_bundle(tensors)  # the first call moves the codec's cached bases to the device once
        with step_ops.counting(emu) as c:
            out = codec.compress_bundle(tensors)
        assert set(out) == {"a", "b"}
        assert c.d2h == 1 and c.h2d == 0, c.transfers
    # The same records as the CPU path writes (compress_batched is byte for byte compress on the CPU).
    for name, t in tensors.items():
        entry, _ = codec.compress(t.clone(), name)
        assert out[name][0].sections["idx"].tobytes() == entry.sections["idx"].tobytes()


def test_the_bench_counts_every_row_at_two_sizes_and_prints_the_targets():
    run = subprocess.run(
        [sys.executable, str(BENCH), "--cases", "2x64,20x64"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in lines
        if line.startswith("| 2 ") or line.startswith("| 20 ")
    ]
    names = {
        "torch AdamW (foreach)",
        "DeMo reference (demo.py)",
        "gradwire DeMo",
        "gradwire SparseLoCo, local step",
        "gradwire SparseLoCo, sync step",
        "gradwire SparseLoCo, mean step (1 sync in 8)",
    }
    for tensors in ("2", "20"):
        got = {r[3]: r for r in rows if r[0] == tensors}
        assert set(got) == names, tensors
        adamw = got["torch AdamW (foreach)"]
        # AdamW foreach: a fixed handful of foreach kernels whatever the number of tensors, no copies.
        assert 0 < int(adamw[4]) <= 12 and adamw[6:8] == ["0", "0"]
        assert int(got["DeMo reference (demo.py)"][4].replace(",", "")) > 0
        assert int(got["gradwire DeMo"][4].replace(",", "")) > 0
    targets = [line for line in lines if line.startswith("target ")]
    assert any(t.startswith("target ops per step, 20 tensors / 2 tensors, gradwire DeMo") for t in targets)
    assert any(t.startswith("target host transfers, gradwire DeMo, 20 tensors") for t in targets)
    assert any(t.startswith("target float64 bytes on the device path, gradwire SparseLoCo, sync step") for t in targets)
    assert all(t.endswith(("— met", "— missed")) for t in targets)
