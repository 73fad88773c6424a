"""One training node of the distributed demo, as its own process: ``python -m gradwire_apps.demo.worker ...``.

The worker trains a demo task's model (:data:`gradwire_apps.demo.tasks.TASKS`) on its shard of the training data
(a safetensors file its parent wrote) through a :class:`~gradwire.client.Node`: each step it computes a
gradient and hands it to the node, which does what the run's algorithm says (send it compressed and apply
the published version; or, for SparseLoCo, a local step and every ``sync_every`` steps a sync). It reports
to its parent as JSON lines on stdout — one ``{"event": "round", ...}`` per step and a final ``{"event": "done", ...}``
with the hash of its own replica — so the parent can draw progress and check that every node ends in sync. The node's
bearer token comes from the ``GRADWIRE_TOKEN`` environment variable, never the command line (which
other users of the machine can read).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import typer

app = typer.Typer(add_completion=False)


def _emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


@app.command()
def main(
    url: str = typer.Option(..., help="The server's base URL."),
    run_id: str = typer.Option(..., help="The run to train."),
    node_id: int = typer.Option(..., help="This node's id (the frame sender), from registration."),
    data: Path = typer.Option(..., help="This node's shard of the training data (safetensors, as the task cut it)."),
    rounds: int = typer.Option(..., help="Train until the run reaches this version."),
    codec: str = typer.Option('{"codec": "dct", "params": {}}', help="Uplink codec as JSON {codec, params}."),
    model_name: str = typer.Option(
        "digits", "--model", help="What to train: digits or transformer (gradwire_apps.demo.tasks.TASKS)."
    ),
    hidden: int | None = typer.Option(None, help="The model's width (must match the run's state)."),
    batch_size: int = typer.Option(32, help="Examples per step on this node."),
    seed: int = typer.Option(0, help="Seed of this node's batch sampling."),
    join_at: int = typer.Option(0, help="Wait until the run reaches this version before joining (a late joiner)."),
    wait: float = typer.Option(30.0, help="Long-poll seconds per request while waiting for a round."),
) -> None:
    """Train one node of a run until the run reaches version ``rounds``."""
    import torch
    from safetensors.torch import load_file

    from gradwire.client import GradwireClient, Node
    from gradwire.codecs import make_codec
    from gradwire.state import state_hash

    from .tasks import make_task

    # Several workers share the machine's cores with the server: one thread each keeps them all moving.
    torch.set_num_threads(1)
    token = os.environ.get("GRADWIRE_TOKEN")
    if not token:
        raise typer.BadParameter("set GRADWIRE_TOKEN to this node's bearer token")
    spec = json.loads(codec)
    uplink = make_codec(spec["codec"], **spec.get("params", {}))

    task = make_task(model_name, hidden)
    shard = load_file(str(data))
    gen = torch.Generator().manual_seed(seed * 1000 + node_id)
    model = task.build()

    with GradwireClient(url, token) as client:
        if join_at > 0:
            _wait_for_version(client, run_id, join_at, wait)
        node = Node(client, run_id, model, uplink, node_id, wait=wait)
        node.sync()
        _emit("joined", node=node_id, version=node.version)
        step = 0
        while node.version < rounds:
            model.zero_grad(set_to_none=False)
            loss = task.batch_loss(model, shard, batch_size, gen)
            loss.backward()
            round_, up, down = node.version, node.bytes_sent, node.bytes_received
            t0 = time.perf_counter()
            node.step()
            _emit(
                "round",
                node=node_id,
                step=step,
                round=round_,
                version=node.version,
                loss=loss.item(),
                up=node.bytes_sent - up,
                down=node.bytes_received - down,
                seconds=time.perf_counter() - t0,
            )
            step += 1
        _emit(
            "done",
            node=node_id,
            version=node.version,
            weights_hash=state_hash(node.params),
            server_hash=node.weights_hash,
            bytes_sent=node.bytes_sent,
            bytes_received=node.bytes_received,
            rounds_missed=node.rounds_missed,
            state_loads=node.state_loads,
        )


def _wait_for_version(client, run_id: str, version: int, wait: float) -> int | None:
    """Block until the run reaches ``version`` (long-polling on the run's updates, bodies discarded)."""
    current = int(client.status(run_id)["version"])
    while current < version:
        current = client.updates(run_id, current, wait=wait).version
    return current


if __name__ == "__main__":
    app()
