"""A real gradwire server in a subprocess on 127.0.0.1, for tests that speak HTTP to it.

A thin test flavour of :class:`gradwire_server.launcher.LoopbackServer` (free loopback port, bounded wait
for ``/readyz``, SIGKILL with ``kill()``, SIGTERM with ``stop()``, ``start()``/``restart()`` on the same
port and data directory): ``LiveServer(data_dir)`` starts at once, with admin token ``test-admin``, and
``close()`` gives it a few seconds to stop gracefully before killing it, so the process never outlives
the test.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from gradwire_server.launcher import LoopbackServer, free_port

__all__ = ["LiveServer", "free_port"]


class LiveServer(LoopbackServer):
    """``python -m gradwire_server`` on loopback, started by the constructor."""

    def __init__(
        self,
        data_dir: os.PathLike | str,
        admin_token: str = "test-admin",
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout: float = 60.0,
        extra_args: Sequence[str] = (),
    ):
        super().__init__(
            data_dir, admin_token=admin_token, port=port, env=env, ready_timeout_s=ready_timeout, extra_args=extra_args
        )
        self.start()

    @property
    def proc(self):
        """The server's :class:`subprocess.Popen` (``process``)."""
        return self.process

    def close(self) -> None:
        """Stop: SIGTERM, then SIGKILL if it has not exited within 5 s."""
        self.stop(timeout=5.0)
