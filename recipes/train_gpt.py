"""Train the GPT recipe on text that ships with the project, one compiled step per batch.

    python -m recipes.train_gpt                       # fp32 plan, best local backend
    python -m recipes.train_gpt --plan recipes/plans/gpt_bf16.yaml --steps 100
    torchrun --standalone --nproc-per-node 2 -m recipes.train_gpt --plan recipes/plans/gpt_dp2_zero1.yaml
    python -m recipes.train_gpt --save-every 50 --out out/train_gpt; python -m recipes.train_gpt --resume latest

Uses only the public API: compile_for_npu with a plan, a model, an optimizer
and a loss function. Shows the compiling phase and a progress bar with the loss,
tokens/s and peak memory, then the validation loss and what compilation did.
Launched by torchrun, every rank draws the same global batches and trains on its
data-parallel share of them. ``--out`` holds the run: ``config.yaml``,
``metrics.jsonl``, ``checkpoints/``, ``loss.png`` and ``metrics.json``
(the launcher's flags: recipes/common.py).
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
from pathlib import Path

import torch

from cann_passes import Plan, compile_for_npu
from recipes.common import (add_training_args, launch, positive_int, prepare, schedule_steps, train_loop, warmup_cosine,
                            write_convergence)
from recipes.data import TextBatches, load_corpus, train_val_split
from recipes.models.gpt import GPT, gpt_loss, gpt_small_cpu

PROG = "python -m recipes.train_gpt"
DEFAULT_PLAN = os.path.join(os.path.dirname(__file__), "plans", "gpt_fp32.yaml")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_training_args(p, plan=DEFAULT_PLAN, steps=200, batch_size=16, lr=3e-3, out="out/train_gpt")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per row")
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model, batches, n: int = 8) -> float:
    model.eval()
    losses = [gpt_loss(model, b).item() for b in itertools.islice(batches, n)]
    model.train()
    return sum(losses) / len(losses)


def main(argv=None) -> float:
    args = parse_args(argv)
    plan, run = prepare(args, PROG)
    return launch(plan, lambda world: train(args, plan, world, run), threads=args.threads)


def train(args, plan: Plan, world, run=None) -> float:
    if world is None or world.rank == 0:
        print(f"{PROG}: plan {args.plan} ({plan.precision}, backend {plan.backend}), {args.steps} steps of "
              f"{args.batch_size} x {args.seq_len} tokens; run directory {args.out}", flush=True)
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    train_tokens, val_tokens = train_val_split(load_corpus())
    model = GPT(gpt_small_cpu(seq_len=args.seq_len))
    val_batches = TextBatches(val_tokens, args.batch_size, args.seq_len, seed=1)
    val_before = evaluate(model, iter(val_batches))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=gpt_loss)
    loop = train_loop(step, TextBatches(train_tokens, args.batch_size, args.seq_len, seed=args.seed),
                      steps=args.steps, world=world, scheduler=warmup_cosine(optimizer, schedule_steps(args)),
                      desc=f"gpt {plan.precision}", items_per_step=args.batch_size * args.seq_len,  # global
                      run=run, evaluate=lambda: evaluate(model, iter(val_batches)))
    val = evaluate(model, iter(val_batches))
    if world is None or world.rank == 0:
        print(step.summary())
        print(f"compile (first step): {loop.compile_seconds:.1f}s; validation loss {val_before:.3f} -> {val:.3f} "
              f"(uniform over bytes: {math.log(256):.3f})")
        if run is not None:
            metrics = {"plan": str(args.plan), "steps": args.steps, "losses": loop.losses, "evals": loop.evals,
                       "val_loss_before": val_before, "val_loss_after": val,
                       "compile_seconds": loop.compile_seconds, "train_seconds": loop.train_seconds}
            write_convergence(run.out, metrics, title=f"GPT, plan {Path(args.plan).name}")
    return val


if __name__ == "__main__":
    main()
