"""Checks the recipe tests share (every family: LLaMA, BERT, CLIP, ALIGN, Flamingo).

- :func:`compile_plan`: the step is captured once and each plan's pipeline runs on a copy, for
  the mesh the plan asks for (a fake ``dp=2`` mesh for a ZeRO plan, so it compiles in one
  process: the rank-0 program of a two-rank run); :func:`plan_effects` says what a plan asked
  for that the program lacks.
- :func:`train_compiled`, :func:`max_difference_from_eager`: the compiled step against plain
  eager PyTorch from the same weights.
- :func:`lower_to_ge`: the final graphs of a plan, compiled as the torchair backend would
  compile them (its pipeline, ``npu_legalize`` included), lowered to GE offline.
"""
from __future__ import annotations

import copy
import json

from pathlib import Path

import torch

from cann_passes import Plan, compile_for_npu, compile_program
from graph_ir import TrainGraph, capture_train_step
from graph_ir.meta import RECOMPUTE
from graph_ir.mesh import MeshDesc
from recipes.clip.train import make_optimizer
from recipes.data.images import ImageTextBatches
from tests.eager_reference import eager_steps
from tools.lower_check import torchair_plan

C10D = "_c10d_functional"


RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def plan_files(plans_dir: Path | str) -> list[Path]:
    """The plans of a recipe: ``plans_dir``, or the recipe's name (``"bert"``: recipes/bert/plans)."""
    plans_dir = RECIPES / plans_dir / "plans" if isinstance(plans_dir, str) and "/" not in plans_dir else plans_dir
    return sorted(Path(plans_dir).glob("*.yaml"))


def capture(model: torch.nn.Module, loss_fn, batch, optimizer: torch.optim.Optimizer | None = None) -> TrainGraph:
    """One training step of ``model`` captured (default optimizer: the recipes' AdamW)."""
    captured, _ = capture_train_step(model, optimizer or make_optimizer(model, 1e-3, 0.05), loss_fn, batch)
    return captured


def compile_plan(captured: TrainGraph, plan: Plan, verify: str = "deep"):
    """The program ``plan`` makes of ``captured`` (rank 0 of a fake mesh when dp > 1)."""
    return compile_program(captured, plan.replace(verify=verify), MeshDesc.fake(dp=plan.dp, ep=plan.ep))


def _nodes(program):
    for graph in program.graphs.values():
        yield from (n for n in graph.graph.nodes if n.op == "call_function")


def plan_effects(plan: Plan, program) -> list[str]:
    """What is missing from ``program`` that ``plan`` asks for (empty: all there)."""
    nodes = list(_nodes(program))
    missing = []
    dtypes = {n.meta["val"].dtype for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    if plan.precision == "bf16" and torch.bfloat16 not in dtypes:
        missing.append("no bf16 value in the graph")
    if plan.precision == "fp16" and torch.float16 not in dtypes:
        missing.append("no fp16 value in the graph")
    if plan.effective_loss_scale != "none" and not any(s.name.startswith("loss_scale")
                                                       for g in program.graphs.values()
                                                       for s in g.signature.inputs):
        missing.append("no loss-scale state among the inputs")
    if plan.recompute != "none" and not any(n.meta.get(RECOMPUTE) for n in nodes):
        missing.append("no node is recomputed")
    if plan.microbatches > 1 and set(program.graphs) != {"grad", "apply"}:
        missing.append(f"graphs {sorted(program.graphs)}, not a grad and an apply graph")
    if plan.zero_stage and not any("reduce_scatter" in str(n.target) for n in nodes):
        missing.append("no reduce_scatter (ZeRO)")
    if plan.ep > 1 and not any("all_to_all_rows" in str(n.target) for n in nodes):
        missing.append("no all-to-all of rows (expert parallelism)")
    if plan.dp > 1 and not any(C10D in str(n.target) for n in nodes):
        missing.append("no collective")
    return missing


def train_compiled(model, loss_fn, plan: Plan, *, steps: int, batch_size: int, lr: float,
                   weight_decay: float = 0.05, warmup: int = 10) -> list[float]:
    """Train ``model`` in place with the compiled step (linear warmup, then constant lr);
    the loss of every step. Contrastive towers collapse without the warmup at these rates."""
    optimizer = make_optimizer(model, lr, weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=loss_fn)
    batches = ImageTextBatches(batch_size)
    losses = []
    for i in range(steps):
        losses.append(step(batches.batch(i)).item())
        scheduler.step()
    return losses


def sgd(model, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)


def max_difference_from_eager(model, loss_fn, batches, plan: Plan | None = None, reference=None,
                              lr: float = 1e-3, optimizer=None) -> tuple[float, float]:
    """(largest loss difference, largest parameter difference) of the compiled step against
    eager PyTorch over ``batches`` from the same weights; ``optimizer(model)`` makes the
    optimizer (default: the recipes' AdamW).

    Adam divides each gradient by its own running magnitude, so a parameter whose gradient is
    about zero (BatchNorm'd ConvNets have some) turns rounding differences of 1e-8 in it into
    steps of size ``lr``; SGD compares such models to rounding."""
    reference = reference if reference is not None else copy.deepcopy(model)
    optimizer = optimizer or (lambda m: make_optimizer(m, lr, 0.05))
    step = compile_for_npu(model, plan or Plan(backend="eager", verify="deep"),
                           optimizer=optimizer(model), loss_fn=loss_fn)
    eager_opt = optimizer(reference)
    loss_diff = 0.0
    for batch in batches:
        got = step(batch).item()
        want = eager_steps(reference, eager_opt, loss_fn, [batch]).losses[0]
        loss_diff = max(loss_diff, abs(got - want) / max(1.0, abs(want)))
    params = dict(reference.named_parameters())
    param_diff = max((p.detach() - params[n].detach()).abs().max().item() for n, p in model.named_parameters())
    return loss_diff, param_diff


def lower_to_ge(model, loss_fn, batch, plan: Plan, out_dir) -> dict:
    """Compile one step of ``model`` with ``plan``'s torchair pipeline, dump it into ``out_dir``
    and lower its final graphs to GE offline; the report (``DIR/ge/report.json``) as a dict.

    Raises ``TorchairUnavailable`` where torchair's package cannot be had."""
    from cann_passes.lowering.ge_offline import write_ge_report

    step = compile_for_npu(model, torchair_plan(plan).replace(dump_dir=str(out_dir)),
                           optimizer=make_optimizer(model, 1e-3, 0.05), loss_fn=loss_fn)
    step.compile(batch)
    return json.loads(Path(write_ge_report(out_dir)).read_text())






def compiled_losses_match_eager(models, loss_fn, batches, *, lr: float = 1e-2, weight_decay: float = 0.1):
    """Every model of ``models`` (the same weights: the recipe's and transformers') trained by the
    compiled fp32 step gives eager PyTorch's losses, step by step, to 1e-5; returns the models."""
    reference = copy.deepcopy(models[0])
    expected = eager_steps(reference, torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=weight_decay),
                           loss_fn, batches).losses
    for model in models:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        step = compile_for_npu(model, Plan(backend="eager", verify="deep"), optimizer=opt, loss_fn=loss_fn)
        got = [step(b).item() for b in batches]
        assert max(abs(g - e) for g, e in zip(got, expected)) <= 1e-5, (type(model).__module__, got, expected)
    return reference


def assert_plan_does_what_it_says(captured: TrainGraph, path: Path) -> None:
    """The plan file at ``path`` compiles ``captured`` (verified after every pass) into a program
    that has everything the plan asks for."""
    plan = Plan.load(path)
    assert plan_effects(plan, compile_plan(captured, plan)) == [], path.name


def bf16_lowers_to_ge(model, loss_fn, batch, plans_dir: Path, out_dir) -> dict:
    """The recipe's ``bf16.yaml`` plan lowers ``model``'s step to GE with no unsupported op and bf16
    tensors in the GE graph; the report's per-step op histogram."""
    report = lower_to_ge(model, loss_fn, batch, Plan.load(Path(plans_dir) / "bf16.yaml"), out_dir)
    assert report["unsupported"] == [], report["unsupported"]
    assert "DT_BF16" in (Path(out_dir) / "ge" / "step.ge.txt").read_text()
    return report["graphs"]["step"]["op_histogram"]
