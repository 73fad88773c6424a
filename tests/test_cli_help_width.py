"""`gradwire serve --help` at 80 columns prints every option name whole (rich's panels cut 13 of them, two
to the same `--checkpoint-eve…`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from gradwire_server.cli import serve_options
from gradwire_server.settings import ServerSettings


def test_serve_help_at_80_columns_names_every_option_whole():
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm"}
    out = subprocess.run(
        [sys.executable, "-m", "gradwire_apps.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert not re.search(r"--[\w-]+…", out.stdout)  # no option name cut short
    assert max(len(line) for line in out.stdout.splitlines()) <= 80
    for name, _, _ in serve_options(ServerSettings):
        assert f"--{name.replace('_', '-')}" in out.stdout.split(), name
