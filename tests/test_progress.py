"""gradwire_apps.progress: a bar on a terminal, a plain line per tenth of the work in a log, with a time left
measured from the first unit of work done (start-up excluded)."""

from __future__ import annotations

import io
import os

from tqdm.auto import tqdm

from gradwire_apps import progress as progress_module
from gradwire_apps.progress import PlainProgress, format_seconds, progress


class _Clock:
    """A clock the test moves by hand (the lines' times are what is under test, not the machine's speed)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_one_line_per_tenth_without_carriage_returns():
    log = io.StringIO()
    bar = progress(range(1000), desc="run", unit="step", file=log)
    assert isinstance(bar, PlainProgress)
    assert sum(1 for _ in bar) == 1000
    lines = log.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in log.getvalue()
    assert lines[0].startswith("run: 100/1000 step (10%), ") and lines[-1].startswith("run: 1000/1000 step (100%), ")
    assert all("left" in line for line in lines[:-1]) and "left" not in lines[-1]


def test_the_time_left_leaves_out_the_start_up(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    log = io.StringIO()
    bar = PlainProgress(total=10, desc="demo", unit="version", file=log)
    clock.now += 300.0  # five minutes of start-up: workers spawned, torch imported
    bar.update(1)  # the first version: the rate is measured from here
    assert log.getvalue().splitlines() == ["demo: 1/10 version (10%), 5:00 elapsed"]  # no estimate yet
    for _ in range(4):
        clock.now += 2.0
        bar.update(1)
    # 2 s a version from the first on: 5 versions left take 10 s (counting the start-up in would say 5:08).
    assert log.getvalue().splitlines()[-1] == "demo: 5/10 version (50%), 5:08 elapsed, about 0:10 left"


def test_postfix_and_description_show_on_the_next_line():
    log = io.StringIO()
    bar = PlainProgress(total=2, desc="a", file=log)
    bar.set_postfix_str("train loss 1.2345")
    bar.update(1)
    bar.set_description("b")
    bar.set_postfix(lr=0.1)
    bar.update(1)
    first, second = log.getvalue().splitlines()
    assert first.startswith("a: 1/2 it (50%)") and first.endswith(", train loss 1.2345")
    assert second.startswith("b: 2/2 it (100%)") and second.endswith(", lr=0.1")


def test_a_terminal_gets_tqdm_and_disabled_shows_nothing():
    controller, terminal = os.openpty()
    try:
        with os.fdopen(terminal, "w", closefd=False) as tty:
            bar = progress(total=3, desc="x", file=tty)
            assert isinstance(bar, tqdm)
            bar.close()
    finally:
        os.close(controller)
        os.close(terminal)
    log = io.StringIO()
    quiet = progress(range(3), file=log, enabled=False)
    assert list(quiet) == [0, 1, 2] and log.getvalue() == ""


def test_format_seconds():
    assert [format_seconds(s) for s in (0, 59.4, 61, 3599, 3600, 7322)] == [
        "0:00",
        "0:59",
        "1:01",
        "59:59",
        "1:00:00",
        "2:02:02",
    ]
