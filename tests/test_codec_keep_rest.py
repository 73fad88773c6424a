"""``Codec.compress_bundle_keep_rest``: error feedback's send in one call. The DCT codec's records are
``compress_bundle``'s byte for byte and every buffer is left holding exactly ``buffer − reconstruction``
(its exact decode subtracted straight into it on the CPU), for every kind of tensor a bundle holds; a codec
whose records may view their input refuses, since writing the buffer would change the records' bytes."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire.algorithms import default_sparseloco_codec
from gradwire.codecs.identity import IdentityCodec


def _bundle() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "matrix": torch.randn(256, 192, generator=g) * 1e-3,  # tiles, decoded into the matrix in place
        "bias": torch.randn(1024, generator=g),  # flat chunks
        "odd": torch.randn(100, 37, generator=g),  # padded flat chunks: the decode, then a subtraction
        "empty": torch.randn(0, 4, generator=g),
        "half": torch.randn(64, 64, generator=g).half(),
        "columns": torch.randn(128, 256, generator=g)[:, :128],  # not contiguous
    }


@pytest.mark.parametrize("codec", [default_sparseloco_codec(), gradwire.DCTCodec(topk=32)], ids=repr)
def test_dct_keep_rest_gives_compress_bundles_records_and_leaves_exactly_the_rest(codec):
    given = _bundle()
    before = codec.compress_bundle({n: t.clone() for n, t in given.items()})
    buffers = {n: t.clone() for n, t in given.items()}
    views = dict(buffers)
    records = codec.compress_bundle_keep_rest(buffers)
    assert list(records) == list(given)
    for name, tensor in given.items():
        want, recon = before[name]
        got = records[name]
        assert got.params == want.params and got.shape == want.shape, name
        for section, data in want.sections.items():
            assert bytes(memoryview(got.sections[section])) == bytes(memoryview(data)), (name, section)
        assert torch.equal(gradwire.decode_entry(got), recon.to(torch.float32)), name
        assert buffers[name] is views[name], f"{name}: the rest was not left in the buffer itself"
        assert torch.equal(buffers[name], tensor - recon.to(tensor.dtype)), name


def test_a_codec_whose_records_view_their_input_refuses_to_keep_the_rest_in_place():
    buffers = {"w": torch.randn(8, 8)}
    with pytest.raises(TypeError, match="view their input"):
        IdentityCodec().compress_bundle_keep_rest(buffers)
