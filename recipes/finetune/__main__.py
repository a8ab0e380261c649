"""Fine-tune a transformers causal LM on the shipped instruction pairs, with one compiled step per batch.

    python -m recipes.finetune                                   # LoRA on a tiny LLaMA, ~1 minute on 2 cores
    python -m recipes.finetune --config recipes/finetune/configs/full.yaml
    python -m recipes.finetune --model my_checkpoint_dir --out out/my_run --method lora --steps 500
    python -m recipes.finetune --steps 200 --save-every 50 --eval-every 25 --out out/ft
    python -m recipes.finetune --steps 200 --resume latest --out out/ft        # continues bitwise
    torchrun --standalone --nproc-per-node 2 -m recipes.finetune --config recipes/finetune/configs/lora_dp2.yaml

The config (``--config``) says what to train and how: the base checkpoint, the method (full, LoRA,
frozen by pattern), the data, the plan; ``--steps --batch-size --lr --seed --threads --out
--schedule-steps`` (each default is the config's, which ``--help`` shows), ``--model --method
--data`` and ``--plan FILE`` (in place of the config's ``plan:``) override it. The run flags are the
launcher's (recipes/README.md): ``--out DIR`` holds ``config.yaml``, ``metrics.jsonl``,
``checkpoints/``, ``loss.png``, ``metrics.json`` and ``model/``, the fine-tuned model as
``save_pretrained`` writes it (LoRA merged), which the command loads back with plain transformers
to report its validation loss and logit difference.
"""
from __future__ import annotations

import argparse
import os

from cann_passes import Plan, PlanError
from recipes.common import add_training_args, launch, load_plan, prepare_run, usage_error

from .config import CONFIG_DIR, ConfigError, FinetuneConfig
from .train import describe, finetune

DEFAULT_CONFIG = os.path.join(CONFIG_DIR, "lora.yaml")
PROG = "python -m recipes.finetune"
# launcher flag -> the config field it overrides (its default is the config's value)
FROM_CONFIG = {"steps": "steps", "batch_size": "batch_size", "lr": "lr", "seed": "seed", "threads": "cpu_threads",
               "out": "out", "schedule_steps": "schedule_steps"}


def _config_flag() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, add_help=False)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="finetune config (YAML)")
    return p


def load_config(path: str) -> FinetuneConfig:
    try:
        return FinetuneConfig.load(path)
    except ConfigError as exc:
        usage_error(PROG, f"--config {path}: {exc}")
    except OSError as exc:
        usage_error(PROG, f"--config {str(path)!r}: cannot be read ({exc.strerror or exc})")


def parse_args(argv=None) -> tuple[argparse.Namespace, FinetuneConfig]:
    """The arguments, and the config file they name (read first: it gives the other flags' defaults)."""
    known, _ = _config_flag().parse_known_args(argv)
    cfg = load_config(known.config)
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], parents=[_config_flag()])
    add_training_args(p, plan="", steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, out=cfg.out)
    p.set_defaults(plan=None, seed=cfg.seed, threads=cfg.cpu_threads, schedule_steps=cfg.schedule_steps)
    for action in p._actions:        # argparse has no public setter for an action's help
        if action.dest == "plan":
            action.help = "plan file (YAML or JSON) in place of the config's plan: mapping"
    p.add_argument("--model", help="base checkpoint directory (save_pretrained format) in place of the config's "
                                   "model_dir")
    p.add_argument("--method", choices=("full", "lora", "freeze"), help="in place of the config's method")
    p.add_argument("--data", help="JSONL of {\"prompt\", \"response\"} lines instead of the shipped pairs")
    return p.parse_args(argv), cfg


def config_from_args(args, cfg: FinetuneConfig) -> FinetuneConfig:
    changes = {field: getattr(args, flag) for flag, field in FROM_CONFIG.items()}
    changes.update({k: v for k, v in (("model_dir", args.model), ("method", args.method), ("data", args.data))
                    if v is not None})
    # a warmup longer than a shortened schedule is cut to it, as the config's own rule asks
    changes["warmup_steps"] = min(cfg.warmup_steps, args.schedule_steps or args.steps)
    try:
        return cfg.replace(**changes)
    except ConfigError as exc:
        usage_error(PROG, str(exc))


def resolve_plan(args, cfg: FinetuneConfig) -> Plan:
    """``--plan FILE`` (read by the launcher), else the config's ``plan:``; ``--backend`` over either."""
    if args.plan:
        return load_plan(args, PROG)
    try:
        plan = Plan.from_dict(cfg.plan)
        plan = plan.replace(backend=args.backend) if args.backend else plan
    except PlanError as exc:
        usage_error(PROG, f"--config {args.config}: {exc}")
    ranks_needed = plan.dp * plan.tp * plan.pp
    if ranks_needed > 1 and "WORLD_SIZE" not in os.environ:
        usage_error(PROG, f"the config {args.config} plans {ranks_needed} ranks (dp={plan.dp}, tp={plan.tp}, "
                          f"pp={plan.pp}); launch it with `.venv/bin/torchrun --standalone --nproc-per-node "
                          f"{ranks_needed} -m recipes.finetune --config {args.config} ...`")
    return plan


def main(argv=None):
    args, file_cfg = parse_args(argv)
    cfg = config_from_args(args, file_cfg)
    plan = resolve_plan(args, cfg)
    run = prepare_run(args, PROG)
    run.args = {**run.args, "finetune": cfg.to_dict()}     # config.yaml: the config as resolved, too

    def train(world):
        try:
            result = finetune(cfg, plan, world=world, run=run)
        except ConfigError as exc:   # a pattern or target that matches no parameter of the model
            usage_error(PROG, str(exc))
        if world is None or world.rank == 0:
            print(describe(cfg, result))
        return result

    return launch(plan, train, threads=args.threads)


if __name__ == "__main__":
    main()
