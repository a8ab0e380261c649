"""The recompute solver's answers priced as the rewriter runs them: one copy per value against the block model.

    python -m bench.recompute_as_run [--models gpt opt t5 whisper bart llama] [--budgets 0.1 0.25 0.5] [--with-7b]

(``--models`` with no name: only the ``--with-7b`` shapes.)

The rewriter recomputes a value once per block whose backward needs it. Per model and budget
(the pass's ``budget`` option, a fraction of the saved bytes without recompute):

- **one copy**: the exact MILP over the model that counts one copy of each recomputed value
  (``solve_milp``), what it says the answer costs, and what the answer costs as run
  (``evaluate``, block by block);
- **block model**: what the pass's ``auto`` solver chooses, as run, and its solve time;
- **open saves by MILP**: the same, with the saves the folded LP leaves open decided by a MILP
  over the whole problem instead of the DP down the stack (``CHAIN_DP_OPEN = -1``): its cost
  and solve time;
- **pass reports**: the recompute pass run on the same graph, the cost of the nodes it added
  (``recompute_time_s``) next to the solver's (``solver_recompute_time_s``).

Models: ``tests.zoo``'s transformers configs with 4 layers (an op's launch dominates such small
shapes); with ``--with-7b`` also the recipe GPT at 32 layers (7B-shaped) and 80 layers (d_model
8192), built on meta and captured with bf16 autocast first, as ``bench.capture_scaling`` does.
Priced on the ``cpu`` profile (the pass's ``auto`` here), in ms for the small models and s for
the large ones.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

from cann_passes.pass_manager import PassContext, PassManager
from cann_passes.passes.recompute import _Builder, _budget_limit, _profile
from cann_passes import recompute_solver
from cann_passes.recompute_solver import _milp, evaluate, solve
from graph_ir import capture_train_step
from graph_ir.analysis.memory import saved_activations
from graph_ir.analysis.structure import find_blocks


def _zoo(name: str):
    from tests.zoo import build
    entry = build(name, layers=4)
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1)
    tg, _ = capture_train_step(entry.model, opt, entry.loss_fn, entry.make_batch(0))
    return PassManager("cleanup").run(tg), "ms"


def _gpt_7b(layers: int, wide: bool):
    from bench.capture_scaling import _model, config
    from recipes.models.gpt import gpt_loss
    model, idx = _model(config(layers, wide))
    with torch.device("meta"):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    tg, _ = capture_train_step(model, opt, gpt_loss, (idx, idx))
    return PassManager("cleanup,autocast").run(tg), "s"


def row(label: str, graph, budget: float, profile: str = "cpu") -> dict:
    structure = find_blocks(graph.graph)
    builder = _Builder(graph, _profile(profile), (), 1, structure)
    saved = saved_activations(graph.graph, builder.root)
    problem = builder.build()
    limit = _budget_limit(saved, builder, problem, budget, sum(saved.values()), PassContext())
    blind = _milp(problem, limit, rel_gap=1e-3)
    said, as_run = evaluate(problem, blind, per_block=False), evaluate(problem, blind)
    start = time.perf_counter()
    block = solve(problem, limit, "auto", builder.stacks())
    seconds = time.perf_counter() - start
    dp_open, recompute_solver.CHAIN_DP_OPEN = recompute_solver.CHAIN_DP_OPEN, -1
    try:
        start = time.perf_counter()
        by_milp = solve(problem, limit, "auto", builder.stacks())
        milp_seconds = time.perf_counter() - start
    finally:
        recompute_solver.CHAIN_DP_OPEN = dp_open
    manager = PassManager(f"recompute{{budget={budget},profile={profile}}}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.run(graph.copy(), PassContext())
    stats = next(r.stats for r in manager.records if r.name == "recompute")
    return {"model": label, "budget": budget, "said": said.cost, "as_run": as_run.cost, "block": block.cost,
            "solve_s": seconds, "reported": stats["recompute_time_s"], "solver": stats["solver_recompute_time_s"],
            "by_milp": by_milp.cost, "milp_solve_s": milp_seconds}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["gpt", "opt", "t5", "whisper", "bart", "llama"])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--with-7b", action="store_true", help="add the 32-layer 7B- and 80-layer 70B-shaped GPT")
    args = p.parse_args(argv)
    graphs = [(name, *_zoo(name)) for name in args.models]
    if args.with_7b:
        graphs += [("gpt 7B 32L", *_gpt_7b(32, False)), ("gpt 70B 80L", *_gpt_7b(80, True))]
    rows = []
    print(f"{'model':>12} {'budget':>6} | {'one copy: said':>14} {'as run':>9} | {'block model':>11} "
          f"{'solve s':>7} | {'open by MILP':>12} {'solve s':>7} | {'pass reports':>12} {'(solver)':>9} | as run / block")
    for label, graph, unit in graphs:
        scale = 1e3 if unit == "ms" else 1.0
        for budget in args.budgets:
            r = row(label, graph, budget)
            rows.append(r)
            print(f"{label:>12} {budget:>6} | {r['said'] * scale:>11.3f} {unit:<2} {r['as_run'] * scale:>6.3f} {unit:<2}"
                  f" | {r['block'] * scale:>8.3f} {unit:<2} {r['solve_s']:>7.2f}"
                  f" | {r['by_milp'] * scale:>9.3f} {unit:<2} {r['milp_solve_s']:>7.2f} | {r['reported'] * scale:>9.3f} {unit:<2}"
                  f" {r['solver'] * scale:>6.3f} {unit:<2} | {r['as_run'] / max(r['block'], 1e-30):.2f}x", flush=True)
    return rows


if __name__ == "__main__":
    main()
