"""split_grad_apply: cut an accumulating step into its per-microbatch and per-optimizer-step graphs.

A program pass: it takes the program and replaces every whole-step graph that
``grad_accumulation`` marked with two graphs, cut at the optimizer region:

- ``grad`` (kind grad, run once per microbatch): forward, loss, backward and
  ``acc = acc_in + weight * grad``; its accumulator outputs flow back into
  its own inputs for the next microbatch and into ``apply``;
- ``apply`` (kind apply, run once per optimizer step): gradient
  synchronization (placed at the start of the optimizer region by
  ``data_parallel`` / ``optimizer_shard``) and the optimizer update, reading
  ``scale * acc``. It has no loss.

Values the optimizer reads from the forward or backward regions other than
the accumulators (rule: the optimizer may read only accumulated gradients
from backward) would have to cross per microbatch, so they are refused. Run
it after the rewrites that need the whole step; passes after it run on each
graph (``apply(cleanup)`` on one kind only).
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.train_graph import lazy_graph_module
from graph_ir.meta import ACCUMULATOR_PREFIX, REGION, GraphAttr, GraphKind, Region, graph_kind, region_of
from graph_ir.program import EVERY_MICROBATCH, EVERY_STEP, Flow, Program, Run
from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature

from ..pass_manager import PassContext, register_pass


class SplitError(ValueError):
    pass


def _part(graph: TrainGraph, keep, outputs: list[tuple[Spec, torch.fx.Node]], kind: GraphKind,
          cut: dict[torch.fx.Node, Spec]) -> TrainGraph:
    """A new TrainGraph of the nodes ``keep`` accepts; values in ``cut`` become inputs."""
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    needed = {a for n in graph.graph.nodes if n.op == "call_function" and keep(n) for a in n.all_input_nodes}
    needed |= {node for _, node in outputs if isinstance(node, torch.fx.Node)}
    inputs = []
    for spec, node in zip(graph.signature.inputs, graph.placeholders()):
        if node in needed:
            env[node] = new.node_copy(node)
            inputs.append(spec)
    for node, spec in cut.items():
        if node in needed:
            if spec in inputs:  # the cut value replaces the input of the same name
                raise SplitError(f"the {kind.value} graph would read {spec.kind} '{spec.name}' twice")
            placeholder = new.placeholder("".join(c if c.isalnum() else "_" for c in spec.name))
            placeholder.meta = {"val": node.meta["val"], REGION: Region.IO.value}
            env[node] = placeholder
            inputs.append(spec)
    for node in graph.graph.nodes:
        # A tensor constant made in forward (``_tensor_constant*``, read by ``lift_fresh_copy``)
        # is a ``get_attr`` of the module: each part that reads it gets its own read, and the
        # GraphModule below copies the attribute, whatever its values.
        if node.op == "get_attr" and node in needed:
            env[node] = new.node_copy(node)
        elif node.op == "call_function" and keep(node):
            missing = [a for a in node.all_input_nodes if a not in env]
            if missing:
                raise SplitError(
                    f"cannot split the step for gradient accumulation: {node.name} ({region_of(node).value}) "
                    f"reads {missing[0].name} ({region_of(missing[0]).value}), which the other part computes "
                    "(rule: the optimizer may read only accumulated gradients from backward)")
            env[node] = new.node_copy(node, env.__getitem__)
    new.output([env[node] if isinstance(node, torch.fx.Node) else node for _, node in outputs])
    gm = lazy_graph_module(graph.gm, new)
    attrs = dict(graph.attrs, **{GraphAttr.NAME: f"{graph.name}.{kind.value}", GraphAttr.KIND: kind.value})
    return TrainGraph(gm, StepSignature(inputs, [spec for spec, _ in outputs]), attrs)


def split(graph: TrainGraph) -> tuple[TrainGraph, TrainGraph, list[Spec]]:
    """The grad and apply graphs of an accumulating step, and the accumulators that flow between them."""
    pairs = list(zip(graph.signature.outputs, graph.output_values()))
    in_apply = lambda n: region_of(n) == Region.OPTIMIZER  # noqa: E731
    grad_outputs = [(s, n) for s, n in pairs if not (isinstance(n, torch.fx.Node) and in_apply(n))]
    apply_outputs = [(s, n) for s, n in pairs if isinstance(n, torch.fx.Node) and in_apply(n)]
    accumulators = [s for s, _ in pairs if s.kind == OutputKind.STEP_STATE and s.name.startswith(ACCUMULATOR_PREFIX)]
    cut = {n: Spec(InputKind.STEP_STATE, s.name) for s, n in pairs if s in accumulators}
    grad = _part(graph, lambda n: not in_apply(n), grad_outputs, GraphKind.GRAD, {})
    apply = _part(graph, in_apply, apply_outputs, GraphKind.APPLY, cut)
    return grad, apply, accumulators


@register_pass("split_grad_apply", preserves=(), on="program")
def split_grad_apply_pass(program: Program, ctx: PassContext) -> Program:
    """Replace each accumulating whole-step graph by its grad (per microbatch) and apply (per step) graphs."""
    targets = [n for n, g in program.graphs.items()
               if graph_kind(g.attrs) == GraphKind.STEP and GraphAttr.GRAD_ACCUMULATION in g.attrs]
    if not targets:
        raise SplitError("split_grad_apply: no graph of the program accumulates gradients "
                         "(rule: run grad_accumulation first)")
    for name in targets:
        grad, apply, accumulators = split(program.graphs[name])
        grad_name, apply_name = ("grad", "apply") if name == "step" else (f"{name}.grad", f"{name}.apply")
        flows = [Flow(grad_name, s, apply_name, Spec(InputKind.STEP_STATE, s.name)) for s in accumulators]
        flows += [Flow(grad_name, s, grad_name, Spec(InputKind.STEP_STATE, s.name)) for s in accumulators]
        program.replace(name, {grad_name: grad, apply_name: apply},
                        [Run(grad_name, EVERY_MICROBATCH), Run(apply_name, EVERY_STEP)], flows)
    ctx.stat("graphs", list(program.graphs))
    ctx.stat("accumulators", sum(len(program.flows_between(n, a)) for n in program.graphs for a in program.graphs
                                 if n != a))
    return program
