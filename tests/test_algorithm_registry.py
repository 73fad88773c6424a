"""One ``Algorithm`` per training algorithm, found through one registry: its config type (which the server's
``RunConfig`` reuses), its node side, what a version publishes and how it is applied — and no code outside
the registry tests an algorithm's name."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gradwire.algorithms import (
    ADAMW,
    DEMO,
    SPARSELOCO,
    AdamWConfig,
    Algorithm,
    DeMoConfig,
    NodeSide,
    SparseLoCoConfig,
    algorithm_names,
    config_from_json,
    get_algorithm,
    register,
)
from gradwire.algorithms import base as registry
from gradwire.published import apply_mean
from gradwire_server.config import RunConfig

REPO = Path(__file__).resolve().parent.parent


def test_every_algorithm_is_registered_once_under_its_name():
    assert algorithm_names() == ("adamw", "demo", "sparseloco")
    assert [get_algorithm(n) for n in algorithm_names()] == [ADAMW, DEMO, SPARSELOCO]
    assert [a.publication for a in (ADAMW, DEMO, SPARSELOCO)] == ["diff", "mean", "mean"]
    with pytest.raises(ValueError, match="unknown algorithm 'adam'.*adamw, demo, sparseloco"):
        get_algorithm("adam")
    with pytest.raises(ValueError, match="already registered"):
        register(DEMO)


@pytest.mark.parametrize("algo", [ADAMW, DEMO, SPARSELOCO], ids=lambda a: a.name)
def test_the_run_config_section_is_the_librarys_config_type(algo):
    config = RunConfig.model_validate({"algorithm": algo.name})
    section = config.algorithm_config()
    assert isinstance(section, algo.config_type) and section == algo.config_type()
    # The JSON the server stores is read back by the library (the nodes' side) to the same value.
    stored = config.model_dump(mode="json")[algo.config_field]
    assert config_from_json(algo.config_type, stored) == section
    assert algo.run_config(config.model_dump(mode="json")) == section


@pytest.mark.parametrize(
    "section, value, match",
    [
        ("demo", {"lr": math.inf}, "demo.lr must be finite"),
        ("demo", {"beta": 1.0}, "demo.beta must be < 1.0"),
        ("sparseloco", {"sync_every": 0}, "sparseloco.sync_every must be >= 1"),
        ("sparseloco", {"outer_lr": 1e999}, "outer_lr must be finite"),
        ("sparseloco", {"inner": {"lr": -1.0}}, "lr must be > 0"),
        ("optimizer", {"schedule": "cosine"}, "cosine' needs total_rounds"),
        ("optimizer", {"betas": [0.9, 1.5]}, "each of betas must be < 1.0"),
        ("demo", {"lrr": 0.1}, "lrr"),
    ],
)
def test_out_of_range_and_unknown_values_are_refused_by_the_library_and_the_server(section, value, match):
    algo = next(a for a in (ADAMW, DEMO, SPARSELOCO) if a.config_field == section)
    with pytest.raises((ValueError, TypeError), match=match):
        algo.config(value)
    with pytest.raises(ValidationError, match=match):
        RunConfig.model_validate({"algorithm": algo.name, section: value})


def test_a_run_without_a_downlink_gets_its_algorithms_default():
    assert RunConfig.model_validate({"algorithm": "demo"}).downlink.params["value_bits"] == 1
    sl = RunConfig.model_validate({"algorithm": "sparseloco", "sparseloco": {"sync_every": 1}})
    from gradwire.algorithms.sparseloco import sparseloco_codec_params

    assert sl.downlink.params["value_bits"] == 4
    assert sl.downlink.params["topk"] < sparseloco_codec_params(1)["topk"]  # the nodes' bytes, 4-bit values
    assert RunConfig.model_validate({}).downlink.params == {"chunk_shape": [64, 64], "topk": 32}
    given = {"codec": "dct", "params": {"chunk_shape": [64], "topk": 3}}
    assert RunConfig.model_validate({"algorithm": "demo", "downlink": given}).downlink.params["topk"] == 3


@dataclasses.dataclass(frozen=True)
class _HalfConfig:
    lr: float = 0.5


class _HalfStep(Algorithm):
    """A toy algorithm: versions publish a mean, applied as ``w -= lr * mean``."""

    name = "toy-half-step"
    config_field = "toy"
    config_type = _HalfConfig
    publication = "mean"

    def node(self, config, codec, params, module=None, model_spec=None) -> NodeSide:
        raise NotImplementedError

    def apply(self, config, weights, mean, state):
        for n in sorted(weights):
            weights[n].sub_(torch.mul(mean[n], self.config(config).lr))
        return {"applied": state.get("applied", 0) + 1}


def test_a_new_algorithm_is_applied_through_the_registry_without_touching_the_transports():
    toy = register(_HalfStep())
    try:
        weights = {"w": torch.ones(3)}
        state = apply_mean("toy-half-step", {"toy": {"lr": 0.25}}, weights, {"w": torch.full((3,), 2.0)}, {})
        assert torch.equal(weights["w"], torch.full((3,), 0.5)) and state == {"applied": 1}
        assert get_algorithm("toy-half-step") is toy
    finally:
        del registry._REGISTRY[toy.name]
    with pytest.raises(ValueError, match="unknown algorithm"):
        apply_mean("toy-half-step", {}, {"w": torch.ones(3)}, {"w": torch.ones(3)}, {})


def _compared_strings(path: Path) -> list[tuple[int, str]]:
    """String constants compared (``==``, ``!=``, ``in``) anywhere in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                out += [
                    (node.lineno, e.value) for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
                ]
    return out


def test_no_code_outside_the_registry_tests_an_algorithms_name():
    names = set(algorithm_names())
    registry_dir = REPO / "python" / "gradwire" / "algorithms"
    offenders = []
    for root in (REPO / "python" / "gradwire", REPO / "server" / "gradwire_server"):
        for path in sorted(root.rglob("*.py")):
            if path.is_relative_to(registry_dir) or path.name == "gcomp.py":  # gcomp: torch optimizer kinds
                continue
            offenders += [
                f"{path.relative_to(REPO)}:{line} compares {s!r}" for line, s in _compared_strings(path) if s in names
            ]
    assert not offenders, offenders


def test_the_name_check_finds_a_comparison(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("if config.algorithm == 'demo' or a in ('sparseloco', 'x'):\n    pass\n")
    assert _compared_strings(path) == [(1, "demo"), (1, "sparseloco"), (1, "x")]


def test_the_library_config_types_are_plain_dataclasses():
    # The library depends on no pydantic: the server validates the same dataclasses through theirs.
    for cls in (AdamWConfig, DeMoConfig, SparseLoCoConfig):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


@pytest.mark.parametrize("sync_every", [1, 8, 32])
def test_sparselocos_default_downlink_spends_the_nodes_bytes_on_4_bit_values(sync_every):
    from gradwire.algorithms.sparseloco import default_sparseloco_codec, default_sparseloco_downlink
    from gradwire.frame import write_frame

    x = {"w": torch.randn(512, 512, generator=torch.Generator().manual_seed(sync_every))}
    up, down = default_sparseloco_codec(sync_every), default_sparseloco_downlink(sync_every)
    assert down.value_bits == 4 and down.topk < up.topk
    sizes = [
        len(write_frame([e for e, _ in c.compress_bundle(x).values()], round=0, sender=0, bundle=True))
        for c in (up, down)
    ]
    assert 0.85 * sizes[0] <= sizes[1] <= 1.05 * sizes[0], sizes
