"""The eager PyTorch reference every test compares a compiled step against.

Plain ``torch.optim`` training, written once::

    from tests.eager_reference import eager_steps

    run = eager_steps(model, optimizer, loss_fn, batches)             # fp32, one step per batch
    run.losses                                                        # list[float], one per step
    run = eager_steps(model, optimizer, loss_fn, batches, autocast_dtype=torch.bfloat16,
                      grad_clip=1.0, microbatches=2)
    run.grad_norms                                                    # clip_grad_norm_'s, per step
    run.microbatch_losses                                             # per step: each chunk's weighted loss

One step is, in this order: ``optimizer.zero_grad(set_to_none=True)``; per microbatch the
forward (under ``torch.autocast("cpu", dtype=autocast_dtype)`` when given), the loss weighted
by the microbatch's share of the rows (with more than one), its backward (through
``grad_scaler.scale`` when given); ``grad_scaler.unscale_``; ``clip_grad_norm_`` over the
optimizer's parameters (with ``grad_clip``); ``grad_scaler.step`` + ``update`` or
``optimizer.step()``. A step's loss is the (weighted) sum of its microbatches' losses.

Importable as ``tests.eager_reference`` from every test directory (the repository root is on
``sys.path``: ``pythonpath = ["."]`` in pyproject.toml), as ``tests.zoo`` is.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree


@dataclass
class EagerRun:
    """What :func:`eager_steps` saw, one entry per step (per batch)."""

    losses: list[float] = field(default_factory=list)
    # Per step, each microbatch's (weighted) loss as a Python float, in order.
    microbatch_losses: list[list[float]] = field(default_factory=list)
    # clip_grad_norm_'s return (the total norm before clipping), per step; empty without grad_clip.
    grad_norms: list[float] = field(default_factory=list)


def split_rows(batch: Any, n: int) -> list:
    """``batch`` (any pytree of tensors) cut into ``n`` row chunks, as the plan's ``microbatches`` cuts it."""
    leaves, spec = pytree.tree_flatten(batch)
    pieces = [leaf.chunk(n) for leaf in leaves]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(n)]


def _rows(part: Any) -> int:
    return len(next(iter(part.values())) if isinstance(part, dict) else part[0])


def eager_steps(model: torch.nn.Module, optimizer, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                batches: Iterable[Any], *, autocast_dtype: torch.dtype | None = None,
                grad_scaler: torch.amp.GradScaler | None = None, grad_clip: float | None = None,
                microbatches: int = 1) -> EagerRun:
    """Train ``model`` in place, one optimizer step per batch of ``batches`` (see the module docstring).

    ``optimizer`` needs only ``zero_grad`` and ``step`` (and ``param_groups`` with ``grad_clip``
    or ``grad_scaler``). With ``microbatches`` N, gradient accumulation as users write it: each of
    the N row chunks' losses, weighted by its share of the rows, is backpropagated, then one
    optimizer step.
    """
    run = EagerRun()
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        parts = split_rows(batch, microbatches) if microbatches > 1 else [batch]
        rows = [_rows(p) for p in parts] if len(parts) > 1 else None
        loss = None
        weighted = []
        for i, part in enumerate(parts):
            with (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
                  else contextlib.nullcontext()):
                part_loss = loss_fn(model, part)
                if rows is not None:
                    part_loss = part_loss * (rows[i] / sum(rows))
            (grad_scaler.scale(part_loss) if grad_scaler is not None else part_loss).backward()
            detached = part_loss.detach()
            loss = detached if loss is None else loss + detached
            weighted.append(detached.item())
        if grad_scaler is not None:
            grad_scaler.unscale_(optimizer)
        if grad_clip is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            run.grad_norms.append(torch.nn.utils.clip_grad_norm_(params, grad_clip).item())
        if grad_scaler is not None:
            grad_scaler.step(optimizer)
            grad_scaler.update()
        else:
            optimizer.step()
        run.losses.append(loss.item())
        run.microbatch_losses.append(weighted)
    return run


def eager_losses(model, loss_fn, optimizer, batches) -> list[float]:
    """The fp32 losses of :func:`eager_steps`, one per batch (the argument order older tests use)."""
    return eager_steps(model, optimizer, loss_fn, batches).losses
