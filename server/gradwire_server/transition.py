"""A run's state and the one deterministic step from version ``v`` to ``v + 1``, shared by closing a round
and by replaying rounds after a restart.

:class:`RunState` holds what the server keeps for a run on its device: the fp32 master weights, AdamW's
moments (``adamw`` runs), the downlink :class:`~gradwire.ErrorFeedback` (``adamw`` runs and runs that
re-encode their aggregate), and the algorithm's state (SparseLoCo's outer momentum; nothing for DeMo). Every step works
**in place** on those buffers — a
round allocates nothing the size of the model — so a step that fails half-way leaves the state unusable;
the round engine then reloads it from the store.

Which step a run takes is its algorithm's publication kind (``gradwire.algorithms``; never its name):

- ``"diff"`` (``adamw``): aggregate (transform domain) → AdamW (:mod:`.optim`) → ``diff = target − master`` compressed
  inside the downlink error feedback → ``master += reconstruction``, the codec's reconstruction being
  exactly what every node decodes from the frame (``Codec.compress``'s contract), so nothing is decoded
  twice. :meth:`RunState.close_adamw` makes the frame; :meth:`RunState.replay_adamw` runs the same code on
  the logged submissions and checks that it makes the frame that was published.
- ``"mean"`` (``demo`` / ``sparseloco``): the exact (robust) aggregate of the node frames, applied with
  :func:`gradwire.published.apply_mean` (the algorithm's ``apply``) — what every node runs. With
  ``publish="aggregate"`` (the default) the aggregate plus the downlink error buffer is compressed with
  the downlink codec and that one frame is published and applied (its reconstruction, which is what nodes
  decode); replaying re-runs it from the logged submissions, like AdamW's, and checks the bytes. With
  ``publish="frames"`` the node frames are published verbatim and replaying needs only them.

On the CPU (and on one GPU) the same inputs give the same bits, so the replay after a crash reproduces
the weights, the moments and the downlink state of the uninterrupted run (the weights are exact in any
case: they are the published frames applied).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradwire import ErrorFeedback, decode_bundle, read_frame
from gradwire.aggregation import NormHistory, exact_mean, update_norm
from gradwire.algorithms import exact_aggregate
from gradwire.dct import records_parsed_once
from gradwire.dct.chunks import from_chunks
from gradwire.dct.transform import idct_chunks
from gradwire.frame import SERVER_SENDER, write_frame
from gradwire.published import apply_mean, read_published, write_published, write_published_aggregate
from gradwire.reencode import ReencodeFeedback
from gradwire.rule import Rule
from gradwire.sender_history import SenderHistory
from gradwire.state import apply_update, state_hash

from .aggregate import Update, large_round, published_weights, round_alignment, rule_aggregate, score_weighted
from .config import RunConfig
from .optim import AdamWState, adamw_step_
from .prepare import close_parses
from .round_sum import ADD_LIMIT_MULTIPLE, RoundSum

__all__ = ["RunState", "Timings"]

log = logging.getLogger("gradwire_server.transition")


@dataclass
class Timings:
    """Seconds spent in each part of the last step (for metrics and bench/server_rounds.py)."""

    aggregate: float = 0.0
    adamw: float = 0.0
    encode: float = 0.0
    apply: float = 0.0
    hash: float = 0.0

    def total(self) -> float:
        return self.aggregate + self.adamw + self.encode + self.apply + self.hash


class _Clock:
    def __init__(self, timings: Timings):
        self.timings = timings
        self.t = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        setattr(self.timings, part, getattr(self.timings, part) + now - self.t)
        self.t = now


@dataclass
class RunState:
    """A run's state at ``version`` on ``device``; the steps below advance it in place."""

    config: RunConfig
    version: int
    master: dict[str, torch.Tensor]
    moments: AdamWState | None = None
    #: The downlink error feedback: AdamW's diff (parameter space), or a re-encoded aggregate's (its
    #: residuals in the DCT coefficient domain where the nodes' records allow: gradwire.reencode).
    downlink: ErrorFeedback | ReencodeFeedback | None = None
    #: The run's aggregation rule and all its state (``bounded_mean``'s clip levels and sender histories:
    #: :mod:`gradwire.rule`), stepped once per version, closing or replaying (:meth:`_step_rule`).
    rule: Rule = field(default_factory=Rule)
    algorithm_state: dict[str, Any] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    _work: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def load(
        cls,
        config: RunConfig,
        version: int,
        weights: Mapping[str, torch.Tensor],
        moments: Mapping[str, torch.Tensor] | None,
        server_state: Mapping[str, Any],
        device: torch.device,
        sketch_key: bytes | None = None,
    ) -> RunState:
        """The state from a checkpoint's tensors (moments ``None``: zeros, as at version 0). ``sketch_key``:
        the server's key for its rule's sketches (:attr:`gradwire.rule.Rule.sketch_key`)."""
        master = {n: weights[n].to(device=device, dtype=torch.float32).contiguous() for n in sorted(weights)}
        state = cls(config, version, master)
        server_state = dict(server_state)
        downlink = server_state.pop("downlink", {})
        rule_state = {k: server_state.pop(k) for k in ("aggregation", "senders") if k in server_state}
        if state.publishes_diffs:
            state.moments = (
                AdamWState.zeros_like(master)
                if moments is None
                else AdamWState.from_tensors(moments, step=version, device=device)
            )
        state.algorithm_state = _to_device(server_state, device)
        # A run that assigns its data has IID honest nodes: there, and only there, a persistent deviation
        # costs a node its weight (gradwire.rule), in every mode.
        state.rule = config.aggregation.rule_object(getattr(config, "data_assignment", None) is not None)
        state.rule.load_state_dict(rule_state)
        if sketch_key is not None:
            state.rule.sketch_key = sketch_key
        if state.publishes_diffs:
            state.downlink = ErrorFeedback(config.downlink.build())
        elif config.reencodes:
            # Reads its own state and the parameter-domain ErrorFeedback states of older checkpoints.
            state.downlink = ReencodeFeedback(config.downlink.build())
        if state.downlink is not None:
            state.downlink.load_state_dict(_to_device(downlink, device))
        return state

    @property
    def publishes_diffs(self) -> bool:
        """Whether the run's versions are the server's compressed weight diffs (its algorithm's publication
        is ``"diff"``), rather than node records whose mean everyone applies (``"mean"``)."""
        return self.config.algorithm_spec.publication == "diff"

    @property
    def norms(self) -> NormHistory | None:
        """The rule's clip-level history (``None`` for rules without a cap)."""
        return self.rule.norms

    @property
    def senders(self) -> SenderHistory | None:
        """The rule's sender histories (``None`` where the rule keeps none)."""
        return self.rule.senders

    def close(
        self,
        updates: Sequence[Update],
        score_weights: Mapping[int, float] | None = None,
        round_sum: RoundSum | None = None,
    ) -> bytes:
        """Round ``version`` closed from ``updates`` (in the order they were committed): the bytes of
        ``version + 1``, by the run's publication kind. ``score_weights``: the validators' weight of each
        sender in a scored round (:mod:`.scores`), multiplied into each update's weight, the trust
        down-weighting sitting the round out (:mod:`gradwire.rule`); ``None``: the round was not scored.
        ``round_sum``: the round's running sum (:meth:`new_round_sum`), kept as its updates were
        acknowledged; one is built here from ``updates`` where it is missing or holds other updates, with
        the same operations, so the bytes are the same either way."""
        scored = score_weights is not None
        logged = _in_aggregation_order(updates)
        updates = score_weighted(logged, score_weights)
        # The direction check, the norms and the aggregate read each record: parsed once, when it arrived
        # (.prepare), or here.
        with records_parsed_once(close_parses(updates)):
            rs = self._round_sum(logged, round_sum)
            return (
                self.close_adamw(updates, scored, rs)
                if self.publishes_diffs
                else self.close_average(updates, scored, rs)
            )

    def replay(
        self,
        updates: Callable[[], Sequence[Update]],
        published: bytes,
        score_weights: Mapping[int, float] | None = None,
    ) -> bool:
        """Re-run the step that published ``published``; ``updates`` gives the round's logged updates in
        their commit order (only runs that re-run their own encoding need them: ``"diff"`` and re-encoded
        ``"mean"`` runs). ``False`` if that encoding made other bytes (see :meth:`replay_adamw`).
        ``score_weights`` as the round's :meth:`close` had them (committed with the version)."""
        scored = score_weights is not None
        with records_parsed_once():
            if not self.publishes_diffs and not self.config.reencodes:
                self.replay_average(published)
                return True
            logged = _in_aggregation_order(updates())
            weighted = score_weighted(logged, score_weights)
            rs = self._round_sum(logged, None)
            if self.publishes_diffs:
                return self.replay_adamw(weighted, published, scored, rs)
            return self.replay_reencoded(weighted, published, scored, rs)

    def new_round_sum(self) -> RoundSum | None:
        """An empty running sum for the open round (:mod:`.round_sum`), or ``None`` where this run's close
        sums no records itself (a coordinate-wise rule; a run that publishes the node frames, or whose
        downlink has no coefficient domain)."""
        if not self.rule.weighted:
            return None
        limit = ADD_LIMIT_MULTIPLE * self.rule.cap()  # the cap from the rounds before this one
        if self.publishes_diffs:
            return RoundSum(limit=limit)
        if not self.config.reencodes or not isinstance(self.downlink, ReencodeFeedback):
            return None
        domain = self.downlink.domain
        if domain is None:
            return None
        return RoundSum(lambda entry: domain.codec.plan(entry.shape), limit)

    def _alignment(self, updates: Sequence[Update], rs: RoundSum | None):
        """The round's direction-check reading (:func:`.aggregate.round_alignment`), from the sketches its
        running sum kept where it has them."""
        key = self.rule.sketch_key
        return round_alignment(updates, key, None if rs is None else rs.sketches(key))

    def _round_sum(self, logged: Sequence[Update], given: RoundSum | None) -> RoundSum | None:
        """``given`` if it holds exactly ``logged``, else a new sum of them (``None`` where the run uses none)."""
        if given is not None and given.matches(logged):
            return given
        rs = self.new_round_sum()
        if rs is not None:
            for u in logged:
                rs.add(u)
        return rs

    @property
    def device(self) -> torch.device:
        return next(iter(self.master.values())).device

    @property
    def names(self) -> list[str]:
        return sorted(self.master)

    def weights_hash(self) -> str:
        clock = _Clock(self.timings)
        h = state_hash(self.master)
        clock.lap("hash")
        return h

    # -- adamw ------------------------------------------------------------------------------------

    def _adamw_frame(
        self, updates: Sequence[Update], scored: bool = False, rs: RoundSum | None = None
    ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """Aggregate, step AdamW, compress the diff in the downlink feedback: ``(frame, reconstruction)``."""
        assert self.moments is not None and self.downlink is not None
        cfg, names, clock = self.config, self.names, _Clock(self.timings)
        summed = None if rs is None else (lambda coeffs: self._summed_gradient(rs, coeffs, updates))
        alignment = self._alignment(updates, rs)
        grads, coeffs, records = rule_aggregate(updates, names, self.rule, self.device, scored, alignment, summed)
        self._step_rule(updates, records, coeffs)
        clock.lap("aggregate")
        if not self._work:
            self._work = {n: torch.empty_like(t) for n, t in self.master.items()}
        adamw_step_(cfg.optimizer, self.master, grads, self.moments, self._work)
        del grads
        diff = {n: self._work[n].sub_(self.master[n]) for n in names}  # target − master, in place
        clock.lap("adamw")
        done = self.downlink.compress_bundle_reconstructed(diff)
        frame = write_frame([e for e, _ in done.values()], round=self.version + 1, sender=SERVER_SENDER, bundle=True)
        clock.lap("encode")
        return frame, {n: r for n, (_, r) in done.items()}

    def _summed_gradient(
        self, rs: RoundSum, coeffs: Sequence[float], updates: Sequence[Update]
    ) -> dict[str, torch.Tensor]:
        """The tensors ``rs`` sums, ``Σ cᵢ uᵢ`` dense: its coefficients corrected and scaled, one inverse
        transform each (as :class:`gradwire.dct.DCTAccumulator` finishes)."""
        s, buffers = rs.finish(coeffs, updates)
        s32 = float(torch.tensor(s, dtype=torch.float32))
        out = {}
        for name, buf in buffers.items():
            c = buf.coeffs if s32 == 1.0 else buf.coeffs.mul_(s32)
            plan = buf.plan
            out[name] = from_chunks(idct_chunks(c.reshape(plan.num_chunks, *plan.chunk_shape)), plan).to(self.device)
        return out

    def close_adamw(self, updates: Sequence[Update], scored: bool = False, rs: RoundSum | None = None) -> bytes:
        """Round ``version`` closed from ``updates`` (in commit order): the frame of ``version + 1``."""
        frame, recon = self._adamw_frame(updates, scored, rs)
        self._apply(recon)
        return frame

    def replay_adamw(
        self, updates: Sequence[Update], published: bytes, scored: bool = False, rs: RoundSum | None = None
    ) -> bool:
        """Re-run the step that published ``published`` from the same logged updates. ``True`` if it made
        the same frame (then the moments and the feedback are the uninterrupted run's, bit for bit);
        otherwise (another thread count or BLAS rounded differently) the published frame is applied all
        the same, and its difference from ours is handed back to the feedback."""
        frame, recon = self._adamw_frame(updates, scored, rs)
        if frame == published:
            self._apply(recon)
            return True
        sent = decode_bundle(read_frame(published), device=self.device)
        assert self.downlink is not None
        self.downlink.take_back({n: recon[n] - sent[n] for n in recon})
        self._apply(sent)
        return False

    # -- demo / sparseloco ------------------------------------------------------------------------

    def close_average(self, updates: Sequence[Update], scored: bool = False, rs: RoundSum | None = None) -> bytes:
        """Round ``version`` closed from ``updates`` (in commit order): the bytes of ``version + 1`` — the
        re-encoded aggregate (``publish='aggregate'``) or the node frames verbatim."""
        clock = _Clock(self.timings)
        # The rule's weights (bounded_mean's direction check among them) are the aggregation's work.
        alignment = self._alignment(updates, rs)
        weights, trim = published_weights(updates, self.rule, scored=scored, alignment=alignment)
        records = [u.frame.entries for u in updates]
        self._step_rule(updates, records, weights)
        clock.lap("aggregate")
        if self.config.reencodes:
            published, recon = self._reencoded_version(records, weights, trim, rs, updates)
            verbatim = self._verbatim_size(updates, weights, trim)
            if verbatim is not None and len(published) > verbatim:
                return self._publish_verbatim_instead(updates, records, weights, trim, recon)
            # The codec's reconstruction is what every node decodes from those bytes (Codec.compress's
            # contract, as for AdamW's diff), so the frame is not decoded again here.
            self._apply_mean(recon)
            return published
        self._average(records, weights, trim)
        return write_published(self.version, [u.raw for u in updates], weights, trim)

    def _verbatim_size(self, updates: Sequence[Update], weights: Sequence[float], trim: int) -> int | None:
        """The bytes the round's frames would take published verbatim as version ``version + 1`` — its header
        (the header of empty frames is the same) plus the frames — without concatenating them; ``None`` where
        an update came without its bytes (callers that build updates by hand)."""
        if not all(u.raw for u in updates):
            return None
        header = write_published(self.version + 1, [b""] * len(updates), weights, trim)
        return len(header) + sum(len(u.raw) for u in updates)

    def _publish_verbatim_instead(
        self,
        updates: Sequence[Update],
        records: Sequence[Sequence],
        weights: Sequence[float],
        trim: int,
        recon: Mapping[str, torch.Tensor],
    ) -> bytes:
        """The re-encoded aggregate came out larger than the round's own frames (a few senders, small
        tensors, a downlink budget above theirs): publish the frames verbatim, so that no version is ever
        larger than the frames it replaces plus its header. Every node then applies the exact aggregate,
        and the downlink buffer takes back what the re-encoding had moved out of it (``recon − mean``),
        leaving the residual it held before this round. The choice and that arithmetic are a fixed
        function of the logged updates, so a replay after a restart makes them again, bit for bit."""
        assert self.downlink is not None
        clock = _Clock(self.timings)
        mean = exact_aggregate(records, weights, trim, device=self.device)
        clock.lap("aggregate")
        self.downlink.take_back({n: recon[n] - mean[n] for n in recon})
        verbatim = write_published(self.version + 1, [u.raw for u in updates], weights, trim)
        self._apply_mean(mean)
        return verbatim

    def _reencoded_version(
        self,
        records: Sequence[Sequence],
        weights: Sequence[float],
        trim: int,
        rs: RoundSum | None = None,
        updates: Sequence[Update] = (),
    ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """The exact (robust) aggregate of ``records``, plus the downlink error buffer, compressed with the
        downlink codec (the buffer keeps the rest): ``(the version's bytes, each record's exact decode)``.
        Only the aggregate reaches the buffer, so a node can move it no more than the rule lets it move
        the aggregate. Where the nodes' records share the downlink's DCT chunks and the rule is a weighted
        mean, the aggregate is summed and compressed in the coefficient domain (gradwire.reencode): no
        decode of the node records, no forward transform."""
        assert isinstance(self.downlink, ReencodeFeedback)
        clock = _Clock(self.timings)
        if rs is not None and not trim:
            # The round's running sum (.round_sum): corrected and scaled into the residuals; the tensors
            # it does not hold are summed here.
            scale, buffers = rs.finish(weights, updates)
            sums = {name: (buf.shape, buf.coeffs) for name, buf in buffers.items()}
            per_sender = [{e.name: e for e in recs} for recs in records]
            rest = sorted(n for n in per_sender[0] if n not in sums)
            mean = exact_mean([[mine[n] for n in rest] for mine in per_sender], weights, self.device) if rest else {}
            clock.lap("aggregate")
            done = self.downlink.reencode_sums(sums, scale, mean, device=self.device)
        else:
            done = self.downlink.reencode(records, weights, trim, device=self.device, lap=clock.lap)
        published = write_published_aggregate(self.version + 1, [e for e, _ in done.values()], len(records))
        clock.lap("encode")
        return published, {n: r for n, (_, r) in done.items()}

    def replay_reencoded(
        self, updates: Sequence[Update], published: bytes, scored: bool = False, rs: RoundSum | None = None
    ) -> bool:
        """Re-run the re-encoding that published ``published`` from the same logged updates, then apply the
        published bytes. ``True`` if it made the same bytes (then the error buffer is the uninterrupted
        run's, bit for bit); otherwise the difference between ours and the published reconstruction is
        handed back to the buffer, as :meth:`replay_adamw` does."""
        alignment = self._alignment(updates, rs)
        weights, trim = published_weights(updates, self.rule, scored=scored, alignment=alignment)
        records = [u.frame.entries for u in updates]
        self._step_rule(updates, records, weights)
        ours, recon = self._reencoded_version(records, weights, trim, rs, updates)
        verbatim = self._verbatim_size(updates, weights, trim)
        if (
            verbatim is not None
            and len(ours) > verbatim == len(published)
            and write_published(self.version + 1, [u.raw for u in updates], weights, trim) == published
        ):
            # The round published its frames verbatim: close_average made the same choice.
            self._publish_verbatim_instead(updates, records, weights, trim, recon)
            return True
        if ours == published:
            self._apply_mean(recon)
            return True
        (version,) = read_published(published)
        sent = version.mean(device=self.device)
        assert self.downlink is not None
        self.downlink.take_back({n: recon[n] - sent[n] for n in recon})
        self._apply_mean(sent)
        return False

    def replay_average(self, published: bytes) -> None:
        (version,) = read_published(published)
        if version.version != self.version + 1:
            raise ValueError(f"the logged frames publish version {version.version}, not {self.version + 1}")
        records = version.records()
        # The norms the server's validation computed for these frames, by the same function (only the cap
        # reads them); the trust the round was closed with is in its weights, and the histories step by them.
        norms = [update_norm(recs) for recs in records] if self.rule.norms is not None else [0.0] * len(records)
        self.rule.step([f.sender for f in version.frames], norms, records, version.weights)
        self._average(records, version.weights, version.trim)

    def _average(self, records: Sequence[Sequence], weights: Sequence[float], trim: int = 0) -> None:
        clock = _Clock(self.timings)
        mean = exact_aggregate(records, weights, trim, device=self.device)
        clock.lap("aggregate")
        self._apply_mean(mean)

    def _apply_mean(self, mean: Mapping[str, torch.Tensor]) -> None:
        clock = _Clock(self.timings)
        self.algorithm_state = apply_mean(
            self.config.algorithm, self.config.algorithm_config(), self.master, mean, self.algorithm_state
        )
        self.version += 1
        clock.lap("apply")

    # -- shared -----------------------------------------------------------------------------------

    def _step_rule(self, updates: Sequence[Update], records: Sequence[Sequence], coeffs: Sequence[float]) -> None:
        """Step the run's rule past the round just closed (after its weights were taken), from what its
        version records: the one place a closing round changes the rule's state."""
        sketches = [u.history_sketch for u in updates]
        self.rule.step([u.node_id for u in updates], [u.norm for u in updates], records, coeffs, sketches)

    def _apply(self, update: Mapping[str, torch.Tensor]) -> None:
        clock = _Clock(self.timings)
        apply_update(self.master, update)  # the operation nodes run, in name order
        self.version += 1
        clock.lap("apply")

    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
        """``(weights, moments, server state)`` as CPU tensors for the store (views on the CPU: write them
        before the next step)."""
        weights = {n: t.detach().cpu() for n, t in self.master.items()}
        moments = {} if self.moments is None else {k: t.cpu() for k, t in self.moments.to_tensors().items()}
        server_state = dict(self.algorithm_state)
        if self.downlink is not None:
            server_state["downlink"] = self.downlink.state_dict()
        server_state.update(self.rule.state_dict())
        return weights, moments, server_state

    def close_memory_bytes(self) -> int:
        """About the memory one close of this run allocates (its buffers and temporaries), for
        :func:`.memory.reserve`: a multiple of the weights' bytes measured by the heap's growth over a
        fresh process's first close (10 M parameters, 4 nodes, each mode's default codecs): 4.0× for
        AdamW runs (the aggregate, the downlink residual, the reconstruction), 7.0× for SparseLoCo's
        re-encoded aggregate (its outer momentum and Nesterov step besides), 2.6× for DeMo's. The larger
        factor is taken for every ``"mean"`` run. 0 on a GPU: its temporaries are not the host's."""
        if self.device.type != "cpu":
            return 0
        return (4 if self.publishes_diffs else 7) * _tensor_bytes(self.master)

    def state_bytes(self) -> int:
        """Bytes of a checkpoint: the weights, plus the moments and the downlink residuals of AdamW runs."""
        weights = _tensor_bytes(self.master)
        if self.publishes_diffs:
            return 4 * weights
        return weights * (2 if self.downlink is not None else 1) + _tensor_bytes(self.algorithm_state)


def _in_aggregation_order(updates: Sequence[Update]) -> list[Update]:
    """A round's updates (given in commit order) in the order its close sums them: commit order in a large
    round (the order its running sum added them), else (node id, round), independent of arrival
    (:data:`.aggregate.LARGE_ROUND_BYTES`)."""
    if large_round(updates):
        return list(updates)
    return sorted(updates, key=lambda u: (u.node_id, u.round))


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _to_device(state: Any, device: torch.device) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, Mapping):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    return state
