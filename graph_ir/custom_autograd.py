"""User-defined autograd inside a captured step: ``torch.autograd.Function`` (old and new
style) and ``torch.library.custom_op`` with ``register_autograd``.

The step is traced by ``make_fx`` over ``functionalize`` with ``torch.func.vjp``
inside. torch.func runs an autograd.Function through its ``custom_function_call``
operator, and in torch 2.13 that operator has two gaps this module fills while a
step is captured (and only then):

- no rule under ``functionalize`` ("NYI: Functionalize rule for
  custom_function_call"). The grad level above has already wrapped the function
  with its backward, so what ``functionalize`` has to do is run the forward on
  its functional tensors; the ops inside are functionalized one by one as
  anywhere else.
- old-style functions (``forward(ctx, *args)``, no ``setup_context``) are refused
  outright. ``register_autograd`` builds exactly such a function, so every custom op
  with a backward is refused too (with a message about ``setup_context`` the user
  never wrote). An old-style function is run as a new-style one: its forward gets a
  recording context, and what it did to that context (``save_for_backward``,
  attributes, ``mark_non_differentiable``, ``set_materialize_grads``) is replayed
  onto the real context in ``setup_context``. Its backward then runs unchanged.

AOTAutograd captures these through autograd itself (``torch.autograd.grad`` under
a functional mode); the capture here keeps ``vjp`` for its forward/backward split
and region tags, so it teaches ``vjp`` the two rules instead.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._functorch.autograd_function import custom_function_call, enable_single_level_autograd_function
from torch._functorch.pyfunctorch import TransformType
from torch.autograd.function import _is_setup_context_defined

_state = threading.local()


def _functionalize_rule(interpreter, autograd_function, *operands, **kwargs):
    # Every op the forward runs is dispatched through this functionalize level.
    with torch.no_grad():
        return autograd_function.forward(*operands, **kwargs)


class _RecordingContext:
    """What an old-style forward may do to its ``ctx``, kept to be replayed in ``setup_context``."""

    def __init__(self, args: tuple):
        object.__setattr__(self, "_attributes", {})
        object.__setattr__(self, "_saved", None)
        object.__setattr__(self, "_non_differentiable", [])
        object.__setattr__(self, "_dirty", [])
        object.__setattr__(self, "_materialize", None)
        object.__setattr__(self, "needs_input_grad", tuple(
            isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()) for a in args))

    def __setattr__(self, name: str, value: Any) -> None:
        self._attributes[name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self._attributes[name]
        except KeyError:
            raise AttributeError(name) from None

    def save_for_backward(self, *tensors) -> None:
        object.__setattr__(self, "_saved", tensors)

    def save_for_forward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        self._non_differentiable.extend(tensors)

    def mark_dirty(self, *tensors) -> None:
        self._dirty.extend(tensors)

    def set_materialize_grads(self, value: bool) -> None:
        object.__setattr__(self, "_materialize", value)

    def replay(self, ctx, inputs: tuple, output: Any) -> None:
        # The forward ran one functorch level below ``ctx``: a tensor it saved or marked
        # that is one of its inputs or outputs is replaced by the same value at ctx's level.
        low_inputs = [a for a in self._inputs if isinstance(a, torch.Tensor)]
        high_inputs = [a for a in inputs if isinstance(a, torch.Tensor)]
        low_outputs = pytree.tree_leaves(self._output)
        high_outputs = pytree.tree_leaves(output)
        lift = {id(lo): hi for lo, hi in zip(low_inputs + low_outputs, high_inputs + high_outputs)}

        def at_ctx_level(t):
            return lift.get(id(t), t) if isinstance(t, torch.Tensor) else t

        for name, value in self._attributes.items():
            setattr(ctx, name, value)
        if self._saved is not None:
            ctx.save_for_backward(*map(at_ctx_level, self._saved))
        if self._non_differentiable:
            ctx.mark_non_differentiable(*map(at_ctx_level, self._non_differentiable))
        if self._dirty:
            ctx.mark_dirty(*map(at_ctx_level, self._dirty))
        if self._materialize is not None:
            ctx.set_materialize_grads(self._materialize)


_new_style: dict[type, type] = {}


def _as_new_style(cls: type) -> type:
    """A new-style twin of the old-style autograd.Function ``cls`` (made once per class)."""
    twin = _new_style.get(cls)
    if twin is not None:
        return twin

    def forward(*args):
        ctx = _RecordingContext(args)
        out = cls.forward(ctx, *args)
        object.__setattr__(ctx, "_inputs", args)
        object.__setattr__(ctx, "_output", out)
        _pending().append(ctx)
        return out

    def setup_context(ctx, inputs, output):
        _pending().pop().replay(ctx, inputs, output)

    def backward(ctx, *grads):
        return cls.backward(ctx, *grads)

    twin = type(cls.__name__, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "__module__": cls.__module__,
        "__qualname__": cls.__qualname__})
    _new_style[cls] = twin
    return twin


def _pending() -> list:
    # A stack: a forward that applies another function finishes that one (forward and
    # setup_context) before its own setup_context runs.
    if not hasattr(_state, "pending"):
        _state.pending = []
    return _state.pending


_original_apply = torch.autograd.Function.__dict__["apply"]   # the classmethod itself


def _apply(cls, *args, **kwargs):
    if torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode):
        # Called from inside the dispatcher at a grad level's autograd key (a custom op's
        # autograd kernel): that level's tensors record plain autograd, as any aten op does there.
        with enable_single_level_autograd_function():
            return super(torch.autograd.Function, cls).apply(*args, **kwargs)
    if torch._C._are_functorch_transforms_active() and not _is_setup_context_defined(cls.setup_context):
        if kwargs:
            raise TypeError(f"autograd.Function {cls.__qualname__}.apply takes positional arguments only "
                            f"(got {sorted(kwargs)})")
        return _original_apply.__func__(_as_new_style(cls), *args)
    return _original_apply.__func__(cls, *args, **kwargs)


@contextlib.contextmanager
def capturing_custom_autograd():
    """While a step is traced, autograd.Functions and custom ops trace with their backward."""
    table = custom_function_call.functorch_table
    saved_rule = table.get(TransformType.Functionalize)
    table[TransformType.Functionalize] = _functionalize_rule
    torch.autograd.Function.apply = classmethod(_apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _original_apply
        if saved_rule is None:
            table.pop(TransformType.Functionalize, None)
        else:
            table[TransformType.Functionalize] = saved_rule
        _pending().clear()
