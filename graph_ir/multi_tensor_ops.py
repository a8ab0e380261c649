"""Multi-tensor optimizer ops a graph may hold, and how each runs in place.

``cann::fused_adam`` is Adam's or AdamW's update of a list of parameters in one call of torch's
fused kernel (``aten._fused_adam_`` / ``aten._fused_adamw_``, the kernel behind
``torch.optim.AdamW(fused=True)``): one pass over each parameter's four tensors instead of the
dozen full-size passes and ~10 0-dim ops per parameter of the single-tensor chain. The kernel
takes ``beta1``, ``beta2``, ``eps`` and ``weight_decay`` as Python floats; the captured step
feeds them as graph inputs (float64 0-dim tensors, so a scheduler never recompiles), so this op
takes the tensors and reads them with ``.item()`` when it runs: exactly the float the user
set, at the cost of four scalar reads per call, and nothing baked into the graph. ``lr`` goes
to the kernel's tensor overload. On CPU the result is bitwise ``torch.optim``'s ``fused=True``
step.

The op is functional (it returns new tensors, as every node of a captured graph does). The eager
lowering runs it in place where the parameters and state it updates die there
(``cann_passes.passes.reuse_dead_operands``): :data:`IN_PLACE` says which argument lists it
writes, and which result each becomes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor


def _kernel(decoupled: bool):
    return (torch.ops.aten._fused_adamw_ if decoupled else torch.ops.aten._fused_adam_).tensor_lr


def fused_adam_into_inputs(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                           exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor],
                           lr: Tensor, beta1: Tensor, beta2: Tensor, eps: Tensor, weight_decay: Optional[Tensor],
                           decoupled: bool, amsgrad: bool, maximize: bool, copies: tuple = ()):
    """``cann::fused_adam`` writing its results into ``params`` and the state lists; returns those
    lists, as the op returns its results. ``grads`` are read only: the kernel's schema marks them
    written because it unscales them in place by ``grad_scale``, which this op never passes.
    ``copies``: (argument index, list index) of the tensors to write a copy of instead (a value
    read again later, or an input the step does not return as its own new value)."""
    if copies:
        lists = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]
        lists = [list(ts) for ts in lists]
        for k, i in copies:
            lists[k][i] = lists[k][i].clone()
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = lists
    _kernel(decoupled)(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr,
                       beta1=beta1.item(), beta2=beta2.item(),
                       weight_decay=0.0 if weight_decay is None else weight_decay.item(),
                       eps=eps.item(), amsgrad=amsgrad, maximize=maximize)
    return params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs


@torch.library.custom_op("cann::fused_adam", mutates_args=())
def fused_adam(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               max_exp_avg_sqs: list[Tensor], steps: list[Tensor], lr: Tensor, beta1: Tensor, beta2: Tensor,
               eps: Tensor, weight_decay: Optional[Tensor], decoupled: bool, amsgrad: bool, maximize: bool
               ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """Adam (``decoupled=False``) or AdamW over lists of tensors; ``steps`` are the incremented step
    counts (torch.optim adds one before the kernel reads them); ``weight_decay`` None: no decay (a
    group whose weight decay is zero has no such input in the chain). Returns the new parameters,
    ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq`` (empty unless ``amsgrad``)."""
    def fresh(ts):
        return [t.clone() for t in ts]
    return fused_adam_into_inputs(fresh(params), grads, fresh(exp_avgs), fresh(exp_avg_sqs),
                                  fresh(max_exp_avg_sqs), steps, lr, beta1, beta2, eps, weight_decay,
                                  decoupled, amsgrad, maximize)


@fused_adam.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
      decoupled, amsgrad, maximize):
    def like(ts):
        return [torch.empty_like(t) for t in ts]
    return like(params), like(exp_avgs), like(exp_avg_sqs), like(max_exp_avg_sqs)


FUSED_ADAM = torch.ops.cann.fused_adam.default


@torch.library.custom_op("cann::fused_adam_", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"))
def fused_adam_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                max_exp_avg_sqs: list[Tensor], steps: list[Tensor], lr: Tensor, beta1: Tensor, beta2: Tensor,
                eps: Tensor, weight_decay: Optional[Tensor], decoupled: bool, amsgrad: bool, maximize: bool
                ) -> None:
    """``cann::fused_adam`` writing into its parameter and state lists, for a compiler that keeps
    input mutations (inductor: AOTAutograd functionalizes it, and inductor's reinplacing runs it
    in place on the step's inputs instead of cloning all four lists first)."""
    fused_adam_into_inputs(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2,
                           eps, weight_decay, decoupled, amsgrad, maximize)


@fused_adam_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
      decoupled, amsgrad, maximize):
    return None


FUSED_ADAM_IN_PLACE = torch.ops.cann.fused_adam_.default


@dataclass(frozen=True)
class InPlaceLists:
    """How a multi-tensor op runs in place: the function that writes into its argument lists (its
    ``copies`` keyword names the tensors to write a copy of instead), and which argument list
    becomes which result list."""

    run: Callable
    written: dict[int, int]          # argument index -> result index


IN_PLACE: dict = {FUSED_ADAM: InPlaceLists(fused_adam_into_inputs, {0: 0, 2: 1, 3: 2, 4: 3})}
