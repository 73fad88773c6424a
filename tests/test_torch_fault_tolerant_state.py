"""What a joining replica group downloads, and what FaultTolerant refuses at construction: the state crosses
as gradwire's state bytes over real HTTP on loopback (never pickled), a download too large or not a state is
refused, and torchft stays an optional extra."""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from torch import nn

from gradwire.algorithms import default_sparseloco_codec
from gradwire.torch import DeMo, FaultTolerant, SparseLoCo
from gradwire.torch.all_gather_exchange import AllGatherExchange
from gradwire.torch.sharded import Pieces, assign_owners
from gradwire.torch.state_bytes import StateBytesError
from gradwire.torch.state_transport import StateBytesTransport, StateDownloadError
from gradwire.torch.torchft_extra import torchft_modules

SECOND = timedelta(seconds=1)


def _state():
    m = nn.Linear(8, 4)
    opt = SparseLoCo(m, torch.optim.AdamW(m.parameters()), sync_every=2, exchange="all_gather")
    for _ in range(4):
        m(torch.randn(3, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"module": m.state_dict(), "optimizer": opt.state_dict()}


def test_a_joiner_downloads_the_healthy_groups_state_bit_for_bit():
    healthy, joiner = StateBytesTransport(), StateBytesTransport()
    try:
        state = _state()
        healthy.send_checkpoint([1], 7, {"user": state, "torchft": {"step": 7}}, SECOND)
        got = joiner.recv_checkpoint(0, healthy.metadata(), 7, SECOND)
        assert got["torchft"] == {"step": 7}
        for k, v in state["module"].items():
            assert torch.equal(got["user"]["module"][k], v)
        anchor = state["optimizer"]["state"][0]["anchor"]
        assert torch.equal(got["user"]["optimizer"]["state"][0]["anchor"], anchor)
        assert joiner.bytes_downloaded == healthy.bytes_served > 0
        healthy.disallow_checkpoint()  # the healthy group's next commit: the bytes are gone
        with pytest.raises(StateDownloadError, match="within 0.3 s"):
            joiner.download(healthy.metadata(), 7, 0.3)
    finally:
        healthy.shutdown()
        joiner.shutdown()


def test_a_download_announcing_more_than_max_state_bytes_is_refused():
    healthy, joiner = StateBytesTransport(), StateBytesTransport(max_state_bytes=1000)
    try:
        healthy.send_checkpoint([1], 1, _state(), SECOND)
        with pytest.raises(StateDownloadError, match=r"announced a state of \d+ bytes, outside 0..1000"):
            joiner.recv_checkpoint(0, healthy.metadata(), 1, SECOND)
    finally:
        healthy.shutdown()
        joiner.shutdown()


def test_bytes_that_are_no_state_are_refused_not_unpickled():
    import pickle

    body = pickle.dumps({"user": "pickled"})  # what torchft's own HTTPTransport would send

    class Hostile(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    joiner = StateBytesTransport()
    try:
        with pytest.raises(StateBytesError, match="is refused: not a gradwire optimizer state"):
            joiner.recv_checkpoint(0, f"http://127.0.0.1:{server.server_address[1]}", 3, SECOND)
    finally:
        server.shutdown()
        joiner.shutdown()


def test_other_optimizers_and_a_sharded_exchange_without_groups_are_refused_before_torchft_is_touched():
    m = nn.Linear(4, 2)
    with pytest.raises(TypeError, match="wraps a gradwire.torch.SparseLoCo or DeMo, got AdamW"):
        FaultTolerant(torch.optim.AdamW(m.parameters()), m, lighthouse="x", replica_id="g0")
    with pytest.raises(ValueError, match="this DeMo has exchange='sharded': pass groups="):
        FaultTolerant(DeMo(m.parameters(), lr=1e-3), m, lighthouse="x", replica_id="g0")
    sharded = SparseLoCo(m, torch.optim.AdamW(m.parameters()), exchange="sharded")
    with pytest.raises(ValueError, match="this SparseLoCo has exchange='sharded': pass groups="):
        FaultTolerant(sharded, m, lighthouse="x", replica_id="g0")
    with pytest.raises(ValueError, match="groups must be >= 1"):
        FaultTolerant(sharded, m, lighthouse="x", replica_id="g0", groups=0)
    with pytest.raises(ValueError, match="round transport carries the all-gather exchange"):
        sharded.use_round_transport(AllGatherExchange(None, None))
    gathered = SparseLoCo(m, torch.optim.AdamW(m.parameters()), exchange="all_gather")
    with pytest.raises(ValueError, match="exchange='all_gather' cuts no pieces"):
        gathered.cut_pieces_for(4)


def test_the_pieces_are_cut_for_the_runs_groups_before_the_first_step_only():
    m = nn.Sequential(nn.Linear(16, 300), nn.Tanh(), nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 1))
    opt = SparseLoCo(m, torch.optim.AdamW(m.parameters()), sync_every=2)  # a group of one process: no cut
    assert len(opt._pieces) == 6
    exchange = opt.cut_pieces_for(4)  # the 300×300 weight cut so that 4 owners get about a quarter each
    assert exchange.pieces is opt._pieces and len(opt._pieces) > 6
    total = sum(p.numel() for p in m.parameters())

    def busiest(pieces: Pieces) -> float:
        loads = [0] * 4
        for p, owner in zip(pieces.pieces, assign_owners(pieces.pieces, 4)):
            loads[owner] += p.numel
        return max(loads) / total

    uncut = Pieces([(n, tuple(p.shape)) for n, p in m.named_parameters()], default_sparseloco_codec(2), world=1)
    assert busiest(uncut) > 0.9  # one owner would hold the 300×300 weight: 94 % of the model
    assert busiest(opt._pieces) < 0.4  # measured 0.376 (the tiles' rows: 5 blocks of 60 for 4 owners)
    m(torch.randn(4, 16)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="before the first step"):
        opt.cut_pieces_for(2)


def test_without_torchft_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft.manager", None)  # as if torchft were not installed
    with pytest.raises(
        ImportError, match=r"FaultTolerant needs torchft, an optional extra: pip install 'gradwire\[torchft\]'"
    ):
        torchft_modules("gradwire.torch.FaultTolerant")
