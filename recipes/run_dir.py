"""A training run's output directory: its resolved config, metrics log and checkpoints, and resuming.

    DIR/config.yaml                the plan as resolved, every argument, the seed and the world size,
                                   written before the first step
    DIR/metrics.jsonl              one line per step: step, loss, lr, <unit>_per_s, seconds (val_* added
                                   on the steps --eval-every evaluates); --log tensorboard: DIR/tensorboard/
    DIR/checkpoints/step-NNNNNN/   cann_passes.runtime.checkpoint's files (model, optimizer, the compiled
                                   step's own state) and trainer.rank<R>.pt: the loop's state on rank R
    DIR/loss.png, DIR/metrics.json the convergence figure and the run's numbers (written by the recipe)

Resuming is bitwise: a run continued from step ``s`` gives the losses and parameters of the run that
never stopped. What that takes, and who keeps each part:

- parameters, optimizer state, the step count and the step's persistent state (fp16 loss scale):
  ``cann_passes.runtime.checkpoint`` (a collective save, any mesh);
- the LR schedule's position (``LambdaLR.state_dict``), the loss history and every RNG the process
  draws from (torch, Python's ``random``, numpy): ``trainer.rank<R>.pt``, one per rank, because
  each rank's generators are its own;
- the data order: the batch iterators are seeded, so the loop starts them at batch ``s`` (indexing
  where the iterator can, else drawing and dropping ``s`` batches);
- the LR schedule's shape: a ``LambdaLR`` keeps its position but not its function, which the
  command rebuilds from ``--schedule-steps``; the resumed run must give the same one.

A checkpoint counts once ``trainer.rank0.pt`` is written, after the collective save has returned on
every rank, so an interrupted save is never what ``--resume latest`` picks.
"""
from __future__ import annotations

import json
import random
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS = "checkpoints"
METRICS_LOG = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
TRAINER_STATE = "trainer.rank{rank}.pt"
LOG_KINDS = ("jsonl", "tensorboard")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def is_checkpoint(path: Path) -> bool:
    """A finished checkpoint: DCP's metadata and rank 0's loop state (written last)."""
    return (path / ".metadata").is_file() and (path / TRAINER_STATE.format(rank=0)).is_file()


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every finished checkpoint under ``out/checkpoints``, oldest first."""
    found = []
    for path in (out / CHECKPOINTS).glob("step-*"):
        step = path.name.removeprefix("step-")
        if step.isdigit() and is_checkpoint(path):
            found.append((int(step), path))
    return sorted(found)


def resolve_resume(value: str | None, out: Path) -> tuple[Path | None, str | None]:
    """(the checkpoint ``--resume value`` names, why it names none): ``latest`` is the newest
    finished checkpoint under ``out/checkpoints``."""
    if value is None:
        return None, None
    if value == "latest":
        found = checkpoints(out)
        if not found:
            return None, (f"--resume latest: no checkpoint under {str(out / CHECKPOINTS)!r} "
                          "(a run saves them with --save-every N)")
        return found[-1][1], None
    path = Path(value).expanduser()
    if not is_checkpoint(path):
        return None, (f"--resume {value!r}: not a checkpoint (give 'latest' or a DIR/{CHECKPOINTS}/step-NNNNNN "
                      f"directory holding .metadata and {TRAINER_STATE.format(rank=0)})")
    return path, None


def log_unavailable(kind: str) -> str | None:
    """Why ``--log kind`` cannot work here, or None."""
    if kind == "tensorboard":
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError as exc:
            missing = getattr(exc, "name", None) or "tensorboard"
            return (f"--log tensorboard: needs the {missing!r} package, which does not import here "
                    f"(pip install tensorboard, or use --log jsonl)")
    return None


# -- the loop's own state ------------------------------------------------------------------------
@dataclass
class TrainerState:
    step: int                                   # optimizer steps done
    losses: list[float]                         # one per step done, for the figure and summary
    scheduler: dict | None                      # LambdaLR.state_dict(): its position, not its function
    schedule_steps: int | None
    rng: dict = field(default_factory=dict)
    evals: list[dict] = field(default_factory=list)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if "numpy" in sys.modules:          # only a process that imported numpy can have drawn from it
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy
        numpy.random.set_state(state["numpy"])


def save_trainer_state(path: Path, rank: int, state: TrainerState) -> None:
    torch.save(asdict(state), path / TRAINER_STATE.format(rank=rank))


def load_trainer_state(path: Path, rank: int) -> TrainerState:
    """Rank ``rank``'s loop state; a run on more ranks than saved takes rank 0's (the ranks draw alike)."""
    own = path / TRAINER_STATE.format(rank=rank)
    file = own if own.is_file() else path / TRAINER_STATE.format(rank=0)
    return TrainerState(**torch.load(file, weights_only=False))


def drop_later_checkpoints(out: Path, step: int) -> list[Path]:
    """Remove the checkpoints after ``step``: a run starting there makes a new history, and an older
    run's later checkpoint must not be what ``--resume latest`` picks. The paths removed."""
    later = [path for s, path in checkpoints(out) if s > step]
    for path in later:
        shutil.rmtree(path)
    return later


# -- config and metrics --------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def write_config(out: Path, *, plan: dict, args: dict, backend: str, world_size: int,
                 resumed_from: Path | None, start_step: int) -> Path:
    import yaml
    config = {"plan": plan, "backend": backend, "args": args, "seed": args.get("seed"),
              "world_size": world_size, "resumed_from": resumed_from, "start_step": start_step}
    path = out / CONFIG_FILE
    path.write_text(yaml.safe_dump(_plain(config), sort_keys=False))
    return path


class MetricsLog:
    """One record per step into ``DIR/metrics.jsonl`` or TensorBoard; a resumed run keeps the earlier
    run's records up to its start step and replaces the rest."""

    def __init__(self, out: Path, kind: str, start_step: int):
        self.kind, self.writer, self.file = kind, None, None
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1)
            return
        path = out / METRICS_LOG
        kept = []
        if start_step and path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
        self.file = path.open("w")
        self.file.writelines(line + "\n" for line in kept)
        self.file.flush()

    def write(self, record: dict) -> None:
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
        else:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()      # a run that is killed keeps every step it logged

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.file is not None:
            self.file.close()
