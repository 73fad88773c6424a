"""Error messages show bytes in one number base: the bad-magic error gives the expected and the found bytes
both as space-separated hex (the found ones were a Python-looking list that read as decimal)."""

from __future__ import annotations

import re

import pytest

import gradwire
from gradwire.frame import read_frame


def test_bad_magic_prints_expected_and_found_bytes_in_hex():
    frame = bytearray(gradwire.IdentityCodec().encode_bundle({"w": __import__("torch").zeros(3)}, round=0, sender=1))
    frame[:4] = b"GWIX"
    with pytest.raises(gradwire.FrameError) as exc:
        read_frame(bytes(frame))
    assert exc.value.kind == "bad_magic"
    message = str(exc.value)
    assert 'expected 47 57 49 52 ("GWIR"), found 47 57 49 58' in message
    assert not re.search(r"\[\d+, \d+", message)
