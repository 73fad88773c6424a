"""Rogue nodes against every mode (bench/attacks.py): the default rule's held-out loss against the clean
run's, the largest published value, the verbatim frame of another run refused.

One row per (mode, attack) under the default rule (``bounded_mean``), and one per mode for the plain
``mean`` under the strongest attack, to show the bound is the rule's doing; in a full run also 2 colluders
of 8 per mode (ALIE, min-max and the adaptive attack on the rule's sender histories). ``quick``: 12 versions per run
and the attacks that move magnitudes or replay frames; full: 40 versions and every attack.
"""

from __future__ import annotations

import math

from bench.attacks import ATTACKS, MODES, Outcome, ratio, run_one
from bench.reliability.row import Row

from gradwire_server.launcher import LoopbackServer

#: The held-out loss an attacked run may reach, relative to its clean run (issue 21: within 5 %).
LOSS_BOUND = 1.05
#: How much larger than the clean run's a published value may be.
PUBLISHED_BOUND = 3.0
QUICK_ATTACKS = ("x1e15", "ef_poison", "other_run")
#: The held-out loss colluders inside the honest spread may reach (issue 38's target), and which attacks of
#: bench/attacks.py's COLLUDING the full run probes: the strongest on the plain mean, and the adaptive one.
COLLUDING_BOUND = 1.10
COLLUDING_PROBED = ("alie", "minmax", "adaptive")


def _attack_row(got: Outcome, clean: Outcome, rounds: int) -> Row:
    r = ratio(got, clean)
    pub = got.max_published / clean.max_published if clean.max_published > 0 else math.inf
    refused = f", {len(got.refused)} frame(s) refused ({', '.join(sorted(set(got.refused)))})" if got.refused else ""
    return Row(
        probe=f"attacks: {got.mode}, 1 rogue node of 4 ({got.attack}), default rule, {rounds} versions",
        expected=f"held-out loss <= {LOSS_BOUND}x clean, max |published| finite and <= {PUBLISHED_BOUND:g}x clean",
        observed=f"{r:.3f}x clean ({got.held_out:.4g} vs {clean.held_out:.4g}), max |published| {pub:.3g}x clean"
        + refused,
        passed=r <= LOSS_BOUND and math.isfinite(got.max_published) and pub <= PUBLISHED_BOUND,
    )


def probes(quick: bool) -> list[Row]:
    rounds = 12 if quick else 40
    attacks = QUICK_ATTACKS if quick else tuple(a for a in ATTACKS if a != "clean")
    rows: list[Row] = []
    with LoopbackServer() as server:
        for mode in MODES:
            clean = run_one(server, mode, "clean", "default", rounds)
            donor = run_one(server, mode, "clean", "default", rounds, task=-1.0)
            for attack in attacks:
                got = run_one(server, mode, attack, "default", rounds, donor=donor.frames)
                rows.append(_attack_row(got, clean, rounds))
            mean_clean = run_one(server, mode, "clean", "mean", rounds)
            hurt = run_one(server, mode, "flip_x1e15", "mean", rounds)
            r = ratio(hurt, mean_clean)
            rows.append(
                Row(
                    probe=f"attacks: {mode}, the same rogue (flip_x1e15) under the unbounded rule 'mean', "
                    f"{rounds} versions",
                    expected="hurt (> 1.5x clean): the bound above is the default rule's doing; status warns",
                    observed=f"{r:.3g}x clean, max |published| {hurt.max_published:.3g}; "
                    f"status warnings: {len(hurt.warnings)}",
                    passed=(not math.isfinite(r) or r > 1.5) and bool(hurt.warnings),
                )
            )
        if not quick:
            rows.extend(_colluding_rows(server, rounds))
    return rows


def _colluding_rows(server: LoopbackServer, rounds: int) -> list[Row]:
    """2 colluders of 8 (25 %) in every mode, under the default rule: ALIE, min-max and the adaptive attack on
    the rule's own defence (bench/attacks.py, COLLUDING), each within COLLUDING_BOUND of the clean run."""
    rows = []
    for mode in MODES:
        clean = run_one(server, mode, "clean", "default", rounds, nodes=8, rogues=2)
        for attack in COLLUDING_PROBED:
            got = run_one(server, mode, attack, "default", rounds, nodes=8, rogues=2)
            r = ratio(got, clean)
            rows.append(
                Row(
                    probe=f"attacks: {mode}, 2 colluders of 8 ({attack}), default rule, {rounds} versions",
                    expected=f"held-out loss <= {COLLUDING_BOUND}x clean",
                    observed=f"{r:.3f}x clean ({got.held_out:.4g} vs {clean.held_out:.4g})",
                    passed=r <= COLLUDING_BOUND,
                )
            )
    return rows
