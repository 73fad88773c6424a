"""ReplicaTimeouts: the defaults keep every order rule, and a setting that breaks one is refused with the rule
named and the values given."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from gradwire.torch import ReplicaTimeouts, TimeoutOrderError
from gradwire.torch.replica_timeouts import TIMEOUT_RULES


def test_defaults_keep_every_rule():
    t = ReplicaTimeouts()
    for _, small, large, factor, _ in TIMEOUT_RULES:
        assert factor * getattr(t, small) < getattr(t, large)


@pytest.mark.parametrize("rule", TIMEOUT_RULES, ids=[r[0] for r in TIMEOUT_RULES])
def test_each_broken_rule_is_refused_by_name_with_the_values(rule):
    name, small, large, factor, _ = rule
    base = asdict(ReplicaTimeouts())
    base[small] = base[large] / factor  # exactly at the bound: not strictly smaller
    with pytest.raises(TimeoutOrderError) as err:
        ReplicaTimeouts(**base)
    assert err.value.rule in {r[0] for r in TIMEOUT_RULES}
    # The first rule the setting breaks is named; moving `small` up may break an earlier one, never none.
    broken = [r[0] for r in TIMEOUT_RULES if not r[3] * base[r[1]] < base[r[2]]]
    assert err.value.rule == broken[0] and name in broken
    assert f"{small}={base[small]:g} s" in str(err.value) or err.value.rule != name


def test_join_shorter_than_a_recovery_is_refused():
    with pytest.raises(TimeoutOrderError, match=r"state_download<join.*state_download=20 s, join=10 s") as err:
        ReplicaTimeouts(join=10.0)
    assert err.value.rule == "state_download<join"


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1", True])
def test_a_timeout_that_is_no_positive_number_is_refused(bad):
    with pytest.raises(TimeoutOrderError, match="heartbeat_timeout must be a positive number"):
        ReplicaTimeouts(heartbeat_timeout=bad)


def test_the_fault_bound_is_twice_heartbeat_plus_quorum_tick():
    t = ReplicaTimeouts(heartbeat_timeout=1.0, quorum_tick=0.05)
    assert t.fault_to_commit_bound == pytest.approx(2.1)
    assert t.ms("heartbeat_timeout") == 1000 and t.delta("join").total_seconds() == 60.0
