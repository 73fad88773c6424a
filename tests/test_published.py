"""Published aggregates: a weights header and the round's node frames verbatim, read back exactly."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire.frame import SERVER_SENDER
from gradwire.published import HEADER_RECORD, read_published, write_published


def _node_frame(node: int, rnd: int = 3) -> bytes:
    g = torch.Generator().manual_seed(node)
    grads = {"a": torch.randn(32, 16, generator=g), "b": torch.randn(7, generator=g)}
    return gradwire.DCTCodec(chunk_shape=(64,), topk=4).encode_bundle(grads, round=rnd, sender=node)


def test_versions_round_trip_with_the_node_frames_verbatim():
    v1 = write_published(4, [_node_frame(1), _node_frame(2)], [0.5, 0.5])
    v2 = write_published(5, [_node_frame(3, rnd=4)], [1.0])
    got = read_published(v1 + v2)
    assert [p.version for p in got] == [4, 5]
    assert got[0].weights == [0.5, 0.5] and got[1].weights == [1.0]
    assert [f.sender for f in got[0].frames] == [1, 2]
    assert got[0].nbytes == len(v1) and got[1].nbytes == len(v2)
    # The node frames are the submitted bytes: they decode to what the nodes sent.
    for frame, node in zip(got[0].frames, (1, 2)):
        assert gradwire.decode_bundle(frame).keys() == {"a", "b"}
        want = gradwire.decode_bundle(_node_frame(node))
        assert all(torch.equal(gradwire.decode_bundle(frame)[n], want[n]) for n in want)


def test_weights_travel_exactly_as_float64():
    w = [1 / 3, 2 / 3]
    (p,) = read_published(write_published(1, [_node_frame(1), _node_frame(2)], w))
    assert p.weights == w


@pytest.mark.parametrize("cut", [1, 10, 40])
def test_a_truncated_version_is_refused(cut):
    data = write_published(1, [_node_frame(1), _node_frame(2)], [0.5, 0.5])
    with pytest.raises(gradwire.FrameError):
        read_published(data[:-cut])


def test_a_header_announcing_more_frames_than_follow_is_refused():
    whole = write_published(1, [_node_frame(1), _node_frame(2)], [0.5, 0.5])
    header_only = whole[: len(whole) - 2 * len(_node_frame(1))]
    with pytest.raises(gradwire.FrameError, match="announces 2 node frames, only 1 follow"):
        read_published(header_only + _node_frame(1))


def test_a_version_must_start_with_the_servers_header():
    with pytest.raises(gradwire.FrameError, match="header frame"):
        read_published(_node_frame(1))
    fake = gradwire.IdentityCodec().encode_bundle({HEADER_RECORD: torch.ones(1, dtype=torch.float64)},
                                                  round=1, sender=SERVER_SENDER)
    server_as_node = gradwire.IdentityCodec().encode_bundle({"a": torch.ones(3)}, round=1, sender=SERVER_SENDER)
    with pytest.raises(gradwire.FrameError, match="bundle from a node"):
        read_published(fake + server_as_node)


@pytest.mark.parametrize("bad", [{"name": "weights"}, {"dtype": torch.float32}, {"value": float("nan")},
                                 {"value": -1.0}])
def test_a_malformed_header_record_is_refused(bad):
    t = torch.tensor([bad.get("value", 1.0)], dtype=bad.get("dtype", torch.float64))
    header = gradwire.IdentityCodec().encode_bundle({bad.get("name", HEADER_RECORD): t}, round=1, sender=SERVER_SENDER)
    with pytest.raises(gradwire.FrameError):
        read_published(header + _node_frame(1))


def test_writing_checks_its_arguments():
    with pytest.raises(ValueError):
        write_published(1, [], [])
    with pytest.raises(ValueError):
        write_published(1, [_node_frame(1)], [0.5, 0.5])
    with pytest.raises(ValueError):
        write_published(1, [_node_frame(1)], [float("inf")])
