"""Codec state is declared, persisted and restored: every codec (and ErrorFeedback around it) restored
from ``state_dict()`` into a fresh instance continues exactly as the original would.

Every codec of the registry is covered (a new one is picked up automatically), plus the codecs outside
it that follow the protocol (Accordion), each in the settings that exercise its state.
"""

from __future__ import annotations

import json

import pytest
import torch

import gradwire
from gradwire import Accordion, ErrorFeedback
from gradwire.codecs import CODECS, make_codec
from gradwire.frame import write_frame

#: Constructor arguments per case: registry name -> kwargs. Every registered codec gets its defaults
#: (or these) through ``_cases``.
KWARGS = {
    "topk": dict(density=0.1),
    "randomk": dict(density=0.1),
    "gcomp": dict(rebuild_every=2),  # books rebuilt within the run: ids and "carried" change
}
EXTRA = {
    "topk-global": lambda: make_codec("topk", density=0.1, scope="global"),
    "gcomp-momentum": lambda: make_codec("gcomp", rebuild_every=3, fixed_level=1),
    "powersgd-r1": lambda: make_codec("powersgd", rank=1, min_compression=1.0),
    "accordion-powersgd": lambda: Accordion(
        low={"codec": "powersgd", "rank": 2}, high={"codec": "powersgd", "rank": 1}, threshold=0.2, interval=2
    ),
    "accordion-randomk-qsgd": lambda: Accordion(
        low={"codec": "qsgd", "levels": 8}, high={"codec": "randomk", "k": 5}, threshold=0.05, interval=1
    ),
    "accordion-global-topk": lambda: Accordion(
        low=gradwire.TopK(k=60, scope="global"), high=gradwire.TopK(k=6, scope="global"), threshold=5.0, interval=1
    ),
}


def _factory(case):
    if case in EXTRA:
        return EXTRA[case]
    return lambda: make_codec(case, **KWARGS.get(case, {}))


CASES = sorted(CODECS) + sorted(EXTRA)
SHAPES = {"w": (24, 16), "b": (16,), "conv": (4, 3, 3, 3), "s": ()}
STATELESS = {"identity", "dct", "minmax", "3lc", "onebit", "signsgd", "topk", "topk-global"}


def _step(t: int) -> dict[str, torch.Tensor]:
    """The tensors of step ``t``: their scale changes over time so Accordion switches settings."""
    g = torch.Generator().manual_seed(1000 + t)
    scale = 1.0 + 3.0 * (t % 3 == 0)
    return {n: torch.randn(s, generator=g) * scale + 0.05 * t for n, s in SHAPES.items()}


def _frame(codec, t, bundle: bool) -> bytes:
    tensors = _step(t)
    if bundle:
        return codec.encode_bundle(tensors, round=t)
    return b"".join(codec.encode(x, name=n, round=t) for n, x in tensors.items())


def _through_cpu_and_json(state):
    """What a checkpoint does to a state: tensors to the CPU (and back), tuples to lists, plain values
    through JSON."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {k: _through_cpu_and_json(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_through_cpu_and_json(v) for v in state]
    assert state is None or isinstance(state, (bool, int, float, str)), type(state)
    return json.loads(json.dumps(state))


def _leaves(state, path=()):
    if isinstance(state, dict):
        for k, v in state.items():
            assert isinstance(k, str), path
            yield from _leaves(v, path + (k,))
    elif isinstance(state, list):
        for i, v in enumerate(state):
            yield from _leaves(v, path + (i,))
    else:
        yield path, state


def _check_plain(state):
    for path, leaf in _leaves(state):
        assert leaf is None or isinstance(leaf, (torch.Tensor, bool, int, float, str)), (path, type(leaf))


@pytest.mark.parametrize("feedback", [False, True], ids=["bare", "error-feedback"])
@pytest.mark.parametrize("bundle", [False, True], ids=["tensors", "bundle"])
@pytest.mark.parametrize("case", CASES)
def test_restored_codec_continues_byte_identically(case, bundle, feedback):
    make = _factory(case)
    wrap = ErrorFeedback if feedback else (lambda c: c)
    original = wrap(make())
    k = 4
    for t in range(k):
        _frame(original, t, bundle)
    state = original.state_dict()
    _check_plain(state)
    restored = wrap(make())
    restored.load_state_dict(_through_cpu_and_json(state))
    for t in range(k, k + 4):
        assert _frame(restored, t, bundle) == _frame(original, t, bundle), (case, t)


@pytest.mark.parametrize("case", CASES)
def test_state_dict_is_a_copy_and_survives_being_loaded_twice(case):
    codec = _factory(case)()
    for t in range(3):
        codec.encode_bundle(_step(t))
    state = codec.state_dict()
    for _, leaf in _leaves(state):
        if isinstance(leaf, torch.Tensor) and leaf.numel() and leaf.is_floating_point():
            leaf.add_(1.0)  # must not reach the codec
    twin = _factory(case)()
    twin.load_state_dict(codec.state_dict())
    twin.load_state_dict(twin.state_dict())
    assert twin.encode_bundle(_step(3)) == codec.encode_bundle(_step(3))


@pytest.mark.parametrize("case", sorted(STATELESS))
def test_stateless_codecs_have_an_empty_state(case):
    codec = _factory(case)()
    codec.encode_bundle(_step(0))
    assert codec.state_dict() == {}
    codec.load_state_dict({})
    with pytest.raises(ValueError, match="keeps no state"):
        codec.load_state_dict({"anything": 1})


def test_the_stateful_codecs_say_what_they_keep():
    assert set(make_codec("powersgd").state_dict()) == {"q"}
    assert set(make_codec("qsgd").state_dict()) == {"generators"}
    assert make_codec("randomk", k=3).state_dict() == {"calls": 0}
    assert make_codec("gcomp").state_dict() == {"books": {}}
    acc = EXTRA["accordion-powersgd"]()
    assert set(acc.state_dict()) == {"layers", "log", "made_by", "low", "high"}
    assert set(ErrorFeedback(acc).state_dict()) == {"residuals", "codec"}
    # Every registered codec not listed stateless here declares some state, even before its first call.
    for name in CODECS:
        if name not in STATELESS:
            assert _factory(name)().state_dict() != {}, name


BAD_STATES = [
    ("powersgd", None),
    ("powersgd", {}),
    ("powersgd", {"q": {"w": [1.0, 2.0]}}),
    ("powersgd", {"q": {"w": torch.zeros(16, 3)}}),  # more columns than rank 2
    ("powersgd", {"q": {"w": torch.zeros(16, 2, dtype=torch.int32)}}),
    ("powersgd", {"q": {}, "extra": 1}),
    ("qsgd", {"generators": {"cpu": torch.zeros(3, dtype=torch.uint8)}}),
    ("qsgd", {"generators": {"not a device": torch.zeros(3, dtype=torch.uint8)}}),
    ("qsgd", {"generators": {"cpu": torch.zeros(3)}}),
    ("randomk", {"calls": -1}),
    ("randomk", {"calls": "3"}),
    ("randomk", {"calls": True}),
    (
        "gcomp",
        {
            "books": {
                "w": {
                    "book": torch.zeros(4, dtype=torch.uint8),
                    "book_id": 0,
                    "steps": 0,
                    "counts": torch.zeros(256, dtype=torch.int64),
                    "carried": False,
                }
            }
        },
    ),
    ("gcomp", {"books": {"w": {"book_id": 0}}}),
    ("identity", {"q": {}}),
    ("dct", [1]),
    ("accordion-powersgd", {"layers": {}, "log": [], "made_by": [], "low": {"q": {}}}),
    (
        "accordion-powersgd",
        {
            "layers": {"w": {"calls": 1, "total": None, "old_norm": None, "setting": "medium"}},
            "log": [],
            "made_by": [],
            "low": {"q": {}},
            "high": {"q": {}},
        },
    ),
    (
        "accordion-powersgd",
        {"layers": {}, "log": [[1, "w", 1.0, "inf", True]], "made_by": [], "low": {"q": {}}, "high": {"q": {}}},
    ),
    ("accordion-powersgd", {"layers": {}, "log": [], "made_by": [], "low": {"q": {}}, "high": {"nope": {}}}),
]


@pytest.mark.parametrize("case, state", BAD_STATES, ids=[f"{c}-{i}" for i, (c, _) in enumerate(BAD_STATES)])
def test_a_bad_state_raises_value_error(case, state):
    codec = _factory(case)()
    before = codec.state_dict()
    with pytest.raises(ValueError):
        codec.load_state_dict(state)
    assert codec.state_dict().keys() == before.keys()


def test_error_feedback_refuses_bad_states_and_keeps_the_flat_residual_format():
    ef = ErrorFeedback(make_codec("randomk", k=3))
    with pytest.raises(ValueError, match="residual 'w'"):
        ef.load_state_dict({"residuals": {"w": torch.zeros(3, dtype=torch.int64)}, "codec": {"calls": 0}})
    with pytest.raises(ValueError, match="unexpected"):
        ef.load_state_dict({"residuals": {}, "codec": {"calls": 0}, "more": 1})
    with pytest.raises(ValueError):
        ef.load_state_dict({"residuals": {}, "codec": {"calls": -5}})
    ef.load_state_dict({"w": torch.ones(3)})  # the flat {name: residual} form: residuals only
    assert torch.equal(ef.residual("w"), torch.ones(3)) and ef.codec.calls == 0
    ef.load_state_dict({"residuals": {"w": torch.zeros(3, dtype=torch.float16)}, "codec": {"calls": 7}})
    assert ef.residual("w").dtype == torch.float32 and ef.codec.calls == 7


def test_qsgd_keeps_the_state_of_a_device_it_has_not_used_yet():
    codec = make_codec("qsgd")
    codec.encode(torch.randn(40), name="w")
    state = codec.state_dict()
    state["generators"]["cuda:7"] = state["generators"]["cpu"].clone()
    other = make_codec("qsgd")
    other.load_state_dict(state)
    assert set(other.state_dict()["generators"]) == {"cpu", "cuda:7"}
    x = torch.randn(40)
    assert other.encode(x, name="w") == codec.encode(x, name="w")


def test_accordion_restores_its_log_and_regimes():
    acc = EXTRA["accordion-powersgd"]()
    entries = []
    for t in range(7):
        entries += [e for e, _ in acc.compress_bundle(_step(t)).values()]
    assert acc.log
    twin = EXTRA["accordion-powersgd"]()
    twin.load_state_dict(_through_cpu_and_json(acc.state_dict()))
    assert twin.log == acc.log
    assert [twin.regime_of(e) for e in entries] == [acc.regime_of(e) for e in entries]
    assert all(twin.setting(n) == acc.setting(n) for n in SHAPES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES)
def test_cuda_state_restores_through_the_cpu(case):
    make = _factory(case)
    original = ErrorFeedback(make())
    steps = [{n: x.cuda() for n, x in _step(t).items()} for t in range(7)]
    for t in range(4):
        original.encode_bundle(steps[t], round=t)
    restored = ErrorFeedback(make())
    restored.load_state_dict(_through_cpu_and_json(original.state_dict()))
    for t in range(4, 7):
        a = original.encode_bundle(steps[t], round=t)
        b = restored.encode_bundle(steps[t], round=t)
        assert a == b, (case, t)
        assert write_frame(gradwire.read_frame(a).entries, round=t, bundle=True) == a
