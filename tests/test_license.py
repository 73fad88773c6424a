"""The LICENSE file is the license every package of the tree declares: Apache-2.0, the full text."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: MD5 of apache.org's LICENSE-2.0.txt, the text GitHub and pip tools recognise.
APACHE_2_0_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


def test_license_is_the_apache_2_0_text():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.md5(text).hexdigest() == APACHE_2_0_MD5


def test_every_package_declares_apache_2_0():
    declared = {
        "pyproject.toml": re.search(r'^license = \{ text = "([^"]+)" \}', (ROOT / "pyproject.toml").read_text(), re.M),
        "server/pyproject.toml": re.search(
            r'^license = \{ text = "([^"]+)" \}', (ROOT / "server" / "pyproject.toml").read_text(), re.M
        ),
        "Cargo.toml": re.search(r'^license = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M),
    }
    assert {name: m and m.group(1) for name, m in declared.items()} == dict.fromkeys(declared, "Apache-2.0")
