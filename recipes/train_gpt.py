"""Train the GPT recipe on text that ships with the project, one compiled step per batch.

    python -m recipes.train_gpt                       # fp32 plan, best local backend
    python -m recipes.train_gpt --plan recipes/plans/gpt_bf16.yaml --steps 100
    torchrun --standalone --nproc-per-node 2 -m recipes.train_gpt --plan recipes/plans/gpt_dp2_zero1.yaml

Uses only the public API: compile_for_npu with a plan, a model, an optimizer
and a loss function. Prints a progress bar with the loss and tokens/s, then
the validation loss and what compilation did. Launched by torchrun, every rank
draws the same global batches and trains on its data-parallel share of them.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os

import torch

from cann_passes import Plan, compile_for_npu
from recipes.common import add_training_args, launch, load_plan, positive_int, train_loop, warmup_cosine
from recipes.data import TextBatches, load_corpus, train_val_split
from recipes.models.gpt import GPT, gpt_loss, gpt_small_cpu

PROG = "python -m recipes.train_gpt"
DEFAULT_PLAN = os.path.join(os.path.dirname(__file__), "plans", "gpt_fp32.yaml")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_training_args(p, plan=DEFAULT_PLAN, steps=200, batch_size=16, lr=3e-3)
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
    plan = load_plan(args, PROG)
    return launch(plan, lambda world: train(args, plan, world), threads=args.threads)


def train(args, plan: Plan, world) -> float:
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    train_tokens, val_tokens = train_val_split(load_corpus())
    model = GPT(gpt_small_cpu(seq_len=args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=gpt_loss)
    run = train_loop(step, TextBatches(train_tokens, args.batch_size, args.seq_len, seed=args.seed),
                     steps=args.steps, world=world, scheduler=warmup_cosine(optimizer, args.steps),
                     items_per_step=args.batch_size * args.seq_len)   # global: all ranks together
    val = evaluate(model, iter(TextBatches(val_tokens, args.batch_size, args.seq_len, seed=1)))
    if world is None or world.rank == 0:
        print(step.summary())
        print(f"compile (first step): {run.compile_seconds:.1f}s; validation loss {val:.3f} "
              f"(untrained: {math.log(256):.3f})")
    return val


if __name__ == "__main__":
    main()
