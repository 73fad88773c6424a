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
    fake = gradwire.IdentityCodec().encode_bundle(
        {HEADER_RECORD: torch.ones(1, dtype=torch.float64)}, round=1, sender=SERVER_SENDER
    )
    server_as_node = gradwire.IdentityCodec().encode_bundle({"a": torch.ones(3)}, round=1, sender=SERVER_SENDER)
    with pytest.raises(gradwire.FrameError, match="bundle from a node"):
        read_published(fake + server_as_node)


@pytest.mark.parametrize(
    "bad", [{"name": "weights"}, {"dtype": torch.float32}, {"value": float("nan")}, {"value": -1.0}]
)
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


def _frames(n: int) -> list[bytes]:
    return [_node_frame(node) for node in range(1, n + 1)]


@pytest.mark.parametrize("n, trim", [(3, 1), (4, 1), (5, 2), (7, 2)])
def test_a_trimmed_version_applies_the_coordinate_wise_trimmed_mean(n, trim):
    (p,) = read_published(write_published(9, _frames(n), [1 / n] * n, trim=trim))
    assert p.trim == trim
    got = p.mean()
    decoded = [gradwire.decode_bundle(f) for f in _frames(n)]
    for name in ("a", "b"):
        ordered = torch.sort(torch.stack([d[name] for d in decoded]), dim=0).values[trim : n - trim]
        torch.testing.assert_close(got[name], ordered.mean(dim=0), rtol=1e-6, atol=1e-7)


def test_the_median_is_the_trim_that_keeps_the_middle():
    from gradwire.algorithms import trim_count

    for n in (1, 2, 3, 4, 5, 8):
        (p,) = read_published(write_published(1, _frames(n), [1 / n] * n, trim=trim_count("median", n)))
        decoded = torch.stack([gradwire.decode_bundle(f)["a"] for f in _frames(n)])
        ordered = torch.sort(decoded, dim=0).values
        want = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        assert torch.equal(p.mean()["a"], want) or n == 2  # n = 2: the mean of both, as (a + b) / 2
        torch.testing.assert_close(p.mean()["a"], want)


def test_the_trimmed_mean_is_bit_identical_across_thread_counts_and_zero_signs():
    from gradwire.algorithms import exact_trimmed_mean

    a = gradwire.IdentityCodec().encode_bundle({"z": torch.tensor([-0.0, 1.0, -0.0])}, round=1, sender=1)
    b = gradwire.IdentityCodec().encode_bundle({"z": torch.tensor([0.0, 2.0, -0.0])}, round=1, sender=2)
    c = gradwire.IdentityCodec().encode_bundle({"z": torch.tensor([0.0, 3.0, -0.0])}, round=1, sender=3)
    records = [gradwire.read_frame(f).entries for f in (a, b, c)]
    out = exact_trimmed_mean(records, 1)["z"]
    # the middle of {-0, +0, +0} is +0 whichever zero sorts first; of {-0, -0, -0} too (-0 + 0 = +0)
    assert out.tolist() == [0.0, 2.0, 0.0] and not torch.signbit(out).any()
    threads = torch.get_num_threads()
    try:
        frames = _frames(6)
        results = []
        for t in (1, 2):
            torch.set_num_threads(t)
            (p,) = read_published(write_published(1, frames, [1 / 6] * 6, trim=2))
            results.append(p.mean())
        assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("trim", [-1, 2, 3])
def test_a_trim_that_keeps_nothing_is_refused_on_both_ends(trim):
    with pytest.raises(ValueError, match="2·trim"):
        write_published(1, _frames(4), [0.25] * 4, trim=trim)
    # a hostile header carrying that trim is refused by the reader
    from gradwire.published import TRIM_RECORD

    header = gradwire.IdentityCodec().encode_bundle(
        {
            HEADER_RECORD: torch.full((4,), 0.25, dtype=torch.float64),
            TRIM_RECORD: torch.tensor([float(trim)], dtype=torch.float64),
        },
        round=1,
        sender=SERVER_SENDER,
    )
    with pytest.raises(gradwire.FrameError, match="trim"):
        read_published(header + b"".join(_frames(4)))


@pytest.mark.parametrize(
    "value, match",
    [
        (torch.tensor([1.0]), "float64"),
        (torch.tensor([0.5], dtype=torch.float64), "whole"),
        (torch.tensor([float("nan")], dtype=torch.float64), "whole"),
        (torch.tensor([1.0, 1.0], dtype=torch.float64), "shape"),
    ],
)
def test_a_malformed_trim_record_is_refused(value, match):
    from gradwire.published import TRIM_RECORD

    header = gradwire.IdentityCodec().encode_bundle(
        {HEADER_RECORD: torch.full((3,), 1 / 3, dtype=torch.float64), TRIM_RECORD: value}, round=1, sender=SERVER_SENDER
    )
    with pytest.raises(gradwire.FrameError, match=match):
        read_published(header + b"".join(_frames(3)))
