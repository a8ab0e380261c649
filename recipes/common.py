"""The recipe launcher: what every recipe's training command shares, written once with the public API.

A recipe keeps its own model, data, loss, optimizer and evaluation; this module holds the rest:

- :func:`add_training_args`: ``--plan --steps --batch-size --lr --backend --seed --threads`` and the
  run-management flags ``--out --resume --save-every --eval-every --log --schedule-steps``, each
  checked by its type (a bad value is one line, exit status 2) and shown with its default in
  ``--help``; :func:`writable_dir` checks an output directory before training starts;
- :func:`prepare`: the plan file (a bad one, or a multi-rank plan without torchrun, exits with one
  line, status 2), ``--backend``, and the run directory: ``--log``'s package, ``--resume``'s
  checkpoint and ``--out``'s writability, all before any work, so a refused command writes nothing;
- :func:`launch`: runs ``train(world)`` in one process, or under torchrun / a ``dp > 1`` plan
  inside ``init_distributed`` (``world`` is then the rank's view of the mesh, else ``None``);
- :func:`warmup_cosine`: linear warmup then cosine decay to a floor; the compiled step reads the
  optimizer's ``lr`` on every call, so a schedule never recompiles;
- :func:`train_loop`: the compiling phase (capture, passes, lowering, timed), then one compiled step
  per global batch (each rank on its data-parallel share) with a progress bar (the last step's loss,
  throughput, peak memory, GFLOP/s), the metrics log, evaluation every ``--eval-every`` steps and
  checkpoints every ``--save-every`` steps; resumes bitwise from ``--resume`` (recipes/run_dir.py
  says what that takes);
- :func:`write_convergence`: ``loss.png`` and ``metrics.json``.

GFLOP/s is the cost model's FLOPs of the compiled step over the step's seconds; MFU divides it by the
plan's device profile's matrix rate (on a CPU, a 512x256x1024 fp32 matmul measured once per CPU and
thread count, so an estimate: steps whose matmuls run faster than that one show above 100%).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cann_passes import Plan, PlanError
from recipes.run_dir import (LOG_KINDS, TrainerState, MetricsLog, checkpoint_name, checkpoints, drop_later_checkpoints,
                             load_trainer_state, log_unavailable, resolve_resume, rng_state, save_trainer_state,
                             set_rng_state, write_config, CHECKPOINTS)


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


def _blocked(directory: str | Path) -> str | None:
    """Why ``directory`` could not be made or written, judged from its nearest existing ancestor
    without making anything (:func:`unwritable` then makes it and writes a probe)."""
    directory = Path(directory).expanduser()
    nearest = next((p for p in [directory, *directory.parents] if p.exists()), None)
    if nearest is None:
        return None
    if not nearest.is_dir():
        return f"{str(nearest)!r} is not a directory"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return f"cannot write into {str(nearest)!r} (permission denied)"
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


def resume_value(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("give 'latest' or a checkpoint directory")
    return text


def add_training_args(p: argparse.ArgumentParser, *, plan: str | Path, steps: int, batch_size: int,
                      lr: float, out: str | Path) -> argparse.ArgumentParser:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter    # every --help line shows its default
    p.add_argument("--plan", default=str(plan), help="plan file (YAML or JSON)")
    p.add_argument("--steps", type=positive_int, default=steps, help="optimizer steps (a resumed run: in all)")
    p.add_argument("--batch-size", type=positive_int, default=batch_size, help="global batch size (rows)")
    p.add_argument("--lr", type=positive_float, default=lr, help="peak learning rate (warmup, then cosine)")
    p.add_argument("--backend", type=backend_name, default=None,
                   help="override the plan's backend (auto, eager, inductor, torchair)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    # The CPU-sized models' ops are too small to share across cores, and on a busy machine a
    # second intra-op thread mostly waits for one: BERT's command ran 3.7x faster with one.
    p.add_argument("--threads", type=positive_int, default=1,
                   help="intra-op CPU threads per process (torch.set_num_threads)")
    p.add_argument("--out", default=str(out),
                   help="run directory: config.yaml, metrics.jsonl, checkpoints/, loss.png, metrics.json")
    p.add_argument("--resume", type=resume_value, default=None, metavar="latest|PATH",
                   help="continue from a checkpoint: 'latest' (the newest under OUT/checkpoints) or its directory")
    p.add_argument("--save-every", type=positive_int, default=None, metavar="N",
                   help="checkpoint into OUT/checkpoints every N steps and after the last")
    p.add_argument("--eval-every", type=positive_int, default=None, metavar="N",
                   help="validation loss every N steps, into the metrics log")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an OUT that holds an earlier run's checkpoints (removing them)")
    p.add_argument("--log", choices=LOG_KINDS, default="jsonl",
                   help="metrics log: OUT/metrics.jsonl, or TensorBoard events in OUT/tensorboard")
    # A LambdaLR checkpoints its position but not its shape: a run meant to be continued past
    # --steps names the schedule's length here, so that the continued run repeats it exactly.
    p.add_argument("--schedule-steps", type=positive_int, default=None, metavar="N",
                   help="length of the LR schedule (default: --steps)")
    return p


def schedule_steps(args: argparse.Namespace) -> int:
    """The LR schedule's length: ``--schedule-steps``, else ``--steps``."""
    return args.schedule_steps or args.steps


@dataclass
class RunOptions:
    """The run directory and what the loop does in it (made by :func:`prepare_run`)."""

    out: Path
    resume: Path | None = None
    save_every: int | None = None
    eval_every: int | None = None
    log: str = "jsonl"
    schedule_steps: int | None = None
    args: dict = field(default_factory=dict)      # every argument, for config.yaml


def prepare_run(args: argparse.Namespace, prog: str, also_writable: tuple[tuple[str | Path, str], ...] = ()
                ) -> RunOptions:
    """The run directory's flags checked before any work (each refusal one line, exit status 2, and
    nothing written): ``--log``'s package, ``--resume``'s checkpoint, then the writability of
    ``--out`` and of each ``(directory, flag)`` in ``also_writable`` (the checks that make directories last)."""
    problem = log_unavailable(args.log)
    if problem:
        usage_error(prog, problem)
    out = Path(args.out).expanduser()
    resume, problem = resolve_resume(args.resume, out)
    if problem:
        usage_error(prog, problem)
    earlier = checkpoints(out) if out.is_dir() else []
    if resume is None and earlier and not getattr(args, "overwrite", False):
        # never a silent loss of a run's checkpoints: the user says which history this run continues
        usage_error(prog, f"--out {str(out)!r} holds checkpoints of an earlier run (newest: step {earlier[-1][0]}); "
                          "--resume latest continues it, --overwrite starts afresh (removing them), or "
                          "choose another --out")
    if resume is not None:
        saved = load_trainer_state(resume, 0)
        if saved.step > args.steps:
            usage_error(prog, f"--resume {args.resume}: its checkpoint is at step {saved.step}, past --steps "
                              f"{args.steps} (--steps counts every step, the resumed ones too)")
        if saved.schedule_steps not in (None, schedule_steps(args)):
            print(f"{prog}: note: the checkpoint's run scheduled its LR over {saved.schedule_steps} steps, this one "
                  f"over {schedule_steps(args)}: the steps after {saved.step} follow the new schedule "
                  f"(--schedule-steps {saved.schedule_steps} repeats the old one)", file=sys.stderr)
    wanted = ((out, "--out"), *also_writable)
    for directory, flag in wanted:      # first without making anything: a later refusal leaves no directory
        problem = _blocked(directory)
        if problem:
            usage_error(prog, f"{flag} {str(directory)!r}: {problem}")
    for directory, flag in wanted:
        writable_dir(directory, flag, prog)
    return RunOptions(out, resume, args.save_every, args.eval_every, args.log, schedule_steps(args), vars(args))


def prepare(args: argparse.Namespace, prog: str, also_writable: tuple[tuple[str | Path, str], ...] = ()
            ) -> tuple[Plan, RunOptions]:
    """The plan and the run directory, every flag checked (see :func:`load_plan`, :func:`prepare_run`)."""
    plan = load_plan(args, prog)
    return plan, prepare_run(args, prog, also_writable)


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
    losses: list[float] = field(default_factory=list)   # every step, a resumed run's earlier ones too
    compile_seconds: float | None = None      # capture + passes + lowering (+ loading) + the first step
    train_seconds: float = 0.0                # every later step of this process
    start_step: int = 0                       # where this process began (a resumed run: the checkpoint's)
    evals: list[dict] = field(default_factory=list)     # {"step": s, "val_...": v} at --eval-every
    checkpoints: list[Path] = field(default_factory=list)


def batches_from(batches: Iterable, start: int) -> Iterator:
    """The batches from batch ``start`` on: indexed where the iterator allows (``batch(k)``), else
    drawn and dropped, which is what a seeded iterator needs to give the same later batches."""
    if hasattr(batches, "batch"):
        return (batches.batch(k) for k in itertools.count(start))
    return itertools.islice(iter(batches), start, None)


def peak_memory_bytes(step) -> int:
    """The peak memory of this process: the accelerator's allocator where the model lives on one, else
    the peak resident set (``getrusage``), which is what the operating system had to give."""
    device = next(step.model.parameters()).device
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024     # macOS reports bytes, Linux KiB


def _eval_record(step_number: int, value) -> dict:
    values = value if isinstance(value, dict) else {"loss": value}
    return {"step": step_number, **{f"val_{k}": float(v) for k, v in values.items()}}


def _compilation(step):
    """The step's latest compilation, or None before it compiled."""
    try:
        return step.last
    except RuntimeError:
        return None


def _show_compilation(step, seconds: float, what: str, write: Callable[[str], Any] = print) -> None:
    comp = step.last
    if comp.cache.startswith("hit"):    # the captured step and the program were read, not made
        made = f"captured step and {len(comp.records)} passes' program from the compile cache {comp.capture_seconds:.2f}s"
    else:
        passes = sum(r.seconds for r in comp.records)
        made = (f"capture {comp.capture_seconds:.2f}s, {len(comp.records)} passes {passes:.2f}s; compile cache "
                f"{comp.cache or 'miss'}")
    lowering = (f"lowering ({comp.backend}) {comp.compile_seconds:.2f}s" if comp.background is None else
                f"lowering (eager) {comp.compile_seconds:.2f}s, {comp.backend} compiling in the background "
                "(its runners take over between two steps)")
    write(f"{what} in {seconds:.1f}s: {made}, {lowering}")
    sys.stdout.flush()


def train_loop(step, batches: Iterable, *, steps: int, world=None, scheduler=None, desc: str = "",
               items_per_step: int = 0, rate_unit: str = "tok_s", run: RunOptions | None = None,
               evaluate: Callable[[], float | dict] | None = None,
               on_step: Callable[[dict], Any] | None = None) -> LoopResult:
    """Run ``step`` until ``steps`` global batches are done; rank 0 shows the progress and logs.

    With ``run``: ``run.out/config.yaml`` before the first step, a metrics record per step,
    ``evaluate()`` (a float or a dict of held-out metrics) every ``run.eval_every`` steps, a
    checkpoint every ``run.save_every`` steps and after the last (every rank: the save is a
    collective), and from ``run.resume`` the run continues as if it had never stopped.
    ``on_step(record)`` sees each step's record before it is logged and may add the recipe's own
    numbers to it (finetune: the gradient norm, which the progress bar then shows)."""
    from cann_passes.runtime.distributed import shard_batch
    rank, dp_rank, dp_size = ranks(world)
    lead = rank == 0
    run = run or RunOptions(out=Path("."), log="")
    out = LoopResult()

    def local(batch):
        return shard_batch(batch, dp_rank, dp_size) if dp_size > 1 else batch

    trainer = load_trainer_state(run.resume, rank) if run.resume is not None else None
    out.start_step = trainer.step if trainer else 0
    stream = batches_from(batches, out.start_step)
    first = next(stream)
    compile_phase = _begin(step, run, trainer, local(first), scheduler, out, lead, desc)
    compile_phase_shown = _compilation(step) is not None
    log = _open_run_dir(step, run, world, out.start_step) if lead and run.log else None

    flops = _compilation(step).cost.total_flops if compile_phase_shown else 0.0
    peak = peak_flops(step) if flops else 0.0
    bar = tqdm(total=steps, initial=out.start_step, unit="step", dynamic_ncols=True, desc=desc or None,
               disable=not lead)
    start = time.perf_counter()
    try:
        for i in range(out.start_step, steps):
            batch = first if i == out.start_step else next(stream)
            lr = float(step.optimizer.param_groups[0]["lr"])
            t1 = time.perf_counter()
            loss = float(step(local(batch)))
            if scheduler is not None:
                scheduler.step()
            seconds = time.perf_counter() - t1
            out.losses.append(loss)
            if i == out.start_step:
                out.compile_seconds = compile_phase + seconds
                start = time.perf_counter()
                if lead and not compile_phase_shown:     # a plan that splits the batch compiles in its first step
                    _show_compilation(step, out.compile_seconds, "compiled and ran the first step", tqdm.write)
            record = {"step": i + 1, "loss": loss, "lr": lr,
                      f"{_UNITS.get(rate_unit, rate_unit)}_per_s": items_per_step / max(seconds, 1e-9),
                      "seconds": seconds}
            if peak:    # this rank's FLOPs per second over its device profile's matrix rate
                record["mfu"] = flops / max(seconds, 1e-9) / peak
            done = i + 1
            if run.eval_every and evaluate is not None and done % run.eval_every == 0:
                if step.model_stale:
                    step.sync_model()        # ZeRO-3: the model's own parameters are older than the shards
                out.evals.append(_eval_record(done, evaluate()))
                record.update({k: v for k, v in out.evals[-1].items() if k != "step"})
            if on_step is not None:
                on_step(record)
            if log is not None:
                log.write(record)
            if run.save_every and (done % run.save_every == 0 or done == steps):
                out.checkpoints.append(_save(step, run, rank, world, done, scheduler, out))
            bar.set_postfix(_postfix(record, rate_unit, items_per_step, flops, step), refresh=False)
            bar.update()
    finally:
        bar.close()
        if log is not None:
            log.close()
    out.train_seconds = time.perf_counter() - start
    if step.model_stale:
        step.sync_model()      # ZeRO-3 keeps parameter shards; gather them for evaluation
    if lead and out.losses:
        print(describe_losses(out.losses))
    return out


_UNITS = {"tok_s": "tokens", "img_s": "images"}


def _begin(step, run: RunOptions, trainer: TrainerState | None, first, scheduler, out: LoopResult, lead: bool,
           desc: str) -> float:
    """The compiling phase, and from a checkpoint everything the loop restores; its seconds."""
    from cann_passes.runtime import checkpoint
    if lead:
        print(f"{desc or 'training'}: compiling the step (capture, passes, lowering)"
              + (f" and loading {run.resume}" if trainer else "") + " ...", flush=True)
    t0 = time.perf_counter()
    if trainer:
        # compiles first (the state to fill must exist), for the batch the step will compile for
        with _quiet_single_process_dcp():
            checkpoint.load(step, run.resume, _compiled_part(step.plan, first))
        if scheduler is not None and trainer.scheduler is not None:
            scheduler.load_state_dict(trainer.scheduler)
        set_rng_state(trainer.rng)            # after compiling, which may draw
        out.losses, out.evals = list(trainer.losses), list(trainer.evals)
    elif _compiles_whole_batch(step.plan):
        step.compile(first)
    seconds = time.perf_counter() - t0
    if lead and _compilation(step) is not None:
        _show_compilation(step, seconds, f"compiled and resumed at step {out.start_step}" if trainer else "compiled")
    return seconds


def _open_run_dir(step, run: RunOptions, world, start_step: int) -> MetricsLog:
    """Rank 0, before the first step: the run's history from ``start_step`` on made its own,
    ``config.yaml`` written, the metrics log opened."""
    dropped = drop_later_checkpoints(run.out, start_step)
    if dropped:
        print(f"removed {len(dropped)} checkpoint(s) of an earlier run past step {start_step} "
              f"from {run.out / CHECKPOINTS}", flush=True)
    write_config(run.out, plan=step.plan.to_dict(), args=run.args, backend=step.backend,
                 world_size=world.world_size if world else 1, resumed_from=run.resume, start_step=start_step)
    return MetricsLog(run.out, run.log, start_step)


def _compiles_whole_batch(plan: Plan) -> bool:
    """Whether the step compiles for the batch it is given (not for microbatches or pipeline stages)."""
    return plan.pp == 1 and plan.microbatches == 1 and plan.accumulate_target is None


def _compiled_part(plan: Plan, batch):
    """The part of ``batch`` the step compiles for: with ``microbatches`` N, the first of N."""
    if plan.microbatches == 1:
        return batch
    import torch.utils._pytree as pytree
    return pytree.tree_map(lambda t: t[: t.shape[0] // plan.microbatches] if isinstance(t, torch.Tensor) else t,
                           batch)


def peak_flops(step) -> float:
    """FLOP/s of the plan's device profile's matrix unit at the plan's precision (the CPU's is
    measured once per CPU and thread count, then read from its cache): the denominator of MFU."""
    from cann_passes.cost_model import get_profile
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(step.plan.precision, torch.float32)
    try:
        return get_profile(step.plan.device_profile).matrix_rate(dtype)
    except (ValueError, KeyError):
        return 0.0


def _postfix(record: dict, rate_unit: str, items_per_step: int, flops: float, step) -> dict:
    shown = {"loss": f"{record['loss']:.3f}"}
    if items_per_step:
        shown[rate_unit] = f"{items_per_step / max(record['seconds'], 1e-9):,.0f}"
    shown["peak"] = f"{peak_memory_bytes(step) / 2**20:,.0f}MiB"
    if flops:
        shown["GFLOP_s"] = f"{flops / 1e9 / max(record['seconds'], 1e-9):.1f}"
    if "mfu" in record:
        shown["MFU"] = f"{100 * record['mfu']:.1f}%"
    if "grad_norm" in record:
        shown["grad_norm"] = f"{record['grad_norm']:.2f}"
    if "val_loss" in record:
        shown["val"] = f"{record['val_loss']:.3f}"
    return shown


def describe_losses(losses: list[float], last: int = 10) -> str:
    """The end-of-run summary line, every number labelled."""
    k = min(last, len(losses))
    return (f"loss: first step {losses[0]:.3f}, last step {losses[-1]:.3f} "
            f"(mean of last {k}: {sum(losses[-k:]) / k:.3f}) over {len(losses)} steps")


@contextlib.contextmanager
def _quiet_single_process_dcp():
    """In one process DCP saves and loads without a process group, and warns that it does each time."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _save(step, run: RunOptions, rank: int, world, done: int, scheduler, out: LoopResult) -> Path:
    """A checkpoint after step ``done``: the collective save, then each rank's loop state; rank 0's
    file last, once every rank's part is on disk, marks it finished."""
    from cann_passes.runtime import checkpoint
    path = run.out / CHECKPOINTS / checkpoint_name(done)
    with _quiet_single_process_dcp():
        checkpoint.save(step, path)
    state = TrainerState(step=done, losses=list(out.losses), evals=list(out.evals),
                         scheduler=scheduler.state_dict() if scheduler is not None else None,
                         schedule_steps=run.schedule_steps, rng=rng_state())
    if rank != 0:
        save_trainer_state(path, rank, state)
    if world is not None:
        torch.distributed.barrier()
    if rank == 0:
        save_trainer_state(path, rank, state)
    return path


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
