"""Train the MoE recipe on the shipped text: one compiled whole step per batch.

    python -m recipes.moe                                     # fp32 plan, a few minutes on 2 CPU cores
    python -m recipes.moe --model dense                       # the dense model of the same active size
    torchrun --standalone --nproc-per-node 2 -m recipes.moe --plan recipes/moe/plans/ep2.yaml
    python -m recipes.moe --steps 200 --save-every 50 --eval-every 25 --out out/moe

Shows the compiling phase, a progress bar (loss, tokens/s, peak memory), then the validation loss
before and after training. ``--out`` holds the run: ``config.yaml``, ``metrics.jsonl``,
``checkpoints/``, the convergence figure ``loss.png`` and ``metrics.json`` (recipes/common.py).
"""
from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch

from cann_passes import Plan, compile_for_npu
from recipes.common import (add_training_args, launch, positive_int, prepare, schedule_steps, train_loop,
                            warmup_cosine, write_convergence)
from recipes.data import TextBatches, load_corpus, train_val_split
from recipes.moe.model import active_parameters, build, moe_loss

PLANS = Path(__file__).with_name("plans")
PROG = "python -m recipes.moe"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_training_args(p, plan=PLANS / "fp32.yaml", steps=200, batch_size=8, lr=3e-3, out="out/moe")
    p.add_argument("--model", choices=("moe", "dense"), default="moe",
                   help="the mixture of experts, or the dense model of the same active size")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per row")
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model, batches, n: int = 8) -> float:
    """Mean next-token cross-entropy on validation windows (the load-balancing term left out)."""
    was_training = model.training
    model.eval()
    losses = []
    for idx, targets in itertools.islice(batches, n):
        logits = model(input_ids=idx, use_cache=False).logits
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                        targets.reshape(-1)).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def main(argv=None) -> dict:
    args = parse_args(argv)
    plan, run = prepare(args, PROG)
    return launch(plan, lambda world: train(args, plan, world, run), threads=args.threads)


def train(args, plan: Plan, world, run=None) -> dict:
    torch.manual_seed(args.seed)       # the same initial weights on every rank
    train_tokens, val_tokens = train_val_split(load_corpus())
    model = build(args.model, max_position_embeddings=args.seq_len)
    val_batches = TextBatches(val_tokens, args.batch_size, args.seq_len, seed=1)
    val_before = evaluate(model, iter(val_batches))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=moe_loss)
    loop = train_loop(step, TextBatches(train_tokens, args.batch_size, args.seq_len, seed=args.seed),
                      steps=args.steps, world=world, scheduler=warmup_cosine(optimizer, schedule_steps(args)),
                      desc=f"{args.model} {plan.precision}", items_per_step=args.batch_size * args.seq_len,
                      run=run, evaluate=lambda: evaluate(model, iter(val_batches)))
    val_after = evaluate(model, iter(val_batches))
    metrics = {"plan": str(args.plan), "model": args.model, "steps": args.steps, "losses": loop.losses,
               "parameters": sum(p.numel() for p in model.parameters()),
               "active_parameters": active_parameters(model),
               "val_loss_before": val_before, "val_loss_after": val_after,
               "evals": loop.evals, "compile_seconds": loop.compile_seconds, "train_seconds": loop.train_seconds}
    if world is None or world.rank == 0:
        print(step.summary())
        print(f"{args.model}: {metrics['parameters'] / 1e6:.2f}M parameters, "
              f"{metrics['active_parameters'] / 1e6:.2f}M active per token; first step (capture + compile): "
              f"{loop.compile_seconds:.1f}s; validation loss {val_before:.3f} -> {val_after:.3f} "
              f"(uniform over bytes: {math.log(256):.3f})")
        write_convergence(Path(args.out), metrics, title=f"MoE recipe ({args.model}), plan {Path(args.plan).name}")
    return metrics
