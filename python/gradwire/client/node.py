"""The per-step helper a training loop calls on one node of a server run, for every algorithm.

:class:`Node` reads the run's config, builds the algorithm's node side through the registry
(:func:`gradwire.algorithms.get_algorithm`), and each step: forms the records the algorithm sends
(gradients with error feedback, DeMo's momentum, SparseLoCo's pseudo-gradient at a sync), submits them,
waits for the round to publish, applies the published versions to the algorithm's target tensors (a
compressed weight diff added, or the exact aggregate of node records applied by the algorithm), and
checks the weights hash against the server's. It never tests an algorithm's name.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ..algorithms import DEFAULT_ALGORITHM, Algorithm, NodeSide, get_algorithm
from ..assignment import AssignmentError, DataAssignment, assigned_pages
from ..binding import binding_entry, strip_binding
from ..codecs.base import Codec
from ..frame import SERVER_SENDER, decode_bundle, read_frame, write_frame
from ..model_record import ModelSpec, model_record_codec, run_spec
from ..protocol import Reason
from ..published import apply_mean, read_published
from ..state import apply_update, state_from_bytes, state_hash, unpack_state_dict
from .errors import (
    ConflictError,
    ObjectStoreError,
    OutOfSyncError,
    ProtocolError,
    RoundClosedError,
    TooFarBehindError,
)
from .http_client import GradwireClient
from .object_store import StoreClient

__all__ = ["Node"]


class Node:
    """One training node's side of a run: ``node.step()`` once per training step.

    ``model`` is a module (its named parameters, which must be float32, are the replica and are
    updated in place) or a mapping of named float32 tensors. The replica must have exactly the names
    and shapes of the run's state. What a step sends and how a published version is applied is the
    run's algorithm's (docs/ALGORITHMS.md); ``codec`` is the uplink codec it sends with.

    What happens to records whose round closed before they arrived (410 ``round_closed``), or that
    find a different frame already recorded for this node and round (409 ``conflicting_submission``,
    as after a restart): their contents go back where they came from — the error-feedback residuals,
    DeMo's momenta or SparseLoCo's error buffers — as if nothing had been sent, and are sent with the
    next records; the node then catches up to the next version as usual. :attr:`rounds_missed` counts
    these steps.

    Published versions are decoded on ``decode_device`` (default the CPU, where the server decodes
    them) and then applied on the replica's device: the decoders' float rounding may differ between
    devices, while the elementwise float32 updates are exact everywhere, so this keeps the replica
    bit-identical to the server.
    """

    def __init__(
        self,
        client: GradwireClient,
        run_id: str,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        codec: Codec,
        node_id: int,
        *,
        wait: float = 30.0,
        step_timeout: float | None = 600.0,
        decode_device: str | torch.device = "cpu",
    ):
        self.client = client
        self.run_id = run_id
        self.node_id = int(node_id)
        self.module = model if isinstance(model, torch.nn.Module) else None
        if self.module is not None:
            # .data: the replica is advanced in place, outside autograd.
            self.params = {name: p.data for name, p in self.module.named_parameters()}
        else:
            self.params = dict(model)
        for name, t in self.params.items():
            if t.dtype != torch.float32:
                raise ValueError(f"replica tensor {name!r} is {t.dtype}; the server's master weights are float32")
        self.codec = codec
        #: The run's configuration (JSON, read at the first :meth:`sync`), its algorithm and this node's
        #: side of it.
        self.config: dict[str, Any] | None = None
        self.algorithm: Algorithm | None = None
        self.algorithm_config: Any = None
        self.side: NodeSide | None = None
        #: The run's model spec when it takes whole-model records (``model_record``), else None.
        self.model_spec: ModelSpec | None = None
        self._algorithm_state: dict[str, Any] = {}
        self.wait = float(wait)
        self.step_timeout = step_timeout
        self.decode_device = torch.device(decode_device)
        #: The version the replica holds (None before the first :meth:`sync`).
        self.version: int | None = None
        self.weights_hash: str | None = None
        #: Uplink bytes (submitted frames) and downlink bytes (published versions and states) so far.
        self.bytes_sent = 0
        self.bytes_received = 0
        #: Steps whose records did not count (see above); full-state loads (joins and catch-ups).
        self.rounds_missed = 0
        self.state_loads = 0
        #: The object store's URLs, where the run's server has one (its status says so at the first
        #: :meth:`sync`): frames are PUT there and versions and checkpoints read from there.
        self.store: StoreClient | None = None

    # -- replica ---------------------------------------------------------------------------------

    def _configure(self) -> None:
        """Read the run's algorithm and set up its node side (once)."""
        status = self.client.status(self.run_id)
        self.config = status["config"]
        if status.get("object_store") and self.store is None:
            self.store = StoreClient(timeout=self.client.timeout)
        self.algorithm = get_algorithm(self.config.get("algorithm", DEFAULT_ALGORITHM))
        # Runs with model_record take the whole model as one record (docs/FORMAT.md section 9).
        self.model_spec = run_spec(self.params) if self.config.get("model_record") else None
        codec = self.codec if self.model_spec is None else model_record_codec(self.codec)
        self.algorithm_config = self.algorithm.run_config(self.config)
        self.side = self.algorithm.node(
            self.algorithm_config, codec, self.params, module=self.module, model_spec=self.model_spec
        )

    @property
    def data_assignment(self) -> DataAssignment | None:
        """How the run deals out its data (its config's ``data_assignment``), or None for a run whose nodes
        read data of their own. Asks the server for the run's config if no :meth:`sync` has read it yet."""
        config = self.config if self.config is not None else self.client.status(self.run_id)["config"]
        section = config.get("data_assignment")
        return None if section is None else DataAssignment(**section)

    def assigned_pages(self, round: int) -> list[int]:
        """The pages this node reads in round ``round`` (``gradwire.assignment.assigned_pages`` of the run's
        assignment, this node's id and the round): what the run's validators expect it to train on.
        Raises ``AssignmentError`` for a run that assigns no data."""
        assignment = self.data_assignment
        if assignment is None:
            raise AssignmentError(f"run {self.run_id!r} assigns no data (its config has no data_assignment)")
        return assigned_pages(assignment, self.node_id, round)

    def sync(self) -> int:
        """Load the server's full state into the replica (at start, or when too far behind)."""
        if self.config is None:
            self._configure()
        if self.store is not None:
            return self._sync_from_store()
        for _ in range(5):
            version = self._load_state()
            if not self.side.needs_algorithm_state:
                self.side.loaded()
                return version
            # The algorithm's state (an outer momentum) must be that of the same version as the weights.
            state, at, _ = self.client.algorithm_state(self.run_id)
            if at == version:
                self._algorithm_state = state
                self.side.loaded()
                return version
        raise ProtocolError(f"node {self.node_id}: the run kept publishing while its state was fetched")

    def _load_state(self) -> int:
        state, version, weights_hash = self.client.state(self.run_id)
        self._copy_state(state)
        self.bytes_received += sum(t.numel() * t.element_size() for t in state.values())
        self.version, self.weights_hash = version, weights_hash
        self.state_loads += 1
        return version

    def _copy_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """The run's weights into the replica, names and shapes checked."""
        if set(state) != set(self.params):
            raise ValueError(
                f"the run's state names {sorted(set(state) ^ set(self.params))[:5]} differently from the replica"
            )
        with torch.no_grad():
            for name, dst in self.params.items():
                src = state[name]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"run state {name!r} has shape {tuple(src.shape)}, the replica {tuple(dst.shape)}")
                dst.copy_(src)

    # -- through the object store ---------------------------------------------------------------

    def _sync_from_store(self) -> int:
        """The run's state from the object store: its last checkpoint (weights, and the algorithm's node
        state), then the versions since, each checked against its SHA-256 and the weights hash at the end."""
        manifest = self.client.objects(self.run_id, since=None)
        self._load_checkpoint(manifest["checkpoint"])
        self._apply_stored(manifest)
        return self.version

    def _load_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        try:
            state = state_from_bytes(self.store.get(checkpoint["weights"]))
            algorithm = checkpoint.get("algorithm")
            self._algorithm_state = {} if algorithm is None else unpack_state_dict(self.store.get(algorithm))
        except ValueError as exc:
            raise ProtocolError(f"the checkpoint of version {checkpoint['version']}: {exc}") from exc
        self._copy_state(state)
        self.bytes_received += int(checkpoint["weights"]["nbytes"])
        self.version, self.weights_hash = int(checkpoint["version"]), checkpoint["weights_hash"]
        if state_hash(self.params) != self.weights_hash:
            raise OutOfSyncError(f"the store's checkpoint of version {self.version} does not match its weights hash")
        self.state_loads += 1
        self.side.loaded()

    def _apply_stored(self, manifest: Mapping[str, Any]) -> int:
        """Apply the manifest's versions (fetched from the store) to the target; the weights hash checked
        after the last. Returns how many were applied."""
        versions = manifest["versions"]
        if versions and versions[0]["version"] != self.version + 1:
            raise ProtocolError(
                f"node {self.node_id} at version {self.version}: the store lists {versions[0]['version']} next"
            )
        target = self.side.target()
        for entry in versions:
            data = self.store.get(entry)
            self.bytes_received += len(data)
            version = int(entry["version"])
            if self.algorithm.publication == "diff":
                frame = read_frame(data)
                if frame.round != version or frame.sender != SERVER_SENDER or not frame.bundle:
                    raise ProtocolError(f"the store's object for version {version} is not the server's frame for it")
                update = decode_bundle(frame, device=self.decode_device)
                with torch.no_grad():
                    apply_update(target, update)
            else:
                (published,) = read_published(data)
                if published.version != version:
                    raise ProtocolError(f"the store's object for version {version} publishes {published.version}")
                mean = published.mean(device=self.decode_device)
                with torch.no_grad():
                    self._algorithm_state = apply_mean(
                        self.algorithm.name, self.algorithm_config, target, mean, self._algorithm_state
                    )
            self.version = version
        if versions or manifest.get("checkpoint") is not None:
            self.side.synced()
            local = state_hash(self.side.target())
            if local != manifest["weights_hash"]:
                server = manifest["weights_hash"]
                raise OutOfSyncError(
                    f"node {self.node_id} at version {self.version}: weights hash {local}, server {server}"
                )
        self.weights_hash = manifest["weights_hash"]
        return len(versions)

    def _store_catch_up(self, wait: float | None) -> int:
        manifest = self.client.objects(self.run_id, since=self.version, wait=wait)
        if manifest["checkpoint"] is not None:  # too far behind what the store keeps: start from its checkpoint
            self._load_checkpoint(manifest["checkpoint"])
        self._apply_stored(manifest)
        return self.version

    def _submit_through_store(self, round_: int, frame: bytes) -> None:
        """Slot, PUT, tell: the frame goes to the object store, the server reads it from there. A key already
        written (412: this node uploaded for the round before, e.g. before a restart) is told all the same:
        whatever is there is this node's upload, and the server's answer says whether it counts."""
        import hashlib

        slot = self.client.upload_slot(self.run_id, round_, len(frame), hashlib.sha256(frame).hexdigest())
        try:
            self.store.put(slot["url"], slot["headers"], frame)
        except ObjectStoreError as exc:
            if exc.status != 412:
                raise
        answer = self.client.uploaded(self.run_id, round_, slot["key"])
        if answer.get("sha256") not in (None, hashlib.sha256(frame).hexdigest()):
            # The key held an earlier upload of this node for the round: that one counts, not this frame.
            raise ConflictError(409, Reason.CONFLICTING_SUBMISSION.value, "an earlier upload of this node counts")

    def catch_up(self, wait: float | None = None) -> int:
        """Apply every version published since the replica's (long-polling up to ``wait`` s for one).

        Falls back to the full state when the server no longer keeps those versions. Verifies the
        weights hash afterwards; raises :class:`OutOfSyncError` if it differs from the server's.
        """
        if self.version is None:
            return self.sync()
        if self.store is not None:
            return self._store_catch_up(wait)
        try:
            if self.algorithm.publication == "diff":
                version, weights_hash, applied = self._apply_diffs(wait)
            else:
                version, weights_hash, applied = self._apply_means(wait)
        except TooFarBehindError:
            return self.sync()
        if applied:
            self.side.synced()
            local = state_hash(self.side.target())
            if local != weights_hash:
                raise OutOfSyncError(
                    f"node {self.node_id} at version {version}: weights hash {local}, server {weights_hash}"
                )
        self.version, self.weights_hash = version, weights_hash
        return self.version

    def _apply_diffs(self, wait: float | None) -> tuple[int, str, int]:
        """``"diff"`` versions: each a compressed weight diff, added to the target."""
        batch = self.client.updates(self.run_id, self.version, wait=wait)
        target = self.side.target()
        for frame in batch.frames:
            self.bytes_received += len(frame)
            update = decode_bundle(frame, device=self.decode_device)
            with torch.no_grad():
                apply_update(target, update)
            self.version += 1  # frames publish version+1, version+2, … (checked by updates())
        return batch.version, batch.weights_hash, len(batch.frames)

    def _apply_means(self, wait: float | None) -> tuple[int, str, int]:
        """``"mean"`` versions: the exact aggregate of node records, applied by the algorithm (to the
        replica for DeMo; to the anchor for SparseLoCo, which then becomes the replica)."""
        batch = self.client.published(self.run_id, self.version, wait=wait)
        self.bytes_received += batch.nbytes
        target = self.side.target()
        for published in batch.versions:
            mean = published.mean(device=self.decode_device)
            with torch.no_grad():  # the one function the server applied the version with
                self._algorithm_state = apply_mean(
                    self.algorithm.name, self.algorithm_config, target, mean, self._algorithm_state
                )
            self.version += 1
        return batch.version, batch.weights_hash, len(batch.versions)

    # -- one training step -----------------------------------------------------------------------

    def gradients(self) -> dict[str, torch.Tensor]:
        """The module's ``p.grad`` by name (zeros for parameters that got no gradient)."""
        if self.module is None:
            raise ValueError("this node was given tensors, not a module: pass the gradients to step()")
        return {
            name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in self.module.named_parameters()
        }

    def step(self, grads: Mapping[str, torch.Tensor] | None = None) -> int:
        """One training step: the algorithm forms this step's records and, if it sends any, they are
        submitted and the replica advanced to the next published version.

        ``grads`` defaults to the module's ``p.grad``; they must have been computed on the weights of
        :attr:`version` (SparseLoCo's local steps: on the current local weights). Returns the version.
        """
        if self.version is None:
            self.sync()
        if grads is None and not self.side.reads_module_grads:
            grads = self.gradients()
        round_ = int(self.version)
        records = self.side.records(grads)
        if records is None:  # a step that sends nothing (SparseLoCo's local steps)
            return self.version
        # Bound to this run and round (docs/FORMAT.md section 10): no other run, or round, takes it verbatim.
        frame = write_frame(
            [*records, binding_entry(self.run_id, round_)], round=round_, sender=self.node_id, bundle=True
        )
        return self._submit_and_advance(round_, frame)

    def _submit_and_advance(self, round_: int, frame: bytes) -> int:
        """Submit ``frame`` for ``round_`` and wait until that round is published and applied. A frame
        that does not count goes back to the node side (``take_back``), as if nothing had been sent."""
        try:
            if self.store is not None:
                self._submit_through_store(round_, frame)
            else:
                self.client.submit(self.run_id, round_, frame)
        except (RoundClosedError, ConflictError) as exc:
            # round_closed: the round was published without us. conflicting_submission: this node
            # already has a different frame recorded for the round (a restarted process); that one
            # counts. Either way these records did not, and the round still publishes: wait for it.
            if isinstance(exc, ConflictError) and exc.error == Reason.REPLAYED_UPDATE.value:
                # Another node's update already carried these very records (a copy that reached the
                # server first): they counted, so they are not taken back.
                self.rounds_missed += 1
            elif isinstance(exc, ConflictError) and exc.error != Reason.CONFLICTING_SUBMISSION.value:
                raise
            else:
                self.rounds_missed += 1
                self.side.take_back(decode_bundle(strip_binding(read_frame(frame))))
        self.bytes_sent += len(frame)
        deadline = None if self.step_timeout is None else time.monotonic() + self.step_timeout
        while self.version <= round_:
            left = self.wait if deadline is None else min(self.wait, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(
                    f"node {self.node_id}: round {round_} was not published within {self.step_timeout} s"
                )
            self.catch_up(wait=left)
        return self.version

    def __repr__(self) -> str:
        name = None if self.algorithm is None else self.algorithm.name
        return f"Node(run={self.run_id!r}, node_id={self.node_id}, algorithm={name!r}, version={self.version})"
