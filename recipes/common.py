"""What every recipe's training command shares: arguments, the plan, the launch, the loop, the figure.

A recipe keeps its own model, data, loss, optimizer and evaluation; this module holds the parts
that are the same for all of them, written once, with the public API only:

- :func:`add_training_args`: ``--plan --steps --batch-size --lr --backend --seed --threads``,
  each checked by its type (a bad value is one line, exit status 2) and shown with its default
  in ``--help``; :func:`writable_dir` checks an output directory before training starts;
- :func:`load_plan`: the plan file (a bad one, or a multi-rank plan without torchrun, exits with
  one line, status 2) and ``--backend``;
- :func:`launch`: runs ``train(world)`` in one process, or under torchrun / a ``dp > 1`` plan
  inside ``init_distributed`` (``world`` is then the rank's view of the mesh, else ``None``);
- :func:`warmup_cosine`: linear warmup then cosine decay to a floor; the compiled step reads the
  optimizer's ``lr`` on every call, so a schedule never recompiles;
- :func:`train_loop`: one compiled step per global batch (each rank on its data-parallel share),
  a progress bar with the loss and throughput, the first step's seconds (capture + passes +
  lowering) kept apart from the training time;
- :func:`write_convergence`: ``loss.png`` and ``metrics.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cann_passes import Plan, PlanError


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a bad one is argparse's one line, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def backend_name(text: str) -> str:
    try:
        Plan(backend=text)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("plan field 'backend' = ")) from None
    return text


def unwritable(directory: str | Path) -> str | None:
    """Why this process cannot write into ``directory`` (made now if missing), or None."""
    directory = Path(directory).expanduser()
    blocker = next((p for p in [directory, *directory.parents] if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        return f"{str(blocker)!r} is not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"cannot write into {str(directory)!r} ({exc.strerror or exc})"
    return None


def writable_dir(path: str | Path, flag: str, prog: str) -> Path:
    """``path`` as a directory this process can write into, made now, or the one-line refusal
    (exit status 2) naming ``flag``: checked before training, so no run finishes unable to save."""
    problem = unwritable(path)
    if problem is not None:
        usage_error(prog, f"{flag} {str(path)!r}: {problem}")
    return Path(path)


def usage_error(prog: str, message: str) -> None:
    """Bad input to a command: one line on stderr, exit status 2 (argparse's convention)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def add_training_args(p: argparse.ArgumentParser, *, plan: str | Path, steps: int, batch_size: int,
                      lr: float) -> argparse.ArgumentParser:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter    # every --help line shows its default
    p.add_argument("--plan", default=str(plan), help="plan file (YAML or JSON)")
    p.add_argument("--steps", type=positive_int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=batch_size, help="global batch size (rows)")
    p.add_argument("--lr", type=positive_float, default=lr, help="peak learning rate (warmup, then cosine)")
    p.add_argument("--backend", type=backend_name, default=None,
                   help="override the plan's backend (auto, eager, inductor, torchair)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    # The CPU-sized models' ops are too small to share across cores, and on a busy machine a
    # second intra-op thread mostly waits for one: BERT's command ran 3.7x faster with one.
    p.add_argument("--threads", type=positive_int, default=1,
                   help="intra-op CPU threads per process (torch.set_num_threads)")
    return p


def load_plan(args: argparse.Namespace, prog: str) -> Plan:
    try:
        plan = Plan.load(args.plan)
        plan = plan.replace(backend=args.backend) if args.backend else plan
    except PlanError as exc:     # a bad plan file is the user's input: one line, not a traceback
        usage_error(prog, str(exc))
    ranks_needed = plan.dp * plan.tp * plan.pp
    if ranks_needed > 1 and "WORLD_SIZE" not in os.environ:
        module = prog.removeprefix("python -m ") if prog.startswith("python -m ") else "<recipe>"
        usage_error(prog, f"the plan {args.plan} runs on {ranks_needed} ranks (dp={plan.dp}, tp={plan.tp}, "
                          f"pp={plan.pp}); launch it with `.venv/bin/torchrun --standalone --nproc-per-node "
                          f"{ranks_needed} -m {module} --plan {args.plan} ...`")
    return plan


def launch(plan: Plan, train: Callable[[Any], Any], threads: int | None = None):
    """``train(world)``: inside ``init_distributed`` when torchrun launched us or the plan needs ranks;
    with ``threads`` intra-op threads (restored afterwards) when given."""
    from cann_passes.runtime.distributed import init_distributed
    if threads is not None and threads < 1:
        usage_error("recipe", f"--threads must be at least 1, got {threads}")
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or plan.dp * plan.tp * plan.pp > 1
    previous = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        with (init_distributed(plan) if launched else contextlib.nullcontext()) as world:
            return train(world)
    finally:
        torch.set_num_threads(previous)


def ranks(world) -> tuple[int, int, int]:
    """``(rank, dp_rank, dp_size)`` of this process (``world=None``: the one process)."""
    return (world.rank, world.dp_rank, world.dp_size) if world else (0, 0, 1)


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int, *, warmup: int = 1,
                  floor: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``floor`` times the peak at ``steps``."""
    warmup = max(1, warmup)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))


@dataclass
class LoopResult:
    losses: list[float] = field(default_factory=list)
    compile_seconds: float | None = None      # the first step: capture + passes + lowering + one step
    train_seconds: float = 0.0                # every later step


def train_loop(step, batches: Iterable, *, steps: int, world=None, scheduler=None, desc: str = "",
               items_per_step: int = 0, rate_unit: str = "tok_s") -> LoopResult:
    """Run ``step`` on ``steps`` global batches; rank 0 shows the progress bar."""
    from cann_passes.runtime.distributed import shard_batch
    rank, dp_rank, dp_size = ranks(world)
    bar = tqdm(total=steps, unit="step", dynamic_ncols=True, desc=desc or None, disable=rank != 0)
    out, start = LoopResult(), time.perf_counter()
    for i, batch in zip(range(steps), batches):
        t0 = time.perf_counter()
        loss = step(shard_batch(batch, dp_rank, dp_size) if dp_size > 1 else batch)
        if scheduler is not None:
            scheduler.step()
        out.losses.append(float(loss))
        if out.compile_seconds is None:
            out.compile_seconds = time.perf_counter() - t0
            start = time.perf_counter()
        elif i % 5 == 0:
            rate = items_per_step * i / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix({"loss": f"{out.losses[-1]:.3f}", rate_unit: f"{rate:,.0f}"})
        bar.update()
    bar.close()
    out.train_seconds = time.perf_counter() - start
    if step.plan.zero_stage == 3:
        step.sync_model()      # ZeRO-3 keeps parameter shards; gather them for evaluation
    return out


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
