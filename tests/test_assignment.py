"""Data assigned by the run (gradwire.assignment): the draw, its checks, and a run that declares one."""

from __future__ import annotations

import hashlib

import pytest

from gradwire.assignment import AssignmentError, DataAssignment, assigned_pages, random_pages
from gradwire.client import GradwireClient, Node
from gradwire_server.app import create_app
from gradwire_server.settings import ServerSettings
from server_helpers import make_run, served, tiny_state

ASSIGNMENT = DataAssignment(seed=7, pages=1000, pages_per_node=16)


def test_assigned_pages_are_the_same_on_every_call_and_distinct_within_a_draw():
    first = assigned_pages(ASSIGNMENT, node_id=3, round=5)
    assert first == assigned_pages(DataAssignment(7, 1000, 16), 3, 5)
    assert len(first) == 16 and len(set(first)) == 16
    assert all(0 <= p < 1000 for p in first)


def test_assigned_pages_differ_across_nodes_rounds_and_seeds():
    draws = {(node, rnd): tuple(assigned_pages(ASSIGNMENT, node, rnd)) for node in range(8) for rnd in range(8)}
    assert len(set(draws.values())) == len(draws)
    assert assigned_pages(DataAssignment(8, 1000, 16), 3, 5) != assigned_pages(ASSIGNMENT, 3, 5)


def test_the_draw_follows_the_documented_sha256_fisher_yates():
    """An independent reading of the module docstring's three steps gives the same pages."""

    def words(key):
        i = 0
        while True:
            d = hashlib.sha256(key + i.to_bytes(8, "little")).digest()
            yield from (int.from_bytes(d[j : j + 8], "little") for j in range(0, 32, 8))
            i += 1

    def draw(key, n, count):
        w, pool, out = words(key), list(range(n)), []
        for j in range(count):
            while True:
                x = next(w)
                if x < 2**64 - 2**64 % (n - j):
                    break
            r = x % (n - j)
            pool[j], pool[j + r] = pool[j + r], pool[j]
            out.append(pool[j])
        return out

    def key(domain, *ints):
        return domain + b"".join(v.to_bytes(8, "little") for v in ints)

    a = DataAssignment(seed=2**64 - 1, pages=37, pages_per_node=37)
    assert assigned_pages(a, 11, 4) == draw(key(b"gradwire/assigned_pages/v1", 2**64 - 1, 11, 4), 37, 37)
    assert random_pages(a, 4, 5, salt=9) == draw(key(b"gradwire/random_pages/v1", 2**64 - 1, 4, 9), 37, 5)
    assert sorted(assigned_pages(a, 11, 4)) == list(range(37))


def test_random_pages_differ_by_salt_and_round_and_from_the_assignment():
    control = random_pages(ASSIGNMENT, round=5, count=16, salt=0)
    assert control == random_pages(ASSIGNMENT, 5, 16, 0)
    assert len(set(control)) == 16
    assert control != random_pages(ASSIGNMENT, 5, 16, 1)
    assert control != random_pages(ASSIGNMENT, 6, 16, 0)
    assert control != assigned_pages(ASSIGNMENT, 0, 5)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"seed": -1, "pages": 10, "pages_per_node": 1}, "seed must be in 0..2**64-1, got -1"),
        ({"seed": 0, "pages": 0, "pages_per_node": 1}, "pages must be at least 1, got 0"),
        ({"seed": 0, "pages": 10, "pages_per_node": 11}, "pages_per_node must be in 1..pages=10, got 11"),
        ({"seed": 0, "pages": 10, "pages_per_node": 0}, "pages_per_node must be in 1..pages=10, got 0"),
        ({"seed": 1.5, "pages": 10, "pages_per_node": 1}, "seed must be an int, got 1.5"),
        ({"seed": True, "pages": 10, "pages_per_node": 1}, "seed must be an int, got True"),
    ],
)
def test_an_assignment_that_cannot_be_drawn_names_its_values(kwargs, named):
    with pytest.raises(AssignmentError, match=named.replace("*", r"\*").replace(".", r"\.")):
        DataAssignment(**kwargs)


def test_draws_refuse_ids_and_counts_out_of_range():
    with pytest.raises(AssignmentError, match="node_id must be in 0..2"):
        assigned_pages(ASSIGNMENT, -1, 0)
    with pytest.raises(AssignmentError, match="count must be in 1..pages=1000, got 1001"):
        random_pages(ASSIGNMENT, 0, 1001, 0)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with served(create_app(ServerSettings(data_dir=tmp_path_factory.mktemp("srv"), admin_token="adm"))) as c:
        yield c


def test_a_run_hands_its_assignment_to_its_nodes(client):
    run = make_run(client, "adm", n_nodes=2, data_assignment={"seed": 7, "pages": 1000, "pages_per_node": 16})
    assert run.status()["config"]["data_assignment"] == {"seed": 7, "pages": 1000, "pages_per_node": 16}
    node = run.nodes[1]
    with GradwireClient(str(client.base_url), node.token) as gw:
        n = Node(gw, run.run_id, tiny_state(), codec=None, node_id=node.node_id)
        assert n.data_assignment == ASSIGNMENT
        assert n.assigned_pages(5) == assigned_pages(ASSIGNMENT, node.node_id, 5)


def test_a_run_without_an_assignment_says_so_to_its_nodes(client):
    run = make_run(client, "adm", n_nodes=1)
    assert run.status()["config"]["data_assignment"] is None
    node = run.nodes[0]
    with GradwireClient(str(client.base_url), node.token) as gw:
        n = Node(gw, run.run_id, tiny_state(), codec=None, node_id=node.node_id)
        assert n.data_assignment is None
        with pytest.raises(AssignmentError, match=f"run '{run.run_id}' assigns no data"):
            n.assigned_pages(0)


def test_a_run_config_with_an_impossible_assignment_is_refused_naming_it(client):
    r = client.post(
        "/v1/runs",
        json={"data_assignment": {"seed": 1, "pages": 4, "pages_per_node": 5}},
        headers={"Authorization": "Bearer adm"},
    )
    assert r.status_code == 422, r.text
    assert "pages_per_node must be in 1..pages=4, got 5" in r.text
    r = client.post(
        "/v1/runs", json={"data_assignment": {"seed": 1, "pages": 4}}, headers={"Authorization": "Bearer adm"}
    )
    assert r.status_code == 422 and "pages_per_node" in r.text
