"""The weights hash (``gradwire.state.state_hash``): what docs/API.md says it hashes, and that it tells apart
any two states that are not bit-identical."""

from __future__ import annotations

import blake3
import torch

from gradwire.state import state_hash


def _documented_stream(state: dict[str, torch.Tensor]) -> bytes:
    """The hashed bytes as docs/API.md spells them, built independently of the library."""
    out = bytearray()
    for name in sorted(state):
        t = state[name]
        out += name.encode() + b"\0" + str(t.dtype).encode() + repr(tuple(t.shape)).encode() + b"\0"
        out += t.contiguous().numpy().tobytes()
    return bytes(out)


def test_weights_hash_is_blake3_128_of_the_documented_stream():
    gen = torch.Generator().manual_seed(3)
    # One tensor large enough to be hashed on several threads, one small, one of another dtype.
    state = {
        "w": torch.randn(700, 1024, generator=gen),
        "b": torch.randn(5, generator=gen),
        "h": torch.randn(4, 4, generator=gen).to(torch.bfloat16).view(torch.int16),
    }
    want = blake3.blake3(_documented_stream(state)).hexdigest(16)
    assert state_hash(state) == want
    assert len(want) == 32


def test_weights_hash_changes_with_one_bit_a_name_a_dtype_or_a_shape():
    gen = torch.Generator().manual_seed(4)
    state = {"layer.weight": torch.randn(64, 33, generator=gen), "layer.bias": torch.randn(64, generator=gen)}
    base = state_hash(state)
    flipped = state["layer.weight"].clone()
    flipped.view(torch.int32)[17, 5] ^= 1  # the lowest mantissa bit of one value
    variants = [
        {**state, "layer.weight": flipped},
        {"layer.w": state["layer.weight"], "layer.bias": state["layer.bias"]},
        {**state, "layer.bias": state["layer.bias"].view(torch.int32)},
        {**state, "layer.weight": state["layer.weight"].reshape(33, 64)},
    ]
    hashes = {state_hash(v) for v in variants}
    assert base not in hashes and len(hashes) == len(variants)


def test_weights_hash_ignores_layout_and_insertion_order():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 80, generator=gen)
    b = torch.randn(80, generator=gen)
    strided = w.t().contiguous().t()  # same values, column-major storage
    assert not strided.is_contiguous()
    assert state_hash({"w": w, "b": b}) == state_hash({"b": b, "w": strided})


def _hash_in_child(state, queue):
    queue.put(state_hash(state))


def test_a_child_forked_after_a_threaded_hash_hashes_the_same_and_does_not_hang():
    import multiprocessing as mp

    state = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MB: hashed on BLAKE3's threads
    want = state_hash(state)  # starts the thread pool in this process before the fork
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_hash_in_child, args=(state, queue))
    child.start()
    try:
        got = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert got == want
