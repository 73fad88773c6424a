"""The helper a validator of a server run calls each round, beside :class:`~gradwire.client.node.Node`.

A validator (docs/SERVER.md, "Validators") runs the same model code as a node. Each round,
:meth:`Validator.score_round` loads the run's weights, reads the round's candidate updates as they arrive
(:meth:`~.http_client.GradwireClient.candidates_since`), measures each by the loss change it gives on a small batch
while the round is still filling, and once the round waits for scores measures the last few and posts the
scores; the server weighs each update by the median of its validators' scores. A candidate's effect is measured
by one probing step: ``θ' = θ − step_size · direction(update)`` (``direction``: the identity for gradients and
pseudo-gradients, ``torch.sign`` for DeMo's sign-applied records), written straight into the model's parameters
from the loaded weights (no copy per probe; the weights are put back once, at the end).

- **A run that assigns its data** (``data_assignment``): Templar's "Gauntlet". The batch is the node's own pages
  (:func:`gradwire.assignment.assigned_pages`) and random pages (:func:`gradwire.assignment.random_pages`, the
  validator's ``salt``). An update scores 1 when it lowers the loss on the node's own pages and does not raise it
  on the random ones by more than ``tolerance`` (relative); else 0. A node that does not improve its own data
  scores 0 however close it sits to the crowd; one that is good on its pages and harmful elsewhere scores 0 too.
- **A run that does not**: the validator's own data (``batch(round)``), scored harm-only: 1 unless the update
  raises the loss by more than ``allowance`` times the good the round's median candidate does there (its loss
  decrease; 0 when the median candidate does none), else 0. An update loses weight for the harm it does, not for
  the help it fails to give; a minority whose data the validator lacks moves shared parameters against the
  validator's data too, which is allowed up to :data:`HARM_ALLOWANCE` (3) times the typical update's help.
  Colluders below half the round do not move the median. What this cannot do: late in a run, when the typical
  update helps the validator's data little, a minority whose objective conflicts with it harms that data 10–100
  times as much as the median candidate helps it (bench/heterogeneity.py's SparseLoCo minority row), as much as
  an inner-product attack does, and loses its score: a run that must keep such a minority assigns its data.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..assignment import DataAssignment, assigned_pages, random_pages
from ..binding import strip_binding
from ..frame import decode_bundle, read_frame
from .http_client import MAX_WAIT_S, GradwireClient  # the longest long poll (gradwire.protocol)

__all__ = ["HARM_ALLOWANCE", "Validator"]

#: Harm-only scoring: an update keeps its score while its probe raises the validator's loss by at most this many
#: times the loss decrease of the round's median candidate. On bench/heterogeneity.py's minority row (2 of 8
#: nodes on data of their own, the validator holding the majority's), at 1 the minority lost a third of its
#: weight under AdamW and DeMo and its own data's held-out loss rose 1.47× and 1.15× the plain mean's; at 3,
#: 1.00× and 1.04× (2 seeds), while IPM and the validator-aimed ``good_own`` still harm 5–30× the median help.
HARM_ALLOWANCE = 3.0


class Validator:
    """One validator's side of a run: ``validator.score_round()`` once per round.

    ``model``: the run's model (its float32 named parameters are loaded with the server's weights each round);
    ``loss(model, batch)``: the training loss of a batch. With a data assignment, ``pages(list_of_pages)`` gives the
    batch of those pages; without one, ``batch(round)`` gives a batch of the validator's own data.

    ``threads``: torch's intra-op threads while a round is scored (``torch.set_num_threads``, process-wide, put
    back after; ``None``: torch's as they are). A small model's probe is a few tiny operations, each an OpenMP
    parallel region: on cores shared with other work (the server, nodes) and OpenMP's default (spinning) wait
    policy each waits for a descheduled worker. ``threads=1``, or ``OMP_WAIT_POLICY=PASSIVE`` set before torch
    loads, keeps such a probe at its arithmetic (bench/validator_cost.py).
    """

    def __init__(
        self,
        client: GradwireClient,
        run_id: str,
        model: torch.nn.Module,
        loss: Callable[[torch.nn.Module, Any], torch.Tensor],
        *,
        pages: Callable[[list[int]], Any] | None = None,
        batch: Callable[[int], Any] | None = None,
        step_size: float = 1e-2,
        tolerance: float = 0.0,
        allowance: float = HARM_ALLOWANCE,
        salt: int = 0,
        direction: Callable[[torch.Tensor], torch.Tensor] | None = None,
        threads: int | None = None,
    ):
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None; got {threads}")
        if step_size <= 0 or tolerance < 0 or allowance < 0:
            raise ValueError(
                f"step_size must be > 0, tolerance and allowance >= 0; got {step_size}, {tolerance}, {allowance}"
            )
        self.client, self.run_id, self.model, self.loss = client, run_id, model, loss
        self.pages_batch, self.own_batch = pages, batch
        self.step_size, self.tolerance, self.allowance = float(step_size), float(tolerance), float(allowance)
        self.salt = int(salt)
        self.direction = direction or (lambda t: t)
        self.threads = threads
        self.params = {n: p for n, p in model.named_parameters()}
        self.assignment: DataAssignment | None = None
        self._configured = False
        self.version: int | None = None
        #: The weights the probes start from (loaded each round), the parameters a probe left changed, and the
        #: batches and losses of the loaded weights kept for the round (the validator's batch and its loss; a
        #: control batch and its loss), by key.
        self._base: dict[str, torch.Tensor] | None = None
        self._dirty: set[str] = set()
        self._kept: dict[tuple, tuple[Any, float]] = {}
        #: Seconds spent scoring a candidate in the last round (decode and probes, most of them while the round
        #: was still filling), for bench/validator_cost.py.
        self.seconds_per_candidate = 0.0
        #: Seconds from the answer saying the last round waits for scores to its scores posted: what this
        #: validator adds to the round's latency beside the network.
        self.seconds_after_ready = 0.0

    def _configure(self) -> None:
        config = self.client.status(self.run_id)["config"]
        if config.get("model_record"):
            raise ValueError(f"run {self.run_id!r} takes whole-model records; validators score per-tensor records")
        section = config.get("data_assignment")
        self.assignment = None if section is None else DataAssignment(**section)
        if self.assignment is not None and self.pages_batch is None:
            raise ValueError(f"run {self.run_id!r} assigns its data: give the Validator pages=(list of pages -> batch)")
        if self.assignment is None and self.own_batch is None:
            raise ValueError(f"run {self.run_id!r} assigns no data: give the Validator batch=(round -> batch)")
        self._configured = True

    def _load(self) -> int:
        state, version, _ = self.client.state(self.run_id)
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state[name])
            self._base = {n: p.detach().clone() for n, p in self.params.items()}
        self._dirty, self._kept = set(), {}
        self.version = version
        return version

    # -- probes: the loaded weights θ, or θ − step_size · direction(update), in the model's parameters ----------

    def _weights(self) -> dict[str, torch.Tensor]:
        if self._base is None:  # probed before any round was loaded: from the model's weights as they are
            self._base = {n: p.detach().clone() for n, p in self.params.items()}
        return self._base

    @torch.no_grad()
    def _restore(self) -> None:
        """The model's parameters back to the loaded weights (those a probe changed)."""
        base = self._weights()
        for n in self._dirty:
            self.params[n].copy_(base[n])
        self._dirty = set()

    @torch.no_grad()
    def _apply(self, update: Mapping[str, torch.Tensor]) -> None:
        """Set the model's parameters to ``θ − step_size · direction(update)``: each tensor written once from
        the loaded weights, no copy kept (``θ − s·d`` as ``θ.sub_(d, alpha=s)`` computes it, to the bit)."""
        base = self._weights()
        for n in self._dirty - update.keys():
            self.params[n].copy_(base[n])
        for n, d in update.items():
            p = self.params[n]
            torch.sub(base[n], self.direction(d.to(p.device)), alpha=self.step_size, out=p)
        self._dirty = set(update)

    @torch.no_grad()
    def _loss(self, batch: Any) -> float:
        return float(self.loss(self.model, batch))

    def _loss_at(self, batch: Any, update: dict[str, torch.Tensor] | None) -> float:
        """The loss of ``batch`` at the loaded weights (``update`` None) or after the probing step."""
        if update is None:
            self._restore()
        else:
            self._apply(update)
        return self._loss(batch)

    def _kept_loss(self, key: tuple, make: Callable[[], Any]) -> tuple[Any, float]:
        """``(batch, loss at the loaded weights)`` of the batch ``make()`` gives, made once per round and key."""
        if key not in self._kept:
            data = make()
            self._kept[key] = (data, self._loss_at(data, None))
        return self._kept[key]

    # -- scores --------------------------------------------------------------------------------------------------

    def gauntlet(self, update: dict[str, torch.Tensor], sender: int, round: int) -> float:
        """The score of ``sender``'s ``update`` in ``round`` of a run that assigns its data (module docstring)."""
        if self.assignment is None:
            raise ValueError(f"run {self.run_id!r} assigns no data: its rounds are scored harm-only")
        assignment = self.assignment
        own_pages = assigned_pages(assignment, sender, round)
        count = len(own_pages)
        control, ctrl_before = self._kept_loss(
            ("control", round, count),
            lambda: self.pages_batch(random_pages(assignment, round, count, self.salt)),
        )
        own = self.pages_batch(own_pages)
        own_before = self._loss_at(own, None)
        self._apply(update)
        own_after, ctrl_after = self._loss(own), self._loss(control)
        helps = own_after < own_before
        harms = ctrl_after - ctrl_before > self.tolerance * abs(ctrl_before)
        return 1.0 if helps and not harms else 0.0

    def loss_change(self, update: dict[str, torch.Tensor], round: int) -> float:
        """How much ``update``'s probing step changes the loss of the validator's own batch of ``round`` (a run
        that assigns no data); the loss at the loaded weights is computed once per round."""
        data, before = self._kept_loss(("own", round), lambda: self.own_batch(round))
        self._apply(update)
        return self._loss(data) - before

    def harm_scores(self, change: Mapping[int, float]) -> dict[int, float]:
        """Harm-only scores from each sender's :meth:`loss_change` (module docstring)."""
        allowed = self.allowance * max(0.0, -statistics.median(change.values())) if change else 0.0
        return {sender: 0.0 if c > allowed else 1.0 for sender, c in change.items()}

    def harm_only(self, updates: Mapping[int, dict[str, torch.Tensor]], round: int) -> dict[int, float]:
        """The scores of a round's ``updates`` (by sender) on the validator's own data (module docstring)."""
        return self.harm_scores({sender: self.loss_change(u, round) for sender, u in updates.items()})

    def score_round(self, round: int | None = None, wait: float = 30.0) -> dict[int, float] | None:
        """Score round ``round`` (default: the run's open round) and post the scores; ``None`` if the round was
        not waiting for scores within ``wait`` seconds. Returns ``{node_id: score}``.

        The candidates are read as they arrive and each is measured at once, so that when the round waits for
        scores only those of the last moments remain; a round not open yet is waited for (within ``wait``)."""
        if not self._configured:
            self._configure()
        before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            return self._score_round(round, wait)
        finally:
            self._restore()  # the model holds the loaded weights, whatever happened
            if self.threads is not None:
                torch.set_num_threads(before)

    def _score_round(self, round: int | None, wait: float) -> dict[int, float] | None:
        end = time.monotonic() + wait
        version = self._load()
        round = version if round is None else int(round)
        # A subclass that scores the round's updates together (its own harm_only) is handed them all at the end;
        # otherwise each is measured on arrival and only its loss change (or its score) is kept.
        together = self.assignment is None and type(self).harm_only is not Validator.harm_only
        measured: dict[int, tuple[int, Any]] = {}  # sender -> (its frame's round, its score, loss change or update)
        since, spent = 0, 0.0
        while True:
            left = end - time.monotonic()
            batch = self.client.candidates_since(self.run_id, round, since, wait=min(MAX_WAIT_S, max(0.0, left)))
            if batch is None:
                if time.monotonic() >= end:
                    return None
                continue
            ready_at = time.perf_counter()
            if self.version != round:
                # The round opened after the weights were loaded: its own weights. (Loaded past it, the round
                # closed meanwhile: the next read says so.)
                self._load()
                if self.version != round:
                    continue
            if batch.total < since + len(batch.frames):  # a count the server no longer holds: read afresh
                since, measured = 0, {}
                continue
            t0 = time.perf_counter()
            for raw in batch.frames:
                frame = strip_binding(read_frame(raw))
                if frame.sender in measured and measured[frame.sender][0] >= frame.round:
                    continue  # a sender's latest round counts (a late update beside its current one)
                update = decode_bundle(frame)
                if self.assignment is not None:
                    measured[frame.sender] = (frame.round, self.gauntlet(update, frame.sender, round))
                elif together:
                    measured[frame.sender] = (frame.round, update)
                else:
                    measured[frame.sender] = (frame.round, self.loss_change(update, round))
            spent += time.perf_counter() - t0
            since = batch.total
            if batch.scoring:
                break
        t0 = time.perf_counter()
        got = {sender: m for sender, (_, m) in sorted(measured.items())}
        if self.assignment is not None:
            scores = got
        elif together:
            scores = self.harm_only(got, round)
        else:
            scores = self.harm_scores(got)
        spent += time.perf_counter() - t0
        self.seconds_per_candidate = spent / max(1, len(measured))
        self.client.post_scores(self.run_id, round, scores)
        self.seconds_after_ready = time.perf_counter() - ready_at
        return scores
