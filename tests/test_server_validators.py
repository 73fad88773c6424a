"""Validators through a real server (uvicorn on loopback, SQLite): their scores decide the weights, the median of
three ignores one liar, a node can neither post scores nor raise its own weight, a round with no score by its
deadline closes with the structural rule, and a kill -9 during a scored round loses nothing and replays bit for
bit; a validator reads a round as it fills (a long poll answered at each arrival), a candidate arriving after
the round became ready does not hold it, and the ``Validator`` helper measures candidates before the quorum and
waits for a round that is not open yet (docs/SERVER.md, "Validators")."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from gradwire.assignment import DataAssignment, assigned_pages
from gradwire.client import GradwireClient, Validator, split_frames
from gradwire.frame import read_frame
from gradwire.published import read_published
from gradwire_server.app import create_app
from gradwire_server.settings import ServerSettings
from server_helpers import Node, dense_frame, make_run, random_grads, served

ADMIN = "adm"
#: A demo run that publishes its frames verbatim: each version's weights are in its bytes.
FRAMES_RUN = {"algorithm": "demo", "publish": "frames", "quorum": 4}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with served(create_app(ServerSettings(data_dir=tmp_path_factory.mktemp("srv"), admin_token=ADMIN))) as c:
        yield c


def frame(rnd: int, sender: int) -> bytes:
    return dense_frame(random_grads(1000 * rnd + sender), rnd, sender)


def register(client: httpx.Client, run, n: int) -> list[Node]:
    out = []
    for i in range(n):
        r = client.post(run.url("/validators"), json={"name": f"v{i}"}, headers=run.admin)
        assert r.status_code == 201, r.text
        body = r.json()
        out.append(Node(body["validator_id"], body["token"]))
    return out


def submit_round(run, rnd: int) -> None:
    for node in run.nodes:
        r = run.submit(node, rnd, frame(rnd, node.node_id))
        assert r.status_code == 202, r.text


def candidates(run, validator: Node, rnd: int) -> list[bytes]:
    r = run.client.get(run.url(f"/rounds/{rnd}/candidates"), params={"wait": 20}, headers=validator.headers)
    assert r.status_code == 200, r.text
    return split_frames(r.content)


def post(run, who: Node, rnd: int, scores: dict[int, float]) -> httpx.Response:
    return run.client.post(run.url(f"/rounds/{rnd}/scores"), json={"scores": scores}, headers=who.headers)


def published_weights(client, run) -> list[dict[int, float]]:
    with GradwireClient(str(client.base_url), ADMIN) as admin:
        return [{f.sender: w for f, w in zip(v.frames, v.weights)} for v in admin.published(run.run_id, 0).versions]


def test_the_validators_scores_decide_the_weights(client):
    run = make_run(client, ADMIN, n_nodes=4, **FRAMES_RUN, validation={"score_deadline_s": 30})
    (validator,) = register(client, run, 1)
    submit_round(run, 0)
    got = candidates(run, validator, 0)
    assert len(got) == 4
    t0 = time.monotonic()
    r = post(run, validator, 0, {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.0})
    assert r.status_code == 200 and r.json() == {"round": 0, "scored": 4}, r.text
    run.wait_version(1)
    assert time.monotonic() - t0 < 5  # every validator scored every candidate: no wait for the deadline
    (weights,) = published_weights(client, run)
    assert weights[4] == 0.0
    assert weights[3] == pytest.approx(weights[1] / 2)
    assert weights[1] == weights[2] and sum(weights.values()) == pytest.approx(1.0)
    log = client.get(run.url("/scores"), headers=run.admin).json()
    assert log == [
        {
            "version": 1,
            "scored": True,
            "weights": {"1": 1.0, "2": 1.0, "3": 0.5, "4": 0.0},
            "scores": {"1": {"1": 1.0, "2": 1.0, "3": 0.5, "4": 0.0}},
        }
    ]


def test_the_median_of_three_validators_ignores_one_that_lies(client):
    honest = {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.0}
    inverted = {n: 1.0 - s for n, s in honest.items()}
    figures = []
    for liars in (0, 1):
        run = make_run(client, ADMIN, n_nodes=4, **FRAMES_RUN, validation={"score_deadline_s": 30})
        validators = register(client, run, 3)
        for rnd in range(2):
            submit_round(run, rnd)
            for i, v in enumerate(validators):
                candidates(run, v, rnd)
                assert post(run, v, rnd, inverted if i < liars else honest).status_code == 200
            run.wait_version(rnd + 1)
        figures.append(published_weights(client, run))
    assert figures[1] == figures[0]
    assert figures[1][-1][4] == 0.0 and figures[1][-1][1] == pytest.approx(1 / 3)


def test_a_node_cannot_post_scores_read_candidates_or_raise_its_own_weight(client):
    run = make_run(client, ADMIN, n_nodes=4, **FRAMES_RUN, validation={"score_deadline_s": 1.0})
    (validator,) = register(client, run, 1)
    submit_round(run, 0)
    node = run.nodes[3]
    for who in (node, Node(0, ADMIN)):
        r = post(run, who, 0, {node.node_id: 1.0, 1: 0.0})
        assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
        r = client.get(run.url("/rounds/0/candidates"), headers=who.headers)
        assert r.status_code == 403, r.text
    # Nor can a validator's token submit an update, or a node's register a validator.
    assert run.submit(validator, 1, frame(1, 1)).status_code == 403
    assert client.post(run.url("/validators"), json={}, headers=node.headers).status_code == 403
    run.wait_version(1)  # the validator never scored: the round closed at its deadline, unscored
    (entry,) = client.get(run.url("/scores"), headers=run.admin).json()
    assert entry["scored"] is False and entry["scores"] == {}
    (weights,) = published_weights(client, run)
    assert weights[node.node_id] == pytest.approx(weights[1])


def test_scores_that_name_no_candidate_or_leave_zero_to_one_are_refused_naming_them(client):
    run = make_run(client, ADMIN, n_nodes=4, **FRAMES_RUN, validation={"score_deadline_s": 30})
    (validator,) = register(client, run, 1)
    submit_round(run, 0)
    r = post(run, validator, 0, {1: 1.5})
    assert r.status_code == 422 and "[0, 1]" in r.text and "1.5" in r.text, r.text
    r = post(run, validator, 0, {9: 1.0})
    assert r.status_code == 422 and "node(s) [9]" in r.text, r.text
    r = post(run, validator, 1, {1: 1.0})
    assert r.status_code == 409 and r.json()["error"] == "round_not_open", r.text


def test_a_round_with_no_score_by_its_deadline_closes_with_the_structural_rule(client):
    """One validator registered and down: each round waits its score deadline (1 s) and no more, and publishes
    what a run without validators publishes from the same frames."""
    plain = make_run(client, ADMIN, n_nodes=4, **FRAMES_RUN)
    waited = make_run(client, ADMIN, n_nodes=4, **FRAMES_RUN, validation={"score_deadline_s": 1.0})
    register(client, waited, 1)
    for rnd in range(3):
        submit_round(plain, rnd)
        plain.wait_version(rnd + 1)
        t0 = time.monotonic()
        submit_round(waited, rnd)
        waited.wait_version(rnd + 1)
        assert 0.9 <= time.monotonic() - t0 < 3.0
    assert published_weights(client, waited) == published_weights(client, plain)
    a = client.get(plain.url("/updates"), params={"since": 0}, headers=plain.admin)
    b = client.get(waited.url("/updates"), params={"since": 0}, headers=waited.admin)
    assert [v.weights for v in read_published(a.content)] == [v.weights for v in read_published(b.content)]


def test_a_kill_during_a_scored_round_loses_nothing_and_replays_bit_for_bit(tmp_path):
    """An adamw run and a re-encoded sparseloco run (both replay from their logged updates), two validators each,
    one node weighed 0 and one 0.5 every round. One server is killed (-9) in round 3 after the nodes' updates
    and the first validator's scores were acknowledged, before the second's; restarted, it takes the second
    validator's scores and closes the round. Every version it publishes equals an uninterrupted twin's."""
    from live_server import LiveServer

    env = {"GRADWIRE_CHECKPOINT_EVERY": "2", "GRADWIRE_CHECKPOINT_EVERY_VERSION_BELOW_BYTES": "0"}
    configs = [
        {"algorithm": "adamw", "quorum": 4, "validation": {"score_deadline_s": 60}},
        {"algorithm": "sparseloco", "quorum": 4, "publish": "aggregate", "validation": {"score_deadline_s": 60}},
    ]
    scores = {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.0}
    published = []
    for crash in (False, True):
        with LiveServer(tmp_path / f"crash-{crash}", env=env) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
            runs = [make_run(c, srv.admin_token, n_nodes=4, **config) for config in configs]
            validators = [register(c, run, 2) for run in runs]
            for rnd in range(6):
                for run, (first, _) in zip(runs, validators):
                    submit_round(run, rnd)
                    candidates(run, first, rnd)
                    assert post(run, first, rnd, scores).status_code == 200
                if crash and rnd == 3:
                    srv.kill()
                    srv.start()
                for run, (_, second) in zip(runs, validators):
                    candidates(run, second, rnd)
                    assert post(run, second, rnd, scores).status_code == 200
                    run.wait_version(rnd + 1)
            got = []
            for run in runs:
                r = c.get(run.url("/updates"), params={"since": 0}, headers=run.admin)
                assert r.status_code == 200 and int(r.headers["X-Gradwire-Version"]) == 6
                got.append(r.content)
                log = c.get(run.url("/scores"), headers=run.admin).json()
                assert all(e["scored"] and e["weights"] == {str(k): v for k, v in scores.items()} for e in log)
            published.append(got)
            if crash:
                assert "made frames other than the published ones" not in (srv.data_dir / "server.log").read_text()
    assert published[0] == published[1]


# -- the Validator helper ------------------------------------------------------------------------------------

TRUE_W = torch.arange(1.0, 9.0) / 8
#: Pages of the Gauntlet's task: each with an offset of its own, which its page's one-hot input lets a model learn.
PAGES = 64


def page_batch(pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression task cut into pages: page p's 16 inputs are drawn from seed p, labelled by TRUE_W."""
    xs = torch.cat([torch.randn(16, 8, generator=torch.Generator().manual_seed(p)) for p in pages])
    return xs, xs @ TRUE_W.unsqueeze(1)


def paged_batch(pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``page_batch`` with each input's page one-hot beside it and the page's own offset in its label."""
    x, y = page_batch(pages)
    onehot = torch.zeros(len(x), PAGES)
    offsets = torch.randn(PAGES, generator=torch.Generator().manual_seed(12345))
    for i, p in enumerate(pages):
        onehot[16 * i : 16 * (i + 1), p] = 1.0
        y[16 * i : 16 * (i + 1)] += offsets[p]
    return torch.cat([x, onehot], dim=1), y


def mse(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def gradient_on(model: torch.nn.Module, batch, scale: float = 1.0) -> dict[str, torch.Tensor]:
    model.zero_grad()
    mse(model, batch).backward()
    return {n: p.grad.detach().clone() * scale for n, p in model.named_parameters()}


def _serve_validator(validator: Validator, rounds: int, out: list) -> threading.Thread:
    def loop():
        try:
            for rnd in range(rounds):
                out.append(validator.score_round(rnd, wait=20))
        except BaseException as exc:  # surfaced by the test
            out.append(exc)

    t = threading.Thread(target=loop)
    t.start()
    return t


def test_the_gauntlet_scores_nodes_on_their_own_pages_against_random_pages(client):
    """A run that assigns its data: two honest nodes send the gradient of their assigned pages; a lazy node sends
    nothing useful (zeros); a colluder sends a gradient that fits its own pages' offsets and, beside it, the
    ascent of the shared weights: good on its own pages, harmful elsewhere. Only the honest ones keep weight."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8 + PAGES, 1)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    assignment = {"seed": 3, "pages": PAGES, "pages_per_node": 4}
    run = make_run(
        client,
        ADMIN,
        n_nodes=4,
        state=state,
        **FRAMES_RUN,
        data_assignment=assignment,
        validation={"score_deadline_s": 30},
    )
    (v,) = register(client, run, 1)
    a = DataAssignment(**assignment)
    with GradwireClient(str(client.base_url), v.token) as gw:
        validator = Validator(
            gw, run.run_id, torch.nn.Linear(8 + PAGES, 1), mse, pages=paged_batch, step_size=0.05, salt=1
        )
        out: list = []
        t = _serve_validator(validator, 1, out)
        for node in run.nodes:
            grads = gradient_on(model, paged_batch(assigned_pages(a, node.node_id, 0)))
            if node.node_id == 3:
                grads = {n: torch.zeros_like(g) for n, g in grads.items()}
            if node.node_id == 4:
                w = grads["weight"].clone()
                w[:, :8] *= -3.0  # ascent of the shared weights
                w[:, 8:] *= 20.0  # its own pages' offsets, fitted hard
                grads = {"weight": w, "bias": torch.zeros_like(grads["bias"])}
            assert run.submit(node, 0, dense_frame(grads, 0, node.node_id)).status_code == 202
        t.join(timeout=60)
    assert out == [{1: 1.0, 2: 1.0, 3: 0.0, 4: 0.0}], out
    run.wait_version(1)
    assert published_weights(client, run)[0] == {1: 0.5, 2: 0.5, 3: 0.0, 4: 0.0}


def _with_features_of(x: torch.Tensor, region: int) -> torch.Tensor:
    """``x`` (8 features) placed in the first (0) or second (1) half of 16 input features, the other half zero."""
    out = torch.zeros(len(x), 16)
    out[:, 8 * region : 8 * region + 8] = x
    return out


def test_harm_only_scores_keep_a_minority_on_other_data_and_drop_an_attacker(client):
    """No assignment: the validator holds only the majority's data. Two majority nodes; a minority node whose
    inputs come from another region of the input space (the other 8 of 16 features) labelled by another rule;
    an attacker sending the majority's ascent. Harm-only scoring drops the attacker and keeps the minority,
    whose help the validator cannot see."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = make_run(client, ADMIN, n_nodes=4, state=state, **FRAMES_RUN, validation={"score_deadline_s": 30})
    (v,) = register(client, run, 1)

    def majority(pages):
        x, y = page_batch(pages)
        return _with_features_of(x, 0), y

    g = torch.Generator().manual_seed(99)
    minority_x = torch.randn(128, 8, generator=g)
    minority = (_with_features_of(minority_x, 1), minority_x @ (-TRUE_W).unsqueeze(1) + 2.0)
    with GradwireClient(str(client.base_url), v.token) as gw:
        validator = Validator(
            gw,
            run.run_id,
            torch.nn.Linear(16, 1),
            mse,
            batch=lambda rnd: majority([100, 101]),
            step_size=0.05,
        )
        out: list = []
        t = _serve_validator(validator, 1, out)
        sent = {
            1: gradient_on(model, majority([0, 1, 2, 3])),
            2: gradient_on(model, majority([4, 5, 6, 7])),
            3: gradient_on(model, minority),
            4: gradient_on(model, majority(list(range(8))), -1.0),
        }
        for node in run.nodes:
            assert run.submit(node, 0, dense_frame(sent[node.node_id], 0, node.node_id)).status_code == 202
        t.join(timeout=60)
    assert out == [{1: 1.0, 2: 1.0, 3: 1.0, 4: 0.0}], out


# -- reading a round as it fills -------------------------------------------------------------------------------


def read_as_it_fills(run, validator: Node, rnd: int, **params) -> httpx.Response:
    return run.client.get(run.url(f"/rounds/{rnd}/candidates"), params=params, headers=validator.headers)


def senders(r: httpx.Response) -> list[tuple[int, int]]:
    return [(f.sender, f.round) for f in map(read_frame, split_frames(r.content))]


def counts(r: httpx.Response) -> tuple[int, int]:
    return int(r.headers["X-Gradwire-Candidates"]), int(r.headers["X-Gradwire-Scoring"])


def in_thread(call) -> tuple[threading.Thread, list]:
    """``call()`` in a thread: its result (or exception) and the seconds it took land in the list."""
    out: list = []

    def run():
        t0 = time.monotonic()
        try:
            out.append(call())
        except BaseException as exc:  # surfaced by the test
            out.append(exc)
        out.append(time.monotonic() - t0)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_validator_reads_the_round_as_it_fills_each_long_poll_answered_at_an_arrival(client):
    run = make_run(client, ADMIN, n_nodes=4, **FRAMES_RUN, validation={"score_deadline_s": 30})
    (validator,) = register(client, run, 1)
    one, two, three, four = run.nodes
    assert read_as_it_fills(run, validator, 0, since=0, wait=0.2).status_code == 204  # nothing yet
    for node in (one, two):
        assert run.submit(node, 0, frame(0, node.node_id)).status_code == 202
    r = read_as_it_fills(run, validator, 0, since=0)
    assert r.status_code == 200 and counts(r) == (2, 0) and senders(r) == [(1, 0), (2, 0)], r.text
    assert read_as_it_fills(run, validator, 0, since=2, wait=0.2).status_code == 204
    # A long poll answers at the next arrival, not at the end of its wait.
    with httpx.Client(base_url=client.base_url, timeout=30) as other:
        t, out = in_thread(
            lambda: other.get(
                run.url("/rounds/0/candidates"), params={"since": 2, "wait": 20}, headers=validator.headers
            )
        )
        time.sleep(0.3)
        assert run.submit(three, 0, frame(0, 3)).status_code == 202
        t.join(timeout=30)
    r, seconds = out
    assert r.status_code == 200 and counts(r) == (3, 0) and senders(r) == [(3, 0)] and seconds < 5, (r, seconds)
    # The quorum: the last candidate (its 202 may come before the round says it waits), then the round waits for
    # scores: an answer with nothing left to read, as soon as it does.
    assert run.submit(four, 0, frame(0, 4)).status_code == 202
    r = read_as_it_fills(run, validator, 0, since=3, wait=20)
    assert r.status_code == 200 and counts(r)[0] == 4 and senders(r) == [(4, 0)], r.text
    t0 = time.monotonic()
    r = read_as_it_fills(run, validator, 0, since=4, wait=20)
    assert r.status_code == 200 and r.content == b"" and counts(r) == (4, 1) and time.monotonic() - t0 < 5
    r = read_as_it_fills(run, validator, 0, since=9, wait=20)  # a count the round does not hold: at once
    assert r.status_code == 200 and r.content == b"" and counts(r) == (4, 1)
    # Without since, every candidate in node-id order, as before; a node's token reads nothing either way.
    assert split_frames(read_as_it_fills(run, validator, 0).content) == [frame(0, n) for n in (1, 2, 3, 4)]
    assert read_as_it_fills(run, one, 0, since=0).status_code == 403
    # A round not open yet is waited for: its first candidate answers.
    with httpx.Client(base_url=client.base_url, timeout=30) as other:
        t, out = in_thread(
            lambda: other.get(
                run.url("/rounds/1/candidates"), params={"since": 0, "wait": 20}, headers=validator.headers
            )
        )
        time.sleep(0.3)
        assert post(run, validator, 0, {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}).status_code == 200
        run.wait_version(1)
        assert run.submit(two, 1, frame(1, 2)).status_code == 202
        t.join(timeout=30)
    r, seconds = out
    assert r.status_code == 200 and counts(r) == (1, 0) and senders(r) == [(2, 1)] and seconds < 10, (r, seconds)
    r = read_as_it_fills(run, validator, 0, since=0)
    assert r.status_code == 410 and r.json()["error"] == "round_closed", r.text


def test_a_candidate_arriving_once_the_round_waits_for_scores_does_not_hold_it(client):
    """Quorum 3 of 4 nodes: the round is ready at the third; the fourth arrives while it waits for scores. The
    validator scores the three it read; the round closes at once (not at its 30 s deadline), the late one
    weighing 0 as no validator scored it."""
    config = {**FRAMES_RUN, "quorum": 3}
    run = make_run(client, ADMIN, n_nodes=4, **config, validation={"score_deadline_s": 30})
    (validator,) = register(client, run, 1)
    for node in run.nodes[:3]:
        assert run.submit(node, 0, frame(0, node.node_id)).status_code == 202
    assert len(candidates(run, validator, 0)) == 3
    assert run.submit(run.nodes[3], 0, frame(0, 4)).status_code == 202
    t0 = time.monotonic()
    assert post(run, validator, 0, {1: 1.0, 2: 1.0, 3: 1.0}).status_code == 200
    run.wait_version(1)
    assert time.monotonic() - t0 < 5
    (weights,) = published_weights(client, run)
    assert weights[4] == 0.0 and weights[1] == weights[2] == weights[3] == pytest.approx(1 / 3)
    (entry,) = client.get(run.url("/scores"), headers=run.admin).json()
    assert entry["scored"] is True and entry["weights"] == {"1": 1.0, "2": 1.0, "3": 1.0, "4": 0.0}


class CountingValidator(Validator):
    """A :class:`Validator` that counts the candidates it measured."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.measured = 0

    def loss_change(self, update, round):
        self.measured += 1
        return super().loss_change(update, round)


def test_the_validator_measures_candidates_before_the_quorum_and_waits_for_a_round_not_open_yet(client):
    """Two validators: the helper (``CountingValidator``) and one over plain HTTP. The helper measures three
    candidates of four while the round fills (it is still at version 0 and not ready); at the quorum only the
    fourth remains. Then it asks for round 1 while round 0 still waits for the other validator's scores: it
    waits for round 1 to open and scores it with round 1's weights, where asking too early used to fail."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = make_run(client, ADMIN, n_nodes=4, state=state, **FRAMES_RUN, validation={"score_deadline_s": 30})
    helper, other = register(client, run, 2)
    data = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
    batch = (data, data.sum(dim=1, keepdim=True))

    def grads(rnd: int, node: int) -> bytes:
        g = torch.Generator().manual_seed(100 * rnd + node)
        return dense_frame({n: 0.1 * torch.randn(p.shape, generator=g) for n, p in state.items()}, rnd, node)

    with GradwireClient(str(client.base_url), helper.token) as gw:
        validator = CountingValidator(gw, run.run_id, torch.nn.Linear(16, 1), mse, batch=lambda rnd: batch)
        out: list = []
        t = _serve_validator(validator, 2, out)
        for node in run.nodes[:3]:
            assert run.submit(node, 0, grads(0, node.node_id)).status_code == 202
        deadline = time.monotonic() + 20
        while validator.measured < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert validator.measured == 3 and run.status()["version"] == 0 and not out
        assert run.submit(run.nodes[3], 0, grads(0, 4)).status_code == 202
        deadline = time.monotonic() + 20
        while not out and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(out) == 1 and set(out[0]) == {1, 2, 3, 4} and validator.measured == 4, out
        time.sleep(0.3)  # the helper now asks for round 1, which is not open: round 0 waits for the other's scores
        assert t.is_alive() and len(out) == 1, out
        candidates(run, other, 0)
        assert post(run, other, 0, out[0]).status_code == 200
        run.wait_version(1)
        for node in run.nodes:
            assert run.submit(node, 1, grads(1, node.node_id)).status_code == 202
        candidates(run, other, 1)
        t.join(timeout=30)
        assert len(out) == 2 and set(out[1]) == {1, 2, 3, 4} and validator.measured == 8, out
        assert validator.version == 1
        assert post(run, other, 1, out[1]).status_code == 200
        run.wait_version(2)
    log = client.get(run.url("/scores"), headers=run.admin).json()
    assert [e["scores"][str(helper.node_id)] for e in log] == [{str(k): v for k, v in o.items()} for o in out]
