"""The optimizer step as a few batched operations gives the bits of the tensor-by-tensor step it replaced,
and the number of operations one step dispatches does not grow with the number of tensors.

Each batched piece is checked against a reference written here the way the library computed it before,
tensor by tensor (one ``compress`` per tensor, one multiply and add per momentum, ...): records byte for
byte, buffers and weights bit for bit. The operation count runs the library's device code path on the CPU
(bench/step_ops.py's emulated device) and counts dispatched operations, not time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gradwire
from bench_modules import load_bench
from gradwire.algorithms import DeMoState, OuterStep, SparseLoCoState, demo_update
from gradwire.algorithms.demo import default_demo_codec
from gradwire.algorithms.sparseloco import default_sparseloco_codec
from gradwire.dct import DCTCodec
from gradwire.feedback import ErrorFeedback
from gradwire.frame import write_frame

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"

#: Shapes a model holds: 64×64 tiles, tiles of other sides, vectors (1-D tiles), small tiles sent as
#: flat padded chunks, a convolution, an empty tensor.
SHAPES = {
    "w0": (128, 128),
    "w1": (256, 64),
    "b0": (128,),
    "b1": (300,),
    "emb": (300, 64),
    "odd": (97, 13),
    "conv": (8, 3, 3, 3),
    "w2": (64, 192),
    "empty": (0, 5),
}

CODECS = [
    default_demo_codec(),
    default_sparseloco_codec(),
    DCTCodec(topk=16, mode="tiles"),
    DCTCodec(chunk_shape=(64,), topk=5, mode="flat", index_coding="auto", value_bits=4),
]


def _tensors(dtype=torch.float32, seed=0, scale=1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * scale).to(dtype) for n, s in SHAPES.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b
        )
    )


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_a_cpu_bundle_stacked_by_chunk_shape_gives_each_tensors_own_record_byte_for_byte(codec, dtype, large):
    tensors = _tensors(dtype)
    if large:  # records of this size are decoded one by one into their tensors, smaller ones stacked
        g = torch.Generator().manual_seed(5)
        tensors = {
            "big0": torch.randn(1024, 512, generator=g).to(dtype),
            "b0": tensors["b0"],
            "big1": torch.randn(512, 1024, generator=g).to(dtype),
            "b1": tensors["b1"],
        }
    bundle = codec.compress_bundle(tensors)
    assert list(bundle) == list(tensors)
    for name, t in tensors.items():
        entry, recon = codec.compress(t, name)
        b_entry, b_recon = bundle[name]
        assert write_frame([b_entry]) == write_frame([entry]), name
        assert _same(b_recon, recon), name
        # And what receivers decode is that reconstruction, bit for bit.
        assert _same(gradwire.decode(write_frame([b_entry])).to(recon.dtype), recon), name


def _demo_reference(momenta, codec, grads, lr, beta):
    """DeMoState.compress as it was: per tensor m = beta·m + lr·g, one compress each, m − recon."""
    entries = []
    for n in sorted(grads):
        g = grads[n].detach().to(torch.float32)
        m = momenta.get(n, torch.zeros_like(g))
        m = torch.add(torch.mul(m, beta), torch.mul(g, lr))
        entry, recon = codec.compress(m, n)
        momenta[n] = torch.sub(m, recon.to(torch.float32))
        entries.append(entry)
    return entries


def test_demo_node_side_in_place_gives_the_tensor_by_tensor_records_and_momenta():
    state = DeMoState(default_demo_codec(), beta=0.9)
    momenta: dict[str, torch.Tensor] = {}
    for step in range(3):
        grads = _tensors(seed=step, scale=1e-2)
        got = state.compress(grads, 0.01)
        want = _demo_reference(momenta, default_demo_codec(), grads, 0.01, 0.9)
        assert write_frame(got, bundle=True) == write_frame(want, bundle=True), step
        for n in grads:
            assert _same(state.momenta[n], momenta[n]), (step, n)


def test_a_record_of_another_codec_is_not_changed_by_the_next_step():
    # A codec whose records may view its input: the node side does not step its buffers in place.
    import numpy as np

    from gradwire.codecs.base import Codec
    from gradwire.frame import Entry

    class Raw(Codec):
        codec_id = 0
        name = "raw"

        def compress(self, tensor, name=""):
            arr = tensor.detach().numpy().reshape(-1).view(np.uint8)  # views the tensor's memory
            return Entry(
                name=name,
                codec=0,
                dtype=torch.float32,
                shape=tuple(tensor.shape),
                params=b"",
                sections={"data": arr},
                section_elems={},
            ), tensor * 0.5

    state = DeMoState(Raw(), beta=0.9)
    first = state.compress({"w": torch.ones(4)}, 1.0)
    before = bytes(first[0].sections["data"])
    state.compress({"w": torch.full((4,), 3.0)}, 1.0)
    assert bytes(first[0].sections["data"]) == before


def test_sparseloco_node_side_in_place_gives_the_tensor_by_tensor_records_and_buffers():
    codec = default_sparseloco_codec()
    state = SparseLoCoState(codec, error_decay=0.95)
    errors: dict[str, torch.Tensor] = {}
    anchor = _tensors(seed=10)
    for step in range(3):
        current = {n: a - 1e-2 * t for (n, a), t in zip(anchor.items(), _tensors(seed=step).values())}
        got = state.compress(anchor, current)
        want = []
        for n in sorted(anchor):
            pg = torch.sub(anchor[n], current[n])
            e = pg if n not in errors else torch.add(torch.mul(errors[n], 0.95), pg)
            entry, recon = codec.compress(e, n)
            errors[n] = torch.sub(e, recon)
            want.append(entry)
        assert write_frame(got, bundle=True) == write_frame(want, bundle=True), step
        for n in anchor:
            assert _same(state.errors[n], errors[n]), (step, n)


def test_error_feedback_on_a_bundle_gives_the_one_by_one_records_and_residuals():
    codec = DCTCodec(topk=9, mode="tiles", index_coding="auto", value_bits=2, topk_scaling="proportional")
    bundled, single = ErrorFeedback(codec), ErrorFeedback(codec)
    for step in range(3):
        tensors = _tensors(seed=step)
        got = bundled.compress_bundle_reconstructed(tensors)
        for n, t in tensors.items():
            entry = single.compress(t, n)
            assert write_frame([got[n][0]]) == write_frame([entry]), (step, n)
            assert _same(bundled.residual(n), single.residual(n)), (step, n)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_demo_update_over_all_tensors_at_once_gives_the_tensor_by_tensor_weights(weight_decay):
    params = {**_tensors(seed=1), "half": torch.randn(64, 64).to(torch.bfloat16)}
    mean = {n: torch.randn(p.shape) for n, p in params.items()}
    want = {n: p.clone() for n, p in params.items()}
    for n in sorted(want):
        if weight_decay:
            want[n].mul_(1.0 - 0.01 * weight_decay)
        want[n].add_(torch.sign(mean[n]).to(want[n].dtype), alpha=-0.01)
    demo_update(params, mean, 0.01, weight_decay)
    for n in params:
        assert _same(params[n], want[n]), n


@pytest.mark.parametrize(
    "momentum,nesterov,lr", [(0.0, False, 1.0), (0.0, False, 0.7), (0.9, False, 0.7), (0.9, True, 0.7)]
)
def test_the_outer_step_over_all_tensors_at_once_gives_the_native_steps_bits(momentum, nesterov, lr):
    # Contiguous float32 CPU anchors take the native one-pass step (the same operations as the torch ones
    # tensor by tensor); transposed views of the same values take the _foreach_ route. Same bits.
    native, batched = OuterStep(lr, momentum, nesterov), OuterStep(lr, momentum, nesterov)
    base = {n: t for n, t in _tensors(seed=3).items() if t.ndim == 2 and t.numel()}
    a_native = {n: t.clone() for n, t in base.items()}
    a_views = {n: t.t().contiguous().t() for n, t in base.items()}  # the same values, not contiguous
    for step in range(3):
        delta = {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(step)) * 1e-2 for n, t in base.items()}
        native.apply(a_native, delta)
        batched.apply(a_views, delta)
        for n in base:
            assert _same(a_views[n].contiguous(), a_native[n]), (step, n)
            if momentum:
                assert _same(batched.buffers[n].contiguous(), native.buffers[n]), (step, n)


@pytest.fixture(scope="module")
def step_ops():
    # Loaded from its file (bench/ is not a package): its emulated device and counters.
    return load_bench("step_ops")


def _ops_of_one_step(step_ops, row: str, tensors: int) -> int:
    with step_ops.emulated_device() as emu:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(tensors // 2)))
        for p in model.parameters():
            step_ops.mark(p)
            p.grad = step_ops.mark(torch.randn(p.shape) * 1e-3)
        params = list(model.parameters())
        if row == "demo":
            opt = gradwire.torch.DeMo(params, lr=1e-3)
            opt.step()
            with step_ops.counting(emu) as c:
                opt.step()
        else:
            opt = gradwire.torch.SparseLoCo(params, torch.optim.AdamW(params, lr=1e-3, foreach=True), sync_every=2)
            for _ in range(3):
                opt.step()
            with step_ops.counting(emu) as c:
                opt.step()  # the second sync: error buffers, residuals and outer state all held
            assert opt.syncs == 2
    return c.ops


@pytest.mark.parametrize("row", ["demo", "sparseloco"])
def test_the_operations_of_one_step_do_not_grow_with_the_number_of_tensors(step_ops, row):
    few, many = _ops_of_one_step(step_ops, row, 10), _ops_of_one_step(step_ops, row, 100)
    assert many <= 1.2 * few, (row, few, many)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_a_device_bundle_crosses_to_the_host_in_one_copy_and_each_record_decodes_to_its_reconstruction(step_ops, codec):
    tensors = _tensors()
    with step_ops.emulated_device() as emu:
        marked = {n: step_ops.mark(t.clone()) for n, t in tensors.items()}
        codec.compress_bundle(marked)  # warm-up: the transform's bases cached on the device
        with step_ops.counting(emu) as c:
            bundle = codec.compress_bundle(marked)
        recons = {n: r.clone() for n, (_, r) in bundle.items()}
    assert (c.d2h, c.h2d) == (1, 0), c.transfers
    for name, (entry, _) in bundle.items():
        # Read back on the host: the bytes the one copy brought over are the payload the device decoded.
        assert _same(gradwire.decode(write_frame([entry])), recons[name].float()), name
