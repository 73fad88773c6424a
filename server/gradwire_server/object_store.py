"""The object-store data plane (docs/SERVER.md, "Object storage"): an S3-compatible bucket that carries the
frames and the versions, so that the server's own port carries small JSON answers only.

:class:`ObjectStore` is the server's one client of the bucket named by ``--object-store s3://bucket/prefix``
(botocore; the endpoint and the credentials come the usual way: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, a profile in
``AWS_PROFILE``). Nodes never hold credentials: the server hands them presigned URLs.

- **Uploads**: one key per (run, round, node) (:meth:`ObjectStore.upload_key`). :meth:`ObjectStore.presign_put`
  binds ``If-None-Match: *`` (a key is written at most once), the frame's ``Content-Length`` and its
  ``x-amz-checksum-sha256`` into the signature: a store that checks signatures refuses any other request
  (SeaweedFS does all three; others do less, and the server checks the size before it reads and parses
  every byte as hostile input in any case).
- **Versions and checkpoints** are written once under keys that carry their content hash, with
  ``If-None-Match: *``: a round closed a second time after a crash before its commit writes the same key
  (the same bytes: the write is taken as done) or, if it made other bytes, another key; only the key the
  SQLite commit names is ever handed out.
- Reads for nodes: a presigned GET (cached while it stays valid for at least half its life), or the
  operator's public or CDN base URL (``object_store_public_url``) followed by the key.

Every failure to reach the store is :class:`ObjectStoreUnavailable` (503 ``object_store_unavailable``,
``Retry-After``), whose message names the store (its ``s3://`` URL and endpoint). The bytes and the
requests are counted for ``/metrics``.

Why botocore and not obstore (measured on loopback against SeaweedFS, docs/SERVER.md): obstore's
``sign`` takes no headers, so it cannot bind ``If-None-Match``, the length or the checksum into a presigned
URL, which uploads need; botocore can (about 170 µs a URL). For the server's own GETs and PUTs the two
were within the machine's noise of each other at 1 and 16 MiB, and one SDK is lighter than two.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from .errors import Reason, Rejected

__all__ = ["ObjectInfo", "ObjectStore", "ObjectStoreUnavailable", "parse_store_url"]

log = logging.getLogger("gradwire_server.object_store")

#: Seconds a client is asked to wait (``Retry-After``) while the store cannot be reached.
RETRY_AFTER_S = 5
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def parse_store_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` → ``(bucket, prefix)`` (the prefix without slashes at its ends, may be empty)."""
    if not url.startswith("s3://"):
        raise ValueError(f"object store {url!r}: expected s3://bucket[/prefix]")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"object store {url!r}: {bucket!r} is not a valid bucket name (3 to 63 of a-z 0-9 . -)")
    return bucket, prefix.strip("/")


class ObjectStoreUnavailable(Rejected):
    """The object store could not be reached or answered with a server error: 503, retry later."""

    def __init__(self, store: str, what: str, cause: str):
        super().__init__(
            Reason.OBJECT_STORE_UNAVAILABLE,
            f"{what}: the object store {store} cannot be reached ({cause}); nothing was recorded, retry later",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
        self.cause = cause


@dataclass(frozen=True)
class ObjectInfo:
    """What a HEAD tells: the object's size and the store's own timestamp of its write (Unix seconds)."""

    nbytes: int
    last_modified: float


class ObjectStore:
    """The server's client of one bucket and prefix (thread-safe: botocore clients are).

    ``count(direction, nbytes)`` and ``request(op)`` are called for every byte moved and request made
    (the metrics). ``client`` is built from the environment unless given (tests may pass one).
    """

    def __init__(
        self,
        url: str,
        *,
        public_url: str | None = None,
        url_expiry_s: int = 900,
        timeout_s: float = 10.0,
        count: Callable[[str, int], None] | None = None,
        request: Callable[[str, bool], None] | None = None,
        client=None,
    ):
        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_store_url(url)
        self.public_url = public_url.rstrip("/") + "/" if public_url else None
        self.url_expiry_s = int(url_expiry_s)
        self._count = count or (lambda direction, n: None)
        self._request = request or (lambda op, ok: None)
        self._client = client or _client_from_environment(timeout_s)
        self.endpoint = self._client.meta.endpoint_url
        self._get_urls: dict[str, tuple[str, float]] = {}
        self._urls_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r}, endpoint={self.endpoint!r})"

    @property
    def name(self) -> str:
        """How error messages name the store: its URL and endpoint."""
        return f"{self.url} (endpoint {self.endpoint})"

    # -- keys -------------------------------------------------------------------------------------

    def key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts] if self.prefix else parts)

    def upload_key(self, run_id: str, round: int, node_id: int) -> str:
        """The one key node ``node_id`` may write for ``round`` of ``run_id``."""
        return self.key("runs", run_id, "uploads", f"r{round:09d}", f"n{node_id}.gwf")

    def version_key(self, run_id: str, version: int, sha256: str) -> str:
        return self.key("runs", run_id, "versions", f"v{version:09d}-{sha256[:32]}.gwf")

    def checkpoint_key(self, run_id: str, version: int, kind: str, sha256: str) -> str:
        """``kind``: ``weights`` (safetensors) or ``algorithm`` (the algorithm's node state, packed)."""
        return self.key("runs", run_id, "checkpoints", f"v{version:09d}-{kind}-{sha256[:32]}.bin")

    # -- presigned URLs ---------------------------------------------------------------------------

    def presign_put(self, key: str, nbytes: int, sha256_hex: str) -> tuple[str, dict[str, str], float]:
        """A URL a node PUTs one frame of ``nbytes`` bytes with SHA-256 ``sha256_hex`` to: ``(url, headers the
        request must carry, expiry as Unix time)``. The headers and the length are in the signature."""
        checksum = base64.b64encode(bytes.fromhex(sha256_hex)).decode()
        params = {
            "Bucket": self.bucket,
            "Key": key,
            "IfNoneMatch": "*",
            "ContentLength": int(nbytes),
            "ChecksumSHA256": checksum,
        }
        url = self._client.generate_presigned_url("put_object", Params=params, ExpiresIn=self.url_expiry_s)
        headers = {"If-None-Match": "*", "x-amz-checksum-sha256": checksum}
        return url, headers, time.time() + self.url_expiry_s

    def get_url(self, key: str) -> str:
        """Where a node GETs ``key``: the public base URL and the key, or a presigned GET (reused while at
        least half its life is left: presigning costs about 170 µs, and every node asks every round)."""
        if self.public_url is not None:
            return self.public_url + key
        now = time.time()
        with self._urls_lock:
            cached = self._get_urls.get(key)
            if cached is not None and cached[1] - now > self.url_expiry_s / 2:
                return cached[0]
        url = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=self.url_expiry_s
        )
        with self._urls_lock:
            if len(self._get_urls) > 4096:
                self._get_urls = {k: v for k, v in self._get_urls.items() if v[1] - now > self.url_expiry_s / 2}
            self._get_urls[key] = (url, now + self.url_expiry_s)
        return url

    # -- the server's own requests ----------------------------------------------------------------

    @contextlib.contextmanager
    def _calling(self, op: str, what: str) -> Iterator[None]:
        """One request: a store that cannot be reached (or answers 5xx) becomes ObjectStoreUnavailable."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status >= 500 or status == 0:
                self._request(op, False)
                raise ObjectStoreUnavailable(self.name, what, _client_error(exc)) from None
            self._request(op, True)
            raise
        except BotoCoreError as exc:
            self._request(op, False)
            raise ObjectStoreUnavailable(self.name, what, f"{type(exc).__name__}: {exc}") from None
        else:
            self._request(op, True)

    def head(self, key: str, what: str) -> ObjectInfo | None:
        """The object's size and write time, or ``None`` when there is no such object."""
        from botocore.exceptions import ClientError

        try:
            with self._calling("head", what):
                r = self._client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _status(exc) in (404, 403) or _code(exc) in ("NoSuchKey", "NotFound", "404"):
                return None
            raise ObjectStoreUnavailable(self.name, what, _client_error(exc)) from None
        return ObjectInfo(int(r["ContentLength"]), _timestamp(r))

    def get(self, key: str, max_bytes: int, what: str) -> bytes | None:
        """The object's bytes (``None`` if absent); never more than ``max_bytes`` are read: a larger
        object is refused by its Content-Length before its body is read (413 ``frame_too_large``)."""
        from botocore.exceptions import ClientError

        try:
            with self._calling("get", what):
                r = self._client.get_object(Bucket=self.bucket, Key=key)
                body = r["Body"]
                try:
                    if int(r["ContentLength"]) > max_bytes:
                        raise Rejected(
                            Reason.FRAME_TOO_LARGE,
                            f"the object {key} is {r['ContentLength']} bytes, over the limit of {max_bytes}",
                        )
                    data = body.read(max_bytes + 1)
                finally:
                    body.close()
        except ClientError as exc:
            if _code(exc) in ("NoSuchKey", "NotFound") or _status(exc) == 404:
                return None
            # Refused by the store (its permissions, say): the store's words, as a 503 naming it.
            raise ObjectStoreUnavailable(self.name, what, _client_error(exc)) from None
        if len(data) > max_bytes:
            raise Rejected(Reason.FRAME_TOO_LARGE, f"the object {key} is over the limit of {max_bytes} bytes")
        self._count("read", len(data))
        return data

    def put_once(self, key: str, data: bytes, what: str) -> None:
        """Write ``data`` under ``key`` unless an object is there already (``If-None-Match: *``; a content-
        addressed key then already holds these bytes, so that counts as done)."""
        from botocore.exceptions import ClientError

        try:
            with self._calling("put", what):
                self._client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
        except ClientError as exc:
            if _status(exc) in (412, 409) or _code(exc) in ("PreconditionFailed", "ConditionalRequestConflict"):
                return
            raise ObjectStoreUnavailable(self.name, what, _client_error(exc)) from None
        self._count("written", len(data))

    def delete(self, keys: Sequence[str], what: str) -> None:
        """Delete ``keys`` (1,000 a request); keys already gone are no error."""
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            with self._calling("delete", what):
                self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def check(self) -> None:
        """One request that needs the bucket (HEAD bucket): at startup, so a wrong URL or credentials show
        at once, naming the store."""
        from botocore.exceptions import ClientError

        try:
            with self._calling("head", "checking the bucket"):
                self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            raise ValueError(f"object store {self.name}: {_client_error(exc)}") from None


def _client_from_environment(timeout_s: float):
    """A botocore S3 client as the AWS tools make one: the endpoint (``AWS_ENDPOINT_URL``,
    ``AWS_ENDPOINT_URL_S3``), credentials, region and profile from the environment and the AWS config
    files. Path-style addressing where an endpoint is set (MinIO, SeaweedFS, GCS and R2 take it)."""
    try:
        import botocore.session
        from botocore.config import Config
    except ImportError:
        raise ValueError(
            "--object-store needs botocore: pip install 'gradwire-server[object-store]' (or botocore)"
        ) from None

    session = botocore.session.get_session()
    region = os.environ.get("AWS_REGION") or session.get_config_variable("region") or "us-east-1"
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path" if endpoint else "auto"},
        connect_timeout=timeout_s,
        read_timeout=timeout_s,
        retries={"max_attempts": 2, "mode": "standard"},
        max_pool_connections=32,
        # A checksum header only where an operation needs one: uploads bind their own.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return session.create_client("s3", region_name=region, endpoint_url=endpoint, config=config)


def _status(exc) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _code(exc) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _client_error(exc) -> str:
    err = exc.response.get("Error", {})
    return f"HTTP {_status(exc)} {err.get('Code', '')}: {err.get('Message', '')}".strip()


def _timestamp(response: dict) -> float:
    """The store's ``Last-Modified`` as Unix seconds (botocore parses it into a datetime)."""
    value = response.get("LastModified")
    if value is None:
        raw = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("last-modified")
        value = parsedate_to_datetime(raw)
    return value.timestamp()
