"""Counting the bytes of the server's own API traffic, headers included (``gradwire_http_bytes_*``).

An ASGI layer outside the routes: each request's line, headers and body as received, each response's
status line, headers and body as sent (the wire's HTTP/1.1 framing, less chunk markers). With an object
store the frames and the versions go through the bucket, and these counters show what is left: small
JSON answers (bench/object_store.py asserts at most 8 KB per node per round each way).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gradwire.protocol import API_PREFIX

from .metrics import Metrics

__all__ = ["TrafficCounter"]


def _header_bytes(headers) -> int:
    # "name: value\r\n" per header, and the blank line that ends them.
    return sum(len(k) + len(v) + 4 for k, v in headers) + 2


class TrafficCounter:
    """Counts every HTTP request's and response's bytes into ``metrics``."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The API only (/v1/…): /metrics, /readyz and /healthz are the operator's, not the nodes' traffic.
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX + "/"):
            await self.app(scope, receive, send)
            return
        query = scope.get("query_string") or b""
        line = len(scope["method"]) + len(scope.get("raw_path") or scope["path"].encode()) + 12
        self.metrics.http_bytes_received.inc(line + (len(query) + 1 if query else 0) + _header_bytes(scope["headers"]))

        async def counted_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                self.metrics.http_bytes_received.inc(len(message.get("body", b"")))
            return message

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                # "HTTP/1.1 200 OK\r\n" and the headers (uvicorn adds date and server: about 60 bytes).
                self.metrics.http_bytes_sent.inc(17 + 60 + _header_bytes(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                self.metrics.http_bytes_sent.inc(len(message.get("body", b"")))
            await send(message)

        await self.app(scope, counted_receive, counted_send)
