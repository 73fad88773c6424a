"""The README's server quick start, whole: a run on `gradwire serve`, one node training through it.

In one terminal, from the checkout (the server writes its data, and its admin token, to ./gradwire-data):

    .venv/bin/gradwire serve

In another, from the same directory:

    .venv/bin/python examples/quickstart_server.py

The admin token is GRADWIRE_ADMIN_TOKEN when it is set, else the gradwire-data/admin_token the server
generated (gradwire.client.read_admin_token); GRADWIRE_URL names another server. The node trains a small
classifier with SparseLoCo: 2 local AdamW steps, then its compressed pseudo-gradient goes up, the server's
re-encoded mean comes down, and the node checks that its weights hash to the server's.
"""

import os
import sys

import torch
from torch import nn

import gradwire.client
from gradwire.algorithms import default_sparseloco_codec
from gradwire.client import GradwireClient, Node, read_admin_token


def make_data(teacher: nn.Module, seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of 64 samples, labelled by ``teacher``."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(64, 64, generator=g) for _ in range(n)]
    with torch.no_grad():
        return [(x, teacher(x).argmax(dim=1)) for x in xs]


def main() -> None:
    url = "http://127.0.0.1:8470"  # where `gradwire serve` listens by default
    url = os.environ.get("GRADWIRE_URL", url)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))
    teacher = nn.Linear(64, 8)  # what the samples' labels come from
    data, held_out = make_data(teacher, 1, 48), make_data(teacher, 2, 4)
    loss_fn = nn.functional.cross_entropy

    admin = GradwireClient(url, read_admin_token())  # GRADWIRE_ADMIN_TOKEN, or gradwire-data/admin_token
    run_id = admin.create_run({"algorithm": "sparseloco", "quorum": 1, "sparseloco": {"sync_every": 2}})
    admin.put_state(run_id, model.state_dict())
    node_id, token = admin.register_node(run_id)  # one per node; the token goes to that node
    codec = default_sparseloco_codec(sync_every=2)  # top-k DCT, 2-bit values: about 300× fewer bytes per step
    node = Node(GradwireClient(url, token), run_id, model, codec, node_id)
    node.sync()  # joins: the run's algorithm and its weights (step() would do it; here to count bytes after it)
    joined = node.bytes_received
    for x, y in data:
        model.zero_grad()
        loss_fn(model(x), y).backward()
        node.step()  # a local step; at a sync the frame goes up, the re-encoded mean comes down, the hash is checked

    with torch.no_grad():
        loss = sum(loss_fn(model(x), y).item() for x, y in held_out) / len(held_out)
    fp32 = 4 * sum(p.numel() for p in model.parameters()) * len(data)  # dense fp32 gradients, every step
    received = node.bytes_received - joined  # the versions, not the weights loaded once at the start
    print(f"run {run_id}: {len(data)} local steps, {node.version} versions")
    print(f"held-out loss: {loss:.4f}")
    print(
        f"node {node_id} sent {node.bytes_sent / len(data):,.0f} bytes per local step "
        f"({fp32 / node.bytes_sent:.0f}x fewer than fp32) and received {received / len(data):,.0f}"
    )
    print(f"weights hash the server's: {node.weights_hash == admin.status(run_id)['weights_hash']}")


if __name__ == "__main__":
    try:
        main()
    except gradwire.client.GradwireClientError as exc:  # no server, a wrong token: one line, not a traceback
        sys.exit(f"{os.path.basename(sys.argv[0])}: {exc}")
