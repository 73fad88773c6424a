"""Train transformers' GPT-2 (random weights, built from a config) with the HF Trainer and gradwire's DeMo or
SparseLoCo.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --optimizer sparseloco
    torchrun --nproc-per-node 2 examples/hf_trainer.py --optimizer demo --steps 20

Under torchrun the Trainer wraps the model in DistributedDataParallel, whose dense all-reduce would run
beside gradwire's frames and spend every byte they save; gradwire's optimizers refuse that at their first
step (gradwire.torch.DenseAllReduceError). The callback below registers
gradwire.torch.local_gradients_hook on the Trainer's DDP module before the first step: each rank keeps
its own gradient, and the optimizer's compressed exchange alone keeps the ranks' weights bit-identical
(checked at the end). The Trainer builds its lr scheduler on the optimizer given: both optimizers take
it (SparseLoCo's param groups are its inner AdamW's). Needs ``pip install transformers accelerate``.

Checkpoints: ``--save-every N`` saves one every N steps, with gradwire.torch.hf_trainer.FullOptimizerState
among the callbacks, so the optimizer file rank 0 writes holds every rank's share; ``--resume DIR`` resumes
from one, on every rank (without the callback rank 1 would be refused: "this checkpoint is rank 0's").

    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 8 --save-every 4
    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 8 --resume /tmp/gradwire-hf-trainer/checkpoint-4
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import gradwire.torch as gt
from gradwire.state import state_hash
from gradwire.torch.hf_trainer import FullOptimizerState


class TokenPatterns(torch.utils.data.Dataset):
    """Sequences repeating a short random pattern, with 10 % of the tokens replaced by noise."""

    def __init__(self, n: int, vocab: int, length: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        pattern = torch.randint(0, vocab, (8,), generator=g)
        start = torch.randint(0, 8, (n, 1), generator=g)
        seqs = pattern[(start + torch.arange(length)) % 8]
        noise = torch.rand(seqs.shape, generator=g) < 0.1
        self.seqs = torch.where(noise, torch.randint(0, vocab, seqs.shape, generator=g), seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.seqs[i], "labels": self.seqs[i]}


class LocalGradients(TrainerCallback):
    """Registers gradwire.torch.local_gradients_hook on the DDP module the Trainer wrapped the model in
    (``trainer.model_wrapped``, set before ``on_train_begin``)."""

    def __init__(self):
        self.trainer: Trainer | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if isinstance(wrapped, DistributedDataParallel):
            gt.skip_ddp_all_reduce(wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=("demo", "sparseloco"), default="sparseloco")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sync-every", type=int, default=4, help="SparseLoCo's local steps per sync")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--no-hook", action="store_true", help="leave DDP's all-reduce on (to see the refusal)")
    ap.add_argument("--out", default="/tmp/gradwire-hf-trainer")
    ap.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: none)")
    ap.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    args = ap.parse_args()

    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=32, vocab_size=512)
    model = GPT2LMHeadModel(config)
    if args.optimizer == "demo":
        opt = gt.DeMo(model.named_parameters(), lr=args.lr or 3e-3, beta=0.9)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr or 3e-3)
        opt = gt.SparseLoCo(model.named_parameters(), inner, sync_every=args.sync_every)

    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=max(1, args.steps // 5),
        save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or 500,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callback = LocalGradients()
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=TokenPatterns(512, config.vocab_size, 32),
        optimizers=(opt, None),
        callbacks=([] if args.no_hook else [callback]) + [FullOptimizerState()],
    )
    callback.trainer = trainer
    result = trainer.train(resume_from_checkpoint=args.resume)
    if args.optimizer == "sparseloco" and opt.local_steps % opt.sync_every:
        opt.sync()  # the local steps since the last sync: one more outer step, so every rank ends identical

    rank, world = dist.get_rank(), dist.get_world_size()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    agree = gt.replicas_agree(model)
    if rank == 0:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print("losses: " + " ".join(f"{v:.4f}" for v in losses))
        print(f"final lr: {opt.param_groups[0]['lr']:.3g}, train loss {result.training_loss:.4f}")
        print(f"bytes sent: {opt.bytes_sent}, received: {opt.bytes_received} ({world} ranks)")
        print(f"compression ratio vs fp32: {4 * numel * args.steps / opt.bytes_sent:.1f}x")
        print(f"replicas bit-identical: {agree}")
        print(f"weights hash: {state_hash({n: p.detach() for n, p in model.named_parameters()})}")
    dist.barrier()
    dist.destroy_process_group()
    if not agree:
        raise SystemExit("replicas differ")


if __name__ == "__main__":
    main()
