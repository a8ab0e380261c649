"""The public entry points: compile a whole training step, or serve as a torch.compile backend."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from .lowering import resolve_backend
from .plan import Plan, PlanError
from .step import CompiledStep


def _as_plan(plan: Plan | dict | str | os.PathLike | None, caller: str) -> Plan:
    if plan is None:
        return Plan()
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    hint = (" (optimizer= and loss_fn= are keyword arguments)"
            if isinstance(plan, torch.optim.Optimizer) or callable(plan) else "")
    # open() would take an int (False, 0) as a file descriptor and read standard input.
    raise TypeError(f"{caller}: plan must be a Plan, a dict of plan fields, or the path of a YAML/JSON "
                    f"plan file, got {_describe(plan)}{hint}")


def _describe(value: Any) -> str:
    text = repr(value)
    short = len(text) <= 60 and "\n" not in text
    return f"{type(value).__name__} {text}" if short else f"a value of type {type(value).__name__}"


def _check_backend_options(plan: Plan, backend_name: str) -> None:
    """``torchair`` options with backend 'auto' apply only where 'auto' picks torchair."""
    if plan.torchair and backend_name != "torchair":
        raise PlanError("torchair", f"options apply only to the torchair backend; backend "
                        f"{plan.backend!r} is {backend_name!r} here (no NPU): drop the options or "
                        "run where torch_npu is available", plan.torchair)


def compile_for_npu(model: torch.nn.Module, plan: Plan | dict | str | None = None, *,
                    optimizer: torch.optim.Optimizer,
                    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> CompiledStep:
    """Compile one whole training step of ``model`` with ``optimizer``.

    ``plan`` is a :class:`Plan`, a dict of plan fields, or the path of a YAML/JSON
    plan file. ``loss_fn(model, batch)`` returns a scalar loss; a batch may be a
    tensor, a tuple or a dict of tensors. The returned step runs forward, loss,
    backward and the optimizer update in one graph per call and keeps ``model``
    and ``optimizer`` up to date.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compile_for_npu: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("compile_for_npu: optimizer must be a torch.optim.Optimizer over the model's "
                        f"parameters, got {type(optimizer).__name__}")
    if not callable(loss_fn):
        raise TypeError("compile_for_npu: loss_fn must be callable as loss_fn(model, batch) -> scalar")
    plan = _as_plan(plan, "compile_for_npu")
    if plan.torchair:
        _check_backend_options(plan, resolve_backend(plan.backend))
    return CompiledStep(model, plan, optimizer=optimizer, loss_fn=loss_fn)


def backend(plan: Plan | dict | str | None = None):
    """A ``torch.compile`` backend that runs the plan's passes on forward and backward graphs."""
    from .torch_compile_backend import make_backend
    plan = _as_plan(plan, "cann_passes.backend")
    if plan.torchair:
        _check_backend_options(plan, resolve_backend(plan.backend))
    return make_backend(plan)
