"""Train the LLaMA recipe on the shipped text: one compiled whole step per batch.

    python -m recipes.llama                                   # fp32 plan, ~1-2 minutes on 2 CPU cores
    python -m recipes.llama --plan recipes/llama/plans/bf16.yaml --steps 100
    python -m recipes.llama --model transformers              # transformers' LlamaForCausalLM, same shape
    torchrun --standalone --nproc-per-node 2 -m recipes.llama --plan recipes/llama/plans/zero1_dp2.yaml
    python -m recipes.llama --steps 200 --save-every 50 --eval-every 25 --out out/llama
    python -m recipes.llama --steps 200 --resume latest --out out/llama    # continues bitwise

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
from recipes.llama.model import LlamaForCausalLM, llama_loss, llama_small_cpu

PLANS = Path(__file__).with_name("plans")
PROG = "python -m recipes.llama"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_training_args(p, plan=PLANS / "fp32.yaml", steps=200, batch_size=8, lr=3e-3, out="out/llama")
    p.add_argument("--model", choices=("recipe", "transformers"), default="recipe",
                   help="our LlamaForCausalLM, or transformers' built from the same config")
    p.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per row")
    return p.parse_args(argv)


def build_model(source: str, **config) -> torch.nn.Module:
    cfg = llama_small_cpu(**config)
    if source == "transformers":
        from transformers import LlamaForCausalLM as TransformersLlama
        return TransformersLlama(cfg.to_transformers())
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def evaluate(model, batches, n: int = 8) -> float:
    was_training = model.training
    model.eval()
    losses = [llama_loss(model, b).item() for b in itertools.islice(batches, n)]
    model.train(was_training)
    return sum(losses) / len(losses)


def main(argv=None) -> dict:
    args = parse_args(argv)
    plan, run = prepare(args, PROG)
    return launch(plan, lambda world: train(args, plan, world, run), threads=args.threads)


def train(args, plan: Plan, world, run=None) -> dict:
    torch.manual_seed(args.seed)       # the same initial weights on every rank
    train_tokens, val_tokens = train_val_split(load_corpus())
    model = build_model(args.model, attention=args.attention, max_position_embeddings=args.seq_len)
    val_batches = TextBatches(val_tokens, args.batch_size, args.seq_len, seed=1)
    val_before = evaluate(model, iter(val_batches))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=llama_loss)
    loop = train_loop(step, TextBatches(train_tokens, args.batch_size, args.seq_len, seed=args.seed),
                      steps=args.steps, world=world, scheduler=warmup_cosine(optimizer, schedule_steps(args)),
                      desc=f"llama {plan.precision}", items_per_step=args.batch_size * args.seq_len,
                      run=run, evaluate=lambda: evaluate(model, iter(val_batches)))
    val_after = evaluate(model, iter(val_batches))
    metrics = {"plan": str(args.plan), "model": args.model, "steps": args.steps, "losses": loop.losses,
               "val_loss_before": val_before, "val_loss_after": val_after,
               "evals": loop.evals, "compile_seconds": loop.compile_seconds, "train_seconds": loop.train_seconds}
    if world is None or world.rank == 0:
        print(step.summary())
        print(f"first step (capture + compile): {loop.compile_seconds:.1f}s; validation loss "
              f"{val_before:.3f} -> {val_after:.3f} (uniform over bytes: {math.log(256):.3f})")
        write_convergence(Path(args.out), metrics, title=f"LLaMA ({args.model}), plan {Path(args.plan).name}")
    return metrics
