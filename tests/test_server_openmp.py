"""The server's entry points choose OpenMP's passive wait policy before torch loads, and keep a user's."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import os, sys
{before}
from gradwire_server.openmp import prefer_passive_openmp
policy = prefer_passive_openmp()
print(policy, os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
"""


def _probe(before: str = "", **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.split()


def test_passive_is_chosen_before_torch_loads_and_importing_the_helper_loads_no_torch():
    assert _probe() == ["PASSIVE", "PASSIVE", "False"]


def test_a_policy_the_user_set_is_kept():
    assert _probe(OMP_WAIT_POLICY="active") == ["ACTIVE", "active", "False"]


def test_nothing_changes_once_torch_is_loaded():
    assert _probe(before="import torch") == ["default", "None", "True"]


def test_the_server_entry_point_sets_the_passive_policy_before_torch_loads(tmp_path):
    # `python -m gradwire_server --help` parses its flags after the policy is set; the policy reaches torch's
    # OpenMP runtime, which reads it at load (observable as the variable in the process's environment).
    code = (
        "import runpy, sys, os; sys.argv = ['gradwire_server', '--help']\n"
        "try:\n    runpy.run_module('gradwire_server', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "import torch; print('POLICY', os.environ.get('OMP_WAIT_POLICY'))"
    )
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=True
    )
    assert "POLICY PASSIVE" in out.stdout
