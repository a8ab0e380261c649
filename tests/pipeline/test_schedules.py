"""Pipeline schedules: torch's action lists replayed with costs; bubbles against the papers."""
from __future__ import annotations

import json

import pytest

from cann_passes import schedules as S
from cann_passes.cost_model import get_profile
from cann_passes.schedules import StageCost

EQUAL = StageCost(1.0, 1.0, 1.0)
# (name, v) with the sizes where each paper's closed form is stated (m a multiple of pp, and
# m >= 2 pp for DualPipeV)
SIZES = [(p, m) for p in (2, 4) for m in (4, 8, 16) if m >= p]


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                     ("interleaved_1f1b", 4)])
@pytest.mark.parametrize("p, m", SIZES)
def test_simulated_bubble_is_within_ten_percent_of_the_papers_formula(name, v, p, m):
    simulated = S.simulate(name, p, m, StageCost(1.0, 1.2, 0.8), v).bubble_fraction
    formula = S.bubble_fraction_formula(name, p, m, v, StageCost(1.0, 1.2, 0.8))
    assert simulated == pytest.approx(formula, rel=0.10)


def test_gpipe_and_1f1b_bubbles_are_the_closed_forms():
    # (p-1)/(m+p-1) as a fraction of the step; (p-1)/m is its ratio to the compute
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        for name in ("gpipe", "1f1b"):
            tl = S.simulate(name, p, m, EQUAL)
            assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    tl = S.simulate("interleaved_1f1b", 4, 8, EQUAL, v=2)
    assert tl.bubble_fraction == pytest.approx(3 / (2 * 8 + 3))


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_and_dualpipev_have_less_bubble_than_1f1b(p, m):
    one_f_one_b = S.simulate("1f1b", p, m, EQUAL).bubble_fraction
    zb = S.simulate("zb1p", p, m, EQUAL).bubble_fraction
    dual = S.simulate("dualpipev", p, m, EQUAL, v=2).bubble_fraction
    assert zb < one_f_one_b and dual < one_f_one_b
    # and they are the papers' forms: ZB1P (p-1)(F+B-2W), DualPipeV (p-1)(F&B+B-3W) on half stages
    assert zb == pytest.approx(S.bubble_fraction_formula("zb1p", p, m), rel=0.10)
    assert dual == pytest.approx(S.bubble_fraction_formula("dualpipev", p, m, 2), rel=0.10)


@pytest.mark.parametrize("name, v, p, m", [("gpipe", 1, 4, 6), ("1f1b", 1, 4, 7), ("interleaved_1f1b", 2, 4, 8),
                                           ("interleaved_1f1b", 3, 2, 6), ("zb1p", 1, 4, 8),
                                           ("zb1p", 2, 2, 4), ("dualpipev", 2, 2, 5)])
def test_every_rank_runs_its_actions_after_their_inputs(name, v, p, m):
    costs = [StageCost(1.0 + 0.1 * s, 1.5, 0.5, send_bytes=1 << 20) for s in range(p * S.stages_per_rank(name, v))]
    tl = S.simulate(name, p, m, costs, v, link=get_profile("ascend_910b"))
    owner = S.stage_to_rank(name, p, v)
    ev = {(e.stage, e.kind, e.microbatch): e for e in tl.events}
    n = len(owner)
    assert len(ev) == len(tl.events)                    # each action once
    for e in tl.events:
        assert owner[e.stage] == e.rank
        if e.kind == "F" and e.stage > 0:
            assert ev[(e.stage - 1, "F", e.microbatch)].end_s <= e.start_s
        if e.kind in ("B", "I"):
            assert ev[(e.stage, "F", e.microbatch)].end_s <= e.start_s
            if e.stage < n - 1:
                nxt = ev.get((e.stage + 1, "B", e.microbatch)) or ev[(e.stage + 1, "I", e.microbatch)]
                assert nxt.end_s <= e.start_s
        if e.kind == "W":
            assert ev[(e.stage, "I", e.microbatch)].end_s <= e.start_s
    for r in range(p):                                   # one action at a time per rank
        mine = sorted((e for e in tl.events if e.rank == r), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))
    # a transfer between ranks delays the receiver by at least the link's latency
    f1 = ev[(1, "F", 0)]
    assert f1.start_s >= ev[(0, "F", 0)].end_s + get_profile("ascend_910b").intra_node_latency


def test_action_lists_are_torchs_own_schedule_orders():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    order = S.torch_pipeline_order("interleaved_1f1b", 2, 4, 2)
    ours = S.action_lists("interleaved_1f1b", 2, 4, 2)
    theirs = [a for a in order[1] if a is not None]
    assert [str(a) for a in ours[1]] == [str(a) for a in theirs]
    assert isinstance(theirs[0], _Action) and theirs[0].computation_type == _ComputationType.FORWARD
    assert S.torch_schedule_class("dualpipev").__name__ == "ScheduleDualPipeV"
    assert S.torch_schedule_class("zb1p").__name__ == "ScheduleInterleavedZeroBubble"
    # DualPipeV's OVERLAP_F_B pairs are expanded into their forward and backward
    kinds = {a.kind for acts in S.action_lists("dualpipev", 2, 4).values() for a in acts}
    assert kinds <= {"F", "B", "I", "W"} and "I" in kinds


def test_1f1b_last_rank_runs_microbatches_from_zero():
    """torch 2.13's Schedule1F1B order numbers its last rank's forwards from 1; ours from 0."""
    last = S.action_lists("1f1b", 4, 8)[3]
    assert [str(a) for a in last[:4]] == ["3F0", "3B0", "3F1", "3B1"]


def test_stage_placement_is_looped_or_v_shaped():
    assert S.stage_to_rank("interleaved_1f1b", 4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert S.stage_to_rank("dualpipev", 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert S.stage_to_rank("1f1b", 3) == [0, 1, 2]
    assert S.stages_per_rank("dualpipev") == 2 and S.stages_per_rank("zb1p", 3) == 3


def test_in_flight_activations_follow_the_schedule():
    assert list(S.simulate("1f1b", 4, 8).in_flight().values()) == [4, 3, 2, 1]
    assert list(S.simulate("gpipe", 4, 8).in_flight().values()) == [8, 8, 8, 8]


def test_chrome_trace_loads_with_one_track_per_rank(tmp_path):
    tl = S.simulate("zb1p", 4, 8, EQUAL)
    path = tl.to_chrome_trace(tmp_path / "trace.json")
    doc = json.loads(open(path).read())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    assert {e["tid"] for e in slices} == set(range(4)) and len(slices) == len(tl.events)
    assert {e["cat"] for e in slices} == {"F", "I", "W"}
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slices)
    assert doc["otherData"]["bubble_fraction"] == pytest.approx(tl.bubble_fraction)


def test_timeline_from_measured_events():
    events = [(0, 0, 0, "F", 0.0, 1.0), (1, 1, 0, "F", 1.0, 2.0), (1, 1, 0, "B", 2.0, 4.0),
              (0, 0, 0, "B", 4.0, 6.0)]
    tl = S.timeline_from_events(events)
    assert tl.makespan == 6.0 and tl.pp == 2
    assert tl.bubble_fraction == pytest.approx(1 - 6.0 / 12.0)
    with pytest.raises(ValueError, match="kind"):
        S.timeline_from_events([(0, 0, 0, "X", 0.0, 1.0)])


def test_dynamic_schedule_takes_the_fastest_that_fits_and_explains():
    costs = [StageCost(1.0, 1.0, 1.0)] * 4
    name, tl = S.choose_schedule(4, 8, costs)
    assert name in ("zb1p", "dualpipev")                 # the least bubble with equal costs
    assert tl.makespan == min(S.simulate(n, 4, 8, costs, v).makespan
                              for n, v in S.DEFAULT_CANDIDATES)
    assert "chosen" in tl.extra["table"] and "gpipe" in tl.extra["table"]
    # GPipe holds all 8 microbatches; 1F1B at most 4: a limit of 5 rules GPipe out
    name, tl = S.choose_schedule(4, 8, costs, stage_activation_bytes=[1.0] * 4, memory_limit=5.0,
                                 candidates=("gpipe", "1f1b"))
    assert name == "1f1b" and "memory limit" in tl.extra["table"]
    with pytest.raises(S.ScheduleError, match="no candidate"):
        S.choose_schedule(4, 8, costs, stage_activation_bytes=[1.0] * 4, memory_limit=0.5)


@pytest.mark.parametrize("name, v, p, m, field", [
    ("1f1b", 1, 4, 2, "microbatches"), ("interleaved_1f1b", 1, 2, 4, "virtual_stages"),
    ("gpipe", 2, 2, 4, "virtual_stages"), ("dualpipev", 2, 4, 6, "microbatches"),
    ("zb1p", 1, 4, 9, "microbatches"), ("1f1b", 1, 1, 4, "pp"), ("dynamic", 1, 2, 4, "schedule"),
])
def test_sizes_a_schedule_cannot_run_are_refused_naming_the_rule(name, v, p, m, field):
    with pytest.raises(S.ScheduleError) as info:
        S.simulate(name, p, m, v=v)
    assert info.value.field == field and name in str(info.value)


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb1p", 1),
                                     ("zb1p", 2), ("dualpipev", 2)])
def test_torch_actions_lower_with_torchs_runtime_and_pass_its_dry_run(name, v):
    from torch.distributed.pipelining import schedules as T
    p, m = 4, 8
    owner = S.stage_to_rank(name, p, v)
    n = len(owner)
    runtime = T._PipelineScheduleRuntime([S._stand_in_stage(n, p, 0, s) for s in range(n) if owner[s] == 0], m)
    runtime._prepare_schedule_with_comms(S.torch_actions(name, p, m, v))    # adds sends / receives
    lowered = runtime.pipeline_order_with_comms
    assert {a.computation_type for acts in lowered.values() for a in acts} >= {T.SEND_F, T.RECV_F}
    if name != "dualpipev":      # torch's dry run knows no OVERLAP_F_B
        compute = {r: [a for a in acts if a.computation_type not in (T.UNSHARD, T.RESHARD, T.REDUCE_GRAD)]
                   for r, acts in lowered.items()}
        T._simulate_comms_compute(compute, lambda s: owner[s], n)


def test_torchs_own_1f1b_order_is_renumbered_only_where_it_is_wrong():
    from torch.distributed.pipelining import schedules as T
    raw = T.Schedule1F1B(S._stand_in_stage(4, 4, 0, 0), 8).pipeline_order
    ours = S.torch_actions("1f1b", 4, 8)
    for r in range(3):
        assert [str(a) for a in ours[r]] == [str(a) for a in raw[r] if a is not None and a.is_compute_op]
    last = [a for a in raw[3] if a is not None and a.is_compute_op]
    assert [str(a) for a in ours[3]][:2] == ["3F0", "3B0"]
    assert [a.computation_type for a in ours[3]] == [a.computation_type for a in last]


def test_measured_events_round_trip_and_give_costs_to_resimulate(tmp_path):
    sim = S.simulate("1f1b", 2, 4, StageCost(2.0, 1.0, 1.0))
    path = S.save_events(sim, tmp_path / "events.json")
    back = S.load_events(path)
    assert (back.name, back.pp, back.microbatches) == ("1f1b", 2, 4)
    assert back.bubble_fraction == pytest.approx(sim.bubble_fraction)
    costs = S.stage_costs_from_timeline(back)
    assert costs == [StageCost(2.0, 1.0, 1.0)] * 2        # B split evenly into I and W
    again = S.simulate("1f1b", 2, 4, costs)
    assert again.makespan == pytest.approx(sim.makespan)


# -- pipeline_schedule: dynamic, resolved by compile_program ------------------------------------

def _tiny_gpt_step():
    import torch

    from graph_ir import capture_train_step
    from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=4, tie_weights=False, bias=False))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    captured, _ = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.05), gpt_loss,
                                     (idx, torch.roll(idx, -1, dims=1)))
    return captured


def test_dynamic_compiles_the_fastest_simulated_candidate_over_its_real_stages(one_intra_op_thread, tmp_path):
    from cann_passes import Plan
    from cann_passes.compile import compile_program
    from cann_passes.plan import PlanError
    from cann_passes.planning import compile_planned
    from cann_passes.simulate import stage_program_figures
    from graph_ir.mesh import MeshDesc
    from graph_ir.meta import GraphAttr
    captured = _tiny_gpt_step()
    plan = Plan(pp=2, microbatches=2, backend="eager", pipeline_schedule="dynamic")
    program = compile_planned(captured, plan, MeshDesc.fake(pp=2), dump_dir=str(tmp_path))
    info = program.attrs[GraphAttr.PIPELINE_PARALLEL]
    choice = info["dynamic"]
    assert choice["table"] in (tmp_path / "pipeline_schedule.txt").read_text()
    rows = {r["schedule"]: r for r in choice["candidates"]}
    # DualPipeV needs microbatches >= 2 pp: refused by its rule; the others simulated
    assert rows["dualpipev"]["makespan_s"] is None and "microbatches >= its 2*pp" in rows["dualpipev"]["verdict"]
    ran = [r for r in choice["candidates"] if r["makespan_s"] is not None]
    assert {r["schedule"] for r in ran} >= {"gpipe", "1f1b", "interleaved_1f1b", "zb1p"}
    best = min(ran, key=lambda r: r["makespan_s"])
    assert (choice["schedule"], choice["virtual_stages"]) == (best["schedule"], best["virtual_stages"])
    assert best["verdict"] == "chosen" and "chosen" in choice["table"]
    # the compiled program is the chosen schedule's: its stage count, its rank placement
    assert info["schedule"] == choice["schedule"]
    assert info["stages"] == 2 * S.stages_per_rank(choice["schedule"], choice["virtual_stages"])
    assert info["stage_to_rank"] == S.stage_to_rank(choice["schedule"], 2, choice["virtual_stages"])
    # each figure is what compiling that schedule and replaying its stage graphs gives
    profile = get_profile(plan.device_profile)
    for row in (best, rows["gpipe"]):
        fixed = plan.replace(pipeline_schedule=row["schedule"], pipeline_virtual_stages=row["virtual_stages"])
        stage_program = compile_program(captured, fixed, MeshDesc.fake(pp=2))
        _, costs = stage_program_figures(stage_program, fixed, profile)
        again = S.simulate(row["schedule"], 2, 2, costs, row["virtual_stages"], link=profile)
        assert again.makespan == pytest.approx(row["makespan_s"], rel=1e-9)
    # a layer-count split cannot be given with it (the stage count is the choice's)
    with pytest.raises(PlanError, match="pipeline_split"):
        Plan(pp=2, microbatches=2, pipeline_schedule="dynamic", pipeline_split=[2, 2])
