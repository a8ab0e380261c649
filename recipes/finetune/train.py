"""The fine-tuning run: one compiled step per batch on the recipe launcher, evaluation, save, reload check.

Uses the compiler only through its public API: ``compile_for_npu(model,
Plan, optimizer=..., loss_fn=...)``. The model is an ordinary transformers
model (wrapped by peft for LoRA); the optimizer is ``torch.optim.AdamW`` over
the parameters that train; the LR schedule is a ``LambdaLR`` the compiled
step reads every call (the learning rate is a graph input: no recompile).
The loop is the launcher's ``train_loop`` (recipes/common.py): the compiling
phase, the progress bar, ``metrics.jsonl``, ``--eval-every``, checkpoints and
bitwise ``--resume`` in the run directory ``cfg.out``; the fine-tuned model
goes to ``cfg.out/model`` (``save_pretrained``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cann_passes import Plan, compile_for_npu
from recipes.common import RunOptions, train_loop, write_convergence
from recipes.data.instructions import InstructionBatches, load_pairs, split_pairs

from .config import FinetuneConfig
from .memory import StepStateBytes, step_state_bytes
from .model import ResponseLoss, load_base, load_tokenizer, make_base_checkpoint, prepare_model, save_finetuned

DEFAULT_MODEL_DIR = FinetuneConfig().model_dir
MODEL_DIR = "model"         # inside the run directory: what save_pretrained writes


@dataclass
class FinetuneResult:
    losses: list[float]                   # every step, a resumed run's earlier ones too
    val_loss_before: float
    val_loss_after: float
    reloaded_val_loss: float | None       # the saved directory, loaded back by plain transformers
    reload_max_logit_diff: float | None
    trainable_params: int
    total_params: int
    state: StepStateBytes
    seconds: float                        # the steps after the first of this process
    first_step_seconds: float             # the compiling phase (a resumed run: and loading) + the first step
    output_dir: str | None                # the saved model: <run directory>/model
    summary: str = ""
    # the steps this process ran (a resumed run: from its checkpoint on); metrics.jsonl holds them all
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)   # before clipping, when the plan clips
    evals: list[dict] = field(default_factory=list)         # {"step", "val_loss"} at --eval-every

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("state", "summary")}
        out["state"] = self.state.to_json()
        return out


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """LR multiplier: linear warmup from 1/warmup to 1, then cosine down to ``min_ratio``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def evaluate(model, loss_fn, batches) -> float:
    was_training = model.training
    model.eval()
    losses = [loss_fn(model, b).item() for b in batches]
    model.train(was_training)
    return sum(losses) / len(losses)


def ensure_base(cfg: FinetuneConfig) -> str:
    """The base checkpoint directory; the default one is made (random init) when absent."""
    if not os.path.exists(cfg.model_dir) and cfg.model_dir == DEFAULT_MODEL_DIR:
        make_base_checkpoint(cfg.model_dir, seed=cfg.seed)
        print(f"made a randomly initialised tiny LLaMA base checkpoint in {cfg.model_dir} "
              "(no pretrained weights ship with the project; pass --model DIR for your own)")
    return cfg.model_dir


def build(cfg: FinetuneConfig):
    """(model, optimizer, scheduler, loss_fn, tokenizer) for ``cfg``, from its base checkpoint."""
    torch.manual_seed(cfg.seed)   # LoRA's initial A matrices (and dropout) are seeded
    base = load_base(ensure_base(cfg), cfg.base_dtype)
    tokenizer = load_tokenizer(cfg.model_dir, base)
    model = prepare_model(base, cfg)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.warmup_steps, cfg.schedule_length, cfg.min_lr_ratio))
    return model, optimizer, scheduler, ResponseLoss(cfg.attention_mask), tokenizer


def finetune(cfg: FinetuneConfig, plan: Plan | None = None, *, world=None, run: RunOptions | None = None,
             save: bool = True) -> FinetuneResult:
    """Train ``cfg`` (``plan``: default the config's ``plan:``) and, on rank 0, save the result into
    ``cfg.out/model`` so plain transformers loads it. With ``run`` (recipes/common.py's
    ``prepare_run``): the run directory's log, evaluations, checkpoints and ``--resume``."""
    plan = plan or Plan.from_dict(cfg.plan)
    lead = world is None or world.rank == 0
    if world is not None:   # one rank makes the default base checkpoint, the others wait for it
        if lead:
            ensure_base(cfg)
        torch.distributed.barrier()
    model, optimizer, scheduler, loss_fn, tokenizer = build(cfg)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in model.parameters())
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=loss_fn)

    train_pairs, val_pairs = split_pairs(load_pairs(cfg.data), seed=cfg.seed)
    val_batches = list(InstructionBatches(val_pairs, min(cfg.batch_size, len(val_pairs)), cfg.seq_len,
                                          seed=cfg.seed, num_batches=cfg.eval_batches, tokenizer=tokenizer))
    val_before = evaluate(model, loss_fn, val_batches)
    batches = InstructionBatches(train_pairs, cfg.batch_size, cfg.seq_len, seed=cfg.seed, tokenizer=tokenizer)

    lrs, grad_norms = [], []

    def observe(record: dict) -> None:
        lrs.append(record["lr"])
        if "grad_clip:grad_norm" in step.metrics:   # the norm before clipping, as clip_grad_norm_ returns
            record["grad_norm"] = step.metrics["grad_clip:grad_norm"].item()
            grad_norms.append(record["grad_norm"])

    loop = train_loop(step, batches, steps=cfg.steps, world=world, scheduler=scheduler,
                      desc=f"finetune {cfg.method}", items_per_step=cfg.batch_size * cfg.seq_len, run=run,
                      evaluate=lambda: evaluate(model, loss_fn, val_batches), on_step=observe)
    val_after = evaluate(model, loss_fn, val_batches)
    result = FinetuneResult(loop.losses, val_before, val_after, None, None, n_trainable, n_total,
                            step_state_bytes(step.last.program), loop.train_seconds, loop.compile_seconds or 0.0,
                            None, step.summary(), lrs, grad_norms, loop.evals)
    if lead:
        write_convergence(Path(cfg.out), {"config": cfg.to_dict(), "steps": cfg.steps, "losses": loop.losses,
                                          "val_loss_before": val_before, "val_loss_after": val_after,
                                          "evals": loop.evals}, title=f"finetune {cfg.method}")
    if save and lead:
        save_and_check(cfg, plan, model, tokenizer, loss_fn, val_batches, result)
    return result


def save_and_check(cfg: FinetuneConfig, plan: Plan, model, tokenizer, loss_fn, val_batches,
                   result: FinetuneResult) -> None:
    """``save_pretrained`` into ``cfg.out/model`` (LoRA merged), its config and numbers beside it in
    ``finetune.json``, then the directory loaded back by plain transformers."""
    result.output_dir = str(Path(cfg.out) / MODEL_DIR)
    check_batch = val_batches[0]
    with torch.no_grad():
        model.eval()
        logits = model(input_ids=check_batch["input_ids"], attention_mask=check_batch["attention_mask"]).logits
    save_finetuned(model, result.output_dir, tokenizer)
    result.reloaded_val_loss, result.reload_max_logit_diff = check_reload(
        result.output_dir, val_batches, loss_fn, check_batch, logits)
    with open(os.path.join(result.output_dir, "finetune.json"), "w", encoding="utf-8") as f:
        json.dump({"config": cfg.to_dict(), "plan": plan.to_dict(), "result": result.to_json()}, f, indent=1)


def check_reload(model_dir, val_batches, loss_fn, batch, logits) -> tuple[float, float]:
    """Load the saved directory with plain transformers: its validation loss and logit difference."""
    from transformers import AutoModelForCausalLM
    reloaded = AutoModelForCausalLM.from_pretrained(model_dir)
    reloaded.eval()
    with torch.no_grad():
        again = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    real = batch["attention_mask"].bool()
    diff = (again.float() - logits.float())[real].abs().max().item()
    return evaluate(reloaded, loss_fn, val_batches), diff


def describe(cfg: FinetuneConfig, result: FinetuneResult) -> str:
    s = result.state
    mib = 2 ** 20
    lines = [
        result.summary,
        f"method {cfg.method}: {result.trainable_params:,} of {result.total_params:,} parameters train "
        f"({100 * result.trainable_params / result.total_params:.2f}%)",
        f"step graph holds: trainable params {s.trainable_param_bytes / mib:.3f} MiB, frozen params "
        f"{s.frozen_param_bytes / mib:.3f} MiB, gradients {s.gradient_bytes / mib:.3f} MiB, "
        f"optimizer state {s.optimizer_state_bytes / mib:.3f} MiB",
        f"response-token loss: first step {result.losses[0]:.3f}, last 10 steps "
        f"{sum(result.losses[-10:]) / len(result.losses[-10:]):.3f}; validation {result.val_loss_before:.3f} -> "
        f"{result.val_loss_after:.3f}",
        f"{len(result.losses)} steps; this process's first step, with compilation: "
        f"{result.first_step_seconds:.1f}s, the rest {result.seconds:.1f}s",
    ]
    if result.output_dir:
        lines.append(f"saved to {result.output_dir} (plain transformers loads it"
                     f"{'; LoRA merged, adapter in ' + os.path.join(result.output_dir, 'adapter') if cfg.method == 'lora' else ''}): "
                     f"reloaded validation loss {result.reloaded_val_loss:.3f}, max logit difference "
                     f"{result.reload_max_logit_diff:.2e}")
    return "\n".join(lines)
