"""The demo's tasks: shards that partition the training data, finite losses, evaluation on held-out data."""

from __future__ import annotations

import pytest
import torch

from gradwire_apps.demo.tasks import CharTask, DigitsTask, make_task


def test_digits_shards_partition_the_training_split():
    task = DigitsTask(hidden=16)
    shards = task.shards(3)
    assert sum(len(s["y"]) for s in shards) == len(task.data.y_train)
    joined = torch.cat([s["x"] for s in shards])
    assert sorted(map(tuple, joined.tolist())) == sorted(map(tuple, task.data.x_train.tolist()))
    torch.manual_seed(0)
    model = task.build()
    loss = task.batch_loss(model, shards[0], 8, torch.Generator().manual_seed(0))
    assert loss.ndim == 0 and torch.isfinite(loss)
    test_loss, acc = task.evaluate(model)
    assert 1.5 < test_loss < 3.5 and 0.0 <= acc <= 0.35  # an untrained 10-way classifier


def test_char_task_shards_are_contiguous_and_exclude_the_held_out_text():
    task = CharTask(d_model=32)
    shards = task.shards(4)
    assert torch.equal(torch.cat([s["tokens"] for s in shards]), task.tokens[: task.split])
    assert task.split < len(task.tokens)
    model = task.build()
    loss = task.batch_loss(model, shards[1], 2, torch.Generator().manual_seed(0))
    # An untrained model is about uniform over the vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(float(len(task.vocab)))).item()) < 1.0
    held_loss, acc = task.evaluate(model)
    assert held_loss > 0 and 0.0 <= acc <= 1.0
    assert task.evaluate(model) == (held_loss, acc)  # fixed held-out windows


def test_make_task_by_name():
    assert isinstance(make_task("digits"), DigitsTask) and make_task("digits", 8).hidden == 8
    assert make_task("transformer", 32).d_model == 32
    with pytest.raises(ValueError, match="unknown demo model"):
        make_task("resnet")
