"""Gradient accumulation at run time: the grad/apply split and the microbatch loop.

The ``grad_accumulation`` pass rewrites the whole step so that the optimizer
reads ``scale * acc`` where ``acc = acc_in + weight * grad`` is runtime-owned
step state. Cutting that graph at the optimizer region gives a "grad" graph
(forward + backward + accumulate, run once per microbatch) and an "apply"
graph (gradient synchronization + optimizer, run once per optimizer step).

Weights are sample counts, so ``acc`` holds the gradient of the *summed*
loss, and ``scale = 1 / samples`` (over all data-parallel ranks) turns it
into the gradient of the mean over every sample of the optimizer step,
whatever the microbatch sizes were.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from graph_ir import TrainGraph
from graph_ir.meta import Region, region_of
from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature

from ..passes.grad_accumulation import ACCUMULATOR, SCALE, WEIGHT


class AccumulationError(RuntimeError):
    pass


def is_split(graph: TrainGraph) -> bool:
    return "grad_accumulation" in graph.attrs


def _accumulator_names(graph: TrainGraph) -> set[str]:
    return {s.name for s in graph.signature.outputs
            if s.kind == OutputKind.STEP_STATE and s.name.startswith(ACCUMULATOR)}


def _part(graph: TrainGraph, keep, outputs: list[tuple[Spec, torch.fx.Node]], name: str,
          cut: dict[torch.fx.Node, Spec]) -> TrainGraph:
    """A new TrainGraph of the nodes ``keep`` accepts; values in ``cut`` become inputs."""
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    needed = {a for n in graph.graph.nodes if n.op == "call_function" and keep(n) for a in n.all_input_nodes}
    needed |= {node for _, node in outputs}
    inputs = []
    for spec, node in zip(graph.signature.inputs, graph.placeholders()):
        if node in needed:
            env[node] = new.node_copy(node)
            inputs.append(spec)
    for node, spec in cut.items():
        if node in needed:
            if spec in inputs:  # the cut value replaces the input of the same name
                raise AccumulationError(f"{name} graph would read {spec.name} twice")
            placeholder = new.placeholder("".join(c if c.isalnum() else "_" for c in spec.name))
            placeholder.meta = {"val": node.meta["val"], "region": Region.IO.value}
            env[node] = placeholder
            inputs.append(spec)
    for node in graph.graph.nodes:
        if node.op == "call_function" and keep(node):
            missing = [a for a in node.all_input_nodes if a not in env]
            if missing:
                raise AccumulationError(
                    f"cannot split the step for gradient accumulation: {node.name} ({region_of(node).value}) "
                    f"reads {missing[0].name} ({region_of(missing[0]).value}), which the other part computes "
                    "(rule: the optimizer may read only accumulated gradients from backward)")
            env[node] = new.node_copy(node, env.__getitem__)
    new.output([env[node] for _, node in outputs])
    gm = torch.fx.GraphModule(graph.gm, new)
    part = TrainGraph(gm, StepSignature(inputs, [spec for spec, _ in outputs]),
                      dict(graph.attrs, name=f"{graph.name}.{name}"))
    # Not verify(): the apply part has no loss, which a whole step must have.
    new.lint()
    return part


def split_grad_apply(graph: TrainGraph) -> tuple[TrainGraph, TrainGraph]:
    """The per-microbatch graph and the per-optimizer-step graph of an accumulating step."""
    accumulators = _accumulator_names(graph)
    pairs = list(zip(graph.signature.outputs, graph.output_values()))
    in_apply = lambda n: region_of(n) == Region.OPTIMIZER  # noqa: E731
    grad_outputs = [(s, n) for s, n in pairs if not (isinstance(n, torch.fx.Node) and in_apply(n))]
    apply_outputs = [(s, n) for s, n in pairs if isinstance(n, torch.fx.Node) and in_apply(n)]
    cut = {n: Spec(InputKind.STEP_STATE, s.name) for s, n in pairs if s.name in accumulators}
    grad = _part(graph, lambda n: not in_apply(n), grad_outputs, "grad", {})
    apply = _part(graph, in_apply, apply_outputs, "apply", cut)
    return grad, apply


# -- batches --------------------------------------------------------------------------------------

def batch_rows(batch: Any) -> int:
    leaves = pytree.tree_leaves(batch)
    return int(leaves[0].shape[0])


def split_batch(batch: Any, n: int) -> list:
    leaves, spec = pytree.tree_flatten(batch)
    rows = leaves[0].shape[0]
    if rows % n:
        raise ValueError(f"plan field 'microbatches' = {n}: a batch of {rows} rows does not split into "
                         f"{n} equal microbatches (rule: the batch size must be a multiple of microbatches)")
    pieces = [leaf.chunk(n) for leaf in leaves]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(n)]


@contextlib.contextmanager
def full_shape_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """Capture traces the unsharded step: stand in full-shape (zero-stride) state for ZeRO shards."""
    swapped = []
    for p in model.parameters():
        state = optimizer.state.get(p, {})
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape != p.shape and p.dim() > 0 \
                    and value.numel() != 1:
                state[key] = torch.zeros((), dtype=value.dtype, device=value.device).expand(p.shape)
                swapped.append((state, key, value))
    try:
        yield
    finally:
        for state, key, value in swapped:
            state[key] = value


# -- the loop -------------------------------------------------------------------------------------

class AccumulationState:
    """Microbatches seen since the last optimizer step, and what each optimizer step consumed."""

    def __init__(self, plan):
        self.plan = plan
        self.target = plan.accumulate_target
        self.pending_samples = 0          # over all data-parallel ranks
        self.pending_microbatches = 0
        self.history: list[int] = []      # samples per completed optimizer step

    def _global(self, step, samples: int) -> int:
        if step.world is None or step.world.dp_size == 1:
            return samples
        count = torch.tensor([samples], dtype=torch.int64)
        torch.distributed.all_reduce(count, group=step.world.group("dp"))
        return int(count.item())

    def _grad(self, step, batch) -> torch.Tensor:
        comp = step.compile(batch)
        if not comp.parts:
            raise AccumulationError("the pipeline has no grad_accumulation pass; the plan's pipeline "
                                    "text must include it when microbatches > 1 or accumulate_target is set")
        step.step_state.values[WEIGHT] = torch.tensor(float(batch_rows(batch)))
        return step._run(comp.parts["grad"], comp.part_runners["grad"], batch)

    def _apply(self, step, samples: int) -> None:
        comp = step.last
        step.step_state.values[SCALE] = torch.tensor(1.0 / samples)
        step._run(comp.parts["apply"], comp.part_runners["apply"], None)
        for name in _accumulator_names(comp.graph):
            step.step_state.values.pop(name, None)
        self.history.append(samples)
        self.pending_samples = self.pending_microbatches = 0
        step.steps_run += 1
        step.optimizer._opt_called = True  # LR schedulers check that the optimizer stepped
        step.metrics["accumulated_samples"] = torch.tensor(samples)

    def discard(self, step) -> None:
        """Forget the gradients accumulated since the last optimizer step."""
        if step._compiled:
            for name in _accumulator_names(step.last.graph):
                step.step_state.values.pop(name, None)
        self.pending_samples = self.pending_microbatches = 0

    def static_step(self, step, batches: list) -> torch.Tensor:
        if not batches:
            raise ValueError("accumulate() needs at least one microbatch")
        losses, rows = [], []
        try:
            for batch in batches:
                losses.append(self._grad(step, batch))
                rows.append(batch_rows(batch))
        except BaseException:
            # Nothing is applied from a failed optimizer step: drop what its
            # microbatches accumulated so the next step starts clean.
            self.discard(step)
            raise
        self._apply(step, self._global(step, sum(rows)) if self.plan.accumulate_target is not None
                    else sum(rows) * (step.world.dp_size if step.world else 1))
        return sum(l * r for l, r in zip(losses, rows)) / sum(rows)

    def dynamic_step(self, step, batch) -> torch.Tensor:
        loss = self._grad(step, batch)
        self.pending_microbatches += 1
        self.pending_samples += self._global(step, batch_rows(batch))
        step.metrics["accumulated_samples"] = torch.tensor(self.pending_samples)
        if self.pending_samples >= self.target:
            self._apply(step, self.pending_samples)
            step.metrics["applied"] = torch.tensor(True)
        else:
            step.metrics["applied"] = torch.tensor(False)
        return loss
