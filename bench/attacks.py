"""Rogue nodes against every training mode, through a real server: held-out loss against the clean run.

``python -m bench.attacks [--rounds 30] [--modes ...] [--attacks ...] [--rules bounded_mean mean ...]``

A real ``gradwire_server`` on loopback (:class:`gradwire_server.launcher.LoopbackServer`) and four real
:class:`gradwire.client.Node` clients on threads train a small MLP on a regression task, each node on its
own data stream. One node of the four (25 %) is rogue: it trains like the others (its replica follows the
published versions and passes the weights-hash check), but what it submits is replaced by an attack on
the frame it would have sent:

- ``x1000``, ``x1e15``: its update scaled by 1000 or 1e15 (decoded, scaled, re-encoded with the run's
  uplink codec: finite values, a valid frame);
- ``flip``: its update with the sign flipped; ``flip_x1e15``: flipped and scaled by 1e15;
- ``ef_poison``: ±1e6 times its update, alternating each round (what a server-side error feedback would
  remember, and a momentum would carry);
- ``copy``: an honest node's frame of the same round, resubmitted as its own (header rewritten: the
  verbatim frame is refused as ``sender_mismatch``; its run binding is that of this run and round);
- ``replay``: an honest node's frame of the previous round, resubmitted as its own in this one, header
  rewritten and bound again to this round (as only a token holder of the run can);
- ``other_run``: the frame its own node id sent in the same round of another run (same mode and rule,
  trained on the opposite task), verbatim: refused (``run_binding_mismatch``: docs/FORMAT.md section 10).

A refused frame is counted, and the node then submits its honest frame so the round still closes.

Colluding attacks (``--nodes 8 --rogues 2``, ``--nodes 20 --rogues 5``: 25 %), from the literature on
attacks that stay inside the honest spread; every colluder submits the same crafted update, re-encoded
with the run's uplink codec and bound to the run:

- ``alie`` (Baruch et al. 2019, "A Little Is Enough"): the honest updates' per-coordinate mean minus
  ``z = 1.0`` standard deviations, from every honest node's update of the round (omniscient);
  ``alie_own``: the same statistics estimated from the colluders' own genuine updates;
- ``ipm_small``, ``ipm_large`` (Xie et al. 2020, inner-product manipulation): ``−0.1`` and ``−4`` times the
  honest mean;
- ``minmax``, ``minsum`` (Shejwalkar & Houmansadr, NDSS 2021): the honest mean plus ``γ`` times the
  negative per-coordinate standard deviation, ``γ`` the largest (by bisection) whose distance to every
  honest update (min-max) or whose sum of squared distances (min-sum) stays within the largest among the
  honest updates themselves;
- ``mimic`` (Karimireddy et al. 2022): every colluder repeats one honest node's update;
- ``adaptive``: ALIE against the default rule's own defence, knowing it and its reference point. The
  colluders keep a mirror of the server's per-node deviation histories (:class:`gradwire.sender_history.
  SenderHistory`, the server's defaults, fed every honest update of every round and the round's mean as its
  reference) and each round pick the largest ``z`` (by bisection, up to 3) for which their updates
  ``mean − z·std`` keep their histories under the level at which the server starts to take weight away
  (95 % of it). Each colluder adds its own tiny noise, so that their updates are not counted once as copies.

An attack aimed at validators (:data:`AIMED_AT_VALIDATORS`, ``bench/heterogeneity.py``'s colluder grid):

- ``good_own``: each colluder sends its own genuine update (good on its own data, or its own assigned pages)
  plus ``κ = 4`` times its norm along the honest mean's part orthogonal to it, reversed: first order, it still
  lowers the loss of the data it was computed on (the added part is orthogonal to it), and it raises the loss
  elsewhere (it points against what the honest nodes' data agree on). A validator that judges a node on its
  own pages alone passes it; one that also measures random pages (the Gauntlet) or its own data should not.

Modes: ``adamw`` (the server's AdamW, compressed diff published), ``demo`` and ``sparseloco`` publishing
the node frames verbatim (``publish="frames"``), and ``demo/agg`` and ``sparseloco/agg``: the re-encoded
downlink (``publish="aggregate"``, the server's error feedback). Each row: the held-out loss of the run's
final weights (the server's), the clean run's (same mode, same rule), their ratio, and the largest
|value| any published version carried (for ``adamw`` the decoded weight diff, for the others the
aggregate every node applies), against the clean run's. The rule ``default`` is the run's default rule
(``bounded_mean``).

The whole default table (5 modes × 9 attacks × 2 rules, 40 versions: 100 runs of 4–10 s) took 992 s on
2 cores shared with other jobs, about 8 minutes on free ones (docs/SERVER.md, "Rogue nodes", quotes it).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

import gradwire
from gradwire.binding import binding_entry, strip_binding
from gradwire.client import GradwireClient, Node
from gradwire.client.errors import GradwireHTTPError
from gradwire.frame import decode_bundle, read_frame, write_frame
from gradwire.sender_history import SenderHistory
from gradwire_server.launcher import LoopbackServer

#: The uplink codec of every mode: a DCT top-k on flat chunks of 64, small enough for this model.
CODEC = {"chunk_shape": [64], "topk": 16}
N_NODES = 4
ROGUE = N_NODES  # node ids count from 1: the last node is the rogue one (25 %)
HONEST_SOURCE = 1  # whose frames ``copy`` and ``replay`` resubmit

#: Each mode's run config (the rule is added per row); quorum = every node, so every round has the rogue.
MODES: dict[str, dict] = {
    "adamw": {
        "algorithm": "adamw",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
        "downlink": {"codec": "dct", "params": {"chunk_shape": [64], "topk": 32}},
    },
    "demo": {"algorithm": "demo", "publish": "frames", "demo": {"lr": 1e-2, "beta": 0.9}},
    "demo/agg": {
        "algorithm": "demo",
        "publish": "aggregate",
        "demo": {"lr": 1e-2, "beta": 0.9},
        "downlink": {"codec": "dct", "params": {"chunk_shape": [64], "topk": 16}},
    },
    "sparseloco": {
        "algorithm": "sparseloco",
        "publish": "frames",
        "sparseloco": {"sync_every": 2, "outer_lr": 0.7, "inner": {"lr": 1e-2, "weight_decay": 0.0}},
    },
    "sparseloco/agg": {
        "algorithm": "sparseloco",
        "publish": "aggregate",
        "sparseloco": {"sync_every": 2, "outer_lr": 0.7, "inner": {"lr": 1e-2, "weight_decay": 0.0}},
        "downlink": {"codec": "dct", "params": {"chunk_shape": [64], "topk": 16}},
    },
}
ATTACKS = ("clean", "x1000", "x1e15", "flip", "flip_x1e15", "ef_poison", "copy", "replay", "other_run")
#: Attacks by colluding nodes that craft one update from the honest ones (``--rogues`` of ``--nodes``).
COLLUDING = ("alie", "alie_own", "ipm_small", "ipm_large", "minmax", "minsum", "mimic", "adaptive")
#: Colluding attacks aimed at validators (module docstring), run like :data:`COLLUDING`'s.
AIMED_AT_VALIDATORS = ("good_own",)
#: ``good_own``'s reversed honest direction, in multiples of the colluder's own update norm.
GOOD_OWN_KAPPA = 4.0


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(stream: int, step: int, size: int = 128, task: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch: ``y`` a fixed nonlinear function of ``x`` (times ``task``: ``-1`` is the other
    run's task, whose frames ``other_run`` replays); streams are seeded apart."""
    g = torch.Generator().manual_seed(7919 * stream + step)
    x = torch.randn(size, 16, generator=g)
    return x, task * (torch.tanh(x[:, :4]) * 0.8 - 0.5 * x[:, 4:8])


HELD_OUT = batch(10_000, 0, size=1024)


def held_out_loss(state: dict[str, torch.Tensor]) -> float:
    m = model()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(state[name])
        x, y = HELD_OUT
        return float(((m(x) - y) ** 2).mean())


def mse(module: nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = xy
    return ((module(x) - y) ** 2).mean()


@dataclass(frozen=True)
class DataSpec:
    """What a run trains on: ``model()`` (the same initial weights for every node), ``batch(node_id, step,
    task)`` (a node's batch of a step; ``task`` −1: :func:`batch`'s opposite task), ``loss(module, batch)``
    and ``held_out_loss(state)`` of the final weights."""

    model: Callable[[], nn.Module]
    batch: Callable[[int, int, float], tuple[torch.Tensor, torch.Tensor]]
    held_out_loss: Callable[[dict[str, torch.Tensor]], float]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor] = mse


#: This bench's task: every node on its own stream of one regression (IID).
REGRESSION = DataSpec(model, lambda node, step, task: batch(node, step, task=task), held_out_loss)


# -- the rogue node ---------------------------------------------------------------------------------


@dataclass
class Frames:
    """Every frame a run's nodes submitted, by (round, node id), for ``copy``, ``replay`` and ``other_run``."""

    by_key: dict[tuple[int, int], tuple[bytes, dict]] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def put(self, round_: int, node_id: int, frame: bytes, headers: dict) -> None:
        with self.cond:
            self.by_key[(round_, node_id)] = (frame, headers)
            self.cond.notify_all()

    def wait(self, round_: int, node_id: int, timeout: float = 30.0) -> bytes | None:
        with self.cond:
            self.cond.wait_for(lambda: (round_, node_id) in self.by_key, timeout=timeout)
            got = self.by_key.get((round_, node_id))
            return None if got is None else got[0]


def rewrite(frame: bytes, round_: int, sender: int, rebind: str | None = None) -> bytes:
    """``frame``'s records under a new header (round, sender) and a fresh CRC: a valid frame. Its run
    binding is kept, or with ``rebind`` (a run id) replaced by that run's binding for ``round_``."""
    f = read_frame(frame)
    entries = f.entries if rebind is None else [*strip_binding(f).entries, binding_entry(rebind, round_)]
    return write_frame(entries, round=round_, sender=sender, bundle=True)


def scaled(frame: bytes, factor: float, round_: int, sender: int, run_id: str) -> bytes:
    """``frame`` decoded, multiplied by ``factor``, re-encoded with the uplink codec (finite values) and
    bound to ``run_id`` (the rogue holds a token of the run: it binds its frames as a node does)."""
    update = decode_bundle(strip_binding(read_frame(frame)))
    entries = [gradwire.DCTCodec(**CODEC).compress(t * factor, n)[0] for n, t in update.items()]
    return write_frame([*entries, binding_entry(run_id, round_)], round=round_, sender=sender, bundle=True)


class RunNode(Node):
    """A real :class:`Node` whose submitted frame goes through ``attack`` (the rogue) or is only recorded
    (the honest nodes)."""

    def __init__(self, *args, frames: Frames, attack: Callable[[RunNode, int, bytes], bytes] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.frames = frames
        self.attack = attack
        self.refused: list[str] = []

    def _submit_and_advance(self, round_: int, frame: bytes) -> int:
        self.frames.put(round_, self.node_id, frame, {})
        if self.attack is not None:
            bad = self.attack(self, round_, frame)
            if bad is not None and bad is not frame:
                try:
                    self._submit_raw(round_, bad)
                except GradwireHTTPError as exc:  # refused: count it, and send the honest frame instead
                    self.refused.append(getattr(exc, "error", None) or str(exc.status_code))
                else:
                    return self._advance(round_)
        return super()._submit_and_advance(round_, frame)

    def _submit_raw(self, round_: int, frame: bytes, headers: dict | None = None) -> None:
        self.client.submit(self.run_id, round_, frame)

    def _advance(self, round_: int) -> int:
        deadline = time.monotonic() + 120
        while self.version <= round_:
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {round_} not published")
            self.catch_up(wait=10)
        return self.version


def _flat_update(frame: bytes) -> tuple[torch.Tensor, list[tuple[str, torch.Size]]]:
    update = decode_bundle(strip_binding(read_frame(frame)))
    layout = [(n, t.shape) for n, t in update.items()]
    return torch.cat([t.reshape(-1).double() for t in update.values()]), layout


def _encoded(flat: torch.Tensor, layout, round_: int, sender: int, run_id: str) -> bytes:
    entries, at = [], 0
    for name, shape in layout:
        n = shape.numel()
        t = flat[at : at + n].float().reshape(shape)
        at += n
        entries.append(gradwire.DCTCodec(**CODEC).compress(t, name)[0])
    return write_frame([*entries, binding_entry(run_id, round_)], round=round_, sender=sender, bundle=True)


def _largest_gamma(mu: torch.Tensor, p: torch.Tensor, honest: torch.Tensor, fits) -> float:
    """The largest ``γ`` in [0, 64] with ``fits(μ + γ p)``, by bisection (Shejwalkar & Houmansadr)."""
    lo, hi = 0.0, 64.0
    if fits(mu + hi * p):
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mu + mid * p) else (lo, mid)
    return lo


def crafted(name: str, honest: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The colluders' update for attack ``name`` from the honest updates (rows) and their own genuine ones."""
    mu, sigma = honest.mean(0), honest.std(0, unbiased=len(honest) > 1)
    if name == "alie":
        return mu - 1.0 * sigma
    if name == "alie_own":
        return own.mean(0) - 1.0 * own.std(0, unbiased=len(own) > 1)
    if name == "ipm_small":
        return -0.1 * mu
    if name == "ipm_large":
        return -4.0 * mu
    if name == "mimic":
        return honest[0]
    p = -sigma
    dist = torch.cdist(honest, honest)
    if name == "minmax":
        bound = float(dist.max())
        return mu + _largest_gamma(mu, p, honest, lambda m: float((honest - m).norm(dim=1).max()) <= bound) * p
    if name == "minsum":
        bound = float((dist**2).sum(1).max())
        return mu + _largest_gamma(mu, p, honest, lambda m: float(((honest - m) ** 2).sum()) <= bound) * p
    raise ValueError(f"unknown colluding attack {name!r}")


class AdaptiveColluders:
    """The ``adaptive`` attack (module docstring): one per run, shared by its colluders, which craft each
    round's frames once, under a lock, and each take its own."""

    def __init__(self, honest_ids: Sequence[int], rogue_ids: Sequence[int], margin: float = 0.95):
        self.honest_ids, self.rogue_ids, self.margin = list(honest_ids), list(rogue_ids), margin
        self.mirror = SenderHistory()  # the server's defaults
        self.lock = threading.Lock()
        self.crafted: dict[int, dict[int, bytes]] = {}
        self.z: list[float] = []

    def frame(self, node: RunNode, rnd: int) -> bytes | None:
        with self.lock:
            if rnd not in self.crafted:
                self.crafted[rnd] = self._craft(node, rnd)
            return self.crafted[rnd].get(node.node_id)

    def _craft(self, node: RunNode, rnd: int) -> dict[int, bytes]:
        got = [node.frames.wait(rnd, i, timeout=60) for i in self.honest_ids]
        if any(f is None for f in got):
            return {}
        flats = [_flat_update(f) for f in got]
        layout = flats[0][1]
        honest = torch.stack([f for f, _ in flats])
        mu, sigma = honest.mean(0), honest.std(0, unbiased=len(honest) > 1)
        honest_records = [strip_binding(read_frame(f)).entries for f in got]
        ids = [*self.honest_ids, *self.rogue_ids]
        noise = {
            r: torch.randn(mu.shape, generator=torch.Generator().manual_seed(1000 * rnd + r), dtype=mu.dtype)
            for r in self.rogue_ids
        }

        def frames_for(z: float) -> dict[int, bytes]:
            return {
                r: _encoded(mu - z * sigma + 1e-3 * sigma * noise[r], layout, rnd, r, node.run_id)
                for r in self.rogue_ids
            }

        def trial(z: float) -> tuple[bool, SenderHistory, dict[int, bytes]]:
            frames = frames_for(z)
            records = honest_records + [strip_binding(read_frame(frames[r])).entries for r in self.rogue_ids]
            mirror = copy.deepcopy(self.mirror)
            mirror.observe(ids, records, [1.0] * len(ids))
            scores = mirror.scores(ids)
            level = mirror.multiple * statistics.median_low(scores)
            return max(scores[len(self.honest_ids) :]) <= self.margin * level, mirror, frames

        lo, hi = 0.0, 3.0
        best = trial(lo)
        for _ in range(10):
            mid = (lo + hi) / 2
            got_mid = trial(mid)
            if got_mid[0]:
                lo, best = mid, got_mid
            else:
                hi = mid
        self.mirror = best[1]
        self.z.append(lo)
        return best[2]


def good_own(own: torch.Tensor, honest: torch.Tensor, kappa: float = GOOD_OWN_KAPPA) -> torch.Tensor:
    """``good_own``'s update (module docstring): ``own`` plus ``kappa·‖own‖`` along the reversed part of the
    honest mean (``honest``: rows) orthogonal to ``own``."""
    mu = honest.mean(0)
    sq = float(own.dot(own))
    perp = mu - (float(mu.dot(own)) / sq) * own if sq > 0 else mu
    size = float(perp.norm())
    if size == 0.0:
        return own
    return own - kappa * sq**0.5 * perp / size


def colluding_fn(name: str, honest_ids: Sequence[int], rogue_ids: Sequence[int]):
    """A colluder's frame: it waits for the round's honest frames (and its fellows' genuine ones: the
    colluders see every frame before it is sent), crafts the update and re-encodes it as its own."""
    if name == "adaptive":
        shared = AdaptiveColluders(honest_ids, rogue_ids)
        return lambda node, rnd, frame: shared.frame(node, rnd)
    if name == "good_own":

        def aimed(node: RunNode, rnd: int, frame: bytes) -> bytes | None:
            got = [node.frames.wait(rnd, i, timeout=60) for i in honest_ids]
            if any(f is None for f in got):
                return None
            own, layout = _flat_update(frame)
            honest = torch.stack([_flat_update(f)[0] for f in got])
            return _encoded(good_own(own, honest), layout, rnd, node.node_id, node.run_id)

        return aimed

    def attack(node: RunNode, rnd: int, frame: bytes) -> bytes | None:
        got = [node.frames.wait(rnd, i, timeout=60) for i in (*honest_ids, *rogue_ids)]
        if any(f is None for f in got):
            return None
        flats = [_flat_update(f) for f in got]
        layout = flats[0][1]
        rows = torch.stack([f for f, _ in flats])
        update = crafted(name, rows[: len(honest_ids)], rows[len(honest_ids) :])
        return _encoded(update, layout, rnd, node.node_id, node.run_id)

    return attack


def attack_fn(name: str, donor: Frames | None) -> Callable[[RunNode, int, bytes], bytes | None] | None:
    """The rogue node's frame for ``name`` (``None``: no rogue)."""
    if name == "clean":
        return None
    if name in ("x1000", "x1e15", "flip", "flip_x1e15"):
        factor = {"x1000": 1e3, "x1e15": 1e15, "flip": -1.0, "flip_x1e15": -1e15}[name]
        return lambda node, rnd, frame: scaled(frame, factor, rnd, node.node_id, node.run_id)
    if name == "ef_poison":
        return lambda node, rnd, frame: scaled(frame, 1e6 if rnd % 2 == 0 else -1e6, rnd, node.node_id, node.run_id)
    if name == "copy":

        def copy(node: RunNode, rnd: int, frame: bytes) -> bytes | None:
            theirs = node.frames.wait(rnd, HONEST_SOURCE)
            return None if theirs is None else rewrite(theirs, rnd, node.node_id)

        return copy
    if name == "replay":

        def replay(node: RunNode, rnd: int, frame: bytes) -> bytes | None:
            old = node.frames.by_key.get((rnd - 1, HONEST_SOURCE))
            return None if old is None else rewrite(old[0], rnd, node.node_id, rebind=node.run_id)

        return replay
    if name == "other_run":

        def other_run(node: RunNode, rnd: int, frame: bytes) -> bytes | None:
            if donor is None:
                return None
            got = donor.by_key.get((rnd, node.node_id))
            return None if got is None else got[0]

        return other_run
    raise ValueError(f"unknown attack {name!r}; known: {', '.join(ATTACKS)}")


# -- one run ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    mode: str
    attack: str
    rule: str
    held_out: float
    max_published: float
    max_weight: float
    versions: int
    refused: list[str]
    frames: Frames
    warnings: list[str]
    seconds: float
    run_id: str = ""
    #: The run's final weights (the server's).
    state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    #: A run with validators: the server's scores log (``GET /v1/runs/{run_id}/scores``), one entry per version.
    scores: list[dict] = field(default_factory=list, repr=False)


def published_max(admin: GradwireClient, run_id: str, diff: bool) -> float:
    """The largest |value| any version of the run published (non-finite values read as ``inf``)."""
    worst = 0.0
    if diff:
        tensors = [decode_bundle(f) for f in admin.updates(run_id, 0).frames]
    else:
        tensors = [v.mean() for v in admin.published(run_id, 0).versions]
    for update in tensors:
        for t in update.values():
            if not bool(torch.isfinite(t).all()):
                return math.inf
            worst = max(worst, float(t.abs().max()) if t.numel() else 0.0)
    return worst


def aggregation_settings(rule: str) -> dict | None:
    """A row's ``aggregation`` run settings: ``None`` for ``"default"`` (the run's default rule);
    ``"assigned"``: the default in a run whose honest nodes are IID by construction (a data assignment: the
    sender histories on, gradwire.rule); ``"default:clip_multiple=3"``: the default with settings of its own;
    ``"trimmed_mean:0.25"``: a rule with its trim fraction; else a rule's name."""
    if rule == "default":
        return None
    if rule == "assigned":
        return {"honest_iid": True}
    name, _, rest = rule.partition(":")
    if name == "default":
        return {k: float(v) for k, _, v in (kv.partition("=") for kv in rest.split(","))}
    return {"rule": name, **({"trim_fraction": float(rest)} if rest else {})}


def run_one(
    server: LoopbackServer,
    mode: str,
    attack: str,
    rule: str,
    rounds: int,
    donor: Frames | None = None,
    task: float = 1.0,
    nodes: int = N_NODES,
    rogues: int = 1,
    data: DataSpec | None = None,
    config: dict | None = None,
    validators: Sequence[Callable[[GradwireClient, str], None]] = (),
) -> Outcome:
    """One run of ``mode`` under ``rule`` (``"default"``: the run's default) with ``attack``, ``rounds``
    versions long, on ``nodes`` nodes; the rogues are the last ``rogues`` node ids (:data:`ROGUE` alone by
    default). ``data``: the model, each node's batches and the held-out loss (default: this bench's
    regression, every node on its own stream of one distribution, :data:`REGRESSION`). ``config``: more run
    settings (``validation``, ``data_assignment``). ``validators``: one function per validator of the run,
    ``serve(client, run_id)``, run on a thread of its own with a client holding the validator's token (it
    scores the run's rounds, and returns when it is done); the outcome then carries the server's scores log."""
    data = data or REGRESSION
    t0 = time.perf_counter()
    n_nodes = nodes
    rogue_ids = list(range(n_nodes - rogues + 1, n_nodes + 1))
    honest_ids = list(range(1, n_nodes - rogues + 1))
    config = dict(MODES[mode], quorum=n_nodes, uplink={"codec": "dct", "params": CODEC}, **(config or {}))
    settings = aggregation_settings(rule)
    if settings is not None:
        config["aggregation"] = settings
    admin = GradwireClient(server.url, server.admin_token, timeout=60)
    run_id = admin.create_run(config)
    admin.put_state(run_id, {n: p.detach() for n, p in data.model().named_parameters()})
    frames = Frames()
    nodes: list[RunNode] = []
    colluding = attack in COLLUDING or attack in AIMED_AT_VALIDATORS
    colluders = colluding_fn(attack, honest_ids, rogue_ids) if colluding else None
    for _ in range(n_nodes):
        node_id, token = admin.register_node(run_id)
        if node_id not in rogue_ids:
            fn = None
        elif colluders is not None:
            fn = colluders
        else:
            fn = attack_fn(attack, donor)
        nodes.append(
            RunNode(
                GradwireClient(server.url, token, timeout=60),
                run_id,
                data.model(),
                gradwire.DCTCodec(**CODEC),
                node_id,
                wait=10,
                frames=frames,
                attack=fn,
            )
        )
    sync_every = MODES[mode].get("sparseloco", {}).get("sync_every", 1)
    steps = rounds * sync_every
    errors: list[BaseException] = []
    validator_tokens = [admin.register_validator(run_id, f"v{i + 1}")[1] for i in range(len(validators))]

    def validate(serve: Callable[[GradwireClient, str], None], token: str) -> None:
        try:
            with GradwireClient(server.url, token, timeout=60) as client:
                serve(client, run_id)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    validator_threads = [
        threading.Thread(target=validate, args=(v, t), daemon=True) for v, t in zip(validators, validator_tokens)
    ]
    for t in validator_threads:
        t.start()

    def train(node: RunNode) -> None:
        try:
            for step in range(steps):
                node.module.zero_grad()
                data.loss(node.module, data.batch(node.node_id, step, task)).backward()
                node.step()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(n,), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for t in validator_threads:
        t.join(timeout=120)
    if errors:
        raise RuntimeError(f"{mode}/{attack}/{rule}: a node failed: {errors[0]!r}") from errors[0]
    state, version, _ = admin.state(run_id)
    status = admin.status(run_id)
    diff = MODES[mode]["algorithm"] == "adamw"
    out = Outcome(
        mode,
        attack,
        rule,
        data.held_out_loss(state),
        published_max(admin, run_id, diff),
        max(float(t.abs().max()) for t in state.values()),
        version,
        [r for n in nodes for r in n.refused],
        frames,
        status.get("warnings", []),
        time.perf_counter() - t0,
        run_id,
        state,
        admin.scores(run_id) if validators else [],
    )
    for n in nodes:
        n.client.close()
    admin.close()
    return out


def run_table(
    modes: Sequence[str],
    attacks: Sequence[str],
    rules: Sequence[str],
    rounds: int,
    server: LoopbackServer | None = None,
    report: Callable[[Outcome, Outcome], None] | None = None,
    nodes: int = N_NODES,
    rogues: int = 1,
) -> list[tuple[Outcome, Outcome]]:
    """Every (mode, rule, attack): ``(attacked, clean)`` outcomes. The clean run of each mode and rule runs
    first, and, for ``other_run``, a clean run of the opposite task (the donor of its frames)."""
    own = server is None
    server = server or LoopbackServer()
    out: list[tuple[Outcome, Outcome]] = []
    try:
        server.start()
        for mode in modes:
            for rule in rules:
                size = dict(nodes=nodes, rogues=rogues)
                clean = run_one(server, mode, "clean", rule, rounds, **size)
                donor = (
                    run_one(server, mode, "clean", rule, rounds, task=-1.0, **size) if "other_run" in attacks else None
                )
                for attack in attacks:
                    got = (
                        clean
                        if attack == "clean"
                        else run_one(
                            server, mode, attack, rule, rounds, donor=None if donor is None else donor.frames, **size
                        )
                    )
                    out.append((got, clean))
                    if report is not None:
                        report(got, clean)
    finally:
        if own:
            server.close()
    return out


def ratio(got: Outcome, clean: Outcome) -> float:
    return got.held_out / clean.held_out if clean.held_out > 0 else math.inf


def row_text(got: Outcome, clean: Outcome) -> str:
    pub = got.max_published / clean.max_published if clean.max_published > 0 else math.inf
    refused = f"{len(got.refused)} ({', '.join(sorted(set(got.refused)))})" if got.refused else "0"
    return (
        f"| {got.mode} | {got.rule} | {got.attack} | {got.held_out:.4f} | {clean.held_out:.4f} | "
        f"{ratio(got, clean):.3f} | {got.max_published:.3g} | {pub:.3g} | {refused} | {got.seconds:.1f} |"
    )


HEADER = (
    "| mode | rule | attack | held-out loss | clean | ratio | max abs published | vs clean | refused | s |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
)


def pivot(rows: Sequence[tuple[str, str, str, float]]) -> str:
    """The table docs/SERVER.md quotes, from ``(mode, rule, attack, ratio)`` rows: one line per attack, one
    column per mode, each cell the default rule's ratio and the plain mean's (``default / mean``)."""
    modes = list(dict.fromkeys(m for m, _, _, _ in rows))
    attacks = list(dict.fromkeys(a for _, _, a, _ in rows if a != "clean"))
    got = {(m, r, a): x for m, r, a, x in rows}
    rules = list(dict.fromkeys(r for _, r, _, _ in rows))
    head = " / ".join(rules)
    lines = [f"| attack | {' | '.join(f'{m}: {head}' for m in modes)} |", "|---|" + "---:|" * len(modes)]
    for a in attacks:
        cells = [" / ".join(f"{got[(m, r, a)]:.3f}×" if (m, r, a) in got else "–" for r in rules) for m in modes]
        lines.append(f"| {a} | {' | '.join(cells)} |")
    return "\n".join(lines)


def parse_rows(text: str) -> list[tuple[str, str, str, float]]:
    """``(mode, rule, attack, ratio)`` of every row this bench printed (:func:`row_text`)."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] in MODES:
            out.append((cells[0], cells[1], cells[2], float(cells[5])))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40, help="versions per run")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=[*ATTACKS, *COLLUDING, *AIMED_AT_VALIDATORS])
    p.add_argument("--nodes", type=int, default=N_NODES, help="nodes per run (quorum: all of them)")
    p.add_argument("--rogues", type=int, default=1, help="how many of them attack (the last node ids)")
    p.add_argument(
        "--rules",
        nargs="+",
        default=["default", "mean"],
        help="'default' (the run's default, bounded_mean), 'assigned' (the default in a run that assigns its data: "
        "sender histories on) and/or rule names (trimmed_mean:0.25 with its trim fraction)",
    )
    p.add_argument(
        "--pivot-from",
        metavar="FILE",
        default=None,
        help="print the attack × mode table of a saved output of this bench, and run nothing",
    )
    args = p.parse_args(argv)
    if args.pivot_from:
        with open(args.pivot_from, encoding="utf-8") as f:
            print(pivot(parse_rows(f.read())))
        return
    t0 = time.perf_counter()
    print(
        f"{args.nodes} nodes, {args.rogues} rogue(s) (the last node ids), {args.rounds} versions per run, quorum "
        f"{args.nodes}; ratio = held-out loss / the clean run's (same mode and rule)\n"
    )
    print(HEADER, flush=True)
    done = run_table(
        args.modes,
        args.attacks,
        args.rules,
        args.rounds,
        report=lambda got, clean: print(row_text(got, clean), flush=True),
        nodes=args.nodes,
        rogues=args.rogues,
    )
    print(f"\n{time.perf_counter() - t0:.0f} s in all\n")
    print(pivot([(got.mode, got.rule, got.attack, ratio(got, clean)) for got, clean in done]))


if __name__ == "__main__":
    main()
