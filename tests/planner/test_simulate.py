"""The simulator against the compiled program it reads, and the planner's choices, on a tiny LLaMA on meta."""
from __future__ import annotations

import dataclasses
import re

import pytest

from cann_passes import Plan
from cann_passes.compile import compile_program
from cann_passes.simulate import simulate, simulate_extrapolated
from graph_ir.mesh import MeshDesc
from tools import plan_cli

ROWS = 2
SPEC = plan_cli.MODELS["llama-tiny"]           # 4 layers, hidden 64, seq 32, built on meta
TOKENS = ROWS * SPEC.seq


@pytest.fixture(scope="module")
def captures():
    caps = plan_cli.Captures(SPEC, SPEC.seq)
    for depth in (*plan_cli.EXTRAPOLATE_FROM, SPEC.layers):
        caps.get(ROWS, depth)
    return caps


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    # cann-plan makes its default output directory (out/cann-plan) where it runs
    monkeypatch.chdir(tmp_path)


def _plan(**kw):
    return Plan(precision="bf16", verify="off", **kw)


@pytest.fixture(scope="module")
def zero_sims(captures):
    full = captures.get(ROWS, SPEC.layers)
    return {z: simulate(full, _plan(dp=4, zero_stage=z), tokens_per_microbatch=TOKENS) for z in (0, 1, 2, 3)}


def test_memory_terms_are_the_compiled_programs_state_bytes(captures, zero_sims):
    plan = _plan(dp=4, zero_stage=1)
    program = compile_program(captures.get(ROWS, SPEC.layers), plan, MeshDesc.fake(dp=4))
    (state,) = program.state_bytes().values()
    sim = zero_sims[1]
    want = dataclasses.asdict(state)
    # the bf16 weight casts kept for backward are reported apart from the activations
    assert sim.memory["param_copies"] > 0
    assert sim.memory["activations"] + sim.memory["param_copies"] == want.pop("activations")
    assert {k: sim.memory[k] for k in want} == want
    assert sim.peak_bytes >= state.params + state.optimizer_state + state.buffers
    assert sim.fits and 0 < sim.headroom < 1
    assert sim.step_seconds >= sim.compute_seconds > 0 and sim.comm_seconds > 0
    assert sim.tokens_per_step == TOKENS * 4 and sim.model_flops > 0


def test_zero_stages_order_memory(zero_sims):
    state = {z: s.memory["params"] + s.memory["grads"] + s.memory["optimizer_state"] for z, s in zero_sims.items()}
    assert state[0] > state[1] >= state[2] > state[3]
    assert zero_sims[1].memory["optimizer_state"] < zero_sims[0].memory["optimizer_state"] / 3
    assert zero_sims[3].memory["params"] < zero_sims[2].memory["params"] / 3
    assert zero_sims[0].peak_bytes > zero_sims[3].peak_bytes
    # ZeRO-3 gathers parameters forward and backward: more communication than ZeRO-1
    assert zero_sims[3].comm_seconds > zero_sims[1].comm_seconds


def test_depth_extrapolation_matches_a_full_capture(captures):
    plan = _plan(dp=4, zero_stage=2, recompute="full")
    rows = ROWS
    caps = {d: captures.get(rows, d) for d in plan_cli.EXTRAPOLATE_FROM}
    full = captures.get(rows, SPEC.layers)
    got = simulate_extrapolated(caps, SPEC.layers, plan, tokens_per_microbatch=rows * SPEC.seq)
    want = simulate(full, plan, tokens_per_microbatch=rows * SPEC.seq)
    for term, value in want.memory.items():
        assert got.memory[term] == pytest.approx(value, rel=0.01, abs=64), term
    assert got.peak_bytes == pytest.approx(want.peak_bytes, rel=0.03)
    assert got.step_seconds == pytest.approx(want.step_seconds, rel=0.03)
    assert got.model_flops == pytest.approx(want.model_flops, rel=0.01)


def _args(*argv):
    args = plan_cli.parse(["llama-tiny", "--devices", "4", "--global-batch", str(4 * ROWS), "--no-progress",
                           "--no-baseline", "--microbatches", "1", *argv])
    spec = plan_cli.check(args)
    return args, spec


def test_planner_picks_a_plan_that_fits_where_plain_dp_does_not(captures, zero_sims, tmp_path):
    # capacity between ZeRO-3's and plain dp's peak (4 layers, extrapolated from 2 and 3)
    capacity = (zero_sims[0].peak_bytes + zero_sims[3].peak_bytes) / 2
    out_file = tmp_path / "best.yaml"
    args, spec = _args("--memory-gb", str(capacity / 1e9), "--min-headroom", "0", "--zero", "0,3", "--recompute", "none",
                       "--out", str(out_file))
    lines = []
    assert plan_cli.run(args, spec, out=lines.append, captures=captures) == 0
    text = "\n".join(lines)
    assert "best: dp=4 tp=1 zero=3" in text
    best = Plan.load(out_file)
    assert (best.dp, best.zero_stage, best.precision) == (4, 3, "bf16")


def test_planner_writes_under_out_by_default_states_its_ranking_and_lists_what_it_skipped(
        captures, zero_sims, tmp_path):
    # room for ZeRO-1 but not plain dp: ZeRO-0 is simulated and misses, ZeRO-1 fits, and every plan
    # saving more memory than ZeRO-1 is skipped as slower
    capacity = (zero_sims[0].peak_bytes + zero_sims[1].peak_bytes) / 2
    args, spec = _args("--memory-gb", str(capacity / 1e9), "--min-headroom", "0", "--recompute", "none,full",
                       "--top", "2")
    printed = []
    assert plan_cli.run(args, spec, out=printed.append, captures=captures) == 0
    lines = "\n".join(printed).splitlines()
    written = tmp_path / "out" / "cann-plan" / "best_plan.yaml"
    assert lines[-1] == f"wrote the best plan to {written.resolve()}"
    assert Plan.load(written).zero_stage == 1
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert plan_cli.ranking_criterion(capacity) in lines
    assert lines[lines.index(plan_cli.ranking_criterion(capacity)) + 1].split()[:2] == ["#", "plan"]
    assert "ranked by predicted tokens/s, highest first" in plan_cli.ranking_criterion(capacity)
    text = "\n".join(printed)
    assert "8 candidates: 3 simulated, 0 pruned-bound, 5 skipped-dominated, 0 failed" in text
    table = [line for line in lines if re.match(r" +\d+  dp=", line)]
    assert len(table) == 2 and "zero=1 recompute=none" in table[0]
    assert "showing 2 of 3 simulated plans (--top 2); the other 5 candidates were not simulated" in text
    assert "not simulated: 5 candidates (2 shown, --top 2)" in lines
    listed = [line for line in lines if line.startswith("  skipped-dominated ")]
    assert len(listed) == 2 and all(line.endswith("saves more memory than a plan that already fits (slower)")
                                    for line in listed)
    assert "  ... and 3 more (raise --top to list them)" in lines


def test_planner_reports_an_impossible_plan_with_its_largest_term(captures, zero_sims):
    # room for ZeRO-3's model state, not for its activations: passes the bound, fails the simulation
    z3 = zero_sims[3]
    memory = 1.05 * (z3.memory["params"] + z3.memory["grads"] + z3.memory["optimizer_state"])
    assert memory < z3.peak_bytes
    args, spec = _args("--memory-gb", str(memory / 1e9), "--min-headroom", "0", "--zero", "3", "--recompute", "none")
    lines = []
    assert plan_cli.run(args, spec, out=lines.append, captures=captures) == 1
    text = "\n".join(lines)
    assert "1 simulated" in text
    assert "no plan fits in" in text
    assert "DOES NOT FIT" in text and "largest term: " in text


def test_model_state_bound_prunes_before_compiling(captures):
    args, spec = _args("--memory-gb", "0.00001", "--zero", "0", "--recompute", "none")
    lines = []
    assert plan_cli.run(args, spec, out=lines.append, captures=captures) == 1
    text = "\n".join(lines)
    assert "1 pruned-bound" in text and "0 simulated" in text and "model state alone" in text
    assert "largest term: optimizer_state" in text   # plain dp, Adam: two fp32 moments per parameter
    printed = text.splitlines()
    assert "no candidate was simulated; 1 candidate was not simulated: listed below, with why" in printed
    assert any(re.fullmatch(r"  pruned-bound +dp=4 tp=1 zero=0 recompute=none mb=1 bf16 +model state alone >= .* GB",
                            line) for line in printed)
    assert printed[-1].startswith("no plan written to ")


@pytest.mark.parametrize("argv, field", [(["no-such-model"], "MODEL"), (["llama-tiny", "--devices", "0"], "--devices"),
                                         (["llama-tiny", "--zero", "5"], "--zero"),
                                         (["llama-tiny", "--precision", "fp8"], "--precision"),
                                         (["llama-tiny", "--device-profile", "tpu"], "--device-profile"),
                                         (["nosuchpkg.mod:make"], "MODEL"),
                                         (["llama-tiny", "--global-batch", "3"], "--global-batch")])
def test_bad_input_exits_2_with_one_line(argv, field, capsys, tmp_path):
    assert plan_cli.main([*argv, "--no-progress"]) == 2
    assert list(tmp_path.iterdir()) == []          # refused before the default out/ is made
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("cann-plan: error:") and field in err


def tiny_factory(rows, seq):
    return SPEC.build(rows, seq, 1)


def test_a_factory_model_is_captured_at_its_own_depth():
    spec = plan_cli.resolve_model("tests.planner.test_simulate:tiny_factory")
    caps = plan_cli.Captures(spec, 16)
    assert spec.layers is None and caps.depths == (None,) and "own depth" in caps.method
    with pytest.raises(plan_cli.UsageError, match="factory model needs --seq"):
        plan_cli.check(plan_cli.parse(["tests.planner.test_simulate:tiny_factory"]))


def test_a_zero_sibling_s_activations_prune_before_compiling(captures, zero_sims):
    # room for ZeRO-2's model state but not for it plus the activations ZeRO-1 was seen to keep
    z2 = zero_sims[2]
    state = z2.memory["params"] + z2.memory["grads"] + z2.memory["optimizer_state"]
    memory = (state + 0.5 * z2.memory["activations"]) / 1e9
    args, spec = _args("--memory-gb", str(memory), "--min-headroom", "0", "--zero", "1,2", "--recompute", "none")
    lines = []
    assert plan_cli.run(args, spec, out=lines.append, captures=captures) == 1
    text = "\n".join(lines)
    assert "1 simulated, 1 pruned-bound" in text
    assert "not simulated: 1 candidate" in text.splitlines()
    assert any(line.startswith("  pruned-bound       dp=4 tp=1 zero=2 ")
               and "model state + the activations a ZeRO 0-2 sibling keeps" in line for line in text.splitlines())


def test_a_cp_plan_is_priced_from_its_context_parallel_graph(captures):
    # cp=2 splits each dp rank's 32-token sequences: the same tokens per step, half the FLOPs and
    # about half the kept activations per rank, the K/V all-gathers and gradient all-reduces over
    # cp on the comm stream
    full = captures.get(ROWS, SPEC.layers)
    one, two = (simulate(full, _plan(dp=2, cp=cp), tokens_per_microbatch=TOKENS) for cp in (1, 2))
    assert two.world_size == 4 and one.world_size == 2
    assert two.tokens_per_step == one.tokens_per_step == TOKENS * 2
    assert two.model_flops == pytest.approx(one.model_flops / 2)
    assert 0.4 < two.memory["activations"] / one.memory["activations"] < 0.6
    assert two.memory["params"] == one.memory["params"]
    assert two.comm_seconds > one.comm_seconds


def test_a_cp_pp_plan_compiles_its_stages_from_the_context_parallel_step(captures):
    # cp=2 x pp=2: context_parallel splits the sequence, pipeline_split cuts the stages of that
    # per-rank step: half the FLOPs per rank, and less kept activation than pp=2 alone
    full = captures.get(ROWS, SPEC.layers)
    staged, both = (simulate(full, _plan(dp=1, cp=cp, pp=2, microbatches=2), tokens_per_microbatch=TOKENS,
                             pipeline_path="stages") for cp in (1, 2))
    for sim in (both, staged):   # the real stage programs ran, not the analytic composition
        assert sim.pipeline_path.startswith("stage programs: pipeline_split compiled 2 stages"), sim.pipeline_path
    assert both.world_size == 4 and staged.world_size == 2
    assert both.model_flops == pytest.approx(staged.model_flops / 2)
    assert both.memory["activations"] < staged.memory["activations"]


def test_cann_plan_searches_cp_and_refuses_a_cp_that_does_not_divide_the_sequence(captures):
    args, spec = _args("--cp", "1,2", "--zero", "0", "--recompute", "none", "--top", "20")
    lines = []
    plan_cli.run(args, spec, out=lines.append, captures=captures)
    simulated = [line for line in "\n".join(lines).splitlines() if re.match(r" +\d+  dp=", line)]
    assert any(" dp=2 cp=2 tp=1 zero=0 " in f" {line.split(None, 1)[1]}" for line in simulated)
    assert any(" dp=4 tp=1 zero=0 " in f" {line.split(None, 1)[1]}" for line in simulated)
    with pytest.raises(plan_cli.UsageError, match=r"cp 3 .*cp must divide --seq"):
        _args("--cp", "3", "--devices", "3", "--global-batch", "3")


def test_a_group_spanning_more_ranks_than_a_node_is_priced_on_the_inter_node_link():
    # dp=2 x tp=8 on 8-device nodes: each dp group is 2 ranks 8 apart, on two nodes
    from cann_passes.cost_model import collective_time, get_profile
    mesh = MeshDesc.fake(dp=2, tp=8)
    assert (mesh.span("dp"), mesh.span("tp")) == (16, 8)
    p = get_profile("ascend_910b")
    near, far = (collective_time("all_reduce", 1 << 30, 2, p, span=s) for s in (2, mesh.span("dp")))
    assert far / near == pytest.approx(p.intra_node_bandwidth / p.inter_node_bandwidth, rel=0.01)
