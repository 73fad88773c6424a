"""Frame bytes of one step: a bundle of per-tensor records beside one whole-model record, measured in one run.

A bundle pays every tensor's record header (name, codec, u64 shape, params, four section headers) and,
with a chunked codec, every tensor's last partial chunk; a model record (docs/FORMAT.md section 9) sends
the model's tensors flattened into one vector under one ``@model:<spec hash>`` name, so what a step costs
no longer grows with the number of tensors. Both sides use the same DCT codec (flat mode, 64×64 chunks
of 4096 consecutive elements, Rice-coded positions) at settings around 300× and 1000× of fp32.

Models: the demo's char transformer (its real gradients, :func:`gradwire_apps.gradients.collect_gradients`;
its spec in ``named_parameters()`` order) and synthetic models of 30 and 100 tensors of the same total
size, half of them 128-element vectors (biases, norms), the rest matrices.

Usage: python bench/model_record.py [--steps 8]
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

import gradwire
from gradwire import DCTCodec, ModelSpec, decode_model, encode_model
from gradwire_apps.gradients import collect_gradients

#: (label, DCT settings): 64×64 flat chunks, k of 4096 coefficients kept, b-bit values, Rice positions.
SETTINGS = [
    ("k=32, 2-bit", dict(topk=32, value_bits=2)),
    ("k=16, 1-bit", dict(topk=16, value_bits=1)),
    ("k=4, 1-bit", dict(topk=4, value_bits=1)),
]


def synthetic(n: int, total: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` tensors of ``total`` elements: every other one a 128-vector, the others matrices of 128
    columns sharing the rest; each at its own scale (gradients of layers differ by orders of magnitude)."""
    g = torch.Generator().manual_seed(seed)
    vectors = n // 2
    matrices = n - vectors
    rows = (total - 128 * vectors) // 128
    row_counts = [rows // matrices] * matrices
    row_counts[-1] += rows - sum(row_counts)
    out, m = {}, 0
    for i in range(n):
        scale = 10 ** torch.empty(()).uniform_(-4, -1, generator=g).item()
        if i % 2 == 0 and m < matrices:
            shape = (row_counts[m], 128)
            m += 1
        else:
            shape = (128,)
        out[f"layers.{i}.{'weight' if len(shape) == 2 else 'bias'}"] = torch.randn(shape, generator=g) * scale
    tail = total - sum(t.numel() for t in out.values())
    if tail:
        last = next(reversed(out))
        out[last] = torch.cat([out[last].reshape(-1), torch.zeros(tail)]).reshape(-1)
    return out


def payload_bytes(frame: bytes) -> int:
    """Bytes of section payloads (what the codec keeps); the rest of the frame is headers."""
    return sum(int(a.nbytes) for e in gradwire.read_frame(frame).entries for a in e.sections.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--steps", type=int, default=8, help="training steps before the char transformer's gradient is taken"
    )
    args = ap.parse_args()
    console = Console(width=200)

    real = collect_gradients("char_transformer", steps=args.steps, record_every=args.steps, progress=False)[-1]
    total = sum(t.numel() for t in real.values())
    models = [("char transformer", real)] + [("synthetic", synthetic(n, total, seed=n)) for n in (30, 100)]

    t = Table(
        title=f"One step's frame: per-tensor bundle vs one model record (DCT flat 64×64, Rice positions; "
        f"{total:,} elements, fp32 {4 * total:,} bytes)"
    )
    for col in (
        "model",
        "tensors",
        "DCT",
        "bundle bytes",
        "bundle ×fp32",
        "bundle headers",
        "model-record bytes",
        "model ×fp32",
        "model headers",
        "saved / tensor",
        "bundle / model",
        "bundle err",
        "model err",
    ):
        t.add_column(col, justify="right")
    for label, grads in models:
        spec = ModelSpec.from_tensors(grads)  # named_parameters() order for the real model
        fp32 = 4 * spec.numel
        for setting, kw in SETTINGS:
            codec = DCTCodec(chunk_shape=(64, 64), index_coding="rice", **kw)
            bundle = codec.encode_bundle(grads)
            model = encode_model(codec, grads, spec)
            out = decode_model(model, spec)
            assert list(out) == spec.names
            flat = spec.flatten(grads)
            norm = flat.norm().item()
            err_bundle = (spec.flatten(gradwire.decode_bundle(bundle)) - flat).norm().item() / norm
            err_model = (spec.flatten(out) - flat).norm().item() / norm
            t.add_row(
                label,
                str(len(spec)),
                setting,
                f"{len(bundle):,}",
                f"{fp32 / len(bundle):.0f}×",
                f"{len(bundle) - payload_bytes(bundle):,}",
                f"{len(model):,}",
                f"{fp32 / len(model):.0f}×",
                f"{len(model) - payload_bytes(model):,}",
                f"{(len(bundle) - len(model)) / (len(spec) - 1):.0f}",
                f"{len(bundle) / len(model):.2f}",
                f"{err_bundle:.3f}",
                f"{err_model:.3f}",
            )
        t.add_section()
    console.print(t)
    console.print(
        "headers: frame bytes outside section payloads (frame header, CRC, record headers). "
        "saved / tensor: (bundle − model record) / (tensors − 1), headers and partial chunks together. "
        "err: ‖decoded − gradient‖ / ‖gradient‖ over the whole model, one step without error feedback."
    )


if __name__ == "__main__":
    main()
