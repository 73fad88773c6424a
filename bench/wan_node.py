"""One node of the WAN bench, as its own process inside its host's network namespace.

``python bench/wan_node.py train --mode MODE ...`` trains the model on this node's shard of the pydoc
text and writes JSON lines to ``--log``: an ``eval`` line (the held-out loss and the training clock) every
``--eval-every`` steps and at the end, and a ``done`` line with the bytes this node sent and received.
Modes (every one from the same initial weights, the same shard and the same batches per rank):

- ``dense``: ``DistributedDataParallel`` over gloo, ``torch.optim.AdamW``: the baseline;
- ``demo``, ``sparseloco``: ``gradwire.torch.DeMo`` / ``gradwire.torch.SparseLoCo`` (inner AdamW) over gloo;
- ``server-demo``, ``server-sparseloco``: a ``gradwire.client.Node`` of a run on the aggregation server
  (its token in ``GRADWIRE_TOKEN``).

The training clock leaves out evaluation: every node evaluates the same weights at the same steps
(replicas are identical at every evaluated step: DDP's all-reduce, and the compressed runs' exact mean
at a sync), so all stop at the same step when ``--target`` is reached, without a message. One thread per
node: the bench shares the machine's cores between nodes.

``python bench/wan_node.py admin ...`` creates a server run for the ``server-*`` modes (run config, the
initial weights, one registered node per rank) and prints its id and the node tokens as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

#: The models: the demo's char transformer (about 0.43 M parameters) and a wider, deeper one (10.7 M).
MODELS = {
    "chars": dict(d_model=128, layers=2, heads=4, context=64),
    "chars10m": dict(d_model=384, layers=6, heads=6, context=64),
}
HELD_OUT = 0.1
EVAL_WINDOWS = 32


@dataclass
class Text:
    """The pydoc text as token ids, its vocabulary size, the training part and fixed held-out windows."""

    vocab: int
    train: torch.Tensor
    eval_x: torch.Tensor
    eval_y: torch.Tensor


def load_text(context: int) -> Text:
    from gradwire_apps.demo.tasks import CharVocab, char_batch, load_pydoc_text

    text = load_pydoc_text()
    vocab = CharVocab.of(text)
    tokens = vocab.encode(text)
    split = int(tokens.numel() * (1 - HELD_OUT))
    x, y = char_batch(tokens[split:], EVAL_WINDOWS, context, torch.Generator().manual_seed(1234))
    return Text(len(vocab), tokens[:split], x, y)


def build_model(name: str, vocab: int, seed: int = 0) -> nn.Module:
    from gradwire_apps.demo.tasks import CharTransformer

    torch.manual_seed(seed)  # the same initial weights in every process and every row
    return CharTransformer(vocab, **MODELS[name])


def shard(text: Text, rank: int, world: int) -> torch.Tensor:
    bounds = [text.train.numel() * i // world for i in range(world + 1)]
    return text.train[bounds[rank] : bounds[rank + 1]]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def held_out_loss(model: nn.Module, text: Text) -> float:
    with torch.no_grad():
        return float(lm_loss(model, text.eval_x, text.eval_y))


class Log:
    """JSON lines to a file, flushed at once (the parent reads it after the process ends)."""

    def __init__(self, path: str):
        self.f = open(path, "w")

    def __call__(self, **fields) -> None:
        self.f.write(json.dumps(fields) + "\n")
        self.f.flush()


def train(args) -> None:
    torch.set_num_threads(1)
    from gradwire_apps.demo.tasks import char_batch

    ctx = MODELS[args.model]["context"]
    text = load_text(ctx)
    model = build_model(args.model, text.vocab, args.seed)
    mine = shard(text, args.rank, args.world)
    gen = torch.Generator().manual_seed(args.seed * 1000 + args.rank)
    log = Log(args.log)
    forward, opt, node, finish = model, None, None, lambda: None
    mode = args.mode
    if mode in ("dense", "demo", "sparseloco"):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world)
        if mode == "dense":
            forward = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        elif mode == "demo":
            import gradwire.torch as gt
            from gradwire.codecs import make_codec

            spec = json.loads(args.codec) if args.codec else None
            opt = gt.DeMo(
                model.parameters(), lr=args.lr, codec=make_codec(spec["codec"], **spec["params"]) if spec else None
            )
        else:
            import gradwire.torch as gt
            from gradwire.codecs import make_codec

            spec = json.loads(args.codec) if args.codec else None
            opt = gt.SparseLoCo(
                model.parameters(),
                torch.optim.AdamW(model.parameters(), lr=args.lr),
                sync_every=args.sync_every,
                codec=make_codec(spec["codec"], **spec["params"]) if spec else None,
            )
        dist.barrier()  # every rank starts its clock together

        def finish():
            dist.barrier()
            dist.destroy_process_group()
    else:
        from gradwire.client import GradwireClient, Node
        from gradwire.codecs import make_codec

        spec = json.loads(args.codec)
        client = GradwireClient(args.url, os.environ["GRADWIRE_TOKEN"], timeout=120.0)
        node = Node(
            client,
            args.run_id,
            model,
            make_codec(spec["codec"], **spec.get("params", {})),
            args.node_id,
            wait=30.0,
            step_timeout=600.0,
        )
        node.sync()
        finish = client.close
    counters = opt if opt is not None and hasattr(opt, "bytes_sent") else node

    paused = 0.0
    t0 = time.perf_counter()

    def evaluate(step: int) -> float:
        nonlocal paused
        t = time.perf_counter()
        loss = held_out_loss(model, text)
        log(event="eval", step=step, t=t - t0 - paused, loss=loss)
        paused += time.perf_counter() - t
        return loss

    evaluate(0)
    step = 0
    while step < args.steps:
        x, y = char_batch(mine, args.batch, ctx, gen)
        loss = lm_loss(forward, x, y)
        if node is not None:
            model.zero_grad(set_to_none=False)
            loss.backward()
            node.step()
        else:
            opt.zero_grad()
            loss.backward()
            opt.step()
        step += 1
        if step % args.eval_every == 0 or step == args.steps:
            if evaluate(step) <= args.target:
                break
    seconds = time.perf_counter() - t0 - paused
    sent = getattr(counters, "bytes_sent", None)
    received = getattr(counters, "bytes_received", None)
    log(
        event="done",
        steps=step,
        t=seconds,
        bytes_sent=sent,
        bytes_received=received,
        params=sum(p.numel() for p in model.parameters()),
    )
    finish()


def admin(args) -> None:
    """Create the server run of a ``server-*`` row; print ``{"run_id", "nodes": [[id, token], ...]}``."""
    from gradwire.client import GradwireClient

    text_vocab = load_text(MODELS[args.model]["context"]).vocab
    model = build_model(args.model, text_vocab, args.seed)
    with GradwireClient(args.url, os.environ["GRADWIRE_ADMIN_TOKEN"], timeout=120.0) as client:
        run_id = client.create_run(json.loads(args.config))
        client.put_state(run_id, {n: p.detach().clone() for n, p in model.named_parameters()})
        nodes = [client.register_node(run_id, f"wan-{i}") for i in range(args.world)]
    print(json.dumps({"run_id": run_id, "nodes": nodes}))


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="one node of bench/wan.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--mode", required=True, choices=("dense", "demo", "sparseloco", "server-demo", "server-sparseloco"))
    t.add_argument("--model", required=True, choices=sorted(MODELS))
    t.add_argument("--rank", type=int, required=True)
    t.add_argument("--world", type=int, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--lr", type=float, required=True)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--sync-every", type=int, default=16)
    t.add_argument("--eval-every", type=int, default=8)
    t.add_argument("--target", type=float, default=float("-inf"), help="stop at the first evaluation at or below")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log", required=True)
    t.add_argument("--master", help="rank 0's address:port (torch.distributed modes)")
    t.add_argument("--url", help="the server's URL (server-* modes)")
    t.add_argument("--run-id")
    t.add_argument("--node-id", type=int)
    t.add_argument(
        "--codec",
        help="the uplink codec as JSON {codec, params} (server-* modes; demo and sparseloco: "
        "instead of the optimizer's default)",
    )
    a = sub.add_parser("admin")
    a.add_argument("--url", required=True)
    a.add_argument("--model", required=True, choices=sorted(MODELS))
    a.add_argument("--world", type=int, required=True)
    a.add_argument("--config", required=True)
    a.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


if __name__ == "__main__":
    ns = parse()
    (train if ns.cmd == "train" else admin)(ns)
    sys.exit(0)
