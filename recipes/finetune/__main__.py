"""Fine-tune a transformers causal LM on the shipped instruction pairs, with one compiled step per batch.

    python -m recipes.finetune                                   # LoRA on a tiny LLaMA, ~1 minute on 2 cores
    python -m recipes.finetune --config recipes/finetune/configs/full.yaml
    python -m recipes.finetune --model my_checkpoint_dir --out my_finetuned --method lora --steps 500
    torchrun --standalone --nproc-per-node 2 -m recipes.finetune --config recipes/finetune/configs/lora_dp2.yaml

Loads ``--model`` with ``from_pretrained`` (a directory written by
``save_pretrained``; the default one is made with random weights when
absent: nothing is downloaded), trains it with the config's method and plan,
prints a progress bar with the response-token loss, and saves the result with
``save_pretrained`` (LoRA merged) so plain transformers loads it; then loads it
back and reports its validation loss and logit difference.
"""
from __future__ import annotations

import argparse
import contextlib
import os

from cann_passes import Plan, PlanError

from .config import CONFIG_DIR, ConfigError, FinetuneConfig
from .train import describe, finetune

DEFAULT_CONFIG = os.path.join(CONFIG_DIR, "lora.yaml")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="finetune config (YAML)")
    p.add_argument("--model", help="base checkpoint directory (save_pretrained format)")
    p.add_argument("--out", help="where to save the fine-tuned model")
    p.add_argument("--method", choices=("full", "lora", "freeze"))
    p.add_argument("--steps", type=int)
    p.add_argument("--data", help="JSONL of {\"prompt\", \"response\"} lines instead of the shipped pairs")
    p.add_argument("--backend", help="override the plan's backend (eager, inductor, auto)")
    return p.parse_args(argv)


def config_from_args(args) -> FinetuneConfig:
    cfg = FinetuneConfig.load(args.config)
    changes = {k: v for k, v in (("model_dir", args.model), ("output_dir", args.out), ("method", args.method),
                                 ("steps", args.steps), ("data", args.data)) if v is not None}
    if args.steps is not None:
        changes["warmup_steps"] = min(cfg.warmup_steps, args.steps)
    if args.backend:
        changes["plan"] = dict(cfg.plan, backend=args.backend)
    return cfg.replace(**changes)


def main(argv=None):
    try:
        cfg = config_from_args(parse_args(argv))
        plan = Plan.from_dict(cfg.plan)
    except (ConfigError, PlanError, OSError) as exc:
        # A bad config or plan is the user's to fix: one line, no traceback.
        raise SystemExit(f"python -m recipes.finetune: {exc}") from None
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or plan.dp > 1
    if launched:
        from cann_passes.runtime.distributed import init_distributed
        context = init_distributed(plan)
    else:
        context = contextlib.nullcontext()
    with context as world:
        try:
            result = finetune(cfg, world=world)
        except ConfigError as exc:
            raise SystemExit(f"python -m recipes.finetune: {exc}") from None
        if world is None or world.rank == 0:
            print(describe(cfg, result))
    return result


if __name__ == "__main__":
    main()
