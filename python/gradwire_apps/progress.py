"""Progress of long jobs (the demo, the benches): a tqdm bar on a terminal, plain lines anywhere else.

In a log file or a pipe (CI, ``make demo > log``) a bar's carriage-return redraws pile up into one
unreadable line of thousands of frames, so there :func:`progress` returns a :class:`PlainProgress`: one
whole line at each tenth of the work, with the elapsed time and the time left at the rate measured since
the first unit of work was done. Start-up (spawning workers, importing torch, a first step that
compiles) is not in that rate: counted in, it made the demo's first estimate 5:08 for a run that had 5 s
left.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

__all__ = ["PlainProgress", "format_seconds", "progress"]


def format_seconds(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour on)."""
    s = int(round(max(0.0, seconds)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class PlainProgress:
    """tqdm's interface (``update``, ``set_description``, ``set_postfix_str``, ``n``, iteration, ``with``)
    writing one line per tenth of ``total``: ``desc: n/total unit (p%), m:ss elapsed, about m:ss left,
    postfix``."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        file: TextIO | None = None,
        steps: int = 10,
    ):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.file = file if file is not None else sys.stderr
        self.steps = steps
        self.n = 0
        self.postfix = ""
        self._shown = 0
        self._t0 = time.monotonic()
        self._rate_origin: tuple[float, int] | None = None  # (time, n) the rate is measured from

    def unpause(self) -> None:
        """Measure the rate from now on (tqdm's name: it restarts tqdm's timer the same way)."""
        self._rate_origin = (time.monotonic(), self.n)

    def update(self, k: int = 1) -> None:
        self.n += k
        if self._rate_origin is None:
            self._rate_origin = (time.monotonic(), self.n)
        if not self.total:
            return
        step = min(self.steps, self.steps * self.n // self.total)
        if step > self._shown:
            self._shown = step
            self.file.write(self.line() + "\n")
            self.file.flush()

    def line(self) -> str:
        """What is printed now."""
        now = time.monotonic()
        parts = [
            f"{self.n}/{self.total} {self.unit} ({100 * self.n // max(1, self.total or 1)}%)",
            f"{format_seconds(now - self._t0)} elapsed",
        ]
        if self.total and self.n < self.total and self._rate_origin and self.n > self._rate_origin[1]:
            t0, n0 = self._rate_origin
            parts.append(f"about {format_seconds((now - t0) / (self.n - n0) * (self.total - self.n))} left")
        if self.postfix:
            parts.append(self.postfix)
        return (f"{self.desc}: " if self.desc else "") + ", ".join(parts)

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update(1)

    def __len__(self) -> int:
        return self.total or 0

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    leave: bool = True,
    file: TextIO | None = None,
):
    """A tqdm bar when ``file`` (stderr) is a terminal, else a :class:`PlainProgress`; nothing shown when
    not ``enabled`` (a disabled tqdm: it still iterates and counts)."""
    from tqdm.auto import tqdm

    stream = file if file is not None else sys.stderr
    if enabled and not (hasattr(stream, "isatty") and stream.isatty()):
        return PlainProgress(iterable, total=total, desc=desc, unit=unit, file=stream)
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled, leave=leave, file=stream)
