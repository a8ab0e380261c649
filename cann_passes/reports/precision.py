"""Precision report: a low-precision plan against fp32, from the same initial weights.

Both plans train a fresh copy of the same model on the same batches. The
report gives both loss curves, the largest relative deviation between them,
the casts in the final low-precision graph (``_to_copy``/``convert_element_type``
nodes, and how many more than the fp32 graph has), the estimated activation
bytes saved for backward under each plan, and, where a loss scale runs, the
scale used at each step and the steps it skipped.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..api import compile_for_npu
from ..passes.autocast import count_casts
from ..plan import Plan


@dataclass
class PrecisionReport:
    precision: str
    fp32_losses: list[float]
    losses: list[float]
    max_rel_deviation: float
    casts: int                     # in the final low-precision graph
    casts_inserted: int            # casts beyond those of the final fp32 graph
    saved_bytes_fp32: int
    saved_bytes: int
    scale_history: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    seconds_per_step_fp32: float = 0.0
    seconds_per_step: float = 0.0

    @property
    def saved_ratio(self) -> float:
        return self.saved_bytes / self.saved_bytes_fp32 if self.saved_bytes_fp32 else float("nan")

    def to_text(self) -> str:
        lines = [f"precision {self.precision} vs fp32 over {len(self.losses)} steps",
                 f"  final loss {self.losses[-1]:.4f} vs {self.fp32_losses[-1]:.4f}, "
                 f"largest relative deviation {self.max_rel_deviation:.2e}",
                 f"  casts in final graph {self.casts} ({self.casts_inserted} more than fp32)",
                 f"  saved activations {self.saved_bytes / 2**20:.2f} MiB vs "
                 f"{self.saved_bytes_fp32 / 2**20:.2f} MiB fp32 (x{self.saved_ratio:.3f})"]
        if self.scale_history:
            lines.append(f"  loss scale: first {self.scale_history[0]:g}, last {self.scale_history[-1]:g}, "
                         f"skipped steps {self.skipped_steps}")
        return "\n".join(lines)


def _train(model, plan: Plan, optimizer_factory, loss_fn, batches: list) -> tuple[Any, list, list, list, float]:
    step = compile_for_npu(model, plan, optimizer=optimizer_factory(model), loss_fn=loss_fn)
    losses, scales, skipped = [], [], []
    step.compile(batches[0])
    start = time.perf_counter()
    for i, batch in enumerate(batches):
        losses.append(step(batch).item())
        if "loss_scale:scale" in step.metrics:
            scales.append(step.metrics["loss_scale:scale"].item())
            if step.metrics["loss_scale:found_inf"].item():
                skipped.append(i)
    seconds = (time.perf_counter() - start) / max(len(batches), 1)
    return step, losses, scales, skipped, seconds


def precision_report(model_factory: Callable[[], torch.nn.Module], plan: Plan, batches: Iterable,
                     steps: int, *, loss_fn: Callable,
                     optimizer_factory: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                     ) -> PrecisionReport:
    """Train ``steps`` steps under ``plan`` and under the same plan at fp32; compare."""
    if plan.precision == "fp32":
        raise ValueError("plan field 'precision' = 'fp32': a precision report compares a bf16 or fp16 "
                         "plan with fp32")
    optimizer_factory = optimizer_factory or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    data = [b for b, _ in zip(batches, range(steps))]
    initial = model_factory()
    ref_step, ref_losses, _, _, ref_seconds = _train(
        copy.deepcopy(initial), plan.replace(precision="fp32", loss_scale="auto", autocast_overrides={},
                                      # loss-scale fields do not apply at fp32: back to their defaults
                                      loss_scale_init=Plan.loss_scale_init,
                                      loss_scale_growth_interval=Plan.loss_scale_growth_interval),
        optimizer_factory, loss_fn, data)
    step, losses, scales, skipped, seconds = _train(copy.deepcopy(initial), plan, optimizer_factory,
                                                    loss_fn, data)
    deviation = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    casts = count_casts(step.last.graph.graph)
    return PrecisionReport(plan.precision, ref_losses, losses, deviation, casts,
                           casts - count_casts(ref_step.last.graph.graph),
                           ref_step.last.memory.saved_bytes, step.last.memory.saved_bytes,
                           scales, skipped, ref_seconds, seconds)
