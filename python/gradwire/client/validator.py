"""The helper a validator of a server run calls each round, beside :class:`~gradwire.client.node.Node`.

A validator (docs/SERVER.md, "Validators") runs the same model code as a node. Each round,
:meth:`Validator.score_round` loads the run's weights, reads the round's candidate updates once the round waits for
scores, scores each by the loss change it gives on a small batch, and posts the scores; the server weighs each
update by the median of its validators' scores. A candidate's effect is measured by one probing step:
``θ' = θ − step_size · direction(update)`` (``direction``: the identity for gradients and pseudo-gradients,
``torch.sign`` for DeMo's sign-applied records).

- **A run that assigns its data** (``data_assignment``): Templar's "Gauntlet". The batch is the node's own pages
  (:func:`gradwire.assignment.assigned_pages`) and random pages (:func:`gradwire.assignment.random_pages`, the
  validator's ``salt``). An update scores 1 when it lowers the loss on the node's own pages and does not raise it
  on the random ones by more than ``tolerance`` (relative); else 0. A node that does not improve its own data
  scores 0 however close it sits to the crowd; one that is good on its pages and harmful elsewhere scores 0 too.
- **A run that does not**: the validator's own data (``batch(round)``), scored harm-only: 1 unless the update
  raises the loss by more than ``allowance`` times the good the round's median candidate does there (its loss
  decrease; 0 when the median candidate does none), else 0. An update loses weight for the harm it does, not for
  the help it fails to give, so a minority whose data the validator lacks keeps its weight (its update may move
  shared parameters a little against the validator's data: that is allowed up to the typical update's help).
  Colluders below half the round do not move the median.
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
from .http_client import GradwireClient

__all__ = ["Validator"]


class Validator:
    """One validator's side of a run: ``validator.score_round()`` once per round.

    ``model``: the run's model (its float32 named parameters are loaded with the server's weights each round);
    ``loss(model, batch)``: the training loss of a batch. With a data assignment, ``pages(list_of_pages)`` gives the
    batch of those pages; without one, ``batch(round)`` gives a batch of the validator's own data.
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
        allowance: float = 1.0,
        salt: int = 0,
        direction: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if step_size <= 0 or tolerance < 0 or allowance < 0:
            raise ValueError(
                f"step_size must be > 0, tolerance and allowance >= 0; got {step_size}, {tolerance}, {allowance}"
            )
        self.client, self.run_id, self.model, self.loss = client, run_id, model, loss
        self.pages_batch, self.own_batch = pages, batch
        self.step_size, self.tolerance, self.allowance = float(step_size), float(tolerance), float(allowance)
        self.salt = int(salt)
        self.direction = direction or (lambda t: t)
        self.params = {n: p for n, p in model.named_parameters()}
        self.assignment: DataAssignment | None = None
        self._configured = False
        self.version: int | None = None
        #: Seconds spent scoring a candidate in the last round (decode and probes), for bench/validator_cost.py.
        self.seconds_per_candidate = 0.0

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
        self.version = version
        return version

    @torch.no_grad()
    def _loss_at(self, batch: Any, update: dict[str, torch.Tensor] | None) -> float:
        if update is None:
            return float(self.loss(self.model, batch))
        saved = {n: p.clone() for n, p in self.params.items() if n in update}
        try:
            for n, d in update.items():
                self.params[n].sub_(self.direction(d.to(self.params[n].device)), alpha=self.step_size)
            return float(self.loss(self.model, batch))
        finally:
            for n, t in saved.items():
                self.params[n].copy_(t)

    def gauntlet(self, update: dict[str, torch.Tensor], sender: int, round: int) -> float:
        """The score of ``sender``'s ``update`` in ``round`` of a run that assigns its data (module docstring)."""
        if self.assignment is None:
            raise ValueError(f"run {self.run_id!r} assigns no data: its rounds are scored harm-only")
        own_pages = assigned_pages(self.assignment, sender, round)
        own = self.pages_batch(own_pages)
        control = self.pages_batch(random_pages(self.assignment, round, len(own_pages), self.salt))
        own_before, own_after = self._loss_at(own, None), self._loss_at(own, update)
        ctrl_before, ctrl_after = self._loss_at(control, None), self._loss_at(control, update)
        helps = own_after < own_before
        harms = ctrl_after - ctrl_before > self.tolerance * abs(ctrl_before)
        return 1.0 if helps and not harms else 0.0

    def harm_only(self, updates: Mapping[int, dict[str, torch.Tensor]], round: int) -> dict[int, float]:
        """The scores of a round's ``updates`` (by sender) on the validator's own data (module docstring)."""
        data = self.own_batch(round)
        before = self._loss_at(data, None)
        change = {sender: self._loss_at(data, u) - before for sender, u in updates.items()}
        allowed = self.allowance * max(0.0, -statistics.median(change.values())) if change else 0.0
        return {sender: 0.0 if c > allowed else 1.0 for sender, c in change.items()}

    def score_round(self, round: int | None = None, wait: float = 30.0) -> dict[int, float] | None:
        """Score round ``round`` (default: the run's open round) and post the scores; ``None`` if the round was
        not waiting for scores within ``wait`` seconds. Returns ``{node_id: score}``."""
        if not self._configured:
            self._configure()
        version = self._load()
        round = version if round is None else round
        frames = self.client.candidates(self.run_id, round, wait=wait)
        if frames is None:
            return None
        t0 = time.perf_counter()
        updates = {}
        for raw in frames:
            frame = strip_binding(read_frame(raw))
            updates[frame.sender] = decode_bundle(frame)
        if self.assignment is not None:
            scores = {sender: self.gauntlet(u, sender, round) for sender, u in updates.items()}
        else:
            scores = self.harm_only(updates, round)
        self.seconds_per_candidate = (time.perf_counter() - t0) / max(1, len(updates))
        self.client.post_scores(self.run_id, round, scores)
        return scores
