"""Train the BERT recipe (masked-LM) on the shipped text and measure masked-token accuracy.

    python -m recipes.bert                                    # fp32 plan, about 1 minute on the loaded 2-core CPU
    python -m recipes.bert --plan recipes/bert/plans/bf16.yaml
    python -m recipes.bert --model transformers               # transformers' BertForMaskedLM, same shape
    torchrun --standalone --nproc-per-node 2 -m recipes.bert --plan recipes/bert/plans/zero1_dp2.yaml

Shows a progress bar (loss, tokens/s); then masked-token accuracy on held-out text next to the
unigram baseline (always answering the corpus's most frequent byte at the same positions). ``--out``
holds the run: ``config.yaml``, ``metrics.jsonl``, ``checkpoints/`` (``--save-every N``; continue with
``--resume latest``), ``loss.png`` and ``metrics.json`` (recipes/common.py).
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from cann_passes import Plan, compile_for_npu
from recipes.bert.model import BertForMaskedLM, bert_small_cpu, masked_accuracy, mlm_loss
from recipes.common import (add_training_args, launch, positive_int, prepare, schedule_steps, train_loop,
                            warmup_cosine, write_convergence)
from recipes.data import load_corpus, train_val_split
from recipes.data.mlm import MaskedLMBatches, most_frequent_token, unigram_accuracy

PLANS = Path(__file__).with_name("plans")
PROG = "python -m recipes.bert"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    # 400 steps of 16 x 32 bytes: the default model leaves the unigram plateau (200 or 250 steps
    # of 32 x 32 bytes, with the schedule fitted to them, stayed on it)
    add_training_args(p, plan=PLANS / "fp32.yaml", steps=400, batch_size=16, lr=2e-3, out="out/bert")
    p.add_argument("--model", choices=("recipe", "transformers"), default="recipe")
    p.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    p.add_argument("--seq-len", type=positive_int, default=32, help="tokens per row")
    return p.parse_args(argv)


def build_model(source: str, **config) -> torch.nn.Module:
    cfg = bert_small_cpu(**config)
    if source == "transformers":
        from transformers import BertForMaskedLM as TransformersBert
        return TransformersBert(cfg.to_transformers())
    return BertForMaskedLM(cfg)


@torch.no_grad()
def evaluate(model, batches, unigram_token: int, n: int = 8) -> dict:
    """Loss, masked-token accuracy and the unigram baseline's accuracy on the same positions."""
    was_training = model.training
    model.eval()
    losses, correct, total, unigram = [], 0, 0, 0.0
    for batch in itertools.islice(batches, n):
        losses.append(mlm_loss(model, batch).item())
        c, t = masked_accuracy(model, batch)
        correct, total = correct + c, total + t
        unigram += unigram_accuracy(batch[1], unigram_token) * t
    model.train(was_training)
    return {"loss": sum(losses) / len(losses), "accuracy": correct / total, "unigram_accuracy": unigram / total}


def main(argv=None) -> dict:
    args = parse_args(argv)
    plan, run = prepare(args, PROG)
    return launch(plan, lambda world: train(args, plan, world, run), threads=args.threads)


def train(args, plan: Plan, world, run=None) -> dict:
    torch.manual_seed(args.seed)
    train_tokens, val_tokens = train_val_split(load_corpus())
    unigram_token = most_frequent_token(train_tokens)      # fitted on training text only
    model = build_model(args.model, attention=args.attention, max_position_embeddings=args.seq_len)
    val_batches = MaskedLMBatches(val_tokens, args.batch_size, args.seq_len, seed=1)
    before = evaluate(model, iter(val_batches), unigram_token)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=mlm_loss)
    loop = train_loop(step, MaskedLMBatches(train_tokens, args.batch_size, args.seq_len, seed=args.seed),
                      steps=args.steps, world=world,
                      scheduler=warmup_cosine(optimizer, schedule_steps(args), warmup=schedule_steps(args) // 10),
                      desc=f"bert {plan.precision}", items_per_step=args.batch_size * args.seq_len,
                      run=run, evaluate=lambda: evaluate(model, iter(val_batches), unigram_token))
    after = evaluate(model, iter(val_batches), unigram_token)
    metrics = {"plan": str(args.plan), "model": args.model, "steps": args.steps, "losses": loop.losses, "evals": loop.evals,
               "val_loss_before": before["loss"], "val_loss_after": after["loss"],
               "masked_accuracy": after["accuracy"], "masked_accuracy_before": before["accuracy"],
               "unigram_accuracy": after["unigram_accuracy"],
               "compile_seconds": loop.compile_seconds, "train_seconds": loop.train_seconds}
    if world is None or world.rank == 0:
        print(step.summary())
        print(f"first step (capture + compile): {loop.compile_seconds:.1f}s; validation loss "
              f"{before['loss']:.3f} -> {after['loss']:.3f}; {args.steps - loop.start_step} steps in "
              f"{loop.train_seconds:.1f}s")
        gain = after["accuracy"] - after["unigram_accuracy"]
        print(f"held-out masked-token accuracy {after['accuracy']:.1%} (untrained {before['accuracy']:.1%}) "
              f"against the unigram baseline's {after['unigram_accuracy']:.1%} at the same positions: "
              + (f"{gain:+.1%}, above the baseline" if gain > 0 else "not above the baseline"))
        write_convergence(Path(args.out), metrics, title=f"BERT masked-LM ({args.model}), plan {Path(args.plan).name}")
    return metrics
