"""Expert parallelism in the simulator and cann-plan, on a tiny Mixtral on meta."""
from __future__ import annotations

import re

import pytest

from cann_passes import Plan
from cann_passes.simulate import simulate
from tools import plan_cli

ROWS = 2
SPEC = plan_cli.MODELS["mixtral-tiny"]         # 4 layers, hidden 64, 4 experts top-2, seq 32
TOKENS = ROWS * SPEC.seq


@pytest.fixture(scope="module")
def captures():
    caps = plan_cli.Captures(SPEC, SPEC.seq)
    for depth in (*plan_cli.EXTRAPOLATE_FROM, SPEC.layers):
        caps.get(ROWS, depth)
    return caps


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_an_ep_plan_holds_its_share_of_the_experts_and_prices_its_all_to_alls(captures):
    full = captures.get(ROWS, SPEC.layers)
    one, two = (simulate(full, Plan(dp=4, ep=ep, precision="bf16", verify="off"), tokens_per_microbatch=TOKENS)
                for ep in (1, 2))
    assert two.world_size == one.world_size == 4 and two.tokens_per_step == one.tokens_per_step
    # the same rows through the same expert shapes: the FLOPs do not change (balanced routing)
    assert two.model_flops == pytest.approx(one.model_flops)
    params = {n: p.numel() for n, p in _model().named_parameters()}
    expert = sum(v for n, v in params.items() if ".experts." in n)
    held = (sum(params.values()) - expert / 2) / sum(params.values())
    assert two.memory["params"] / one.memory["params"] == pytest.approx(held, rel=1e-3)
    assert two.memory["optimizer_state"] / one.memory["optimizer_state"] == pytest.approx(held, rel=1e-3)
    # the expert gradients are not all-reduced (ep = dp), the rows' all-to-alls are on the comm stream
    from cann_passes.compile import compile_program
    from graph_ir.analysis.collectives import collectives
    from graph_ir.mesh import MeshDesc
    program = compile_program(full, Plan(dp=4, ep=2, verify="off"), MeshDesc.fake(dp=4, ep=2))
    kinds = [c.kind for g in program.graphs.values() for c in collectives(g.graph)]
    assert kinds.count("all_to_all") == 5 * SPEC.layers    # counts, rows out and back, and in backward


def _model():
    import torch
    with torch.device("meta"):
        return SPEC.build(ROWS, SPEC.seq)[0]


def test_cann_plan_searches_ep_where_it_composes():
    args = plan_cli.parse(["mixtral-tiny", "--devices", "4", "--global-batch", str(4 * ROWS), "--no-progress",
                           "--no-baseline", "--microbatches", "1", "--ep", "1,2,4", "--tp", "1,2",
                           "--zero", "0,1,3", "--recompute", "none"])
    cands = plan_cli.plan_candidates(args, plan_cli.check(args))
    eps = {(c.plan.ep, c.plan.tp, c.plan.zero_stage) for c in cands}
    assert {(1, 1, 0), (2, 1, 0), (4, 1, 1), (2, 1, 3), (1, 2, 3), (2, 2, 0), (2, 2, 3)} <= eps
    assert not any(tp > 1 and ep > 2 for ep, tp, z in eps)     # ep divides dp = 4 / tp
    # ep=8 would not divide the tiny Mixtral's 4 experts
    eight = plan_cli.candidates(8, 8, tps=(1,), stages=(0,), recomputes=("none",), microbatches=(1,),
                                precisions=("bf16",), budget=0.5, heads=4, eps=(1, 4, 8), experts=SPEC.experts)
    assert sorted({c.plan.ep for c in eight}) == [1, 4]
    assert all(c.plan.backend == "eager" for c in cands if c.plan.ep > 1)


def test_cann_plan_prints_ep_plans_with_memory_and_step_time(captures):
    args = plan_cli.parse(["mixtral-tiny", "--devices", "4", "--global-batch", str(4 * ROWS), "--no-progress",
                           "--no-baseline", "--microbatches", "1", "--ep", "1,2", "--zero", "0",
                           "--recompute", "none", "--top", "20"])
    spec = plan_cli.check(args)
    lines = []
    plan_cli.run(args, spec, out=lines.append, captures=captures)
    rows = [line for line in "\n".join(lines).splitlines() if re.match(r" +\d+  dp=", line)]
    assert any("dp=4 ep=2 tp=1 zero=0" in line for line in rows), rows


def test_an_ep_plan_with_tp_keeps_the_experts_whole_over_tp(captures):
    # dp=2 = ep=2 x tp=2: attention and the dense projections split over tp, the experts over ep
    # only (whole on each tp rank), so a rank holds half the expert bytes at tp 1 and at tp 2
    full = captures.get(ROWS, SPEC.layers)
    ep_only, with_tp = (simulate(full, Plan(dp=2, ep=2, tp=tp, precision="bf16", verify="off"),
                                 tokens_per_microbatch=TOKENS) for tp in (1, 2))
    params = {n: p.numel() for n, p in _model().named_parameters()}
    expert = sum(v for n, v in params.items() if ".experts." in n)
    experts_held = (expert / 2) / (sum(params.values()) - expert / 2)    # of what a rank holds at tp 1
    assert ep_only.memory["params"] > with_tp.memory["params"] >= ep_only.memory["params"] * experts_held
    assert with_tp.world_size == 4
