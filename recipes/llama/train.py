"""Train the LLaMA recipe on the shipped text: one compiled whole step per batch.

    python -m recipes.llama                                   # fp32 plan, ~1-2 minutes on 2 CPU cores
    python -m recipes.llama --plan recipes/llama/plans/bf16.yaml --steps 100
    python -m recipes.llama --model transformers              # transformers' LlamaForCausalLM, same shape
    torchrun --standalone --nproc-per-node 2 -m recipes.llama --plan recipes/llama/plans/zero1_dp2.yaml

Shows a progress bar (loss, tokens/s), then the validation loss before and after training,
and writes the convergence figure ``loss.png`` and ``metrics.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cann_passes import Plan, compile_for_npu
from cann_passes.runtime.distributed import init_distributed, shard_batch
from recipes.data import TextBatches, load_corpus, train_val_split
from recipes.llama.model import LlamaForCausalLM, llama_loss, llama_small_cpu

PLANS = Path(__file__).with_name("plans")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m recipes.llama", description=__doc__.splitlines()[0])
    p.add_argument("--plan", default=str(PLANS / "fp32.yaml"), help="plan file (YAML or JSON)")
    p.add_argument("--model", choices=("recipe", "transformers"), default="recipe",
                   help="our LlamaForCausalLM, or transformers' built from the same config")
    p.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--backend", default=None, help="override the plan's backend (eager, inductor)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/llama", help="where loss.png and metrics.json go")
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
    plan = Plan.load(args.plan)
    if args.backend:
        plan = plan.replace(backend=args.backend)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or plan.dp * plan.tp * plan.pp > 1
    with (init_distributed(plan) if launched else contextlib.nullcontext()) as world:
        return train(args, plan, world)


def train(args, plan: Plan, world) -> dict:
    rank, dp_rank, dp_size = (world.rank, world.dp_rank, world.dp_size) if world else (0, 0, 1)
    torch.manual_seed(args.seed)       # the same initial weights on every rank
    train_tokens, val_tokens = train_val_split(load_corpus())
    model = build_model(args.model, attention=args.attention, max_position_embeddings=args.seq_len)
    val_batches = TextBatches(val_tokens, args.batch_size, args.seq_len, seed=1)
    val_before = evaluate(model, iter(val_batches))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=llama_loss)

    batches = TextBatches(train_tokens, args.batch_size, args.seq_len, seed=args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(itertools.islice(batches, args.steps), total=args.steps, unit="step", dynamic_ncols=True,
               desc=f"llama {plan.precision}", disable=rank != 0)
    losses, start, compile_seconds = [], time.perf_counter(), None
    for i, batch in enumerate(bar):
        t0 = time.perf_counter()
        loss = step(shard_batch(batch, dp_rank, dp_size) if dp_size > 1 else batch)
        scheduler.step()
        losses.append(float(loss))
        if compile_seconds is None:
            compile_seconds = time.perf_counter() - t0    # capture + passes + lowering + one step
            start = time.perf_counter()
        elif i % 5 == 0:
            rate = tokens_per_step * i / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
    bar.close()
    if plan.zero_stage == 3:
        step.sync_model()
    val_after = evaluate(model, iter(val_batches))
    metrics = {"plan": str(args.plan), "model": args.model, "steps": args.steps, "losses": losses,
               "val_loss_before": val_before, "val_loss_after": val_after,
               "compile_seconds": compile_seconds, "train_seconds": time.perf_counter() - start}
    if rank == 0:
        print(step.summary())
        print(f"first step (capture + compile): {compile_seconds:.1f}s; validation loss "
              f"{val_before:.3f} -> {val_after:.3f} (uniform over bytes: {math.log(256):.3f})")
        write_convergence(Path(args.out), metrics, title=f"LLaMA ({args.model}), plan {Path(args.plan).name}")
    return metrics


def write_convergence(out: Path, metrics: dict, *, title: str) -> Path:
    """``loss.png`` (training loss per step, validation before/after) and ``metrics.json`` in ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(metrics["losses"], lw=1, label="training loss")
    ax.axhline(metrics["val_loss_after"], color="C1", ls="--", label=f"validation after ({metrics['val_loss_after']:.2f})")
    ax.axhline(metrics["val_loss_before"], color="C2", ls=":", label=f"validation before ({metrics['val_loss_before']:.2f})")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'loss.png'} and {out / 'metrics.json'}")
    return out / "loss.png"
