"""Honest heterogeneity and colluders side by side, through a real server: what the default rule costs runs
whose honest nodes hold data of their own, and what it holds against colluders.

``python bench/heterogeneity.py [--rounds 30] [--seeds 0 1] [--modes ...] [--rows ...] [--colluders] [--full]
[--grid-modes ...] [--grid-attacks ...] [--no-validators]``

Every run is ``bench/attacks.py``'s ``run_one``: a real ``gradwire_server`` on loopback and real
:class:`gradwire.client.Node` clients on threads, one small MLP (``chars16``: a small char model), quorum = every
node. Ratios are held-out losses of the final weights, same seeds and samples, measured in this one run of the
bench.

**Honest rows** (0 attackers; ``--rows``; ``iid``, every node on the majority's data, only where asked),
each under the default rule (``default``: ``bounded_mean``, no data assignment), the plain ``mean`` and
``default + validators`` (``--no-validators`` leaves it out): the same run as ``default`` with one harm-only
:class:`gradwire.client.Validator` (no data assignment: docs/SERVER.md, "Validators") whose own data is the
majority's distribution only, the hard case of issue 43 ("a minority whose data the validator lacks would be
judged on data it never saw"): for ``minority``, the majority's regression; for the Dirichlet rows, the pooled
label shares of nodes 1–6 (nodes 7 and 8's classes are rare or absent there); for ``chars16``, the text of the
first group's parts only (nodes 1–4). The run waits for its score
(``validation.score_deadline_s``); the validator probes each candidate by one step (:func:`probe`: the
identity for AdamW's gradients and SparseLoCo's pseudo-gradients at their outer step, ``torch.sign`` at DeMo's
``lr`` for DeMo's sign-applied records):

- ``minority``: 8 nodes, 2 of them (ids 7, 8) on data of their own: inputs from another region of the input
  space (shifted by +2 in every coordinate) labelled by another rule (other input features, other signs).
  Held-out loss on the 75/25 mixture and on each group's own data.
- ``dirichlet0.1``, ``dirichlet1``: a 10-class task (Gaussian classes in 16 dimensions, cross-entropy) dealt
  over 8 nodes by Dirichlet label proportions (α = 0.1: most nodes see two or three classes; α = 1: every
  class, in skewed shares). Held-out loss on the mixture (every class in the nodes' pooled shares) and on
  each node's own distribution (the worst node's ratio is printed).
- ``chars16``: 16 nodes of a char-level language model
  (:class:`CharMLP`, 13.7 k parameters: 12 characters of context, each embedded in 8 dimensions, one tanh layer
  of 64, next-character cross-entropy) on the chars task's corpus (``bench/convergence.py``'s ``CharsTask``:
  Python's bundled ``pydoc_data`` text, no download), cut into 16 contiguous parts, node ``i`` on part ``i``
  (random windows of its first 90 %; its last 10 % held out). 4 groups of 4 consecutive nodes (parts far apart
  in the corpus differ most); each group's held-out loss on every window of its nodes' tails, the mixture the
  groups' mean (the worst group's ratio is printed). Each run has 16 nodes (the other rows 8): the full row
  (5 modes × 2 seeds × 3 rules, 30 versions: 30 runs of 6–21 s, DeMo and SparseLoCo publishing frames the
  slowest) took 194 s for seed 0 on 2 cores shared with other jobs (so about 6.5 minutes for both seeds), so
  it is one of the default rows (alone: ``--rows chars16``).

For each row and mode: mixture ÷ mean and the worst group's own ÷ mean, for ``default`` and for ``default +
validators``; and the weight each group received under each: its mean share of a round, over all rounds, as the
run's :class:`gradwire.rule.Rule` computes it from the frames the nodes submitted (the rule replayed here on
the same frames, with each scored round's score weights as the server's scores log has them,
``GET /v1/runs/{run_id}/scores``; for the modes that publish frames the published weights are these).

**Colluder grid** (``--colluders``; the attacks of ``bench/attacks.py``): 2 of 8 nodes collude, on the IID
regression and on the ``minority`` data (non-IID: the colluders are nodes 7, 8 and the honest minority is
then nodes 5, 6), under the default rule without an assignment (``default``), the default in a run that
assigns its data (``assigned``: honest nodes IID, sender histories on), ``default + validators`` (one
harm-only validator whose data is the honest majority's), ``assigned + validators`` (IID only: a run with a
real ``data_assignment``, every node training on its assigned pages of the regression, :func:`paged_data`,
and one validator scoring Templar's Gauntlet on the node's pages and random ones) and the plain ``mean``.
Each cell is held-out loss ÷ the clean run's (same mode and rule, on the mixture; a validated rule's clean
run has its validator). The default size runs a few attacks in a few modes; ``--full`` runs every attack in
every mode. Two more rows per (data, mode):

- ``good_own`` (``bench/attacks.py``): colluders aimed at validators, each sending its own genuine update
  (good on its own data or pages) plus a large part against the honest direction, orthogonal to its own
  (harmful elsewhere).
- a lying validator: 3 validators, 1 of which posts ``1 − score`` (:class:`LyingValidator`), under
  :data:`LIAR_ATTACK`; the server takes the median. Its validator cells are held-out loss ÷ that of the same
  run with 3 honest validators (target: within 1.02×); its mean cell is the attack's against the mean.

Writes ``docs/results/heterogeneity.md`` (``--out``) with the date, the command and the tables.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gradwire.aggregation import update_norm
from gradwire.assignment import DataAssignment, assigned_pages
from gradwire.binding import strip_binding
from gradwire.client import GradwireClient, Validator
from gradwire.client.errors import GradwireHTTPError
from gradwire.frame import read_frame
from gradwire_server.aggregate import Update, published_weights
from gradwire_server.config import AggregationConfig
from gradwire_server.launcher import LoopbackServer


def _attacks_bench():
    """bench/attacks.py, this bench's harness (bench/ is no package: loaded by path, as the tests load it)."""
    if "attacks_bench" in sys.modules:
        return sys.modules["attacks_bench"]
    spec = importlib.util.spec_from_file_location("attacks_bench", Path(__file__).resolve().parent / "attacks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["attacks_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


attacks = _attacks_bench()

N = 8
MINORITY = (7, 8)


# -- the data -----------------------------------------------------------------------------------------


def _majority(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x[:, :4]) * 0.8 - 0.5 * x[:, 4:8]


def _minority(x: torch.Tensor) -> torch.Tensor:
    return -0.6 * torch.tanh(x[:, 8:12]) + 0.4 * (x[:, 12:16] - 2.0)


def _regression_batch(group: str, stream: int, step: int, size: int = 128):
    g = torch.Generator().manual_seed(7919 * stream + step)
    x = torch.randn(size, 16, generator=g)
    if group == "minority":
        x = x + 2.0
        return x, _minority(x)
    return x, _majority(x)


#: A validator's own batch: ``(validator stream, round) -> batch``.
ValidatorData = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
#: The size of a validator's own batch (harm-only scoring), and the stream its validator ``i`` starts from.
VALIDATOR_BATCH = 256
VALIDATOR_STREAM = 50_000


def majority_batch(stream: int, rnd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the majority's regression (the validators' own data in every regression layout)."""
    return _regression_batch("majority", VALIDATOR_STREAM + stream, rnd, size=VALIDATOR_BATCH)


@dataclass
class Groups:
    """A data layout: the DataSpec each node trains on, each group's node ids and held-out loss, the
    mixture's (each group's loss weighed by its share of the nodes), and a harm-only validator's own data (the
    majority's distribution only)."""

    data: attacks.DataSpec
    members: dict[str, list[int]]
    losses: dict[str, Callable[[dict[str, torch.Tensor]], float]]
    validator_data: ValidatorData = majority_batch
    #: How many nodes a run of this layout has (ids 1..nodes).
    nodes: int = N

    def mixture(self, state: dict[str, torch.Tensor]) -> float:
        total = sum(len(m) for m in self.members.values())
        return sum(len(self.members[g]) / total * self.losses[g](state) for g in self.members)


def _load(make: Callable[[], nn.Module], state: dict[str, torch.Tensor]) -> nn.Module:
    m = make()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(state[name])
    return m


def held_out_loss(make: Callable[[], nn.Module], loss_fn, xy) -> Callable[[dict[str, torch.Tensor]], float]:
    """The held-out loss ``loss_fn`` of batch ``xy`` under a state's weights (a model from ``make``)."""

    def loss(state: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            return float(loss_fn(_load(make, state), xy))

    return loss


def minority_groups(minority: Sequence[int] = MINORITY, nodes: int = N) -> Groups:
    """``minority``'s nodes on data of their own, the rest on the majority's."""
    held = {g: _regression_batch(g, 10_000, 0, size=1024) for g in ("majority", "minority")}

    def batch(node: int, step: int, task: float):
        x, y = _regression_batch("minority" if node in minority else "majority", node, step)
        return x, task * y

    data = attacks.DataSpec(attacks.model, batch, lambda state: 0.0)
    members = {
        "majority": [i for i in range(1, nodes + 1) if i not in minority],
        "minority": [i for i in range(1, nodes + 1) if i in minority],
    }
    members = {g: m for g, m in members.items() if m}
    groups = Groups(data, members, {g: held_out_loss(attacks.model, attacks.mse, held[g]) for g in members})
    return Groups(attacks.DataSpec(attacks.model, batch, groups.mixture), members, groups.losses, majority_batch)


CLASSES = 10


def _classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def _ce(module: nn.Module, xy) -> torch.Tensor:
    x, y = xy
    return nn.functional.cross_entropy(module(x), y)


_CENTERS = torch.randn(CLASSES, 16, generator=torch.Generator().manual_seed(4242)) * 1.2


def _class_batch(shares: torch.Tensor, stream: int, step: int, size: int = 128):
    g = torch.Generator().manual_seed(104729 * stream + step)
    y = torch.multinomial(shares, size, replacement=True, generator=g)
    return _CENTERS[y] + torch.randn(size, 16, generator=g), y


def dirichlet_groups(alpha: float, nodes: int = N) -> Groups:
    """A 10-class task dealt over ``nodes`` by Dirichlet(``alpha``) label shares (fixed seed): every node is a
    group of its own. A validator's data: the pooled shares of the nodes outside :data:`MINORITY` (the
    majority's distribution)."""
    dist = torch.distributions.Dirichlet(torch.full((CLASSES,), float(alpha)))
    torch.manual_seed(31337)
    shares = {i: dist.sample().clamp_min(1e-6) for i in range(1, nodes + 1)}
    pooled = torch.stack(list(shares.values())).mean(0)
    majority = torch.stack([s for i, s in shares.items() if i not in MINORITY]).mean(0)
    held = {f"node{i}": _class_batch(s, 20_000 + i, 0, size=512) for i, s in shares.items()}
    mix = _class_batch(pooled, 30_000, 0, size=2048)

    def batch(node: int, step: int, task: float):
        return _class_batch(shares[node], node, step)

    def validator_data(stream: int, rnd: int):
        return _class_batch(majority, VALIDATOR_STREAM + stream, rnd, size=VALIDATOR_BATCH)

    members = {f"node{i}": [i] for i in shares}
    return Groups(
        attacks.DataSpec(_classifier, batch, held_out_loss(_classifier, _ce, mix), _ce),
        members,
        {g: held_out_loss(_classifier, _ce, held[g]) for g in members},
        validator_data,
    )


#: ``chars16``: its nodes, its groups (of consecutive nodes), the characters a window's next one is predicted from,
#: the share of each node's part held out (its tail) and a node's batch (windows).
CHAR_NODES = 16
CHAR_GROUPS = 4
CHAR_CONTEXT = 12
CHAR_HELD_OUT = 0.1
CHAR_BATCH = 64


@functools.lru_cache(maxsize=1)
def char_parts() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], int]:
    """The chars task's corpus (``bench/convergence.py``'s ``CharsTask``: Python's bundled ``pydoc_data`` text,
    no download) as token ids, cut into :data:`CHAR_NODES` contiguous parts, one per node: each part's head
    (its training data) and its tail (:data:`CHAR_HELD_OUT` of it, held out), and the vocabulary's size."""
    from gradwire_apps.demo.tasks import CharVocab, load_pydoc_text

    text = load_pydoc_text()
    vocab = CharVocab.of(text)
    tokens = vocab.encode(text)
    size = tokens.numel() // CHAR_NODES
    parts = [tokens[i * size : (i + 1) * size] for i in range(CHAR_NODES)]
    cuts = [int(part.numel() * (1 - CHAR_HELD_OUT)) for part in parts]
    return tuple(p[:c] for p, c in zip(parts, cuts)), tuple(p[c:] for p, c in zip(parts, cuts)), len(vocab)


class CharMLP(nn.Module):
    """A char-level language model: the last :data:`CHAR_CONTEXT` characters, each embedded in ``width``
    dimensions, through one tanh layer to the next character's logits (about 13 k parameters)."""

    def __init__(self, vocab: int, context: int = CHAR_CONTEXT, width: int = 8, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(context * width, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(x).flatten(1))))


def _char_model(seed: int = 0) -> nn.Module:
    vocab = char_parts()[2]
    torch.manual_seed(seed)
    return CharMLP(vocab)


def _windows(tokens: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows of ``tokens`` at ``starts``: :data:`CHAR_CONTEXT` characters and the one after them."""
    w = tokens[starts[:, None] + torch.arange(CHAR_CONTEXT + 1)]
    return w[:, :-1], w[:, -1]


def _char_batch(parts: Sequence[torch.Tensor], stream: int, step: int, size: int = CHAR_BATCH):
    """``size`` random windows of ``parts`` (each window inside one part, parts drawn uniformly)."""
    g = torch.Generator().manual_seed(104723 * stream + step)
    which = torch.randint(0, len(parts), (size,), generator=g)
    xs, ys = [], []
    for i, part in enumerate(parts):
        n = int((which == i).sum())
        if n:
            x, y = _windows(part, torch.randint(0, part.numel() - CHAR_CONTEXT, (n,), generator=g))
            xs.append(x)
            ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def chars_groups(nodes: int = CHAR_NODES, groups: int = CHAR_GROUPS) -> Groups:
    """``chars16``: :func:`char_parts`' parts, node ``i`` on part ``i`` (random windows of its head), in
    ``groups`` groups of consecutive nodes (parts far apart in the corpus differ most); a group's held-out
    loss is the cross-entropy on every window of its nodes' tails, the mixture the groups' mean. A
    validator's data: the first group's parts only (it lacks the other groups' text)."""
    train, held, _ = char_parts()
    assert len(train) == nodes and nodes % groups == 0, (len(train), nodes, groups)
    per = nodes // groups
    ids = [list(range(g * per + 1, (g + 1) * per + 1)) for g in range(groups)]
    members = {f"nodes{m[0]}-{m[-1]}": m for m in ids}
    tails = [_windows(t, torch.arange(t.numel() - CHAR_CONTEXT)) for t in held]  # every window of each tail
    held_out = {
        g: (torch.cat([tails[i - 1][0] for i in m]), torch.cat([tails[i - 1][1] for i in m]))
        for g, m in members.items()
    }
    first = [train[i - 1] for i in next(iter(members.values()))]

    def batch(node: int, step: int, task: float):
        return _char_batch([train[node - 1]], node, step)

    def validator_data(stream: int, rnd: int):
        return _char_batch(first, VALIDATOR_STREAM + stream, rnd, size=VALIDATOR_BATCH)

    losses = {g: held_out_loss(_char_model, _ce, held_out[g]) for g in members}
    mixture = Groups(attacks.DataSpec(_char_model, batch, lambda state: 0.0, _ce), members, losses).mixture
    return Groups(attacks.DataSpec(_char_model, batch, mixture, _ce), members, losses, validator_data, nodes)


ROWS: dict[str, Callable[[], Groups]] = {
    "iid": lambda: minority_groups(minority=()),
    "minority": minority_groups,
    "dirichlet0.1": lambda: dirichlet_groups(0.1),
    "dirichlet1": lambda: dirichlet_groups(1.0),
    "chars16": chars_groups,
}


# -- the validators -----------------------------------------------------------------------------------

#: A validated run's settings: each round waits for its scores, at most this long.
VALIDATION = {"validation": {"score_deadline_s": 30}}
#: ``assigned + validators``' data assignment: the regression cut into pages of :data:`PAGE_SIZE` samples.
ASSIGNMENT = {"seed": 7, "pages": 100_000, "pages_per_node": 4}
PAGE_SIZE = 32
#: The attack of the lying-validator row.
LIAR_ATTACK = "ipm_large"


def probe(mode: str) -> dict:
    """A validator's probing step for ``mode``'s candidates (:class:`~gradwire.client.Validator`'s
    ``step_size`` and ``direction``): DeMo's records are applied by their sign at its ``lr``; AdamW's are
    gradients (the identity, at its ``lr``); SparseLoCo's are pseudo-gradients, applied at its ``outer_lr``."""
    cfg = attacks.MODES[mode]
    if cfg["algorithm"] == "demo":
        return {"step_size": cfg["demo"]["lr"], "direction": torch.sign}
    if cfg["algorithm"] == "sparseloco":
        return {"step_size": cfg["sparseloco"]["outer_lr"]}
    return {"step_size": cfg["optimizer"]["lr"]}


def _sync_every(mode: str) -> int:
    return attacks.MODES[mode].get("sparseloco", {}).get("sync_every", 1)


def page_batch(pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The regression's samples on ``pages`` (:data:`PAGE_SIZE` each; page ``p`` is always the same)."""
    parts = [_regression_batch("majority", 200_000 + p, 0, size=PAGE_SIZE) for p in pages]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def paged_data(mode: str) -> attacks.DataSpec:
    """The IID regression as a run that assigns its data (:data:`ASSIGNMENT`) reads it: each node trains, in
    round ``r``, on its :func:`gradwire.assignment.assigned_pages` of ``r`` (every step of ``r``: SparseLoCo's
    inner steps too). Held out as :data:`attacks.REGRESSION`."""
    assignment, every = DataAssignment(**ASSIGNMENT), _sync_every(mode)

    def batch(node: int, step: int, task: float):
        x, y = page_batch(assigned_pages(assignment, node, step // every))
        return x, task * y

    return attacks.DataSpec(attacks.model, batch, attacks.held_out_loss)


class LyingValidator(Validator):
    """A validator that posts the opposite of what it measures: ``1 − score`` for every candidate."""

    def harm_only(self, updates, round):
        return {sender: 1.0 - s for sender, s in super().harm_only(updates, round).items()}

    def gauntlet(self, update, sender, round):
        return 1.0 - super().gauntlet(update, sender, round)


def serving(make: Callable[[GradwireClient, str], Validator], rounds: int) -> Callable[[GradwireClient, str], None]:
    """A validator's side of a run of ``rounds`` versions (``attacks.run_one``'s ``validators``): it waits for
    each round to open (the run's version), scores it once it waits for scores and posts; a round closed
    without it (its score deadline) is skipped."""

    def serve(client: GradwireClient, run_id: str) -> None:
        v = make(client, run_id)
        rnd, deadline = 0, time.monotonic() + 600
        while rnd < rounds:
            if time.monotonic() > deadline:
                raise TimeoutError(f"validator of {run_id}: round {rnd} of {rounds} never came")
            version = int(client.status(run_id)["version"])
            if version < rnd:  # the previous round is closing: its weights are not this round's yet
                time.sleep(0.02)
                continue
            rnd = max(rnd, version)
            if rnd >= rounds:
                break
            try:
                if v.score_round(rnd, wait=30) is not None:
                    rnd += 1
            except GradwireHTTPError as exc:
                if exc.error == "round_closed":  # closed by its deadline before this validator read it
                    rnd += 1
                elif exc.error != "round_not_open":
                    raise

    return serve


def harm_only_validators(
    mode: str, data: attacks.DataSpec, own: ValidatorData, rounds: int, count: int = 1, liars: int = 0, seed: int = 0
) -> list[Callable[[GradwireClient, str], None]]:
    """``count`` harm-only validators on data ``own`` (validator ``i`` on its own stream of it), the last
    ``liars`` of them lying."""

    def make(i: int):
        cls = LyingValidator if i >= count - liars else Validator
        stream = 1000 * seed + 97 * i
        return lambda client, run_id: cls(
            client, run_id, data.model(), data.loss, batch=lambda rnd: own(stream, rnd), **probe(mode)
        )

    return [serving(make(i), rounds) for i in range(count)]


def gauntlet_validators(mode: str, rounds: int, count: int = 1, liars: int = 0) -> list:
    """``count`` Gauntlet validators of :func:`paged_data`'s run (validator ``i``'s random pages salted ``i``),
    the last ``liars`` of them lying."""

    def make(i: int):
        cls = LyingValidator if i >= count - liars else Validator
        return lambda client, run_id: cls(
            client, run_id, attacks.model(), attacks.mse, pages=page_batch, salt=i + 1, **probe(mode)
        )

    return [serving(make(i), rounds) for i in range(count)]


# -- the weights --------------------------------------------------------------------------------------


def score_log(out: attacks.Outcome) -> dict[int, dict[int, float]]:
    """The score weights of each scored round of a validated run, by round (version − 1), from the server's
    scores log."""
    return {
        int(e["version"]) - 1: {int(n): float(w) for n, w in e["weights"].items()} for e in out.scores if e["scored"]
    }


def group_weights(
    out: attacks.Outcome, rule: str, members: dict[str, list[int]], rounds: int, data_assigned: bool = False
) -> dict[str, float]:
    """Each group's mean share of a round (its nodes' coefficients summed), over the run's rounds, by the
    run's rule replayed on the frames its nodes submitted (the server's :class:`~gradwire.rule.Rule`, built
    from the same settings and stepped the same way); a round its validators scored, with the score weights the
    server logged (each update's weight times its score weight, the rule told the round was scored)."""
    if rule == "mean":
        total = sum(len(m) for m in members.values())
        return {g: len(m) / total for g, m in members.items()}
    cfg = AggregationConfig(**(attacks.aggregation_settings(rule) or {}))
    the_rule = cfg.rule_object(data_assigned=data_assigned)
    scored = score_log(out)
    nodes = sorted(i for m in members.values() for i in m)
    got = {g: 0.0 for g in members}
    counted = 0
    for r in range(rounds):
        raw = [out.frames.by_key.get((r, i), (None, None))[0] for i in nodes]
        if any(b is None for b in raw):
            continue
        score = scored.get(r)
        ups = []
        for i, b in zip(nodes, raw):
            frame = strip_binding(read_frame(b))
            weight = 1.0 if score is None else score.get(i, 0.0)
            ups.append(Update(frame, weight, update_norm(frame.entries), i))
        coeffs, _ = published_weights(ups, the_rule, scored=score is not None)
        the_rule.step(nodes, [u.norm for u in ups], [u.frame.entries for u in ups], coeffs)
        by_node = dict(zip(nodes, coeffs))
        for g, m in members.items():
            got[g] += sum(by_node[i] for i in m)
        counted += 1
    return {g: w / max(counted, 1) for g, w in got.items()}


# -- the honest rows ----------------------------------------------------------------------------------

#: The honest rows' rules: ``default + validators`` is ``default`` with one harm-only validator.
VALIDATED = "default + validators"


@dataclass
class HonestCell:
    row: str
    mode: str
    rule: str
    seed: int
    mixture: float
    own: dict[str, float]
    weights: dict[str, float]
    seconds: float
    #: How many of the run's rounds its validators scored (0 without validators).
    scored: int = 0
    #: The run itself (its frames, final weights and scores log).
    outcome: attacks.Outcome | None = field(default=None, repr=False)


def _seeded(data: attacks.DataSpec, seed: int) -> attacks.DataSpec:
    """``data`` with its model's initial weights from ``seed`` and every node's stream shifted by it (the
    groups keep their node ids)."""
    if seed == 0:
        return data
    make, base = data.model, data.batch
    return attacks.DataSpec(
        lambda: make(seed), lambda n, s, t: base(n, s + 1_000_000 * seed, t), data.held_out_loss, data.loss
    )


def honest_cell(server, row: str, mode: str, rule: str, seed: int, rounds: int) -> HonestCell:
    """One honest run of ``row`` in ``mode`` under ``rule`` (``default``, ``mean`` or :data:`VALIDATED`)."""
    groups = ROWS[row]()
    data = _seeded(groups.data, seed)
    extra: dict = {}
    if rule == VALIDATED:
        extra = dict(
            config=VALIDATION, validators=harm_only_validators(mode, data, groups.validator_data, rounds, seed=seed)
        )
    base = "default" if rule == VALIDATED else rule
    out = attacks.run_one(server, mode, "clean", base, rounds, nodes=groups.nodes, rogues=0, data=data, **extra)
    return HonestCell(
        row,
        mode,
        rule,
        seed,
        out.held_out,
        {g: loss(out.state) for g, loss in groups.losses.items()},
        group_weights(out, base, groups.members, rounds),
        out.seconds,
        len(score_log(out)),
        out,
    )


def _own_text(own: dict[str, float]) -> str:
    """Each group's own ratio (two groups), or the worst group's (the Dirichlet rows)."""
    if len(own) <= 2:
        return ", ".join(f"{g} {own[g]:.3f}×" for g in own)
    worst = max(own, key=own.get)
    return f"{own[worst]:.3f}× ({worst})"


def _shares(w: dict[str, float], wm: dict[str, float]) -> str:
    if len(w) > 2:
        low = min(w, key=w.get)
        return f"lowest {low}: {w[low]:.3f}; {wm[low]:.3f}"
    return "; ".join(f"{g}: {w[g]:.3f}; {wm[g]:.3f}" for g in w)


def honest_table(cells: Sequence[HonestCell], rounds: int | None = None) -> str:
    """One line per (row, mode): the default's and the mean's held-out losses (mean over seeds), their
    ratio on the mixture and on each group's own data (the worst group for the Dirichlet rows), the same two
    ratios for ``default + validators`` (with the rounds its validator scored), and each group's weight under
    the default and under ``default + validators``."""
    lines = [
        "| row | mode | seeds | mixture: default | mean | default ÷ mean | worst group's own: ÷ mean (group) "
        "| default + validators: mixture ÷ mean; own ÷ mean (group) | weight under default (group: share; "
        "mean's share) | weight under default + validators (group: share; mean's share; rounds scored) |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    keys = list(dict.fromkeys((c.row, c.mode) for c in cells))
    for row, mode in keys:
        by_rule = {
            r: [c for c in cells if (c.row, c.mode, c.rule) == (row, mode, r)] for r in ("default", "mean", VALIDATED)
        }
        d, m, v = by_rule["default"], by_rule["mean"], by_rule[VALIDATED]
        if not d or not m:
            continue
        dm = statistics.fmean(c.mixture for c in d)
        mm = statistics.fmean(c.mixture for c in m)

        def own_ratio(cs):
            return {
                g: statistics.fmean(c.own[g] for c in cs) / statistics.fmean(c.own[g] for c in m) for g in cs[0].own
            }

        def weights(cs):
            return {g: statistics.fmean(c.weights[g] for c in cs) for g in cs[0].weights}

        wm = m[0].weights
        validated, validated_shares = "–", "–"
        if v:
            vm = statistics.fmean(c.mixture for c in v)
            validated = f"{vm / mm:.3f}×; {_own_text(own_ratio(v))}"
            scored = sum(c.scored for c in v)
            of = f"/{rounds * len(v)}" if rounds else ""
            validated_shares = f"{_shares(weights(v), wm)}; {scored}{of} scored"
        lines.append(
            f"| {row} | {mode} | {len(d)} | {dm:.4f} | {mm:.4f} | {dm / mm:.3f}× | {_own_text(own_ratio(d))} "
            f"| {validated} | {_shares(weights(d), wm)} | {validated_shares} |"
        )
    return "\n".join(lines)


# -- the colluder grid --------------------------------------------------------------------------------


DEFAULT_ATTACKS = ("alie", "ipm_large", "minmax")
FULL_ATTACKS = ("alie", "alie_own", "ipm_large", "minmax", "minsum", "mimic", "adaptive")
DEFAULT_COLLUDER_MODES = ("adamw", "demo")
#: The grid's columns, in order; the validated ones are left out (``–``) without ``--validators``.
GRID_RULES = ("assigned", "default", "default + validators", "assigned + validators", "mean")
VALIDATED_RULES = ("default + validators", "assigned + validators")


def grid_run(server, mode: str, attack: str, rule: str, rounds: int, data, own: ValidatorData, validators=None):
    """One run of the grid: ``rule`` one of :data:`GRID_RULES`; ``validators``: ``(count, liars)`` for the
    validated rules (default ``(1, 0)``)."""
    count, liars = validators or (1, 0)
    kw: dict = dict(nodes=N, rogues=2)
    if rule == "default + validators":
        vs = harm_only_validators(mode, data, own, rounds, count, liars)
        return attacks.run_one(
            server, mode, attack, "default", rounds, data=data, config=VALIDATION, validators=vs, **kw
        )
    if rule == "assigned + validators":
        config = {**VALIDATION, "data_assignment": ASSIGNMENT}
        vs = gauntlet_validators(mode, rounds, count, liars)
        return attacks.run_one(
            server, mode, attack, "default", rounds, data=paged_data(mode), config=config, validators=vs, **kw
        )
    return attacks.run_one(server, mode, attack, rule, rounds, data=data, **kw)


def colluder_grid(
    server, modes, attack_names, rounds: int, seed: int = 0, validators: bool = True, liar: bool = True
) -> str:
    """Every (data, mode, attack): held-out loss ÷ the clean run's under each of :data:`GRID_RULES`, 2 of 8
    colluding (nodes 7, 8); then, with ``validators`` and ``liar``, the lying-validator row (module
    docstring)."""
    minority = minority_groups(minority=(5, 6))
    layouts = {
        "IID": (attacks.REGRESSION, majority_batch),
        # Non-IID: an honest minority of 2 (nodes 5, 6) on data of their own beside the colluders.
        "non-IID": (minority.data, minority.validator_data),
    }
    rules = [r for r in GRID_RULES if validators or r not in VALIDATED_RULES]
    lines = [
        "| data | mode | attack | " + " | ".join(GRID_RULES) + " |",
        "|---|---|---|" + "---:|" * len(GRID_RULES),
    ]

    def runs_here(name: str, r: str) -> bool:
        # An assignment makes the honest nodes IID: the non-IID layout's assigned cells are the IID rows'.
        return r in rules and not (name == "non-IID" and r.startswith("assigned"))

    for name, (data, own) in layouts.items():
        for mode in modes:
            here = [r for r in GRID_RULES if runs_here(name, r)]
            clean = {r: grid_run(server, mode, "clean", r, rounds, data, own) for r in here}
            got: dict[tuple[str, str], attacks.Outcome] = {}
            for attack in attack_names:
                cells = []
                for r in GRID_RULES:
                    if r not in here:
                        cells.append("–")
                        continue
                    got[(attack, r)] = grid_run(server, mode, attack, r, rounds, data, own)
                    cells.append(f"{got[(attack, r)].held_out / clean[r].held_out:.3f}×")
                lines.append(f"| {name} | {mode} | {attack} | {' | '.join(cells)} |")
                print(lines[-1], flush=True)
            if not (validators and liar):
                continue
            cells = []
            for r in GRID_RULES:
                if r == "mean":
                    if (LIAR_ATTACK, r) not in got:
                        got[(LIAR_ATTACK, r)] = grid_run(server, mode, LIAR_ATTACK, r, rounds, data, own)
                    cells.append(f"{got[(LIAR_ATTACK, r)].held_out / clean[r].held_out:.3f}×")
                elif r in here and r in VALIDATED_RULES:
                    honest = grid_run(server, mode, LIAR_ATTACK, r, rounds, data, own, validators=(3, 0))
                    lying = grid_run(server, mode, LIAR_ATTACK, r, rounds, data, own, validators=(3, 1))
                    cells.append(f"{lying.held_out / honest.held_out:.3f}× ÷ 3 honest")
                else:
                    cells.append("–")
            lines.append(f"| {name} | {mode} | {LIAR_ATTACK}, 1 of 3 validators lies | {' | '.join(cells)} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="versions per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--modes", nargs="+", default=list(attacks.MODES), choices=list(attacks.MODES))
    p.add_argument("--rows", nargs="+", default=[r for r in ROWS if r != "iid"], choices=list(ROWS))
    p.add_argument("--colluders", action="store_true", help="also run the colluder grid")
    p.add_argument("--full", action="store_true", help="the colluder grid: every attack in every mode")
    p.add_argument(
        "--validators",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the validated columns (default + validators; assigned + validators and the lying-validator row "
        "in the colluder grid)",
    )
    p.add_argument(
        "--grid-modes",
        nargs="+",
        default=None,
        choices=list(attacks.MODES),
        help="the colluder grid's modes (default: adamw and demo among --modes; every mode with --full)",
    )
    p.add_argument(
        "--grid-attacks",
        nargs="+",
        default=None,
        choices=list(attacks.COLLUDING),
        help=f"the colluder grid's attacks (default: {' '.join(DEFAULT_ATTACKS)}; --full: {' '.join(FULL_ATTACKS)}); "
        "good_own (and, with the validators, the lying-validator row) is always added",
    )
    p.add_argument("--out", default="docs/results/heterogeneity.md", help="the report page ('' for none)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    cells: list[HonestCell] = []
    rules = ("default", "mean", *((VALIDATED,) if args.validators else ()))
    with LoopbackServer() as server:
        for row in args.rows:
            for mode in args.modes:
                for seed in args.seeds:
                    for rule in rules:
                        c = honest_cell(server, row, mode, rule, seed, args.rounds)
                        cells.append(c)
                        print(
                            f"{row} {mode} {rule} seed {seed}: mixture {c.mixture:.4f} own "
                            f"{ {g: round(v, 4) for g, v in c.own.items()} } weights "
                            f"{ {g: round(v, 3) for g, v in c.weights.items()} }"
                            f"{f' scored {c.scored}' if rule == VALIDATED else ''} ({c.seconds:.0f} s)",
                            flush=True,
                        )
        honest = honest_table(cells, args.rounds)
        print("\n" + honest + "\n", flush=True)
        grid = ""
        if args.colluders or args.full:
            modes = list(attacks.MODES) if args.full else [m for m in DEFAULT_COLLUDER_MODES if m in args.modes]
            names = FULL_ATTACKS if args.full else DEFAULT_ATTACKS
            names = (*(args.grid_attacks or names), *attacks.AIMED_AT_VALIDATORS)
            grid = colluder_grid(server, args.grid_modes or modes, names, args.rounds, validators=args.validators)
            print("\n" + grid + "\n", flush=True)
    seconds = time.perf_counter() - t0
    print(f"{seconds:.0f} s in all")
    if args.out:
        write_page(Path(args.out), honest, grid, " ".join(sys.argv[1:] if argv is None else argv), seconds, args)


def write_page(path: Path, honest: str, grid: str, command: str, seconds: float, args) -> None:
    today = datetime.date.today().isoformat()
    validated = getattr(args, "validators", True)
    nodes = "8 real nodes per run (16 in chars16)" if "chars16" in getattr(args, "rows", ()) else "8 real nodes per run"
    left_out = "" if validated else " This run left the validators out (`--no-validators`): their cells are –."
    text = f"""# Heterogeneity: the default rule against the plain mean, honest nodes on data of their own

Measured {today} by `python bench/heterogeneity.py {command}` ({seconds:.0f} s on 2 shared cores): a real
server on loopback, {nodes}, {args.rounds} versions, seeds {", ".join(map(str, args.seeds))}
(bench/heterogeneity.py says what each row is). Every figure is a ratio of held-out losses measured side by
side in that run. "default" is `bounded_mean` without a data assignment (gradwire.rule). "default +
validators" is the same run with one harm-only validator (`gradwire.client.Validator`, no data assignment:
docs/SERVER.md, "Validators") whose own data is the majority's distribution only (the minority row: the
majority's regression; the Dirichlet rows: the pooled label shares of nodes 1–6; chars16: the text of nodes
1–4), so that a minority is judged
on data the validator never saw; its weights are the server's, from the score weights of every scored round
(`GET /v1/runs/{{run_id}}/scores`).{left_out}

Targets (issue 43): default ÷ mean ≤ 1.03× on the mixture and ≤ 1.10× on each group's own data, every mode.

## Honest rows (0 attackers)

{honest}
"""
    if grid:
        text += f"""
## Colluders, 2 of 8 (nodes 7, 8): held-out loss ÷ the clean run's (same mode and rule)

"assigned": the default rule in a run whose honest nodes are IID by construction (`honest_iid`, which a data
assignment sets): sender histories on. "default": no assignment. "default + validators": no assignment, one
harm-only validator whose data is the honest majority's. "assigned + validators" (IID only): a run with a
`data_assignment`, every node training on its assigned pages, one validator scoring Templar's Gauntlet (the
node's own pages and as many random pages). "mean": the plain mean, to show each attack bites. A validated
rule's clean run has its validator too. Targets: assigned ≤ 1.10×; default never worse than the mean.

Two rows aimed at the validators: `good_own` (each colluder sends its own genuine update, good on its own data
or pages, plus 4 × its norm against the honest direction, orthogonal to its own: harmful elsewhere); and
"{LIAR_ATTACK}, 1 of 3 validators lies": 3 validators, one posting 1 − its score, the server taking the median.
That row's validator cells are held-out loss ÷ the same run's with 3 honest validators (target: within 1.02×),
its mean cell the attack's against the mean.

{grid}
"""
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
