"""Gradient accumulation at run time: the microbatch loop over the program's grad and apply graphs.

The ``grad_accumulation`` pass rewrites the whole step so that the optimizer
reads ``scale * acc`` where ``acc = acc_in + weight * grad`` is runtime-owned
step state; the ``split_grad_apply`` pass cuts it into a "grad" graph (run
once per microbatch) and an "apply" graph (run once per optimizer step), and
the program's flows name the accumulators that pass from one to the other.

Weights are sample counts, so ``acc`` holds the gradient of the *summed*
loss, and ``scale = 1 / samples`` (over all data-parallel ranks) turns it
into the gradient of the mean over every sample of the optimizer step,
whatever the microbatch sizes were.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.utils._pytree as pytree

from graph_ir.meta import ACCUMULATION_FIRST, ACCUMULATION_SCALE, ACCUMULATION_WEIGHT
from graph_ir.signature import InputKind


class AccumulationError(RuntimeError):
    pass


def _accumulator_names(program) -> set[str]:
    return {f.input.name for f in program.flows_between("grad", "apply")}


# -- batches --------------------------------------------------------------------------------------

def batch_rows(batch: Any) -> int:
    leaves = pytree.tree_leaves(batch)
    return int(leaves[0].shape[0])


def split_batch(batch: Any, n: int) -> list:
    leaves, spec = pytree.tree_flatten(batch)
    rows = leaves[0].shape[0]
    if rows % n:
        raise ValueError(f"plan field 'microbatches' = {n}: a batch of {rows} rows does not split into "
                         f"{n} equal microbatches (rule: the batch size must be a multiple of microbatches)")
    pieces = [leaf.chunk(n) for leaf in leaves]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(n)]


@contextlib.contextmanager
def full_shape_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, shards):
    """Capture traces the unsharded step: stand in full-shape (zero-stride) state for the optimizer
    state entries that are this rank's shards (the ShardStore knows which, and their placements)."""
    swapped = []
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        state = optimizer.state.get(p, {})
        for key, value in list(state.items()):
            spec_key = f"{InputKind.OPT_STATE.value}:{names[id(p)]}:{key}"
            if shards is not None and shards.holds(spec_key, value):
                placement = shards.placements[spec_key]
                state[key] = torch.zeros((), dtype=value.dtype, device=value.device).expand(placement.shape)
                swapped.append((state, key, value))
    try:
        yield
    finally:
        for state, key, value in swapped:
            state[key] = value


# -- the loop -------------------------------------------------------------------------------------

class AccumulationState:
    """Microbatches seen since the last optimizer step, and what each optimizer step consumed."""

    def __init__(self, plan):
        self.plan = plan
        self.target = plan.accumulate_target
        self.pending_samples = 0          # over all data-parallel ranks
        self.pending_microbatches = 0
        self.history: list[int] = []      # samples per completed optimizer step

    def _global(self, step, samples: int) -> int:
        if step.world is None or step.world.dp_size == 1:
            return samples
        count = torch.tensor([samples], dtype=torch.int64)
        torch.distributed.all_reduce(count, group=step.world.group("dp"))
        return int(count.item())

    def _grad(self, step, batch, first: bool) -> torch.Tensor:
        comp = step.compile(batch)
        if not comp.parts:
            raise AccumulationError("the compiled program has no grad and apply graphs; a plan pipeline given "
                                    "as text must include grad_accumulation and split_grad_apply when "
                                    "microbatches > 1 or accumulate_target is set")
        step.step_state.values[ACCUMULATION_WEIGHT] = torch.tensor(float(batch_rows(batch)))
        step.step_state.values[ACCUMULATION_FIRST] = torch.tensor(1.0 if first else 0.0)
        return step._run(comp.program["grad"], comp.runners["grad"], batch)

    def _apply(self, step, samples: int) -> None:
        comp = step.last
        step.step_state.values[ACCUMULATION_SCALE] = torch.tensor(1.0 / samples)
        step._run(comp.program["apply"], comp.runners["apply"], None)
        for name in _accumulator_names(comp.program):
            step.step_state.values.pop(name, None)
        self.history.append(samples)
        self.pending_samples = self.pending_microbatches = 0
        step.steps_run += 1
        step.optimizer._opt_called = True  # LR schedulers check that the optimizer stepped
        step.metrics["accumulated_samples"] = torch.tensor(samples)

    def discard(self, step) -> None:
        """Forget the gradients accumulated since the last optimizer step."""
        if step._compiled:
            for name in _accumulator_names(step.last.program):
                step.step_state.values.pop(name, None)
        self.pending_samples = self.pending_microbatches = 0

    def static_step(self, step, batches: list) -> torch.Tensor:
        if not batches:
            raise ValueError("accumulate() needs at least one microbatch")
        losses, rows = [], []
        try:
            for i, batch in enumerate(batches):
                losses.append(self._grad(step, batch, first=i == 0))
                rows.append(batch_rows(batch))
        except BaseException:
            # Nothing is applied from a failed optimizer step: drop what its
            # microbatches accumulated so the next step starts clean.
            self.discard(step)
            raise
        self._apply(step, self._global(step, sum(rows)) if self.plan.accumulate_target is not None
                    else sum(rows) * (step.world.dp_size if step.world else 1))
        return sum(l * r for l, r in zip(losses, rows)) / sum(rows)

    def add_samples(self, step, rows: int, microbatches: int) -> bool:
        """A pipelined call's microbatches accumulated (accumulate_target with pp): whether the
        samples of every data-parallel rank now reach the target, so that the update runs."""
        self.pending_microbatches += microbatches
        self.pending_samples += self._global(step, rows)
        step.metrics["accumulated_samples"] = torch.tensor(self.pending_samples)
        reached = self.pending_samples >= self.target
        step.metrics["applied"] = torch.tensor(reached)
        return reached

    def applied(self, step) -> None:
        """A pipelined update ran over the pending samples (the runtime clears the accumulators)."""
        self.history.append(self.pending_samples)
        step.metrics["accumulated_samples"] = torch.tensor(self.pending_samples)
        self.pending_samples = self.pending_microbatches = 0

    def dynamic_step(self, step, batch) -> torch.Tensor:
        loss = self._grad(step, batch, first=self.pending_microbatches == 0)
        self.pending_microbatches += 1
        self.pending_samples += self._global(step, batch_rows(batch))
        step.metrics["accumulated_samples"] = torch.tensor(self.pending_samples)
        if self.pending_samples >= self.target:
            self._apply(step, self.pending_samples)
            step.metrics["applied"] = torch.tensor(True)
        else:
            step.metrics["applied"] = torch.tensor(False)
        return loss
