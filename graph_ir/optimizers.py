"""Functional update rules for the torch.optim optimizers a step can capture.

Why not call ``torch.optim``'s own functional kernels: their non-capturable
path reads the step count with ``.item()`` (data-dependent, it cannot be
traced) and their capturable path asserts an accelerator device unless
Dynamo is compiling. These rules follow ``torch.optim``'s single-tensor code
line for line, keep every value a tensor and return new tensors instead of
mutating, so the captured graph is functional.

Every float hyperparameter a rule reads (``lr``, ``betas``, ``eps``,
``weight_decay``, ``momentum``, ...) is a graph input, a float64 0-dim tensor
standing in for torch.optim's Python float: an LR or momentum scheduler
(OneCycleLR, CyclicLR cycling betas or momentum) never forces a recompile.
Inputs are named ``<key>:group<i>``, tuple entries ``<key>.<j>:group<i>``
(``betas.0:group0``). Options that change the graph's structure (``amsgrad``,
``nesterov``, whether weight decay or momentum is zero) are part of
:meth:`UpdateRule.key`: a change compiles anew.

Scalars meet float32 tensors only inside an op, exactly where torch.optim's
Python floats do (``x.add(y, alpha=a)`` is spelled ``x.addcmul(y, a)``, the
same fused multiply-add), so on CPU each update is bitwise equal to the eager
optimizer.

The state uses torch.optim's own keys (``step``, ``exp_avg``, ``exp_avg_sq``,
``momentum_buffer``, ``square_avg``, ``sum``, ``exp_inf``, ``mu_product``, ...),
so ``optimizer.state_dict()`` stays valid for checkpointing.

Your own optimizer: describe its update for one parameter as an
:class:`UpdateRule` and register it::

    from graph_ir.optimizers import UpdateRule, register_update_rule

    def lion_update(param, grad, state, h, group):
        beta1, beta2 = h["betas"]
        update = state["exp_avg"].lerp(grad, 1 - beta1).sign()
        param = param * (1 - h["lr"] * h["weight_decay"])
        return param - h["lr"] * update, {"exp_avg": state["exp_avg"].lerp(grad, 1 - beta2)}

    register_update_rule(Lion, UpdateRule(
        state_keys=lambda group: ("exp_avg",),
        init_state=lambda p, group: {"exp_avg": torch.zeros_like(p)},
        update=lion_update,
        inputs=("lr", "betas", "weight_decay")))

``update(param, grad, state, h, group)`` gets ``h``: each key of ``inputs`` as a
tensor (a tuple of tensors for tuple-valued options) and returns the new
parameter and the new state, out of place. ``register_update_rule`` also
accepts a factory ``optimizer -> UpdateRule`` (to check the optimizer's
options first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch
from torch import Tensor

State = dict[str, Tensor]
Hparams = dict[str, Union[Tensor, tuple[Tensor, ...]]]


class UnsupportedOptimizer(ValueError):
    pass


def _no_structure(group: dict) -> tuple:
    return ()


@dataclass(frozen=True)
class UpdateRule:
    """How one optimizer class updates one parameter."""

    state_keys: Callable[[dict], tuple[str, ...]]
    init_state: Callable[[Tensor, dict], State]
    update: Callable[[Tensor, Tensor, State, Hparams, dict], tuple[Tensor, State]]
    # Group options whose values are baked into the graph: a change needs a recompile.
    baked: tuple[str, ...] = ()
    # Float group options fed as graph inputs (``h[key]`` in ``update``).
    inputs: tuple[str, ...] = ("lr",)
    # State entries that are one scalar per parameter whatever its shape.
    scalar_state: tuple[str, ...] = ("step",)
    # What else of a group shapes the graph (e.g. whether weight decay is zero).
    structure: Callable[[dict], tuple] = _no_structure

    def key(self, group: dict) -> tuple:
        """Everything of ``group`` the captured graph is specialised on."""
        return tuple(repr(group.get(k)) for k in self.baked) + tuple(self.structure(group))

    def input_names(self, group: dict, index: int) -> list[str]:
        """The graph-input names of ``group``'s hyperparameters (group number ``index``)."""
        names = []
        for key in self.inputs:
            value = group[key]
            if isinstance(value, (tuple, list)):
                names += [f"{key}.{j}:group{index}" for j in range(len(value))]
            else:
                names.append(f"{key}:group{index}")
        return names

    def input_values(self, group: dict) -> list[float]:
        values = []
        for key in self.inputs:
            value = group[key]
            values += [float(v) for v in value] if isinstance(value, (tuple, list)) else [float(value)]
        return values

    def pack(self, group: dict, flat: list[Tensor]) -> Hparams:
        """``flat`` (in ``input_names`` order) as the ``h`` mapping ``update`` reads."""
        it, h = iter(flat), {}
        for key in self.inputs:
            value = group[key]
            h[key] = tuple(next(it) for _ in value) if isinstance(value, (tuple, list)) else next(it)
        return h


# -- helpers: torch.optim's scalar-argument ops with tensor scalars ---------------------------------

def _once(h: Hparams, name: str, make: Callable[[], Tensor]) -> Tensor:
    """A value of the group's hyperparameters alone (``-lr``, ``1 - beta1``), traced once per group.

    torch.optim computes it again for every parameter, the same arithmetic on the same numbers;
    traced per parameter it was as many graph nodes, each traced and then merged away by the
    pipeline's first cleanup."""
    key = ("once", name)
    if key not in h:
        h[key] = make()   # type: ignore[index]
    return h[key]         # type: ignore[index]


def _add_scaled(x: Tensor, y: Tensor, a: Tensor) -> Tensor:
    """``x.add(y, alpha=a)`` for a tensor ``a``: the same fused multiply-add."""
    return x.addcmul(y, a)


def _addcmul(x: Tensor, t1: Tensor, t2: Tensor, value: Tensor) -> Tensor:
    """``x.addcmul(t1, t2, value=v)`` for a tensor ``v``: the kernel computes x + (v*t1)*t2."""
    return x.addcmul(t1 * value, t2)


def _zeros(param: Tensor) -> Tensor:
    return torch.zeros_like(param, memory_format=torch.preserve_format)


def _step0(param: Tensor) -> Tensor:
    return torch.tensor(0.0, dtype=torch.float32, device=param.device)


def _nonzero(*keys: str) -> Callable[[dict], tuple]:
    return lambda group: tuple(f"{k}!=0" if group.get(k, 0) != 0 else f"{k}=0" for k in keys)


def _maximize(grad: Tensor, group: dict) -> Tensor:
    return -grad if group.get("maximize", False) else grad


def _decay(param: Tensor, grad: Tensor, h: Hparams, group: dict, decoupled: bool):
    """Weight decay, coupled (into the gradient) or decoupled (into the parameter, AdamW)."""
    if group.get("weight_decay", 0) == 0:
        return param, grad
    if decoupled:
        return param * _once(h, "1 - lr * weight_decay", lambda: 1 - h["lr"] * h["weight_decay"]), grad
    return param, _add_scaled(grad, param, h["weight_decay"])


# -- SGD ------------------------------------------------------------------------------------------

def _sgd_keys(group: dict) -> tuple[str, ...]:
    return ("momentum_buffer",) if group["momentum"] != 0 else ()


def _sgd_init(param: Tensor, group: dict) -> State:
    # torch.optim starts the buffer as a clone of the first gradient; zeros
    # give the same first step exactly when dampening is 0 (0*m + g == g).
    return {"momentum_buffer": _zeros(param)} if group["momentum"] != 0 else {}


def _sgd_update(param: Tensor, grad: Tensor, state: State, h: Hparams, group: dict):
    grad = _maximize(grad, group)
    param, grad = _decay(param, grad, h, group, decoupled=False)
    new_state: State = {}
    if group["momentum"] != 0:
        buf = state["momentum_buffer"].mul(h["momentum"]).add(grad)
        new_state["momentum_buffer"] = buf
        grad = _add_scaled(grad, buf, h["momentum"]) if group["nesterov"] else buf
    return _add_scaled(param, grad, _once(h, "-lr", lambda: -h["lr"])), new_state


# -- Adam, AdamW ----------------------------------------------------------------------------------

def _adam_keys(group: dict) -> tuple[str, ...]:
    keys = ("step", "exp_avg", "exp_avg_sq")
    return keys + ("max_exp_avg_sq",) if group["amsgrad"] else keys


def _adam_init(param: Tensor, group: dict) -> State:
    state = {"step": _step0(param), "exp_avg": _zeros(param), "exp_avg_sq": _zeros(param)}
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = _zeros(param)
    return state


def adam_update(param: Tensor, grad: Tensor, state: State, h: Hparams, group: dict, decoupled: bool):
    # Scalars (bias corrections, step size) are float64 0-dim tensors, like
    # torch.optim's Python floats.
    beta1, beta2 = h["betas"]
    lr, eps = h["lr"], h["eps"]
    grad = _maximize(grad, group)
    step = state["step"] + 1
    param, grad = _decay(param, grad, h, group, decoupled)
    exp_avg = state["exp_avg"].lerp(grad, _once(h, "1 - beta1", lambda: 1 - beta1))
    exp_avg_sq = _addcmul(state["exp_avg_sq"].mul(beta2), grad, grad, _once(h, "1 - beta2", lambda: 1 - beta2))
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


# -- RMSprop --------------------------------------------------------------------------------------

def _rmsprop_keys(group: dict) -> tuple[str, ...]:
    keys = ("step", "square_avg")
    if group["momentum"] > 0:
        keys += ("momentum_buffer",)
    return keys + ("grad_avg",) if group["centered"] else keys


def _rmsprop_init(param: Tensor, group: dict) -> State:
    return {k: _step0(param) if k == "step" else _zeros(param) for k in _rmsprop_keys(group)}


def _rmsprop_update(param: Tensor, grad: Tensor, state: State, h: Hparams, group: dict):
    alpha, eps, lr = h["alpha"], h["eps"], h["lr"]
    grad = _maximize(grad, group)
    new_state: State = {"step": state["step"] + 1}
    param, grad = _decay(param, grad, h, group, decoupled=False)
    square_avg = _addcmul(state["square_avg"].mul(alpha), grad, grad, _once(h, "1 - alpha", lambda: 1 - alpha))
    new_state["square_avg"] = square_avg
    if group["centered"]:
        grad_avg = state["grad_avg"].lerp(grad, 1 - alpha)
        new_state["grad_avg"] = grad_avg
        avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt()
    else:
        avg = square_avg.sqrt()
    avg = avg + eps
    if group["momentum"] > 0:
        buf = state["momentum_buffer"].mul(h["momentum"]).addcdiv(grad, avg)
        new_state["momentum_buffer"] = buf
        return _add_scaled(param, buf, -lr), new_state
    return param + (-lr * grad) / avg, new_state


# -- Adagrad --------------------------------------------------------------------------------------

def _adagrad_init(param: Tensor, group: dict) -> State:
    return {"step": _step0(param),
            "sum": torch.full_like(param, group["initial_accumulator_value"],
                                   memory_format=torch.preserve_format)}


def _adagrad_update(param: Tensor, grad: Tensor, state: State, h: Hparams, group: dict):
    step = state["step"] + 1
    grad = _maximize(grad, group)
    param, grad = _decay(param, grad, h, group, decoupled=False)
    clr = h["lr"] / (1 + (step.to(torch.float64) - 1) * h["lr_decay"])
    state_sum = state["sum"].addcmul(grad, grad, value=1)
    std = state_sum.sqrt() + h["eps"]
    return param + (-clr * grad) / std, {"step": step, "sum": state_sum}


# -- Adamax ---------------------------------------------------------------------------------------

def _adamax_init(param: Tensor, group: dict) -> State:
    return {"step": _step0(param), "exp_avg": _zeros(param), "exp_inf": _zeros(param)}


def _adamax_update(param: Tensor, grad: Tensor, state: State, h: Hparams, group: dict):
    beta1, beta2 = h["betas"]
    grad = _maximize(grad, group)
    step = state["step"] + 1
    param, grad = _decay(param, grad, h, group, decoupled=False)
    exp_avg = state["exp_avg"].lerp(grad, _once(h, "1 - beta1", lambda: 1 - beta1))
    exp_inf = torch.maximum(state["exp_inf"].mul(beta2), grad.abs() + h["eps"])
    clr = h["lr"] / (1 - torch.pow(beta1, step.to(torch.float64)))
    return param + (-clr * exp_avg) / exp_inf, {"step": step, "exp_avg": exp_avg, "exp_inf": exp_inf}


# -- NAdam ----------------------------------------------------------------------------------------

def _nadam_init(param: Tensor, group: dict) -> State:
    return {"step": _step0(param), "mu_product": torch.tensor(1.0, dtype=torch.float32, device=param.device),
            "exp_avg": _zeros(param), "exp_avg_sq": _zeros(param)}


def _nadam_update(param: Tensor, grad: Tensor, state: State, h: Hparams, group: dict):
    beta1, beta2 = h["betas"]
    lr = h["lr"]
    grad = _maximize(grad, group)
    step = state["step"] + 1
    step64 = step.to(torch.float64)
    bias_correction2 = 1 - torch.pow(beta2, step64)
    param, grad = _decay(param, grad, h, group, decoupled=group.get("decoupled_weight_decay", False))
    mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, step64 * h["momentum_decay"]))
    mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (step64 + 1) * h["momentum_decay"]))
    # The state is float32; torch.optim multiplies it by a Python float (rounded to float32).
    mu_product = state["mu_product"] * mu.to(torch.float32)
    mu_product64 = mu_product.to(torch.float64)
    exp_avg = state["exp_avg"].lerp(grad, _once(h, "1 - beta1", lambda: 1 - beta1))
    exp_avg_sq = _addcmul(state["exp_avg_sq"].mul(beta2), grad, grad, _once(h, "1 - beta2", lambda: 1 - beta2))
    denom = exp_avg_sq.div(bias_correction2).sqrt() + h["eps"]
    mu_product_next = mu_product64 * mu_next
    param = param + ((-lr * (1.0 - mu) / (1.0 - mu_product64)) * grad) / denom
    param = param + (((-lr * mu_next) / (1.0 - mu_product_next)) * exp_avg) / denom
    return param, {"step": step, "mu_product": mu_product, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


# -- RAdam ----------------------------------------------------------------------------------------

def _radam_init(param: Tensor, group: dict) -> State:
    return {"step": _step0(param), "exp_avg": _zeros(param), "exp_avg_sq": _zeros(param)}


def _radam_update(param: Tensor, grad: Tensor, state: State, h: Hparams, group: dict):
    beta1, beta2 = h["betas"]
    lr = h["lr"]
    grad = _maximize(grad, group)
    step = state["step"] + 1
    step64 = step.to(torch.float64)
    param, grad = _decay(param, grad, h, group, decoupled=group.get("decoupled_weight_decay", False))
    exp_avg = state["exp_avg"].lerp(grad, _once(h, "1 - beta1", lambda: 1 - beta1))
    exp_avg_sq = _addcmul(state["exp_avg_sq"].mul(beta2), grad, grad, _once(h, "1 - beta2", lambda: 1 - beta2))
    bias_correction1 = 1 - torch.pow(beta1, step64)
    bias_correction2 = 1 - torch.pow(beta2, step64)
    bias_corrected_exp_avg = exp_avg / bias_correction1
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step64 * torch.pow(beta2, step64) / bias_correction2
    # torch.optim branches on rho_t > 5 in Python; here both sides are computed and
    # one is selected (the rectified side is NaN where it is not selected).
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
    adaptive_lr = torch.pow(bias_correction2, 0.5) / (exp_avg_sq.sqrt() + h["eps"])
    rectified = bias_corrected_exp_avg * lr * adaptive_lr * rect
    plain = bias_corrected_exp_avg * lr
    update = torch.where(rho_t > 5.0, rectified, plain)
    return param - update, {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


# -- the registry ---------------------------------------------------------------------------------

_BUILT_IN_NAMES = "SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam"
_registry: dict[type, Union[UpdateRule, Callable[[torch.optim.Optimizer], UpdateRule]]] = {}


def register_update_rule(optimizer_cls: type,
                         rule: Union[UpdateRule, Callable[[torch.optim.Optimizer], UpdateRule]]) -> None:
    """Let steps with ``optimizer_cls`` (and its subclasses) be captured with ``rule``."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"register_update_rule: {optimizer_cls!r} is not a torch.optim.Optimizer subclass")
    if not (isinstance(rule, UpdateRule) or callable(rule)):
        raise TypeError("register_update_rule: rule must be an UpdateRule or a callable optimizer -> UpdateRule")
    _registry[optimizer_cls] = rule


def _check_group(name: str, group: dict, refused: dict[str, object]) -> None:
    for key, default in refused.items():
        if key in group and group[key] not in (default, None):
            raise UnsupportedOptimizer(
                f"{name} option {key}={group[key]!r} is not supported in a captured step "
                f"(supported: {key}={default!r})")


def _sgd_rule(optimizer) -> UpdateRule:
    for group in optimizer.param_groups:
        if group["dampening"] != 0 and group["momentum"] != 0:
            raise UnsupportedOptimizer(
                "SGD option dampening must be 0 in a captured step: torch.optim starts the "
                "momentum buffer as an undampened copy of the first gradient")
    return UpdateRule(_sgd_keys, _sgd_init, _sgd_update, baked=("dampening", "nesterov", "maximize"),
                      inputs=("lr", "momentum", "weight_decay"),
                      structure=_nonzero("momentum", "weight_decay"))


def _adam_rule(optimizer) -> UpdateRule:
    # Per group, as torch.optim reads it in step(): AdamW's groups default to decoupled decay.
    default = isinstance(optimizer, torch.optim.AdamW)

    def update(param, grad, state, h, group):
        return adam_update(param, grad, state, h, group, bool(group.get("decoupled_weight_decay", default)))

    return UpdateRule(_adam_keys, _adam_init, update, baked=("amsgrad", "maximize", "decoupled_weight_decay"),
                      inputs=("lr", "betas", "eps", "weight_decay"), structure=_nonzero("weight_decay"))


def _simple(keys, init, update, inputs, baked=("maximize",), structure=("weight_decay",)):
    return lambda optimizer: UpdateRule(lambda group: keys(group) if callable(keys) else keys, init, update,
                                        baked=baked, inputs=inputs, structure=_nonzero(*structure))


def _builtin() -> dict[type, Callable[[torch.optim.Optimizer], UpdateRule]]:
    optim = torch.optim
    return {
        optim.SGD: _sgd_rule, optim.Adam: _adam_rule, optim.AdamW: _adam_rule,
        optim.RMSprop: _simple(_rmsprop_keys, _rmsprop_init, _rmsprop_update,
                               ("lr", "alpha", "eps", "weight_decay", "momentum"),
                               baked=("maximize", "centered"), structure=("weight_decay", "momentum")),
        optim.Adagrad: _simple(("step", "sum"), _adagrad_init, _adagrad_update,
                               ("lr", "lr_decay", "weight_decay", "eps")),
        optim.Adamax: _simple(("step", "exp_avg", "exp_inf"), _adamax_init, _adamax_update,
                              ("lr", "betas", "eps", "weight_decay")),
        optim.NAdam: _simple(("step", "mu_product", "exp_avg", "exp_avg_sq"), _nadam_init, _nadam_update,
                             ("lr", "betas", "eps", "weight_decay", "momentum_decay"),
                             baked=("maximize", "decoupled_weight_decay")),
        optim.RAdam: _simple(("step", "exp_avg", "exp_avg_sq"), _radam_init, _radam_update,
                             ("lr", "betas", "eps", "weight_decay"),
                             baked=("maximize", "decoupled_weight_decay")),
    }


def _lookup(cls: type):
    """A registered rule (the class or a base), else the built-in one of the class or of a base
    whose ``step`` the class does not override (an overridden ``step`` is an unknown update)."""
    for base in cls.__mro__:
        if base in _registry:
            return _registry[base]
    builtin = _builtin()
    for base in cls.__mro__:
        if base in builtin:
            return builtin[base]
        if "step" in vars(base):
            return None
    return None


def fused_kernel_asked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` runs torch's fused kernel (``fused=True``): the captured step then
    runs that kernel too (``optimizer_kernel: fused``), so that it updates bitwise as eager does.
    Only Adam and AdamW have it here; a fused SGD, or fused and unfused groups in one optimizer,
    are refused naming the option."""
    name = type(optimizer).__name__
    fused = [bool(group.get("fused")) for group in optimizer.param_groups]
    if not any(fused):
        return False
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise UnsupportedOptimizer(f"{name} option fused=True is not supported in a captured step (supported: "
                                   "fused=False; the step runs torch's fused kernel for Adam and AdamW only)")
    if not all(fused):
        raise UnsupportedOptimizer(f"{name} option fused is True in some param groups and not in others; a "
                                   "captured step runs one kernel for all of them (rule: the same fused in "
                                   "every group)")
    return True


def rule_for(optimizer: torch.optim.Optimizer) -> UpdateRule:
    """The update rule for ``optimizer``'s class, or a clear error naming what is missing."""
    name = type(optimizer).__name__
    fused_kernel_asked(optimizer)
    for group in optimizer.param_groups:
        _check_group(name, group, {"differentiable": False})
    found = _lookup(type(optimizer))
    if found is None:
        raise UnsupportedOptimizer(
            f"optimizer {name} is not supported in a captured step; supported: {_BUILT_IN_NAMES}, "
            "and any optimizer registered with graph_ir.optimizers.register_update_rule")
    rule = found if isinstance(found, UpdateRule) else found(optimizer)
    for group in optimizer.param_groups:
        missing = [k for k in rule.inputs if k not in group]
        if missing:
            raise UnsupportedOptimizer(f"{name} param group lacks {missing}, which its update rule reads")
    return rule
