"""Train the BERT recipe (masked-LM) on the shipped text and measure masked-token accuracy.

    python -m recipes.bert                                    # fp32 plan, ~1-2 minutes on 2 CPU cores
    python -m recipes.bert --plan recipes/bert/plans/bf16.yaml
    python -m recipes.bert --model transformers               # transformers' BertForMaskedLM, same shape
    torchrun --standalone --nproc-per-node 2 -m recipes.bert --plan recipes/bert/plans/zero1_dp2.yaml

Shows a progress bar (loss, tokens/s); then masked-token accuracy on held-out text next to the
unigram baseline (always answering the corpus's most frequent byte at the same positions), and
writes ``loss.png`` and ``metrics.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cann_passes import Plan, compile_for_npu
from cann_passes.runtime.distributed import init_distributed, shard_batch
from recipes.bert.model import BertForMaskedLM, bert_small_cpu, masked_accuracy, mlm_loss
from recipes.data import load_corpus, train_val_split
from recipes.data.mlm import MaskedLMBatches, most_frequent_token, unigram_accuracy
from recipes.llama.train import write_convergence

PLANS = Path(__file__).with_name("plans")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m recipes.bert", description=__doc__.splitlines()[0])
    p.add_argument("--plan", default=str(PLANS / "fp32.yaml"), help="plan file (YAML or JSON)")
    p.add_argument("--model", choices=("recipe", "transformers"), default="recipe")
    p.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--backend", default=None, help="override the plan's backend (eager, inductor)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/bert", help="where loss.png and metrics.json go")
    return p.parse_args(argv)


def build_model(source: str, **config) -> torch.nn.Module:
    cfg = bert_small_cpu(**config)
    if source == "transformers":
        from transformers import BertForMaskedLM as TransformersBert
        return TransformersBert(cfg.to_transformers())
    return BertForMaskedLM(cfg)


@torch.no_grad()
def evaluate(model, batches, n: int = 8) -> dict:
    """Loss, masked-token accuracy and the unigram baseline's accuracy on the same positions."""
    was_training = model.training
    model.eval()
    losses, correct, total, unigram = [], 0, 0, []
    for batch in itertools.islice(batches, n):
        losses.append(mlm_loss(model, batch).item())
        c, t = masked_accuracy(model, batch)
        correct, total = correct + c, total + t
        unigram.append((unigram_accuracy(batch[1], evaluate.unigram_token), t))
    model.train(was_training)
    return {"loss": sum(losses) / len(losses), "accuracy": correct / total,
            "unigram_accuracy": sum(a * t for a, t in unigram) / total}


def main(argv=None) -> dict:
    args = parse_args(argv)
    plan = Plan.load(args.plan)
    if args.backend:
        plan = plan.replace(backend=args.backend)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or plan.dp * plan.tp * plan.pp > 1
    with (init_distributed(plan) if launched else contextlib.nullcontext()) as world:
        return train(args, plan, world)


def train(args, plan: Plan, world) -> dict:
    rank, dp_rank, dp_size = (world.rank, world.dp_rank, world.dp_size) if world else (0, 0, 1)
    torch.manual_seed(args.seed)
    train_tokens, val_tokens = train_val_split(load_corpus())
    evaluate.unigram_token = most_frequent_token(train_tokens)   # fitted on training text only
    model = build_model(args.model, attention=args.attention, max_position_embeddings=args.seq_len)
    val_batches = MaskedLMBatches(val_tokens, args.batch_size, args.seq_len, seed=1)
    before = evaluate(model, iter(val_batches))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=mlm_loss)

    batches = MaskedLMBatches(train_tokens, args.batch_size, args.seq_len, seed=args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(itertools.islice(batches, args.steps), total=args.steps, unit="step", dynamic_ncols=True,
               desc=f"bert {plan.precision}", disable=rank != 0)
    losses, start, compile_seconds = [], time.perf_counter(), None
    for i, batch in enumerate(bar):
        t0 = time.perf_counter()
        loss = step(shard_batch(batch, dp_rank, dp_size) if dp_size > 1 else batch)
        scheduler.step()
        losses.append(float(loss))
        if compile_seconds is None:
            compile_seconds = time.perf_counter() - t0
            start = time.perf_counter()
        elif i % 5 == 0:
            rate = tokens_per_step * i / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
    bar.close()
    if plan.zero_stage == 3:
        step.sync_model()
    after = evaluate(model, iter(val_batches))
    metrics = {"plan": str(args.plan), "model": args.model, "steps": args.steps, "losses": losses,
               "val_loss_before": before["loss"], "val_loss_after": after["loss"],
               "masked_accuracy": after["accuracy"], "masked_accuracy_before": before["accuracy"],
               "unigram_accuracy": after["unigram_accuracy"],
               "compile_seconds": compile_seconds, "train_seconds": time.perf_counter() - start}
    if rank == 0:
        print(step.summary())
        print(f"first step (capture + compile): {compile_seconds:.1f}s; validation loss "
              f"{before['loss']:.3f} -> {after['loss']:.3f}; masked-token accuracy {after['accuracy']:.1%} "
              f"(untrained {before['accuracy']:.1%}; unigram baseline {after['unigram_accuracy']:.1%})")
        write_convergence(Path(args.out), metrics, title=f"BERT masked-LM ({args.model}), plan {Path(args.plan).name}")
    return metrics
