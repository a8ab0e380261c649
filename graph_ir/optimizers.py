"""Functional update rules for the torch.optim optimizers a step can capture.

Why not call ``torch.optim``'s own functional kernels: their non-capturable
path reads the step count with ``.item()`` (data-dependent, it cannot be
traced) and their capturable path asserts an accelerator device unless
Dynamo is compiling. These rules follow ``torch.optim``'s single-tensor code
line for line, keep every value a tensor (the step count and the learning
rate are graph inputs, so an LR scheduler never forces a recompile) and
return new tensors instead of mutating, so the captured graph is functional.

The state they read and write uses torch.optim's own keys (``step``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``), so
``optimizer.state_dict()`` stays valid for checkpointing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

State = dict[str, Tensor]


class UnsupportedOptimizer(ValueError):
    pass


@dataclass(frozen=True)
class UpdateRule:
    """How one optimizer class updates one parameter."""

    state_keys: Callable[[dict], tuple[str, ...]]
    init_state: Callable[[Tensor, dict], State]
    update: Callable[[Tensor, Tensor, State, Tensor, dict], tuple[Tensor, State]]
    # Hyperparameters that are baked into the graph: a change after compile
    # needs a recompile, unlike ``lr`` which is an input.
    baked: tuple[str, ...]
    # State entries that are one scalar per parameter whatever its shape.
    scalar_state: tuple[str, ...] = ("step",)


def _sgd_keys(group: dict) -> tuple[str, ...]:
    return ("momentum_buffer",) if group["momentum"] != 0 else ()


def _sgd_init(param: Tensor, group: dict) -> State:
    # torch.optim starts the buffer as a clone of the first gradient; zeros
    # give the same first step exactly when dampening is 0 (0*m + g == g).
    if group["momentum"] != 0:
        return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}
    return {}


def _sgd_update(param: Tensor, grad: Tensor, state: State, lr: Tensor, group: dict):
    if group.get("maximize", False):
        grad = -grad
    if group["weight_decay"] != 0:
        grad = grad.add(param, alpha=group["weight_decay"])
    new_state: State = {}
    momentum = group["momentum"]
    if momentum != 0:
        buf = state["momentum_buffer"].mul(momentum).add(grad, alpha=1 - group["dampening"])
        new_state["momentum_buffer"] = buf
        grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
    return param - lr * grad, new_state


def _adam_keys(group: dict) -> tuple[str, ...]:
    keys = ("step", "exp_avg", "exp_avg_sq")
    return keys + ("max_exp_avg_sq",) if group["amsgrad"] else keys


def _adam_init(param: Tensor, group: dict) -> State:
    zeros = lambda: torch.zeros_like(param, memory_format=torch.preserve_format)  # noqa: E731
    state = {"step": torch.tensor(0.0, dtype=torch.float32, device=param.device),
             "exp_avg": zeros(), "exp_avg_sq": zeros()}
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = zeros()
    return state


def _adam_update(param: Tensor, grad: Tensor, state: State, lr: Tensor, group: dict,
                 decoupled: bool):
    # Scalars (bias corrections, step size) are computed in float64 0-dim tensors
    # and meet float32 tensors only inside an op, exactly where torch.optim's
    # Python floats do; together with torch.optim's op order this makes the
    # update bitwise equal to the eager optimizer on CPU.
    beta1, beta2 = group["betas"]
    weight_decay, eps = group["weight_decay"], group["eps"]
    if group.get("maximize", False):
        grad = -grad
    step = state["step"] + 1
    if weight_decay != 0:
        if decoupled:
            param = param * (1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg = state["exp_avg"].lerp(grad, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
    step64 = step.to(torch.float64)
    bias_correction1 = 1 - torch.pow(beta1, step64)
    bias_correction2_sqrt = torch.pow(1 - torch.pow(beta2, step64), 0.5)
    neg_step_size = -(lr / bias_correction1)
    new_state = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second_moment = exp_avg_sq
    if group["amsgrad"]:
        second_moment = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        new_state["max_exp_avg_sq"] = second_moment
    denom = second_moment.sqrt() / bias_correction2_sqrt + eps
    return param + (neg_step_size * exp_avg) / denom, new_state


def _check_group(name: str, group: dict, refused: dict[str, object]) -> None:
    for key, default in refused.items():
        if key in group and group[key] not in (default, None):
            raise UnsupportedOptimizer(
                f"{name} option {key}={group[key]!r} is not supported in a captured step "
                f"(supported: {key}={default!r})")


def rule_for(optimizer: torch.optim.Optimizer) -> UpdateRule:
    """The update rule for ``optimizer``'s class, or a clear error naming what is missing."""
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        _check_group(name, group, {"differentiable": False, "fused": False})
        if isinstance(optimizer, torch.optim.SGD) and group["dampening"] != 0 and group["momentum"] != 0:
            raise UnsupportedOptimizer(
                "SGD option dampening must be 0 in a captured step: torch.optim starts the "
                "momentum buffer as an undampened copy of the first gradient")
    if isinstance(optimizer, torch.optim.AdamW):
        decoupled = True
    elif isinstance(optimizer, torch.optim.Adam):
        decoupled = bool(optimizer.param_groups[0].get("decoupled_weight_decay", False))
    elif isinstance(optimizer, torch.optim.SGD):
        return UpdateRule(_sgd_keys, _sgd_init, _sgd_update,
                          baked=("momentum", "dampening", "nesterov", "weight_decay", "maximize"))
    else:
        raise UnsupportedOptimizer(
            f"optimizer {name} is not supported in a captured step; supported: SGD, Adam, AdamW")

    def update(param, grad, state, lr, group):
        return _adam_update(param, grad, state, lr, group, decoupled)

    return UpdateRule(_adam_keys, _adam_init, update,
                      baked=("betas", "eps", "weight_decay", "amsgrad", "maximize"))
