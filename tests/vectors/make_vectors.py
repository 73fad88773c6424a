"""Writes the golden frames of tests/vectors/ (run once; the files are committed and never regenerated
silently — tests/test_vectors.py checks gradwire against them byte for byte).

Each vector NAME has NAME.gwf (the frame), NAME.safetensors (``input/<record>`` the tensors that were
encoded, ``decoded/<record>`` what the frame decodes to) and an entry in manifest.json (codec settings,
round, sender, and whether the input was designed so that re-encoding it is stable across BLAS builds).

The DCT inputs are designed in the coefficient domain: every chunk has exactly ``k`` nonzero coefficients,
far from zero, whose values sit exactly on the int8 grid between the chunk's min and max. Float noise
from the transform (~1e-7) then cannot change which coefficients are kept or how they round, so
``encode(input)`` reproduces the frame's positions and values exactly on any machine.

Whole-model vectors (FORMAT.md section 9) also list their ``model_spec`` in the manifest (name, dtype by
its table 4.1 name, shape; in the spec's order); their one record is named ``@model:<hash>``, its input
is the flat vector, and ``model/<tensor>`` holds each tensor as ``gradwire.decode_model`` returns it.

Layout frames (FORMAT.md section 12) also list their ``templates`` in the manifest, in the order the frame
refers to them, each as plain data a reader without gradwire takes: ``name``, ``codec`` (id), ``dtype``
(code, table 4.1), ``shape``, ``params`` (hex digits) and ``sections`` ([name, element code] pairs).

Usage: python tests/vectors/make_vectors.py [NAME ...]   (only the named vectors, others untouched)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import gradwire
from gradwire import dct as D
from gradwire.algorithms import default_demo_codec
from gradwire.algorithms.demo import demo_codec_params
from gradwire.codecs import DCTCodec, make_codec
from gradwire.frame import RecordTemplate, dtype_code

HERE = Path(__file__).parent
#: dtypes by their FORMAT.md table 4.1 names, as a manifest's ``model_spec`` writes them.
SPEC_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64}
#: dtypes by their FORMAT.md table 4.1 codes, as a manifest's ``templates`` write them.
CODE_DTYPES = {8: torch.float16, 9: torch.bfloat16, 10: torch.float32, 11: torch.float64}


def designed_dct_input(shape, codec: DCTCodec, seed: int) -> torch.Tensor:
    plan = codec.plan(shape)
    n, c = plan.num_chunks, plan.chunk_numel
    k = codec.chunk_topk(c)
    top = (1 << getattr(codec, "value_bits", 8)) - 1  # the grid's last level: 255 for int8
    g = torch.Generator().manual_seed(seed)
    coeffs = torch.zeros(n, c, dtype=torch.float64)
    grid = torch.arange(0, top + 1, dtype=torch.float64)
    for j in range(n):
        pos = torch.randperm(c, generator=g)[:k]
        lo = -1.0 - torch.rand(1, generator=g, dtype=torch.float64).item()
        hi = 1.0 + torch.rand(1, generator=g, dtype=torch.float64).item()
        values = lo + grid * ((hi - lo) / top)  # the chunk's grid, lo and hi included
        far = torch.nonzero(values.abs() > 0.3).flatten()
        if far.numel() >= k - 2:
            pick = far[torch.randperm(far.numel(), generator=g)[: k - 2]]
        else:  # a grid of few levels (value_bits < 8): levels repeat
            pick = far[torch.randint(far.numel(), (k - 2,), generator=g)]
        q = torch.cat([torch.tensor([0, top]), pick])[:k]
        coeffs[j, pos] = values[q]
    x = D.idct_chunks(coeffs.reshape(n, *plan.chunk_shape))
    return D.from_chunks(x.reshape(n, c), plan).float()


def build(config: dict):
    """The codec a manifest record names: {"codec": name, **its parameters}, dtypes by name."""
    params = {k: v for k, v in config.items() if k != "codec"}
    if "wire_dtype" in params:
        params["wire_dtype"] = getattr(torch, params["wire_dtype"])
    return make_codec(config["codec"], **params)


def model_spec(listed: list[dict]) -> gradwire.ModelSpec:
    """The ModelSpec a manifest's ``model_spec`` lists."""
    return gradwire.ModelSpec((t["name"], SPEC_DTYPES[t["dtype"]], t["shape"]) for t in listed)


def model_inputs(spec: gradwire.ModelSpec, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors whose flattening is ``flat`` (its slices in the spec's dtypes, which must hold them exactly)."""
    out = {n: t.to(d).clone() for (n, t), d in zip(spec.unflatten(flat).items(), spec.dtypes)}
    assert torch.equal(spec.flatten(out), flat), "the flat input does not fit the spec's dtypes"
    return out


def model_vector(listed: list[dict], config: dict, make_flat):
    """The manifest fields and the one record of a whole-model vector: ``make_flat(spec, codec)``."""
    spec = model_spec(listed)
    return dict(model_spec=listed), [(spec.record_name, config, make_flat(spec, build(config)))]


def template_fields(t: RecordTemplate) -> dict:
    """A template as a manifest's ``templates`` list it (plain data: FORMAT.md section 12's fields)."""
    return dict(
        name=t.name,
        codec=int(t.codec),
        dtype=dtype_code(t.dtype),
        shape=[int(d) for d in t.shape],
        params=bytes(t.params).hex(),
        sections=[[n, int(e)] for n, e in t.sections],
    )


def layout_templates(listed: list[dict]) -> list[RecordTemplate]:
    """The templates a manifest's ``templates`` lists, as gradwire's ``write_frame``/``read_frame`` take them."""
    return [
        RecordTemplate(
            t["name"],
            t["codec"],
            CODE_DTYPES[t["dtype"]],
            tuple(t["shape"]),
            bytes.fromhex(t["params"]),
            tuple((n, e) for n, e in t["sections"]),
        )
        for t in listed
    ]


def vectors():
    g = torch.Generator().manual_seed(1234)
    yield (
        "identity_f32",
        dict(round=7, sender=3, bundle=False, stable=True),
        [
            ("w", {"codec": "identity"}, torch.randn(2, 3, generator=g)),
        ],
    )
    yield (
        "identity_bundle_f16_bf16",
        dict(round=0, sender=0, bundle=True, stable=True),
        [
            ("a.weight", {"codec": "identity", "wire_dtype": "float16"}, torch.randn(3, 5, generator=g)),
            ("b", {"codec": "identity"}, torch.randn(4, generator=g).to(torch.bfloat16)),
            ("scalar", {"codec": "identity"}, torch.tensor(-2.75, dtype=torch.float64)),
        ],
    )
    flat = {"codec": "dct", "chunk_shape": [16, 16], "topk": 8}
    yield (
        "dct_flat",
        dict(round=42, sender=1, bundle=False, stable=True),
        [
            ("layer.weight", flat, designed_dct_input((32, 48), build(flat), 1)),
        ],
    )
    padded = {"codec": "dct", "chunk_shape": [4, 4], "topk": 3}
    yield (
        "dct_flat_padded",
        dict(round=1, sender=2, bundle=False, stable=False),
        [
            ("w", padded, torch.randn(5, 7, generator=g)),
        ],
    )
    tiles = {"codec": "dct", "topk": 4, "mode": "tiles"}
    yield (
        "dct_tiles_bundle",
        dict(round=9, sender=5, bundle=True, stable=True),
        [
            ("m", tiles, designed_dct_input((96, 10), build(tiles), 2)),
            ("v", tiles, designed_dct_input((70,), build(tiles), 3)),
            ("conv", tiles, designed_dct_input((4, 2, 3, 3), build(tiles), 4)),
        ],
    )
    # Entropy-coded positions and values below a byte (FORMAT.md §5.2 index_coding 1, §6.2).
    rice4 = {"codec": "dct", "chunk_shape": [16, 16], "topk": 8, "index_coding": "rice", "value_bits": 4}
    yield (
        "dct_rice_4bit",
        dict(round=3, sender=7, bundle=False, stable=True),
        [
            ("layer.weight", rice4, designed_dct_input((32, 48), build(rice4), 5)),
        ],
    )
    rice2 = {"codec": "dct", "topk": 24, "mode": "tiles", "index_coding": "rice", "value_bits": 2}
    yield (
        "dct_tiles_rice_2bit",
        dict(round=4, sender=8, bundle=False, stable=True),
        [
            ("m", rice2, designed_dct_input((8, 12), build(rice2), 6)),
        ],
    )
    sparse1 = {"codec": "dct", "chunk_shape": [64], "topk": 3, "index_coding": "auto", "value_bits": 1}
    dense1 = {"codec": "dct", "chunk_shape": [16], "topk": 12, "index_coding": "auto", "value_bits": 1}
    yield (
        "dct_auto_1bit_bundle",
        dict(round=5, sender=9, bundle=True, stable=True),
        [
            ("sparse", sparse1, designed_dct_input((256,), build(sparse1), 7)),
            ("dense", dense1, designed_dct_input((48,), build(dense1), 8)),
        ],
    )
    # Whole-model records (FORMAT.md section 9): one flat record named by the spec's hash.
    spec_listed = [
        {"name": "embed.weight", "dtype": "f32", "shape": [5, 4]},
        {"name": "norm.weight", "dtype": "bf16", "shape": [6]},
        {"name": "temperature", "dtype": "f32", "shape": []},
    ]
    g3 = torch.Generator().manual_seed(77)

    def identity_flat(spec, _codec):
        return spec.flatten({n: torch.randn(s, generator=g3).to(d) for n, d, s in spec.tensors})

    fields, records = model_vector(spec_listed, {"codec": "identity"}, identity_flat)
    yield "model_identity", dict(round=11, sender=12, bundle=True, stable=True, **fields), records
    spec_listed = [
        {"name": "tok.weight", "dtype": "f32", "shape": [10, 16]},
        {"name": "layer.weight", "dtype": "f32", "shape": [16, 4]},
        {"name": "layer.bias", "dtype": "f32", "shape": [16]},
        {"name": "head.bias", "dtype": "f32", "shape": [16]},
    ]
    rice_model = {"codec": "dct", "chunk_shape": [64], "topk": 4, "index_coding": "rice", "value_bits": 2}
    fields, records = model_vector(
        spec_listed, rice_model, lambda spec, codec: designed_dct_input((spec.numel,), codec, 9)
    )
    yield "model_dct_rice", dict(round=12, sender=13, bundle=True, stable=True, **fields), records
    # A layout frame (FORMAT.md section 12) of DeMo's codec: records of templates the reader holds. The
    # embedding and the bias match their templates (compact records); the attention weight's template is a
    # fixed-coding codec's, so its Rice-coded record carries its own params; the conv weight has no
    # template (a full record). The templates are listed in another order than the records.
    demo = {"codec": "dct", **demo_codec_params()}
    shapes = {
        "embed.weight": (128, 64),
        "blocks.0.attn.weight": (32, 48),
        "blocks.0.bias": (96,),
        "conv.weight": (4, 2, 3, 3),
    }
    for n, shape in shapes.items():
        assert build(demo).record_template(n, shape) == default_demo_codec().record_template(n, shape)
    templates = [
        build(demo).record_template("blocks.0.bias", shapes["blocks.0.bias"]),
        build(dict(demo, index_coding="fixed")).record_template("blocks.0.attn.weight", shapes["blocks.0.attn.weight"]),
        build(demo).record_template("embed.weight", shapes["embed.weight"]),
    ]
    yield (
        "dct_layout_bundle",
        dict(round=13, sender=14, bundle=True, stable=True, templates=[template_fields(t) for t in templates]),
        [(n, demo, designed_dct_input(shape, build(demo), seed)) for seed, (n, shape) in enumerate(shapes.items(), 20)],
    )
    # GComp (FORMAT.md §5.4, §6.4) and QSGD (§5.5, §6.3). Deterministic, but their re-encoding is
    # checked in their own tests (test_codec_gcomp.py, test_codec_qsgd.py), not by the DCT-specific one.
    g2 = torch.Generator().manual_seed(99)
    grads = torch.randn(40, 12, generator=g2) * 1e-3
    grads[::3] = 0.0
    grads[5, 7] = 2.5e4  # an exponent that a cap of 5 escapes
    yield (
        "gcomp_levels_bundle",
        dict(round=6, sender=10, bundle=True, stable=False),
        [
            ("lossless", {"codec": "gcomp", "block": 16, "cap": 5}, grads),
            ("level2", {"codec": "gcomp", "block": 16, "cap": 5, "fixed_level": 2}, grads.flip(0)),
            (
                "bf16",
                {"codec": "gcomp", "block": 8, "fixed_level": 1},
                torch.randn(30, generator=g2).to(torch.bfloat16),
            ),
        ],
    )
    yield (
        "qsgd_omega_gamma_bundle",
        dict(round=7, sender=11, bundle=True, stable=False),
        [
            ("omega", {"codec": "qsgd", "levels": 4, "bucket": 32, "seed": 3}, torch.randn(100, generator=g2)),
            (
                "gamma",
                {"codec": "qsgd", "levels": 2, "bucket": 64, "elias": "gamma", "seed": 4},
                torch.randn(7, 9, generator=g2),
            ),
        ],
    )


def main(names: list[str]) -> None:
    path = HERE / "manifest.json"
    manifest = json.loads(path.read_text()) if names and path.exists() else {}
    for name, meta, records in vectors():
        if names and name not in names:
            continue
        entries = [build(config).compress(t, rec)[0] for rec, config, t in records]
        templates = layout_templates(meta["templates"]) if "templates" in meta else None
        frame = gradwire.write_frame(
            entries, round=meta["round"], sender=meta["sender"], bundle=meta["bundle"], templates=templates
        )
        decoded = gradwire.decode_bundle(gradwire.read_frame(frame, templates=templates))
        tensors = {}
        if "model_spec" in meta:
            spec = model_spec(meta["model_spec"])
            [(rec, config, flat)] = records
            again = gradwire.encode_model(
                build(config), model_inputs(spec, flat), spec, round=meta["round"], sender=meta["sender"]
            )
            assert again == frame, "encode_model disagrees with the record written by hand"
            for n, t in gradwire.decode_model(frame, spec).items():
                tensors[f"model/{n}"] = t.clone().contiguous()
        (HERE / f"{name}.gwf").write_bytes(frame)
        for rec, _, t in records:
            tensors[f"input/{rec}"] = t.contiguous()
            tensors[f"decoded/{rec}"] = decoded[rec].contiguous()
        save_file(tensors, str(HERE / f"{name}.safetensors"))
        manifest[name] = dict(meta, records={rec: config for rec, config, _ in records})
    path.write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
