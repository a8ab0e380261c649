"""Capture one whole training step as one functional aten graph.

The step is ``loss_fn(model, batch)``, its gradient with respect to every
trainable parameter, and the optimizer update, traced by ``make_fx`` over
``torch.func.functionalize``:

- ``torch.func.vjp`` rather than ``grad``: it splits the trace into a forward
  and a backward call, so every node can be tagged with its region.
- ``torch.autograd.grad`` does not work here: inside ``functionalize`` the
  wrapped tensors do not require grad.
- Module paths come from forward pre/post hooks that annotate the current
  tracing context; backward nodes inherit the module of the forward node whose
  autograd node produced them (matched by autograd sequence number, the same
  mechanism AOTAutograd uses to copy forward metadata to backward nodes).
- Tracing is always on fake tensors: nothing is computed, so a 7B-parameter
  model built on the ``meta`` device is captured without allocating memory.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

from .analysis.gradients import GradientNotFound, find_gradients
from .build import eliminate_dead_code
from .custom_autograd import capturing_custom_autograd
from .gc_pause import gc_paused
from .guards import GuardRecorder
from .meta import MODULE_PATH, REGION, GraphAttr, Region
from .meta_attention import fused_attention_on_meta
from .optimizers import UpdateRule, fused_kernel_asked, rule_for
from .signature import InputKind, OutputKind, Spec, StepSignature, state_name
from .stack_room import with_stack_room
from .train_graph import TrainGraph

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

_PREFIX = {InputKind.PARAM: "param", InputKind.BUFFER: "buffer", InputKind.OPT_STATE: "state",
           InputKind.HPARAM: "hparam", InputKind.BATCH: "batch", InputKind.STEP_STATE: "step"}


class CaptureError(RuntimeError):
    pass


# What eager PyTorch raises when ``loss.backward()`` meets a loss without autograd history.
NO_GRAD_LOSS = "element 0 of tensors does not require grad and does not have a grad_fn"


@dataclass
class StepLayout:
    """Where each input of a captured step comes from in the model and optimizer."""

    trainable: list[str]            # parameters the optimizer updates, in input order
    frozen: list[str]               # parameters read but not updated
    buffers: list[str]
    state_keys: dict[str, tuple[str, ...]]   # per trainable parameter
    group_of: dict[str, int]        # trainable parameter -> param group index
    batch_paths: list[str]
    batch_spec: pytree.TreeSpec
    # Hyperparameter inputs per param group, named ``<key>:group<i>`` / ``<key>.<j>:group<i>``.
    hparams: list[list[str]] = field(default_factory=list)


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter name -> param-group index, refusing parameters the model does not own."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    group_of: dict[str, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in name_of:
                raise CaptureError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                    "not a parameter of the model (rule: every optimized tensor must be a model parameter)")
            group_of[name_of[id(p)]] = gi
    return group_of


def batch_path(path) -> str:
    """The signature name of a batch leaf from its pytree path: ``batch[0]``, ``batch['ids']``."""
    return "batch" + "".join(f"[{k.key!r}]" if isinstance(k, pytree.MappingKey) else
                             f"[{getattr(k, 'idx', k)}]" for k in path)


def plan_layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                rule: UpdateRule, unused: frozenset[str] = frozenset()) -> StepLayout:
    """Where each input comes from; ``unused`` parameters (no gradient) are read, not updated."""
    group_of = optimizer_param_names(model, optimizer)
    trainable, frozen = [], []
    for name, p in model.named_parameters():
        updated = name in group_of and p.requires_grad and name not in unused
        (trainable if updated else frozen).append(name)
    leaves, spec = pytree.tree_flatten_with_path(batch)
    devices = {p.device for p in model.parameters()}
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise CaptureError(f"{batch_path(path)} is a {type(leaf).__name__}; "
                               "every leaf of a batch must be a tensor")
        if leaf.device.type == "meta" and devices and any(d.type != "meta" for d in devices):
            raise CaptureError(f"{batch_path(path)} of shape {tuple(leaf.shape)} is on device meta (no data) "
                               f"while the model's parameters are on {sorted(map(str, devices))}; "
                               "a batch must hold real data on the model's device")
    state_keys = {n: rule.state_keys(optimizer.param_groups[group_of[n]]) for n in trainable}
    hparams = [rule.input_names(g, i) for i, g in enumerate(optimizer.param_groups)]
    return StepLayout(trainable, frozen, [n for n, _ in model.named_buffers()], state_keys,
                      {n: group_of[n] for n in trainable}, [batch_path(p) for p, _ in leaves], spec,
                      hparams)


def build_signature(layout: StepLayout) -> StepSignature:
    ins = [Spec(InputKind.PARAM, n) for n in layout.trainable + layout.frozen]
    ins += [Spec(InputKind.BUFFER, n) for n in layout.buffers]
    ins += [Spec(InputKind.OPT_STATE, state_name(n, k)) for n in layout.trainable
            for k in layout.state_keys[n]]
    ins += [Spec(InputKind.HPARAM, n) for names in layout.hparams for n in names]
    ins += [Spec(InputKind.BATCH, p) for p in layout.batch_paths]
    outs = [Spec(OutputKind.LOSS, "loss")]
    outs += [Spec(OutputKind.PARAM, n) for n in layout.trainable]
    # Every buffer at first; those the forward does not mutate are pruned after tracing.
    outs += [Spec(OutputKind.BUFFER, n) for n in layout.buffers]
    outs += [Spec(OutputKind.OPT_STATE, state_name(n, k)) for n in layout.trainable
             for k in layout.state_keys[n]]
    return StepSignature(ins, outs)


@contextlib.contextmanager
def _module_path_annotations(model: torch.nn.Module):
    """Tag every traced node with the path of the module running when it was made."""
    stack: list[contextlib.AbstractContextManager] = []
    handles = []

    def enter(path):
        def hook(module, args):
            ctx = fx_traceback.annotate({MODULE_PATH: path})
            ctx.__enter__()
            stack.append(ctx)
        return hook

    def leave(module, args, output):
        if stack:
            stack.pop().__exit__(None, None, None)

    for path, module in model.named_modules(remove_duplicate=False):
        if path:
            handles.append(module.register_forward_pre_hook(enter(path)))
            handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while stack:
            stack.pop().__exit__(None, None, None)


def _tag_backward_with_forward_module(loss: torch.Tensor) -> None:
    """Ask autograd to record, on each backward node, the sequence number of its forward op."""
    try:
        from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
    except ImportError:  # a torch without it: backward nodes keep no module path
        return
    if loss.grad_fn is not None:
        setup_stacktrace_preservation_hooks([loss.grad_fn])


def _update_keeping_dtype(rule: UpdateRule, p, g, state, h, group):
    """``rule.update``, with a 0-dim parameter (CLIP's ``logit_scale``) seen as shape (1,).

    The rules compute their scalars as float64 0-dim tensors, standing in for
    torch.optim's Python floats; against a 0-dim float32 tensor that promotes
    the update to float64, where a Python float would not. As a 1-element
    tensor the parameter is "dimensioned" and keeps its dtype, with the same
    arithmetic as every other parameter.
    """
    if p.dim() != 0:
        return rule.update(p, g, state, h, group)
    shaped = {k: v if k in rule.scalar_state else v.reshape(1) for k, v in state.items()}
    new_p, new_s = rule.update(p.reshape(1), g.reshape(1), shaped, h, group)
    return new_p.reshape(()), {k: v if k in rule.scalar_state else v.reshape(()) for k, v in new_s.items()}


def _every_holder(model: torch.nn.Module, bound: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``bound`` (parameter and buffer names -> values) for every module attribute that holds one
    of those tensors, once per (module, attribute).

    A tied weight (one Parameter in two modules) is bound in each; a module reachable at two paths
    (``self.a = self.b = nn.Linear(...)``) once: binding it under both paths would swap the same
    attribute twice, and restoring would then leave the tracing tensor in the model.
    """
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    value_of = {id(named[name]): value for name, value in bound.items()}
    out, seen = {}, set()
    for path, module in model.named_modules(remove_duplicate=False):
        for leaf, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is None or id(tensor) not in value_of or (id(module), leaf) in seen:
                continue
            seen.add((id(module), leaf))
            out[f"{path}.{leaf}" if path else leaf] = value_of[id(tensor)]
    return out


def _refuse_module_backward_hooks(model: torch.nn.Module) -> None:
    """Full backward hooks hang on autograd nodes of each call (``grad_fn`` hooks), which a
    functional trace does not have; torch's own message for them says nothing of the model."""
    import torch.nn.modules.module as module_globals
    if module_globals._global_backward_hooks or module_globals._global_backward_pre_hooks:
        raise CaptureError("a global module backward hook (register_module_full_backward_hook) cannot be "
                           "captured: the step's backward is one graph; remove it, or put a tensor hook "
                           "(tensor.register_hook) on the value in forward")
    for path, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            raise CaptureError(
                f"module '{path or type(model).__name__}' has a full backward hook "
                "(register_full_backward_hook / register_full_backward_pre_hook), which cannot be captured: "
                "the step's backward is one graph; put a tensor hook (tensor.register_hook) on its output "
                "in forward, or on its parameters, instead")


def _gradient_hooks(model: torch.nn.Module, layout: StepLayout) -> dict[str, list]:
    """Each trainable parameter's ``register_hook`` hooks, refusing what a graph cannot run."""
    params = dict(model.named_parameters())
    hooks = {}
    for name in layout.trainable:
        p = params[name]
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise CaptureError(
                f"parameter '{name}' has a post-accumulate-grad hook (register_post_accumulate_grad_hook): "
                "it runs Python on p.grad after backward, which a captured step, whose gradients are "
                "values of its graph, cannot call; remove the hook (the plan's grad_clip_norm or "
                "accumulation replace the usual ones)")
        if p._backward_hooks:
            hooks[name] = list(p._backward_hooks.values())
    return hooks


def _run_gradient_hooks(hooks, grad: torch.Tensor) -> torch.Tensor:
    # A leaf's tensor hooks see its gradient before it is accumulated, in registration order,
    # each replacing it when it returns a tensor: traced here, they become nodes of the backward.
    for hook in hooks:
        result = hook(grad)
        if result is not None:
            grad = result
    return grad


def _make_step_fn(model, optimizer, loss_fn, layout: StepLayout, rule: UpdateRule):
    n_train, n_frozen, n_buf = len(layout.trainable), len(layout.frozen), len(layout.buffers)
    groups = optimizer.param_groups
    grad_hooks = _gradient_hooks(model, layout)
    _refuse_module_backward_hooks(model)
    on_meta = any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))

    def step(*flat):
        it = iter(flat)
        trainable = [next(it) for _ in range(n_train)]
        frozen = [next(it) for _ in range(n_frozen)]
        buffers = [next(it) for _ in range(n_buf)]
        states = [{k: next(it) for k in layout.state_keys[n]} for n in layout.trainable]
        hparams = [rule.pack(group, [next(it) for _ in names]) for group, names in zip(groups, layout.hparams)]
        batch = pytree.tree_unflatten(list(it), layout.batch_spec)
        frozen_params = dict(zip(layout.frozen, frozen))

        def loss_of(*params):
            # Buffers are bound as copies made inside the transform: a forward that
            # updates them in place (BatchNorm's running statistics) may then do so,
            # and the copies, returned as aux, are the buffers' new values.
            new_buffers = {n: b.clone() for n, b in zip(layout.buffers, buffers)}
            bound = dict(zip(layout.trainable, params)) | frozen_params | new_buffers
            with _reparametrize_module(model, _every_holder(model, bound), strict=False):
                with _module_path_annotations(model), fused_attention_on_meta(on_meta):
                    loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise CaptureError("loss_fn must return a scalar tensor "
                                   f"(got {type(loss).__name__} of shape {getattr(loss, 'shape', None)})")
            if not loss.requires_grad:
                # Detached, computed under no_grad, or not differentiable (argmax):
                # eager's backward refuses it with this error, so the step does too.
                raise RuntimeError(NO_GRAD_LOSS)
            _tag_backward_with_forward_module(loss)
            return loss.reshape(()), [new_buffers[n] for n in layout.buffers]

        with fx_traceback.annotate({REGION: Region.FORWARD.value}):
            loss, vjp_fn, new_buffers = torch.func.vjp(loss_of, *trainable, has_aux=True)
        with fx_traceback.annotate({REGION: Region.BACKWARD.value}):
            # As eager's backward runs: without building a graph of itself. With one (vjp's
            # default under grad mode) autograd spells some derivatives in an "infinitely
            # differentiable" form, other kernels than eager's (SiLU's, group norm's, RMSNorm's).
            grads = vjp_fn(torch.ones_like(loss), create_graph=False)
            grads = [_run_gradient_hooks(grad_hooks.get(name, ()), g) for name, g in zip(layout.trainable, grads)]
            # Two parameters can receive one tensor as their gradient (``x + b1 + b2``); eager gives
            # each its own ``.grad``, and so does the graph: every gradient is its parameter's value.
            seen: set[int] = set()
            for i, g in enumerate(grads):
                if id(g) in seen:
                    grads[i] = g = g.clone()
                seen.add(id(g))
        new_params, new_states = [], []
        with fx_traceback.annotate({REGION: Region.OPTIMIZER.value}):
            for name, p, g, s in zip(layout.trainable, trainable, grads, states):
                group = groups[layout.group_of[name]]
                with fx_traceback.annotate({MODULE_PATH: name.rpartition(".")[0]}):
                    new_p, new_s = _update_keeping_dtype(rule, p, g, s, hparams[layout.group_of[name]], group)
                new_params.append(new_p)
                new_states.extend(new_s[k] for k in layout.state_keys[name])
        return [loss, *new_params, *new_buffers, *new_states]

    return step


class _RefusedWithLine(CaptureError):
    """A refusal that names the model's source line (found by tracing again with stack traces)."""


def _refuse_generator(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """A ``torch.Generator`` the model passes to a random op: tracing copies it into the graph, so
    the step would draw from the copy while the model's own generator stood still."""
    if node.op != "get_attr" or not isinstance(getattr(gm, node.target, None), torch.Generator):
        return
    user = next(iter(node.users), node)
    raise _RefusedWithLine(
        f"a torch.Generator passed to {user.target} {_source_line(user)}: a captured step cannot draw "
        "from a generator object of the model (its state would not advance as in eager); draw from "
        "the default generator (seeded by torch.manual_seed), or make the noise outside the step "
        "and pass it in the batch")


def _symbolic(t: torch.Tensor) -> bool:
    """Whether a size, stride or the storage offset of ``t`` is a symbol (asked first: a layout of
    plain ints, nearly every node's, needs no walk for unbacked symbols)."""
    return any(isinstance(d, torch.SymInt) for d in (*t.shape, *t.stride(), t.storage_offset()))


def _refuse_data_dependent_shape(node: torch.fx.Node) -> None:
    """A value whose shape depends on the data (boolean-mask indexing, nonzero, unique) cannot be
    one static graph: refused here, naming the model's line from the node's stack trace."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else [vals]
    if not any(isinstance(v, torch.Tensor) and _symbolic(v) and free_unbacked_symbols(v) for v in vals):
        return
    raise _RefusedWithLine(
        f"data-dependent shape {_source_line(node)} ({node.target}): the step is captured as one graph "
        "with static shapes, and this value's shape depends on tensor data (boolean-mask indexing, "
        "nonzero, unique); use a mask of the full shape instead (torch.where, multiplying by the mask)")


def _source_line(node: torch.fx.Node) -> str:
    """``at file.py:N (`code`)``: the innermost frame of the node's stack trace in the model's or the
    loss's source (not torch's, not ours)."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()]
    own = tuple(os.path.join(_OWN_DIRS[0], d) for d in ("graph_ir", "cann_passes"))
    for i in reversed(range(len(lines))):
        line = lines[i]
        if line.startswith("File ") and not any(d in line for d in _LIBRARY_DIRS + own):
            path, _, rest = line[len("File "):].partition(", line ")
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"at {os.path.basename(path.strip(chr(34)))}:{rest.split(',')[0]}" + \
                (f" (`{code}`)" if code else "")
    return "in the model or loss_fn"


def _trace_with_stack_traces(step_fn, flat: list, layout: StepLayout, loss_fn) -> torch.fx.GraphModule:
    # make_fx keeps the frames of functions named ``forward``; the loss function's are kept too.
    from torch.fx.proxy import _register_stack_trace_anchor
    fn = getattr(loss_fn, "__func__", loss_fn)
    if hasattr(fn, "__code__"):
        _register_stack_trace_anchor(fn)
    return _trace(step_fn, flat, layout, stack_traces=True)


def _finish_metadata(gm: torch.fx.GraphModule) -> None:
    """Move annotations into the IR's vocabulary and give backward nodes their module path."""
    module_by_seq: dict[int, str] = {}
    for node in gm.graph.nodes:
        custom = node.meta.pop("custom", {}) or {}
        if node.op in ("placeholder", "output"):
            node.meta[REGION] = Region.IO.value
            continue
        _refuse_generator(gm, node)
        node.meta[REGION] = custom.get(REGION, Region.FORWARD.value)
        path = custom.get(MODULE_PATH, "")
        seq = node.meta.get("seq_nr")
        if node.meta[REGION] == Region.FORWARD.value and path and seq is not None:
            module_by_seq.setdefault(seq, path)
        if node.meta[REGION] == Region.BACKWARD.value and node.meta.get("autograd_backward"):
            path = module_by_seq.get(seq, "")
        node.meta[MODULE_PATH] = path
        _refuse_data_dependent_shape(node)
        # Stack traces point into this file and torch; they make dumps unreadable.
        node.meta.pop("stack_trace", None)
    _loss_is_forward(gm)


def _loss_is_forward(gm: torch.fx.GraphModule) -> None:
    """What the loss is computed from is forward, whatever annotation it was traced under.

    Functionalization re-creates a view of a mutated value where it is next read: a loss updated
    in place (transformers' ``loss += coef * aux_loss`` for a mixture of experts) gets its
    ``reshape(())`` traced at the backward's first read of it, inside the backward annotation."""
    loss = gm.graph.output_node().args[0][0]       # the step returns the loss first
    todo = [loss] if isinstance(loss, torch.fx.Node) else []
    while todo:
        node = todo.pop()
        if node.meta.get(REGION) == Region.BACKWARD.value:
            node.meta[REGION] = Region.FORWARD.value
            todo.extend(node.all_input_nodes)


def _functionalize_batch_norm(gm: torch.fx.GraphModule) -> None:
    """Make training-mode ``native_batch_norm`` return its running statistics.

    Its schema does not declare that it updates ``running_mean``/``running_var``
    in place, so functionalization keeps it as is; the functional variant
    returns the new statistics, which then become the buffers' outputs.
    """
    aten = torch.ops.aten
    output = gm.graph.output_node()
    for node in list(gm.graph.nodes):
        if node.target != aten.native_batch_norm.default or not node.args[5]:
            continue
        running = node.args[3:5]
        if any(r is None for r in running):
            continue
        node.target = aten._native_batch_norm_legit_functional.default
        old_val = node.meta["val"]
        node.meta["val"] = (*old_val, running[0].meta["val"], running[1].meta["val"])
        with gm.graph.inserting_after(node):
            new_stats = [gm.graph.call_function(operator.getitem, (node, i)) for i in (3, 4)]
        for stat, source in zip(new_stats, running):
            stat.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            stat.meta["val"] = source.meta["val"]
            # The buffer's output was the copy the kernel used to update in place.
            output.args = ([stat if v is source else v for v in output.args[0]],)


def _inline_constants(gm: torch.fx.GraphModule) -> None:
    """Tensor constants made in ``forward`` (``torch.tensor(...)``, ``torch.tensor([])``) become
    creation ops.

    make_fx stores them as ``_tensor_constant*`` attributes read by ``get_attr`` and
    copied by ``lift_fresh_copy``. Those are not values of the step's dataflow: a
    graph split in parts (gradient accumulation), serialized or lowered per part
    would lose them. A constant whose elements are all equal (every one the models
    users bring make: empty tensors, scalars, fills) is the same as
    ``aten.full(shape, value)``, a node like any other, tagged with the region and
    module of its first use. Others stay ``get_attr`` reads of the graph module.
    """
    aten = torch.ops.aten
    inlined: set[str] = set()
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or value.is_complex() or value.is_quantized:
            continue
        flat = value.reshape(-1)
        if flat.numel() and not bool((flat == flat[0]).all()):
            continue
        fill = flat[0].item() if flat.numel() else 0
        first_use = next(iter(node.users), None)
        with gm.graph.inserting_before(node):
            full = gm.graph.call_function(aten.full.default, (list(value.shape), fill),
                                          {"dtype": value.dtype, "device": value.device})
        source = first_use if first_use is not None else node
        full.meta.update({k: v for k, v in source.meta.items() if k in (REGION, MODULE_PATH, "val")})
        if "val" not in full.meta and "val" in node.meta:
            full.meta["val"] = node.meta["val"]
        for user in list(node.users):
            if user.target == aten.lift_fresh_copy.default:
                user.replace_all_uses_with(full)
                gm.graph.erase_node(user)
            else:
                user.replace_input_with(node, full)
        gm.graph.erase_node(node)
        inlined.add(node.target)
    # An attribute is dropped once no read of it is left: one tensor can be read by several get_attr nodes.
    for name in inlined - {n.target for n in gm.graph.nodes if n.op == "get_attr"}:
        delattr(gm, name)


def _prune_unmutated_buffers(gm: torch.fx.GraphModule, signature: StepSignature) -> None:
    """Drop buffer outputs that are only the copy of their input: the forward left them alone."""
    placeholders = {spec.name: node for node, spec in
                    zip([n for n in gm.graph.nodes if n.op == "placeholder"], signature.inputs)
                    if spec.kind == InputKind.BUFFER}
    output = gm.graph.output_node()
    keep_values, keep_specs = [], []
    for value, spec in zip(output.args[0], signature.outputs):
        untouched = (spec.kind == OutputKind.BUFFER and isinstance(value, torch.fx.Node)
                     and value.target == torch.ops.aten.clone.default
                     and value.args[0] is placeholders[spec.name])
        if not untouched:
            keep_values.append(value)
            keep_specs.append(spec)
    output.args = (keep_values,)
    signature.outputs[:] = keep_specs


def _name_placeholders(gm: torch.fx.GraphModule, signature: StepSignature) -> None:
    taken = {n.name for n in gm.graph.nodes}
    for node, spec in zip([n for n in gm.graph.nodes if n.op == "placeholder"], signature.inputs):
        kind = InputKind(spec.kind)
        raw = spec.name if kind == InputKind.BATCH else f"{_PREFIX[kind]}_{spec.name}"
        base = "".join(c if c.isalnum() else "_" for c in raw).strip("_")
        name, i = base, 1
        while name in taken and name != node.name:
            name, i = f"{base}_{i}", i + 1
        taken.discard(node.name)
        node._rename(name)
        node.target = name
        taken.add(name)


def initial_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            layout: StepLayout, rule: UpdateRule) -> set[str]:
    """Create torch.optim-format state for parameters that have none yet; returns their names."""
    params = dict(model.named_parameters())
    created = set()
    for name in layout.trainable:
        p = params[name]
        state = optimizer.state[p]
        if not state:
            state.update(rule.init_state(p.detach(), optimizer.param_groups[layout.group_of[name]]))
            created.add(name)
        missing = [k for k in layout.state_keys[name] if k not in state]
        if missing:
            raise CaptureError(f"optimizer state of '{name}' lacks {missing}; "
                               f"it has {sorted(state)}")
    return created


def hparam_value(optimizer: torch.optim.Optimizer, name: str) -> float:
    """``lr:group0`` -> group 0's lr; ``betas.1:group0`` -> group 0's betas[1]."""
    key, _, group = name.partition(":group")
    key, _, index = key.partition(".")
    value = optimizer.param_groups[int(group)][key]
    return float(value[int(index)] if index else value)


def gather_inputs(model, optimizer, layout: StepLayout, batch: Any) -> list[torch.Tensor]:
    """The flat input list of a captured step, read from the live model and optimizer."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    flat = [params[n].detach() for n in layout.trainable + layout.frozen]
    flat += [buffers[n] for n in layout.buffers]
    flat += [optimizer.state[params[n]][k] for n in layout.trainable for k in layout.state_keys[n]]
    device = flat[0].device if flat else torch.device("cpu")
    # float64, like the Python float torch.optim computes with.
    flat += [torch.tensor(hparam_value(optimizer, n), dtype=torch.float64, device=device)
             for names in layout.hparams for n in names]
    leaves, spec = pytree.tree_flatten(batch)
    if spec != layout.batch_spec:
        raise CaptureError(f"batch structure changed: captured {layout.batch_spec}, got {spec}")
    return flat + leaves


def _unused_parameters(gm: torch.fx.GraphModule, signature: StepSignature,
                       layout: StepLayout) -> set[str]:
    """Trainable parameters the forward never reads: their gradient is None in eager PyTorch."""
    placeholders = dict(zip(signature.inputs, (n for n in gm.graph.nodes if n.op == "placeholder")))
    return {name for name in layout.trainable
            if not any(u.meta.get(REGION) == Region.FORWARD.value
                       for u in placeholders[Spec(InputKind.PARAM, name)].users)}


@contextlib.contextmanager
def _tracing_state():
    """Tell the model it is being traced, as ``torch.export``'s non-strict mode does.

    Libraries test ``torch.compiler.is_compiling()`` / ``is_exporting()`` to leave out
    shortcuts that read tensor values: transformers' attention-mask builders skip
    the mask when ``attention_mask.all()`` (is_causal instead), which would need
    the batch's data at capture. Traced this way the step always builds the mask,
    so one graph is right for all-ones and padded masks alike and a change of mask
    kind never recompiles (a guard on the mask's kind would double compilations).
    """
    old = torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag
    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = old


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, contextlib))
_OWN_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the model's or the loss's own source (not torch's, not ours)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_LIBRARY_DIRS) or frame.filename.startswith("<"):
            continue
        if path.startswith(_OWN_DIRS) and not _is_users(path):
            continue
        return frame
    return None


def _is_users(path: str) -> bool:
    # Our own package directories are graph_ir and cann_passes; everything else under the
    # repository (recipes, tests, tools) is model or loss code.
    own = tuple(os.path.join(_OWN_DIRS[0], d) + os.sep for d in ("graph_ir", "cann_passes"))
    return not path.startswith(own)


def _where(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "in the model or loss_fn"
    code = f" (`{frame.line.strip()}`)" if frame.line else ""
    return f"at {os.path.basename(frame.filename)}:{frame.lineno}{code}"


def _data_dependent(exc: BaseException) -> bool:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)):
        return True
    # A tensor's value read in Python (``.item()``) and used where Python needs an int (an index):
    # the read is a symbol while tracing, which Python's indexing refuses by type.
    return isinstance(exc, (IndexError, TypeError)) and "SymInt" in str(exc)


class _RefusedCheckpoint:
    """Stands in for torch.utils.checkpoint's machinery while a step is captured."""

    @staticmethod
    def apply(*args, **kwargs):
        raise CaptureError("torch.utils.checkpoint inside the model cannot be captured: the step's "
                           "recompute is chosen by the plan (recompute: selective/full/every_n_layers/"
                           "budget); remove the checkpoint call (or disable gradient checkpointing) "
                           "and set the plan's recompute instead")


@contextlib.contextmanager
def _refusing_checkpoint():
    import torch.utils.checkpoint as ckpt
    saved = ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator
    ckpt.CheckpointFunction = _RefusedCheckpoint
    ckpt._checkpoint_without_reentrant_generator = _RefusedCheckpoint.apply
    try:
        yield
    finally:
        ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator = saved


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """Fake tensors log a meta kernel's failure with its whole traceback before re-raising it;
    capture turns that failure into one line of its own, so the log would only repeat it."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _trace(step, flat: list, layout: StepLayout, stack_traces: bool = False) -> torch.fx.GraphModule:
    try:
        # A lazy GraphModule: capture edits the graph afterwards, code is generated once, when run.
        with fx_traceback.preserve_node_meta(), _tracing_state(), _refusing_checkpoint(), \
                capturing_custom_autograd(), _quiet_fake_tensor_log(), _use_lazy_graph_module(True):
            return make_fx(torch.func.functionalize(step), tracing_mode="fake",
                           _allow_non_fake_inputs=True, record_stack_traces=stack_traces)(*flat)
    except CaptureError as exc:
        frame = _user_frame(exc)
        if frame is None or "torch.utils.checkpoint" not in str(exc):
            raise
        raise CaptureError(f"{exc} ({_where(frame)})") from None
    except Exception as exc:
        shapes = ", ".join(f"{p}: {tuple(t.shape)}" for p, t in
                           zip(layout.batch_paths, flat[len(flat) - len(layout.batch_paths):]))
        frame = _user_frame(exc)
        if _data_dependent(exc):
            raise CaptureError(
                f"data-dependent control flow {_where(frame)}: the step is captured as one graph, which "
                "cannot branch on tensor values or read them in Python (.item(), bool(tensor), "
                "shapes that depend on data); compute it with tensor ops (torch.where, masks, "
                "clamp) or move it out of the model and loss_fn") from None
        if str(exc) == NO_GRAD_LOSS:
            raise exc.with_traceback(None) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raised_by_torch = frame is None or traceback.extract_tb(exc.__traceback__)[-1].filename.startswith(
            _LIBRARY_DIRS[0])
        if raised_by_torch and isinstance(exc, RuntimeError) and type(exc).__init__ is RuntimeError.__init__:
            # A torch op refused the batch (a shape or dtype that does not fit the model): eager's
            # error type (CaptureError is a RuntimeError) and message, on one line, with where and
            # for which batch.
            raise CaptureError(f"{first} ({_where(frame)}; capturing the step for a batch of {shapes})") \
                from None
        exc.add_note(f"while capturing the training step for a batch of {shapes}")
        raise


@gc_paused()
@with_stack_room
def capture_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                       batch: Any, *, name: str = "step", unused: frozenset[str] = frozenset(),
                       guards: "GuardRecorder | None" = None) -> tuple[TrainGraph, StepLayout]:
    """Capture ``loss_fn(model, batch)`` + backward + ``optimizer`` update as one TrainGraph.

    The optimizer's state is initialised in torch.optim's own format where it is
    empty, so the same tensors can be fed to the graph and checkpointed.
    Parameters the loss does not depend on are left alone, as torch.optim skips
    a parameter whose ``grad`` is None: found after a first trace, they are
    captured again as read-only inputs.
    """
    rule = rule_for(optimizer)
    layout = plan_layout(model, optimizer, batch, rule, unused)
    if not layout.trainable:
        raise CaptureError("the optimizer updates no trainable parameter of the model")
    created = initial_optimizer_state(model, optimizer, layout, rule)
    signature = build_signature(layout)
    flat = gather_inputs(model, optimizer, layout, batch)
    step_fn = _make_step_fn(model, optimizer, loss_fn, layout, rule)
    with guards.attributes(model) if guards is not None else contextlib.nullcontext():
        gm = _trace(step_fn, flat, layout)
    if guards is not None:
        guards.functions(model, loss_fn)
        guards.structure(model)
    try:
        _finish_metadata(gm)
    except _RefusedWithLine as first:
        # Refused: traced once more, now recording where each op came from, to name the line.
        # Stack traces cost every node a walk of the Python stack, so only this path pays.
        try:
            _finish_metadata(_trace_with_stack_traces(step_fn, flat, layout, loss_fn))
        except _RefusedWithLine as named:
            raise CaptureError(str(named)) from None
        raise CaptureError(str(first)) from None
    newly_unused = _unused_parameters(gm, signature, layout)
    if newly_unused:
        params = dict(model.named_parameters())
        for param_name in newly_unused & created:
            optimizer.state.pop(params[param_name], None)
        return capture_train_step(model, optimizer, loss_fn, batch, name=name,
                                  unused=unused | frozenset(newly_unused), guards=guards)
    _inline_constants(gm)
    _functionalize_batch_norm(gm)
    _prune_unmutated_buffers(gm, signature)
    _name_placeholders(gm, signature)
    eliminate_dead_code(gm.graph)
    gm.recompile()
    tg = TrainGraph(gm, signature, {"name": name, "optimizer": type(optimizer).__name__,
                                    "model": type(model).__name__,
                                    GraphAttr.OPTIMIZER_FUSED: fused_kernel_asked(optimizer)})
    _mark_gradients(tg)
    return tg, layout


def _mark_gradients(tg: TrainGraph) -> None:
    """Mark each parameter's gradient now, while every parameter's is still its own node: after
    ``cleanup`` merges equal computations (GPT-NeoX's parallel residual gives two biases one equal
    gradient sum), name-keyed rewrites would see one value serving two parameters."""
    try:
        find_gradients(tg, mark=True)
    except GradientNotFound:
        pass     # a custom rule whose gradient is not one value: the passes that need one say so
