"""The downlink's reads: pages of published versions, streamed from their files.

``GET …/updates?since=v`` answers versions ``v+1 …`` in one *page*: as many versions as fit in
``max_catch_up_bytes`` (always at least one), at most :data:`MAX_PAGE_FILES`. The page's files are opened
before the answer starts (a version pruned meanwhile stays readable through its descriptor, so a body is
never cut short) and sent :data:`CHUNK_BYTES` at a time as the client reads them: the server holds about
one chunk per answer, whatever the page's size, instead of the whole catch-up. The answer says where the
page ends (``X-Gradwire-Version`` and the weights hash at that version) and the run's current version
(``X-Gradwire-Latest-Version``); a client that is still behind asks again from there (``GradwireClient``
does).

Pages of more than one version — catch-ups — take one of ``max_catch_ups`` slots while they are sent;
beyond, 429 ``busy`` with Retry-After. A page of one version (every node after every round) never waits.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gradwire.protocol import HASH_HEADER, LATEST_VERSION_HEADER, OCTET_STREAM, VERSION_HEADER

from .errors import Reason, Rejected
from .store import Store

__all__ = ["CHUNK_BYTES", "CatchUpSlots", "MAX_PAGE_FILES", "Page", "PageResponse", "open_page"]

#: Bytes read from a version's file and handed to the connection at a time.
CHUNK_BYTES = 1 << 20
#: Versions in one page at most: the descriptors a page holds while it is sent.
MAX_PAGE_FILES = 64
#: What a refused catch-up is told to wait, in seconds.
RETRY_AFTER_S = 1


class CatchUpSlots:
    """At most ``limit`` catch-ups sent at a time (on the event loop: no lock needed)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0

    def take(self) -> Callable[[], None]:
        """A slot, or 429 ``busy``; returns the function that gives it back (once)."""
        if self.in_use >= self.limit:
            raise Rejected(
                Reason.BUSY,
                f"{self.limit} catch-ups are being sent; retry in {RETRY_AFTER_S} s",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.in_use += 1
        given = False

        def give_back() -> None:
            nonlocal given
            if not given:
                given = True
                self.in_use -= 1

        return give_back


@dataclass
class Page:
    """Versions ``first … last`` of a run (none when ``first > last``), open and ready to send."""

    first: int
    last: int
    latest: int
    weights_hash: str
    files: list[BinaryIO] = field(default_factory=list)
    nbytes: int = 0
    release: Callable[[], None] | None = None

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []
        if self.release is not None:
            self.release()


def open_page(store: Store, run_id: str, first: int, last: int, max_bytes: int) -> tuple[list[BinaryIO], int]:
    """Open the files of versions ``first …`` up to ``last`` while they fit in ``max_bytes`` (at least one);
    returns them and their total size. ``FileNotFoundError`` when version ``first`` is gone (pruned)."""
    files: list[BinaryIO] = []
    total = 0
    try:
        for version in range(first, min(last, first + MAX_PAGE_FILES - 1) + 1):
            try:
                f = open(store.diff_path(run_id, version), "rb")
            except FileNotFoundError:
                if not files:
                    raise
                break  # cannot happen for versions after an existing one (pruning goes oldest first)
            size = os.fstat(f.fileno()).st_size
            if files and total + size > max_bytes:
                f.close()
                break
            files.append(f)
            total += size
    except BaseException:
        for f in files:
            f.close()
        raise
    return files, total


class PageResponse(Response):
    """A page as the answer: the protocol's headers, then its files' bytes streamed as the client reads."""

    def __init__(self, page: Page):
        self.page = page
        super().__init__(
            media_type=OCTET_STREAM,
            headers={
                VERSION_HEADER: str(page.last if page.files else page.latest),
                HASH_HEADER: page.weights_hash,
                LATEST_VERSION_HEADER: str(page.latest),
                "Content-Length": str(page.nbytes),
            },
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            for f in self.page.files:
                while not gone.is_set():
                    chunk = await asyncio.to_thread(f.read, CHUNK_BYTES)
                    if not chunk:
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.page.close()
