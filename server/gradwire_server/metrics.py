"""The server's Prometheus metrics, in a registry of their own (one per app, so apps never collide).

``/metrics`` needs no token, so no metric names a run unless the operator asks (``run_ids``, the setting
``metrics_run_ids``): run ids are what a node token is scoped to, and a list of them maps the server.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_GROUP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """Counters, gauges and histograms exposed at ``GET /metrics``."""

    def __init__(
        self,
        live_nodes: Callable[[], float],
        run_ids: bool = False,
        store_writable: Callable[[], float] | None = None,
        stored_bytes: Callable[[], float] | None = None,
        run_statuses: Callable[[], list[str]] | None = None,
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.updates_accepted = Counter(
            "gradwire_updates_accepted", "Update frames accepted (202), duplicates excluded.", registry=r
        )
        self.updates_rejected = Counter(
            "gradwire_updates_rejected", "Update submissions refused, by reason.", ["reason"], registry=r
        )
        self.requests_rejected = Counter(
            "gradwire_requests_rejected", "Other requests refused with a 4xx, by reason.", ["reason"], registry=r
        )
        self.bytes_in = Counter("gradwire_bytes_in", "Update frame bytes received.", registry=r)
        self.bytes_out = Counter("gradwire_bytes_out", "Update frame and state bytes sent.", registry=r)
        # Everything the server's port carries, headers included (gradwire_server.traffic): with an object
        # store, small JSON only (docs/SERVER.md, "Object storage").
        self.http_bytes_received = Counter(
            "gradwire_http_bytes_received",
            "Bytes of API requests (/v1/...) received: request line, headers and body.",
            registry=r,
        )
        self.http_bytes_sent = Counter(
            "gradwire_http_bytes_sent", "Bytes of API responses sent: status line, headers and body.", registry=r
        )
        self.object_store_bytes = Counter(
            "gradwire_object_store_bytes",
            "Object bytes the server read from (direction=read) or wrote to (written) its object store.",
            ["direction"],
            registry=r,
        )
        self.object_store_requests = Counter(
            "gradwire_object_store_requests",
            "Requests the server made to its object store, by operation (head, get, put, delete) and outcome "
            "(ok: answered; failed: unreachable or a server error).",
            ["op", "outcome"],
            registry=r,
        )
        self.compression_ratio = Gauge(
            "gradwire_compression_ratio", "Dense fp32 bytes / frame bytes of the last accepted update.", registry=r
        )
        self.round_duration = Histogram(
            "gradwire_round_duration_seconds",
            "From a round opening to its version being published.",
            buckets=_ROUND_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "gradwire_decode_seconds",
            "Parsing and validating one submitted frame.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_group_size = Histogram(
            "gradwire_commit_group_size",
            "Updates recorded by one group commit (one directory fsync and one SQLite transaction each).",
            buckets=_GROUP_BUCKETS,
            registry=r,
        )
        self.aggregate_seconds = Histogram(
            "gradwire_aggregate_seconds",
            "Aggregating one round's updates into one gradient.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.publish_seconds = Histogram(
            "gradwire_publish_seconds",
            "Closing a round until readers see its version: aggregate, AdamW, downlink encode, durable publish.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.close_part_seconds = Histogram(
            "gradwire_close_part_seconds",
            "One part of a round's close (gradwire_publish_seconds): aggregate, "
            "adamw, encode (the downlink's), apply, hash (the weights'), publish (frame fsync and SQLite commit).",
            ["part"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.live_nodes = Gauge("gradwire_live_nodes", "Nodes that submitted in the last N rounds.", registry=r)
        self.live_nodes.set_function(live_nodes)
        self.runs = Gauge(
            "gradwire_runs",
            "Runs by status: active, paused (by the admin), failed (round close kept "
            "failing; the cause is in the run's status).",
            ["status"],
            registry=r,
        )
        statuses = run_statuses or (lambda: [])
        for status in ("active", "paused", "failed"):
            self.runs.labels(status=status).set_function(lambda status=status: float(statuses().count(status)))
        self.close_failures = Counter(
            "gradwire_round_close_failures",
            "Failed round closes (each retried with backoff), by cause: storage "
            "(full or failing disk) or error (anything else).",
            ["cause"],
            registry=r,
        )
        self.store_writable = Gauge(
            "gradwire_store_writable",
            "1 while the store's writes succeed, 0 after one failed for want of storage (until one succeeds).",
            registry=r,
        )
        self.store_writable.set_function(store_writable or (lambda: 1.0))
        self.stored_bytes = Gauge("gradwire_stored_bytes", "Bytes of the runs' files and the database.", registry=r)
        self.stored_bytes.set_function(stored_bytes or (lambda: 0.0))
        self.connections_closed = Counter(
            "gradwire_connections_closed",
            "Connections the server closed for its bounds, by cause (gradwire_server.connections.CAUSES).",
            ["cause"],
            registry=r,
        )
        self.connections_open = Gauge("gradwire_connections_open", "Open HTTP connections.", registry=r)
        self.run_ids = run_ids
        self.version = (
            Gauge("gradwire_version", "Current published version, by run.", ["run"], registry=r) if run_ids else None
        )

    def set_version(self, run_id: str, version: int) -> None:
        """``gradwire_version{run}``, when run ids are exposed."""
        if self.version is not None:
            self.version.labels(run=run_id).set(version)

    def forget_run(self, run_id: str) -> None:
        """A deleted run's samples go."""
        if self.version is not None:
            try:
                self.version.remove(run_id)
            except KeyError:
                pass

    def reject(self, reason: str, *, update: bool) -> None:
        (self.updates_rejected if update else self.requests_rejected).labels(reason=reason).inc()
