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
import contextlib
import itertools
import math
import os
import time

import torch
from tqdm import tqdm

from cann_passes import Plan, PlanError, compile_for_npu
from cann_passes.runtime.distributed import init_distributed, shard_batch
from recipes.data import TextBatches, load_corpus, train_val_split
from recipes.models.gpt import GPT, gpt_loss, gpt_small_cpu

DEFAULT_PLAN = os.path.join(os.path.dirname(__file__), "plans", "gpt_fp32.yaml")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default=DEFAULT_PLAN, help="plan file (YAML or JSON)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--backend", default=None, help="override the plan's backend")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model, batches, n: int = 8) -> float:
    model.eval()
    losses = [gpt_loss(model, b).item() for b in itertools.islice(batches, n)]
    model.train()
    return sum(losses) / len(losses)


def main(argv=None) -> float:
    args = parse_args(argv)
    try:
        plan = Plan.load(args.plan)
    except PlanError as e:  # a bad plan file is the user's input: one line, not a traceback
        raise SystemExit(f"train_gpt: {e}") from None
    if args.backend:
        plan = plan.replace(backend=args.backend)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or plan.dp * plan.tp * plan.pp > 1
    with (init_distributed(plan) if launched else contextlib.nullcontext()) as world:
        return train(args, plan, world)


def train(args, plan: Plan, world) -> float:
    rank, dp_rank, dp_size = (world.rank, world.dp_rank, world.dp_size) if world else (0, 0, 1)
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    train_tokens, val_tokens = train_val_split(load_corpus())
    model = GPT(gpt_small_cpu(seq_len=args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    # Cosine decay: the step reads param_groups' lr every call, so no recompile.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=gpt_loss)

    batches = TextBatches(train_tokens, args.batch_size, args.seq_len, seed=args.seed)
    tokens_per_step = args.batch_size * args.seq_len      # global: all ranks together
    bar = tqdm(itertools.islice(batches, args.steps), total=args.steps, unit="step",
               dynamic_ncols=True, disable=rank != 0)
    start, first_step_seconds = time.perf_counter(), None
    for i, batch in enumerate(bar):
        t0 = time.perf_counter()
        loss = step(shard_batch(batch, dp_rank, dp_size) if dp_size > 1 else batch)
        scheduler.step()
        if first_step_seconds is None:
            first_step_seconds = time.perf_counter() - t0  # includes capture + compile
            start = time.perf_counter()
        elif i % 5 == 0:
            rate = tokens_per_step * i / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{rate:,.0f}")
    bar.close()
    if plan.zero_stage == 3:
        step.sync_model()   # ZeRO-3 keeps parameter shards; gather them for evaluation
    val = evaluate(model, iter(TextBatches(val_tokens, args.batch_size, args.seq_len, seed=1)))
    if rank == 0:
        print(step.summary())
        print(f"compile (first step): {first_step_seconds:.1f}s; validation loss {val:.3f} "
              f"(untrained: {math.log(256):.3f})")
    return val


if __name__ == "__main__":
    main()
