"""Writes the golden frames of tests/vectors/ (run once; the files are committed and never regenerated
silently — tests/test_vectors.py checks gradwire against them byte for byte).

Each vector NAME has NAME.gwf (the frame), NAME.safetensors (``input/<record>`` the tensors that were
encoded, ``decoded/<record>`` what the frame decodes to) and an entry in manifest.json (codec settings,
round, sender, and whether the input was designed so that re-encoding it is stable across BLAS builds).

The DCT inputs are designed in the coefficient domain: every chunk has exactly ``k`` nonzero coefficients,
far from zero, whose values sit exactly on the int8 grid between the chunk's min and max. Float noise
from the transform (~1e-7) then cannot change which coefficients are kept or how they round, so
``encode(input)`` reproduces the frame's positions and values exactly on any machine.

Usage: python tests/vectors/make_vectors.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

import gradwire
from gradwire import dct as D
from gradwire.codecs import DCTCodec, make_codec

HERE = Path(__file__).parent


def designed_dct_input(shape, codec: DCTCodec, seed: int) -> torch.Tensor:
    plan = codec.plan(shape)
    n, c = plan.num_chunks, plan.chunk_numel
    k = min(codec.topk, c)
    g = torch.Generator().manual_seed(seed)
    coeffs = torch.zeros(n, c, dtype=torch.float64)
    grid = torch.arange(-128, 128, dtype=torch.float64)
    for j in range(n):
        pos = torch.randperm(c, generator=g)[:k]
        lo = -1.0 - torch.rand(1, generator=g, dtype=torch.float64).item()
        hi = 1.0 + torch.rand(1, generator=g, dtype=torch.float64).item()
        values = lo + (grid + 128) * ((hi - lo) / 255)  # the chunk's int8 grid, lo and hi included
        far = torch.nonzero(values.abs() > 0.3).flatten()
        pick = far[torch.randperm(far.numel(), generator=g)[: k - 2]]
        q = torch.cat([torch.tensor([0, 255]), pick])[:k]
        coeffs[j, pos] = values[q]
    x = D.idct_chunks(coeffs.reshape(n, *plan.chunk_shape))
    return D.from_chunks(x.reshape(n, c), plan).float()


def build(config: dict):
    """The codec a manifest record names: {"codec": name, **its parameters}, dtypes by name."""
    params = {k: v for k, v in config.items() if k != "codec"}
    if "wire_dtype" in params:
        params["wire_dtype"] = getattr(torch, params["wire_dtype"])
    return make_codec(config["codec"], **params)


def vectors():
    g = torch.Generator().manual_seed(1234)
    yield "identity_f32", dict(round=7, sender=3, bundle=False, stable=True), [
        ("w", {"codec": "identity"}, torch.randn(2, 3, generator=g)),
    ]
    yield "identity_bundle_f16_bf16", dict(round=0, sender=0, bundle=True, stable=True), [
        ("a.weight", {"codec": "identity", "wire_dtype": "float16"}, torch.randn(3, 5, generator=g)),
        ("b", {"codec": "identity"}, torch.randn(4, generator=g).to(torch.bfloat16)),
        ("scalar", {"codec": "identity"}, torch.tensor(-2.75, dtype=torch.float64)),
    ]
    flat = {"codec": "dct", "chunk_shape": [16, 16], "topk": 8}
    yield "dct_flat", dict(round=42, sender=1, bundle=False, stable=True), [
        ("layer.weight", flat, designed_dct_input((32, 48), build(flat), 1)),
    ]
    padded = {"codec": "dct", "chunk_shape": [4, 4], "topk": 3}
    yield "dct_flat_padded", dict(round=1, sender=2, bundle=False, stable=False), [
        ("w", padded, torch.randn(5, 7, generator=g)),
    ]
    tiles = {"codec": "dct", "topk": 4, "mode": "tiles"}
    yield "dct_tiles_bundle", dict(round=9, sender=5, bundle=True, stable=True), [
        ("m", tiles, designed_dct_input((96, 10), build(tiles), 2)),
        ("v", tiles, designed_dct_input((70,), build(tiles), 3)),
        ("conv", tiles, designed_dct_input((4, 2, 3, 3), build(tiles), 4)),
    ]


def main() -> None:
    manifest = {}
    for name, meta, records in vectors():
        entries = [build(config).compress(t, rec)[0] for rec, config, t in records]
        frame = gradwire.write_frame(entries, round=meta["round"], sender=meta["sender"], bundle=meta["bundle"])
        decoded = gradwire.decode_bundle(frame)
        (HERE / f"{name}.gwf").write_bytes(frame)
        tensors = {}
        for rec, _, t in records:
            tensors[f"input/{rec}"] = t.contiguous()
            tensors[f"decoded/{rec}"] = decoded[rec].contiguous()
        save_file(tensors, str(HERE / f"{name}.safetensors"))
        manifest[name] = dict(meta, records={rec: config for rec, config, _ in records})
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
