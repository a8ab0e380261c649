"""Pipeline parallelism in the simulator: stages composed from the pp = 1 program, against its
totals, the schedule's in-flight counts, and the Megatron / Korthikanti formulas at small size.

The formula check runs a GPT of d_model 256 (8 heads, seq 64) with tp 2 and sequence
parallelism, captured at 2 layers and composed at 8 (exact: the blocks are identical); the
formulas are closed forms in s, b, h, a, t, p, so the same check at GPT-3 width is what
``bench/planner_megatron_memory.py`` prints.
"""
from __future__ import annotations

import pytest

from cann_passes import Plan
from cann_passes.reports.megatron_memory import MegatronPlan, Shape, formula
from cann_passes.simulate import SimulationError, simulate
from tools import plan_cli

SPEC = plan_cli.MODELS["llama-tiny"]           # 4 layers, untied head
ROWS = 2
TOKENS = ROWS * SPEC.seq


@pytest.fixture(scope="module")
def captured():
    return plan_cli.Captures(SPEC, SPEC.seq).get(ROWS, SPEC.layers)


def _plan(**kw):
    return Plan(precision="bf16", verify="off", **kw)


@pytest.fixture(scope="module")
def flat_and_pp(captured):
    flat = simulate(captured, _plan(dp=2), tokens_per_microbatch=TOKENS)
    piped = simulate(captured, _plan(dp=2, microbatches=4), tokens_per_microbatch=TOKENS, pp=2,
                     pipeline_path="analytic")
    return flat, piped


def test_stages_partition_the_model_state_of_the_pp1_program(flat_and_pp):
    flat, piped = flat_and_pp
    assert [st["layers"] for st in piped.stages] == [[2], [2]]
    for term in ("params", "grads", "optimizer_state", "param_copies"):
        total = sum(st["memory"][term] for st in piped.stages)
        assert total == pytest.approx(flat.memory[term], rel=1e-6), term
    assert piped.world_size == 4 and piped.pp == 2 and piped.schedule == "1f1b"
    assert "analytic" in piped.pipeline_path


def test_1f1b_keeps_pp_minus_s_microbatches_on_stage_s(flat_and_pp, captured):
    _, piped = flat_and_pp
    assert [st["in_flight"] for st in piped.stages] == [[2], [1]]
    gpipe = simulate(captured, _plan(dp=2, microbatches=4), tokens_per_microbatch=TOKENS, pp=2, schedule="gpipe",
                     pipeline_path="analytic")
    assert [st["in_flight"] for st in gpipe.stages] == [[4], [4]]
    # same layers, twice the microbatches held: the first stage's activations double
    assert gpipe.stages[0]["memory"]["activations"] == pytest.approx(2 * piped.stages[0]["memory"]["activations"])
    assert 0 < piped.bubble_fraction < 0.5 and piped.bubble_fraction == pytest.approx(piped.timeline.bubble_fraction)
    assert piped.step_seconds >= piped.timeline.makespan


def test_a_pipeline_with_more_stages_than_layers_is_refused(captured):
    with pytest.raises(SimulationError, match="at least one layer per stage"):
        simulate(captured, _plan(dp=1, microbatches=8), tokens_per_microbatch=TOKENS, pp=8, pipeline_path="analytic")


def test_first_stage_memory_matches_megatron_and_korthikanti_at_small_size():
    spec = plan_cli.ModelSpec("gpt-small", plan_cli._gpt(n_layer=8, n_head=8, d_model=256, vocab_size=512), 8, 64, 8)
    captured = plan_cli.Captures(spec, 64).get(1, 2)
    mplan = MegatronPlan(tp=2, pp=4, dp=2)
    plan = _plan(dp=2, tp=2, sequence_parallel=True, recompute="selective", microbatches=8)
    sim = simulate(captured, plan, profile="a100", tokens_per_microbatch=64, pp=4, layers=8, pipeline_path="analytic")
    assert sim.rank == 0 and [st["in_flight"] for st in sim.stages][0] == [4]
    shape = Shape("gpt-small", 8, 256, 8, 64, 512, 1024, positions=64)
    want = formula(shape, mplan)
    m = sim.memory
    state = m["params"] + m["param_copies"] + m["grads"] + m["optimizer_state"]
    assert state == pytest.approx(want["model_state"], rel=0.10)
    assert m["activations"] == pytest.approx(want["activations"], rel=0.10)
    # no dropout here: Korthikanti's count without its two dropout masks is 32, and it is exact
    assert m["activations"] == pytest.approx(formula(shape, mplan, dropout_masks=False)["activations"], rel=0.05)


def test_the_real_stage_programs_and_the_analytic_stages_agree_on_the_same_split():
    import torch
    from graph_ir import capture_train_step
    from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=4, tie_weights=False))   # pipeline_split refuses tied embeddings
    idx = torch.randint(0, 256, (2, 16))
    gpt = capture_train_step(model, torch.optim.AdamW(model.parameters()), gpt_loss,
                             (idx, torch.roll(idx, -1, 1)))[0]
    plan = _plan(dp=1, microbatches=4)
    real = simulate(gpt, plan.replace(pp=2, pipeline_split=(2, 2)), tokens_per_microbatch=32,
                    pipeline_path="stages")
    model_ = simulate(gpt, plan, tokens_per_microbatch=32, pp=2, pipeline_path="analytic")
    assert real.pipeline_path.startswith("stage programs") and model_.pipeline_path.startswith("analytic")
    for r, a in zip(real.stages, model_.stages):
        for term in ("params", "optimizer_state", "grads"):
            assert r["memory"][term] == pytest.approx(a["memory"][term], rel=1e-6), (r["rank"], term)
        assert r["in_flight"] == a["in_flight"]
        assert r["memory"]["activations"] == pytest.approx(a["memory"]["activations"], rel=0.25), r["rank"]
        assert r["busy_s"] == pytest.approx(a["busy_s"], rel=0.25), r["rank"]
