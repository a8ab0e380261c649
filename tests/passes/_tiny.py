"""Tiny subjects for the per-pass unit tests: the recipe MLP's captured step, hand-made graphs,
and running a graph on concrete inputs in this process.

- :func:`mlp_step`: ``MLP([12, 32, 32, 5])`` + SGD (momentum, weight decay), one step captured
  (89 nodes); ``inputs()`` are the captured graph's flat inputs, ``fresh()`` a model and optimizer
  with the same initial weights for an eager or compiled twin.
- :func:`fx_graph`: a function traced by ``make_fx`` as a one-region TrainGraph (batch inputs,
  one loss output), for rules that need two exact duplicates side by side.
- :func:`run`: a graph's outputs by name, its inputs taken from the captured step's where the
  names match and from ``extra`` (the step state a pass added) otherwise.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graph_ir import TrainGraph, capture_train_step
from graph_ir.capture import gather_inputs
from graph_ir.meta import REGION
from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature
from recipes.models.mlp import MLP, mlp_loss

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def mlp_batch(seed: int = 1, rows: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)


@dataclass
class Step:
    model: torch.nn.Module           # the captured model, as it was before any step
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    batch: Any
    captured: TrainGraph
    layout: Any
    make_optimizer: Callable

    def inputs(self, batch=None) -> list[torch.Tensor]:
        """The captured graph's flat inputs (parameters, optimizer state, hyperparameters, batch)."""
        return gather_inputs(self.model, self.optimizer, self.layout, self.batch if batch is None else batch)

    def fresh(self):
        """A model with the captured step's initial weights and a new optimizer for it."""
        model = copy.deepcopy(self.model)
        return model, self.make_optimizer(model.parameters())


def mlp_step(make_optimizer: Callable = sgd, seed: int = 0, rows: int = 8) -> Step:
    torch.manual_seed(seed)
    model = MLP([12, 32, 32, 5])
    initial = copy.deepcopy(model)
    optimizer = make_optimizer(model.parameters())
    batch = mlp_batch(rows=rows)
    captured, layout = capture_train_step(model, optimizer, mlp_loss, batch)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial.parameters()))
    return Step(model, optimizer, mlp_loss, batch, captured, layout, make_optimizer)


def negating_lr_per_parameter(captured: TrainGraph) -> TrainGraph:
    """A copy of a captured SGD step with ``-lr`` computed once per parameter, as torch.optim
    computes it (capture traces it once per group): each update after the first reads its own
    copy of the negation, duplicates for a cleanup to merge."""
    graph = captured.copy()
    neg = next(n for n in graph.graph.nodes if n.target is torch.ops.aten.neg.default)
    for user in list(neg.users)[1:]:
        with graph.graph.inserting_before(user):
            duplicate = graph.graph.node_copy(neg)
        user.replace_input_with(neg, duplicate)
    return graph


def fx_graph(fn: Callable, *args: torch.Tensor, region: str = "forward") -> TrainGraph:
    """``fn(*args) -> [scalar]`` traced with fake tensors; every computation in ``region``."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    for n in gm.graph.nodes:
        n.meta[REGION] = "io" if n.op in ("placeholder", "output") else region
    signature = StepSignature([Spec(InputKind.BATCH, f"batch[{i}]") for i in range(len(args))],
                              [Spec(OutputKind.LOSS, "loss")])
    return TrainGraph(gm, signature)


def run(graph: TrainGraph, step: Step, extra: dict[str, torch.Tensor] | None = None,
        batch=None) -> dict[str, torch.Tensor]:
    """``graph`` run eagerly; its outputs by signature name. Inputs named as in the captured step
    come from ``step.inputs(batch)``, the others from ``extra``."""
    extra = extra or {}
    given = dict(zip(step.captured.signature.inputs, step.inputs(batch)))
    inputs = [(given[s] if s in given else extra[s.name]).clone() for s in graph.signature.inputs]
    outputs = graph.gm(*inputs)
    return {s.name if s.kind != OutputKind.LOSS else "loss": v for s, v in zip(graph.signature.outputs, outputs)}


def ops(graph: TrainGraph, region: str | None = None) -> Counter:
    """How many nodes of each op ``graph`` computes (in ``region``), by op name."""
    return Counter(str(n.target) for n in graph.compute_nodes()
                   if region is None or str(n.meta.get(REGION)) == region)


def collectives(graph: TrainGraph) -> list[torch.fx.Node]:
    """The graph's functional collectives (not their waits), in graph order."""
    return [n for n in graph.graph.nodes if getattr(n.target, "namespace", "") == "_c10d_functional"
            and n.target is not c10d.wait_tensor.default]
