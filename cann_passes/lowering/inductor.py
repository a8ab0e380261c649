"""inductor: torch's own compiler (``compile_fx``), C++/OpenMP on CPU, Triton on GPU.

The graph is already functional aten, so inductor's own AOT step has nothing
left to trace and goes straight to fusion and code generation.

Parameters, buffers and optimizer state are updated in place through input
mutation: the lowered copy ends with ``copy_(input, new value)`` for each
value the step returns as its own new contents (see ``writable_inputs``) and
returns the input itself. AOTAutograd keeps those mutations in the graph
(``keep_inference_input_mutations``) and inductor fuses each copy into the
kernel that computes the value, which then stores straight into the input's
buffer, after every read of the old value (its scheduler orders the write
after them): no fresh parameter and state tensors per step and nothing for
the runtime to store. A ``cann::fused_adam`` call becomes the mutating
``cann::fused_adam_`` on the inputs, which inductor reinplaces (the
functional op would clone every parameter and moment first). The kernel
order is inductor's, so unlike the eager backend nothing fences the writes
after the last backward op; the kernels that can fail on bad data (index
bounds of the embedding and the loss's gather) run in the forward, before
any gradient exists. A call whose
written inputs share storage with another input runs a functional
compilation instead (made on first need).

A second process lowers from inductor's FX graph cache and AOTAutograd's
cache (``compile_cache.lowering_context`` gives them a ShapeEnv); the lowered
copy drops the tracer class so that the graph loaded from the compile cache
and the freshly captured one have one AOTAutograd key.

The pipeline ends with three passes for this backend (``required_passes``; the
compile driver appends them to any pipeline, one given as text included):
``spell_out_alpha`` (torch 2.13's post-grad ``addmm`` pattern drops the
``alpha`` of ``add(mm(a, b), c, alpha=k)``) and ``tanh_gelu_as_sigmoid``
(inductor's C++ kernels evaluate ``tanh`` at six times the cost of
``sigmoid``; tanh-GELU and its gradient are spelled with ``sigmoid``, float32
CPU tensors only, a few ulps of rounding), and ``bool_collectives_as_bytes`` (inductor
types a collective's result on a boolean tensor int64 on CPU and then fails on a mask built from it:
context parallelism's gathered attention mask). ``linear_on_onednn`` (float32 CPU
matmuls on oneDNN instead of MKL) is opt-in, ``Plan(extra_passes=
("linear_on_onednn",))``: inductor calls its op as an extern kernel.
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx

from graph_ir import TrainGraph

from . import cpp_kernel_batches
from graph_ir.meta import GraphAttr
from graph_ir.multi_tensor_ops import FUSED_ADAM, FUSED_ADAM_IN_PLACE, IN_PLACE
from graph_ir.stack_room import with_stack_room

from .base import GuardedRunner, LoweringFailed, buffer_plan_enabled, cxx_compiler_available, writable_inputs
from .inductor_buffers import HoldingRunner, allocating_from_kept_buffers

aten = torch.ops.aten


def memory_format(name: str) -> torch.memory_format:
    """``torch.<name>``: what a memory format pickles as while inductor keys its caches here."""
    return getattr(torch, name)


def _reduce_memory_format(fmt: torch.memory_format):
    return memory_format, (str(fmt).removeprefix("torch."),)


@contextlib.contextmanager
def stable_cache_keys():
    """Inductor's and AOTAutograd's cache keys the same in every process for the same graph.

    Their keys pickle the inputs' metadata, whose memory format (``torch.contiguous_format``)
    pickles by name with no module: pickle takes the first module in ``sys.modules`` that reaches
    ``torch`` from its attributes, which depends on what the process imported first (a rank run
    by multiprocessing: its ``__mp_main__``; a child process: ``torch._utils``). The key then
    differs between the training process and background lowering's child, and the training
    process missed the child's caches and compiled again (gloo ranks holding several pipeline
    stages). While a graph is lowered here a memory format pickles as a call of
    :func:`memory_format` by name: the same bytes in every process."""
    import copyreg
    previous = copyreg.dispatch_table.get(torch.memory_format)
    copyreg.dispatch_table[torch.memory_format] = _reduce_memory_format
    try:
        yield
    finally:
        if previous is None:
            copyreg.dispatch_table.pop(torch.memory_format, None)
        else:
            copyreg.dispatch_table[torch.memory_format] = previous


def _keep_gloo_order(graph: TrainGraph):
    """Inductor's node reordering (for peak memory, for locality) off for a graph whose collectives
    ``gloo_all_gathers_alone`` ordered: it would issue all-gathers beside other collectives again
    (gloo's all-gather beside other collectives corrupts the heap)."""
    from torch._inductor import config
    return config.patch(reorder_for_peak_memory=False, reorder_for_locality=False) \
        if graph.attrs.get(GraphAttr.GLOO_ORDERED) else contextlib.nullcontext()


def _multi_tensor_updates_in_place(gm: torch.fx.GraphModule, writable: dict[torch.fx.Node, int]) -> list:
    """Each ``cann::fused_adam`` whose written lists are all step inputs, each updated to the
    op's result and read by nothing after it, becomes ``cann::fused_adam_`` writing into them.

    The functional op clones the parameters and both moments before the kernel (about 8 ms a step
    on a 100M-parameter LLaMA on CPU) and the lowering's ``copy_`` writes each result back; the
    mutating op is functionalized by AOTAutograd and reinplaced by inductor, which runs the kernel
    on the inputs themselves. Returns the inputs so written."""
    graph, written = gm.graph, []
    values = list(graph.output_node().args[0])
    position = {n: i for i, n in enumerate(graph.nodes)}
    lists_of = IN_PLACE[FUSED_ADAM].written             # argument index -> result index
    for node in list(graph.find_nodes(op="call_function", target=FUSED_ADAM)):
        results = {}                                    # (result index, i) -> getitem node
        items = [item for user in node.users for item in user.users]
        plain = all(u.target is operator.getitem for u in [*node.users, *items])
        for item in items if plain else ():
            results[(item.args[0].args[1], item.args[1])] = item
        targets = [(k, i, a) for k in lists_of for i, a in enumerate(node.args[k])]
        if not plain or not all(isinstance(a, torch.fx.Node) and a in writable and
                                values[writable[a]] is results.get((lists_of[k], i)) and
                                all(position[u] < position[node] for u in a.users if u is not node)
                                for k, i, a in targets) \
                or len({a for _, _, a in targets}) != len(targets):
            continue
        with graph.inserting_before(node):
            in_place = graph.call_function(FUSED_ADAM_IN_PLACE, node.args, node.kwargs)
        in_place.meta.update(node.meta, val=None)
        for k, i, a in targets:
            results[(lists_of[k], i)].replace_all_uses_with(a)
        for item in results.values():
            graph.erase_node(item)
        for user in list(node.users):
            graph.erase_node(user)
        graph.erase_node(node)
        written += [a for _, _, a in targets]
    return written


def mutate_inputs(gm: torch.fx.GraphModule, writable: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    """End ``gm`` with ``copy_(input, new)`` for each writable input whose new value has its shape and
    dtype, and return the input in that output position; multi-tensor updates write their inputs
    themselves (``_multi_tensor_updates_in_place``). Returns the inputs mutated."""
    mutated = _multi_tensor_updates_in_place(gm, writable)
    out = gm.graph.output_node()
    values = list(out.args[0])
    with gm.graph.inserting_before(out):
        for node, index in writable.items():
            new, old = values[index], node.meta.get("val")
            value = new.meta.get("val") if isinstance(new, torch.fx.Node) else None
            if new is node or not isinstance(value, torch.Tensor) or not isinstance(old, torch.Tensor) \
                    or value.shape != old.shape or value.dtype != old.dtype:
                continue
            copy = gm.graph.call_function(aten.copy_.default, (node, new))
            copy.meta["val"] = old
            values[index] = node
            mutated.append(node)
    out.args = (values,)
    gm.graph.lint()
    gm.recompile()
    return mutated


def _static_example_inputs(example_inputs) -> list:
    """The example inputs as fake tensors of static shape, in the tracing context's fake mode.

    A real tensor handed to ``compile_fx`` under a fake mode with a ShapeEnv (the one
    ``compile_cache.lowering_context`` sets up) is fakified with dynamic, duck-sized dimensions:
    every size becomes a symbol, inductor then generates kernels over symbolic sizes, reasons about
    them with sympy at every fusion decision, and on a ResNet fails outright (BatchNorm's
    ``n / (n - 1)`` over symbolic convolution sizes becomes a SymFloat AOTAutograd cannot turn
    back into a tensor). The step's shapes are fixed when it is compiled (a new shape recompiles),
    so they are handed over already fake and static, as Dynamo hands its graphs to a backend."""
    from torch._guards import TracingContext
    context = TracingContext.try_get()
    if context is None or context.fake_mode is None:
        return list(example_inputs)
    mode = context.fake_mode
    return [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
            for x in example_inputs]


def _holding(run):
    """The runner keeping its intermediate buffers between calls (``inductor_buffers``), as the eager
    backend holds its planned slots; ``$CANN_PASSES_BUFFER_PLAN=0`` turns both off."""
    return HoldingRunner(run) if buffer_plan_enabled() else run


class InductorLowering:
    name = "inductor"
    required_passes = ("spell_out_alpha", "tanh_gelu_as_sigmoid", "bool_collectives_as_bytes")

    def available(self) -> tuple[bool, str]:
        return cxx_compiler_available()

    @staticmethod
    def warm_up() -> None:
        """Import inductor's compiler and hash torch's sources for its cache keys (once per process):
        background lowering does both in a thread before its take-over."""
        import torch._inductor.compile_fx  # noqa: F401
        from torch._inductor.codecache import torch_key
        torch_key()

    def compile(self, graph: TrainGraph, example_inputs, plan):
        from torch._inductor.compile_fx import compile_fx

        def lowered(mutating: bool):
            copy = graph.copy()
            gm = copy.gm
            # AOTAutograd's cache key pickles the GraphModule, tracer class included: a captured
            # graph (make_fx's tracer) and the same graph loaded from the compile cache (none)
            # must key alike, or a second process re-traces and recompiles what the first stored.
            gm._tracer_cls = gm.graph._tracer_cls = None
            for node in gm.graph.nodes:
                # torch reads node.meta["recompute"] as a CheckpointPolicy (FX's code printer takes
                # its .name); the recompute pass's mark there is a plain bool, so the copy drops it.
                if isinstance(node.meta.get("recompute"), bool):
                    del node.meta["recompute"]
            mutated = mutate_inputs(gm, writable_inputs(copy)) if mutating else []
            return copy, gm, mutated

        copy, gm, mutated = lowered(True)
        inputs = _static_example_inputs(example_inputs)

        def compiled(gm):
            with _keep_gloo_order(graph), cpp_kernel_batches.batched(), stable_cache_keys(), \
                    allocating_from_kept_buffers():
                # Inductor's trace and code generation run deeper than capture (see graph_ir.stack_room).
                return _holding(with_stack_room(compile_fx)(gm, inputs))
        try:
            run = compiled(gm)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise LoweringFailed(
                f"inductor could not compile graph '{graph.name}' ({type(exc).__name__}: {first}); the "
                "graph verified, and backend 'eager' runs it (or background_lowering: true, which "
                "keeps the step on the eager lowering when the backend's fails)") from exc
        if not mutated:
            return run
        positions = {n: i for i, n in enumerate(copy.placeholders())}
        return GuardedRunner(run, copy, sorted(positions[n] for n in mutated),
                             lambda: compiled(lowered(False)[1]))
