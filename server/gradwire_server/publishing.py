"""Versions and checkpoints in the object store, and what a node reads to find them (docs/SERVER.md,
"Object storage").

:class:`StorePublisher` writes each published version once (its key carries the bytes' SHA-256; the row
naming it is part of the version's own SQLite commit, :meth:`.store.Store.publish`), and every
``checkpoint_every`` versions the weights and the algorithm's node state (SparseLoCo's outer momentum)
of a version, from which nodes that join or come back start. :meth:`StorePublisher.manifest` is the small
JSON a node gets from the server instead of bytes: the checkpoint it starts from (when asked) and the
versions after it, each with the URL to GET, its size, its SHA-256 and the weights hash it leads to.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from safetensors.torch import save as st_save

from gradwire.state import pack_state_dict

from .config import RunConfig
from .errors import Reason, Rejected
from .object_store import ObjectStore
from .store import Store, StoredObject
from .transition import RunState

log = logging.getLogger("gradwire_server.object_store")

__all__ = ["MAX_MANIFEST_VERSIONS", "StorePublisher"]

#: Versions listed in one manifest at most (the client asks again from where it ended).
MAX_MANIFEST_VERSIONS = 64


class StorePublisher:
    """The server's writes of versions and checkpoints to ``objects``, and the rows naming them in ``store``."""

    def __init__(self, objects: ObjectStore, store: Store):
        self.objects = objects
        self.store = store

    def put_version(self, run_id: str, version: int, frame: bytes) -> StoredObject:
        """Write the bytes publishing ``version`` (before the commit that names them)."""
        sha = hashlib.sha256(frame).hexdigest()
        key = self.objects.version_key(run_id, version, sha)
        self.objects.put_once(key, frame, f"publishing version {version} of run {run_id}")
        return StoredObject(run_id, version, "version", key, len(frame), sha)

    def put_state(
        self, run_id: str, version: int, weights: dict, algorithm_state: dict[str, Any] | None
    ) -> list[StoredObject]:
        """Write a checkpoint's weights (safetensors) and, for algorithms that have one, the node state
        (``gradwire.state.pack_state_dict``); returns their rows (not yet recorded)."""
        out = []
        parts = [("weights", st_save({n: t.detach().cpu().contiguous() for n, t in weights.items()}))]
        if algorithm_state is not None:
            parts.append(("algorithm", pack_state_dict(algorithm_state)))
        for kind, data in parts:
            sha = hashlib.sha256(data).hexdigest()
            key = self.objects.checkpoint_key(run_id, version, kind, sha)
            self.objects.put_once(key, data, f"the {kind} of version {version} of run {run_id}")
            out.append(StoredObject(run_id, version, kind, key, len(data), sha))
        return out

    def put_checkpoint(self, run_id: str, version: int, state: RunState, config: RunConfig) -> None:
        """The weights and node state of the current ``version`` of ``state``, written and recorded."""
        public = config.algorithm_spec.public_state(state.algorithm_state)
        self.store.record_objects(self.put_state(run_id, version, state.master, public or None))

    def prune(self, run_id: str, before: int) -> None:
        """Forget and delete the objects of versions before ``before`` (a store that cannot be reached keeps
        them: deleting is tried again with the rows of the next prune only if still recorded, so an
        unreachable store leaves garbage, never a hole)."""
        keys = self.store.prune_objects(run_id, before)
        if keys:
            try:
                self.objects.delete(keys, f"deleting {len(keys)} old object(s) of run {run_id}")
            except Exception as exc:  # housekeeping never fails a close: the objects are left behind
                log.warning("run %s: %d old object(s) left in the object store: %s", run_id, len(keys), exc)

    def manifest(
        self, run_id: str, since: int | None, version: int, weights_hash: str, oldest_kept: int
    ) -> dict[str, Any]:
        """What a node at ``since`` (``None``: a node with no state) needs to reach ``version``: the store's
        last checkpoint (only when ``since`` is ``None`` or older than what is kept) and the versions after
        its starting point, at most :data:`MAX_MANIFEST_VERSIONS` (``"version"`` says where the list ends,
        ``"latest"`` the run's version)."""
        checkpoint = None
        start = since
        if since is None or since + 1 < oldest_kept:
            at = self.store.store_checkpoint(run_id, version)
            if at is None:
                raise Rejected(
                    Reason.STATE_NOT_SET, f"run {run_id} has no checkpoint in the object store yet; retry shortly"
                )
            objs = {o.kind: o for o in self.store.stored_objects(run_id, "weights", at, at)}
            objs.update({o.kind: o for o in self.store.stored_objects(run_id, "algorithm", at, at)})
            checkpoint = {
                "version": at,
                "weights_hash": weights_hash if at == version else self.store.version_hash(run_id, at),
                **{kind: self._entry(o) for kind, o in objs.items()},
            }
            start = at
        last = min(version, start + MAX_MANIFEST_VERSIONS)
        listed = self.store.stored_objects(run_id, "version", start + 1, last)
        if [o.version for o in listed] != list(range(start + 1, last + 1)):
            if checkpoint is None:
                # Versions the store does not hold (published before the server had one): from its checkpoint.
                return self.manifest(run_id, None, version, weights_hash, oldest_kept)
            raise Rejected(Reason.TOO_FAR_BEHIND, f"versions after {start} are not in the object store")
        hashes = self.store.version_hashes(run_id, start + 1, last)
        versions = [{**self._entry(o), "version": o.version, "weights_hash": hashes[o.version]} for o in listed]
        end_hash = weights_hash if last == version else (hashes[last] if listed else checkpoint["weights_hash"])
        return {
            "version": last,
            "latest": version,
            "weights_hash": end_hash,
            "checkpoint": checkpoint,
            "versions": versions,
        }

    def _entry(self, o: StoredObject) -> dict[str, Any]:
        return {"url": self.objects.get_url(o.key), "nbytes": o.nbytes, "sha256": o.sha256}
