"""The demo's models (gradwire_apps.demo.tasks: pydoc text, char transformer) and the real gradients
recorded from them (gradwire_apps.gradients)."""

from __future__ import annotations

import pytest
import torch

from gradwire_apps.demo.tasks import CharTransformer, CharVocab, char_batch, load_pydoc_text
from gradwire_apps.gradients import collect_gradients


def test_pydoc_text_ships_with_python_and_round_trips_through_the_vocabulary():
    text = load_pydoc_text()
    assert len(text) > 100_000 and "lambda" in text
    vocab = CharVocab.of(text)
    assert 50 < len(vocab) < 300 and list(vocab.chars) == sorted(vocab.chars)
    sample = text[1000:1200]
    assert vocab.decode(vocab.encode(sample)) == sample


def test_char_batches_are_next_character_targets():
    tokens = torch.arange(1000)
    x, y = char_batch(tokens, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y, x + 1)


def test_char_transformer_is_causal():
    torch.manual_seed(0)
    model = CharTransformer(vocab_size=30, d_model=32, heads=4, layers=2, context=16).eval()
    ids = torch.randint(0, 30, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 30
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert a.shape == (2, 16, 30)
    torch.testing.assert_close(a[:, :10], b[:, :10])  # the past does not see the future
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("model, steps, every", [("digits", 6, 3), ("char_transformer", 2, 1)])
def test_collect_gradients_records_every_nth_step_reproducibly(model, steps, every):
    a = collect_gradients(model, steps, record_every=every, progress=False)
    assert len(a) == steps // every
    names = list(a[0])
    assert all(list(g) == names for g in a)
    assert all(t.dtype == torch.float32 and t.isfinite().all() and t.norm() > 0 for t in a[0].values())
    assert not torch.equal(a[0][names[0]], a[-1][names[0]])  # training moved on between records
    b = collect_gradients(model, steps, record_every=every, progress=False)
    assert all(torch.equal(a[-1][n], b[-1][n]) for n in names)


def test_unknown_model_is_rejected():
    with pytest.raises(ValueError, match="unknown model"):
        collect_gradients("resnet", 1)
