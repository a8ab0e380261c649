"""One training command for the image-text recipes (CLIP, ALIGN, Flamingo).

A recipe names its model builders, its loss and its held-out evaluation; :func:`run` does
the rest with the public API only: ``compile_for_npu`` with a plan from the recipe's
``plans/`` directory, a progress bar with the loss and pictures/s, the held-out metrics
before and after training, and the loss curve as a figure. Launched by torchrun with a
``dp > 1`` plan, every rank draws the same global batches and trains on its share.

The run-management flags are the launcher's (recipes/common.py): ``--out`` (default
``out/<recipe>``) holds ``config.yaml``, ``metrics.jsonl``, ``checkpoints/`` and ``loss.png``;
``--save-every N`` / ``--resume latest`` continue a run bitwise; ``--eval-every N`` logs the
held-out metrics (``val_<metric>``) every N steps.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from cann_passes import Plan, compile_for_npu
from recipes.common import add_training_args, launch, prepare, schedule_steps, train_loop, warmup_cosine
from recipes.data.images import ImageTextBatches


@dataclass
class Recipe:
    name: str
    models: dict[str, Callable[[], torch.nn.Module]]   # --model choice -> builder; the first is the default
    loss_fns: dict[str, Callable[[torch.nn.Module, Any], torch.Tensor]]  # per --model choice
    evaluate: Callable[[torch.nn.Module], dict[str, float]]             # held-out metrics, eval mode
    plans_dir: Path
    steps: int = 200
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.05
    warmup: int = 20
    # parameter-name suffix -> multiple of --lr for those parameters (Flamingo's tanh gates)
    lr_scale: dict[str, float] = field(default_factory=dict)
    headline: str = ""                                  # the metric the summary line leads with
    notes: list[str] = field(default_factory=list)
    verdict: Callable[[dict[str, float]], str] | None = None   # one line on the held-out metrics

    @property
    def default_plan(self) -> Path:
        return self.plans_dir / "fp32.yaml"


def parse_args(recipe: Recipe, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m recipes.{recipe.name}",
                                description=f"Train the {recipe.name.upper()} recipe on procedural images.")
    add_training_args(p, plan=recipe.default_plan, steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr,
                      out=f"out/{recipe.name}")
    p.add_argument("--model", choices=list(recipe.models), default=next(iter(recipe.models)))
    p.add_argument("--figure", default=None,
                   help="where to save the loss curve (PNG; default OUT/loss.png); 'none' for no figure")
    args = p.parse_args(argv)
    if args.figure is None:
        args.figure = str(Path(args.out) / "loss.png")
    return args


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                   lr_scale: dict[str, float] | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; no weight decay on gains, biases and scales (1-D).

    ``lr_scale`` maps a parameter-name suffix to a multiple of ``lr``: those parameters get a
    group of their own (no weight decay), which a schedule scales like the others."""
    lr_scale = lr_scale or {}
    decay, no_decay, scaled = [], [], {suffix: [] for suffix in lr_scale}
    for name, param in model.named_parameters():
        if not param.requires_grad:      # a frozen tower is not the optimizer's
            continue
        suffix = next((s for s in lr_scale if name.endswith(s)), None)
        if suffix is not None:
            scaled[suffix].append(param)
        else:
            (no_decay if param.ndim < 2 else decay).append(param)
    missing = [s for s, params in scaled.items() if not params]
    if missing:
        raise ValueError(f"lr_scale: no trainable parameter name ends with {missing}")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups += [{"params": params, "weight_decay": 0.0, "lr": lr * lr_scale[s]} for s, params in scaled.items()]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def main(recipe: Recipe, argv=None) -> dict:
    args = parse_args(recipe, argv)
    figure = () if args.figure.lower() == "none" else ((Path(args.figure).parent, "--figure"),)
    plan, run = prepare(args, f"python -m recipes.{recipe.name}", also_writable=figure)
    return launch(plan, lambda world: train(recipe, args, plan, world, run), threads=args.threads)


def train(recipe: Recipe, args: argparse.Namespace, plan: Plan, world=None, run=None) -> dict:
    torch.manual_seed(args.seed)          # the same initial weights on every rank
    model = recipe.models[args.model]()
    optimizer = make_optimizer(model, args.lr, recipe.weight_decay, recipe.lr_scale)
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=recipe.loss_fns[args.model])
    before = recipe.evaluate(model)
    loop = train_loop(step, ImageTextBatches(args.batch_size), steps=args.steps, world=world,
                      scheduler=warmup_cosine(optimizer, schedule_steps(args), warmup=recipe.warmup, floor=0.05),
                      desc=f"{recipe.name} {args.model} {plan.precision}", items_per_step=args.batch_size,
                      rate_unit="img_s", run=run, evaluate=lambda: recipe.evaluate(model))
    after = recipe.evaluate(model)
    losses = loop.losses
    result = {"recipe": recipe.name, "model": args.model, "plan": str(args.plan), "steps": args.steps,
              "losses": losses, "before": before, "after": after, "evals": loop.evals,
              "compile_seconds": loop.compile_seconds, "train_seconds": loop.train_seconds, "step": step}
    if world is None or world.rank == 0:
        print(step.summary())
        print(f"compile (first step): {loop.compile_seconds:.1f}s; {args.steps - loop.start_step} steps in "
              f"{loop.train_seconds:.1f}s; loss, mean of the first 10 steps {_mean(losses[:10]):.3f} -> "
              f"of the last 10 {_mean(losses[-10:]):.3f}")
        for key in after:
            print(f"  held-out {key}: {before[key]:.3f} before training -> {after[key]:.3f} after")
        if recipe.verdict is not None:
            print(recipe.verdict(after))
        if args.figure and args.figure.lower() != "none":
            save_figure(args.figure, recipe, result)
            print(f"wrote {args.figure}")
    return result


def _mean(xs) -> float:
    return sum(xs) / max(len(xs), 1)


def save_figure(path: str, recipe: Recipe, result: dict) -> None:
    """The training loss (raw and smoothed) with the held-out metrics before and after."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = result["losses"]
    k = max(1, len(losses) // 20)
    smooth = [_mean(losses[max(0, i - k + 1): i + 1]) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(losses, color="0.75", lw=0.8, label="loss per step")
    ax.plot(smooth, color="C0", lw=1.8, label=f"mean of {k} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    text = "\n".join(f"{key}: {result['before'][key]:.3f} -> {v:.3f}" for key, v in result["after"].items())
    ax.text(0.98, 0.95, "held-out\n" + text, transform=ax.transAxes, ha="right", va="top", fontsize=8,
            bbox=dict(facecolor="white", alpha=0.8, edgecolor="0.8"))
    ax.set_title(f"{recipe.name.upper()} ({result['model']}) on procedural images, plan {Path(result['plan']).name}",
                 fontsize=9)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
