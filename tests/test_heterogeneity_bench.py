"""bench/heterogeneity.py's validated columns, in short runs through a real server: the honest rows'
``default + validators`` column is filled from a run its validator scored, and that validator's scores (not the
structural rule) set the weights the table reports; in the colluder grid the Gauntlet takes its weight from
``good_own`` (good on its own pages, harmful elsewhere), and the median of three validators ignores the one
that posts inverted scores."""

from __future__ import annotations

import math

import pytest
import torch

from bench_modules import load_bench
from gradwire_server.launcher import LoopbackServer

ROUNDS = 6
#: The honest minority row's validator (SparseLoCo) finds harm in the minority's updates past its allowance (3 × the
#: median candidate's help) from about the fourth version.
HONEST_ROUNDS = 16


@pytest.fixture(scope="module")
def het():
    return load_bench("heterogeneity")


@pytest.fixture(scope="module")
def server():
    with LoopbackServer() as srv:
        yield srv


def test_the_validators_column_is_filled_and_the_validators_scores_set_the_weights(het, server):
    rounds = HONEST_ROUNDS
    cells = [
        het.honest_cell(server, "minority", "sparseloco", r, 0, rounds) for r in ("default", "mean", het.VALIDATED)
    ]
    default, _, validated = cells
    assert default.scored == 0 and validated.scored == rounds
    row = [c.strip() for c in het.honest_table(cells, rounds).splitlines()[2].strip("|").split("|")]
    assert row[7] != "–" and row[7].startswith(f"{validated.mixture / cells[1].mixture:.3f}×"), row
    assert row[9].endswith(f"{rounds}/{rounds} scored"), row
    # The harm-only validator holds only the majority's data: it scores the minority (nodes 7, 8) 0 in some rounds
    # (the server's scores log), and the weights the table reports take those scores in.
    log = het.score_log(validated.outcome)
    assert len(log) == rounds and all(w[i] == 1.0 for w in log.values() for i in range(1, 7)), log
    assert any(w[7] == 0.0 or w[8] == 0.0 for w in log.values()), log
    assert validated.weights["minority"] < default.weights["minority"] - 0.01


def test_the_gauntlet_drops_colluders_good_on_their_own_pages_and_a_lying_validator_moves_nothing(het, server):
    def run(attack, validators=(1, 0)):
        return het.grid_run(
            server, "adamw", attack, "assigned + validators", ROUNDS, None, het.majority_batch, validators
        )

    out = run("good_own")
    log = het.score_log(out)
    assert len(log) == ROUNDS
    assert all(w[7] == 0.0 and w[8] == 0.0 for w in log.values()), log
    assert all(w[i] == 1.0 for w in log.values() for i in range(1, 7)), log
    honest, lying = run(het.LIAR_ATTACK, (3, 0)), run(het.LIAR_ATTACK, (3, 1))
    # The liar (validator 3) posts the colluders 1 and the honest nodes 0; the median keeps the others' verdict.
    for entry in lying.scores:
        if entry["scored"]:
            liar = {int(n): s for n, s in entry["scores"]["3"].items()}
            assert liar[7] == liar[8] == 1.0 and all(liar[i] == 0.0 for i in range(1, 7)), entry
    assert het.score_log(lying) == het.score_log(honest)
    assert lying.held_out / honest.held_out == pytest.approx(1.0, abs=0.02)


def test_the_chars16_row_is_16_nodes_on_contiguous_parts_of_the_corpus_and_its_loss_goes_down(het, server):
    groups = het.ROWS["chars16"]()
    assert groups.nodes == 16 and list(groups.members.values()) == [list(range(g, g + 4)) for g in (1, 5, 9, 13)]
    from gradwire_apps.demo.tasks import CharVocab, load_pydoc_text

    train, held, vocab = het.char_parts()
    # Node i's part: a head it trains on, then its held-out tail (a tenth), the parts in the corpus' order.
    text = load_pydoc_text()
    parts = torch.cat([x for t, h in zip(train, held) for x in (t, h)])
    assert len(train) == 16 and torch.equal(parts, CharVocab.of(text).encode(text)[: parts.numel()])
    assert all(abs(h.numel() / (t.numel() + h.numel()) - 0.1) < 1e-3 for t, h in zip(train, held))
    x, y = groups.data.batch(3, 0, 1.0)
    assert x.shape == (het.CHAR_BATCH, het.CHAR_CONTEXT) and y.shape == (het.CHAR_BATCH,)
    start = groups.data.held_out_loss({n: p.detach() for n, p in groups.data.model().named_parameters()})
    assert abs(start - math.log(vocab)) < 0.2, start
    cell = het.honest_cell(server, "chars16", "adamw", "default", 0, 4)
    assert cell.outcome.versions == 4 and cell.mixture < start - 0.5, (start, cell.mixture)
    assert set(cell.weights) == set(groups.members) and sum(cell.weights.values()) == pytest.approx(1.0)
