"""Stage balancer: exact against brute force, memory respected, infeasibility named."""
from __future__ import annotations

import itertools
import random

import pytest

from cann_passes.stage_balance import balance, in_flight_for, layer_count_split


def brute_force(costs, p, static, act, flights, limit):
    """Smallest max stage cost over every contiguous split that fits (None if none fits)."""
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), p - 1):
        starts, ends = (0, *cuts), (*cuts, n)
        if any(sum(static[b:e]) + flights[k] * sum(act[b:e]) > limit
               for k, (b, e) in enumerate(zip(starts, ends))):
            continue
        worst = max(sum(costs[b:e]) for b, e in zip(starts, ends))
        best = worst if best is None else min(best, worst)
    return best


def test_balance_is_optimal_against_brute_force_with_and_without_memory():
    rng = random.Random(14)
    checked_infeasible = checked = 0
    for _ in range(250):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        costs = [rng.random() for _ in range(n)]
        static = [rng.random() for _ in range(n)]
        act = [rng.random() for _ in range(n)]
        flights = [rng.randint(1, 4) for _ in range(p)]
        limit = rng.uniform(0.5, 6.0)
        expect = brute_force(costs, p, static, act, flights, limit)
        if expect is None:
            with pytest.raises(ValueError, match="stage"):
                balance(costs, p, unit_static_bytes=static, unit_activation_bytes=act,
                        in_flight=flights, memory_limit=limit)
            checked_infeasible += 1
            continue
        split = balance(costs, p, unit_static_bytes=static, unit_activation_bytes=act,
                        in_flight=flights, memory_limit=limit)
        assert max(split.stage_costs) == pytest.approx(expect, abs=1e-12)
        assert all(b <= limit + 1e-9 for b in split.stage_bytes)
        assert split.boundaries[0] == 0 and list(split.boundaries) == sorted(set(split.boundaries))
        unconstrained = balance(costs, p)
        assert max(unconstrained.stage_costs) == pytest.approx(
            brute_force(costs, p, [0] * n, [0] * n, [1] * p, 1.0), abs=1e-12)
        checked += 1
    assert checked > 50 and checked_infeasible > 10


def test_stage_bytes_count_in_flight_activations():
    split = balance([1, 1, 1, 1], 2, unit_static_bytes=[10, 10, 10, 10],
                    unit_activation_bytes=[1, 2, 3, 4], in_flight=[4, 1])
    assert split.boundaries == (0, 2)
    assert split.stage_bytes == (20 + 4 * 3, 20 + 1 * 7)


def test_memory_limit_moves_units_off_the_stage_that_holds_more_microbatches():
    # stage 0 keeps 4 microbatches alive (1F1B, pp=4), the last stage one: with a tight limit the
    # balancer gives stage 0 fewer units even though costs are equal
    costs, act = [1.0] * 8, [1.0] * 8
    free = balance(costs, 4, unit_activation_bytes=act, in_flight=[4, 3, 2, 1])
    assert free.boundaries == (0, 2, 4, 6)
    tight = balance(costs, 4, unit_activation_bytes=act, in_flight=[4, 3, 2, 1], memory_limit=4.0)
    assert tight.boundaries[1] == 1 and all(b <= 4.0 for b in tight.stage_bytes)


def test_infeasible_split_names_the_stage_and_the_bytes():
    with pytest.raises(ValueError, match=r"stage 0 cannot hold unit 0 alone .*= 5 bytes"):
        balance([1, 1, 1], 2, unit_static_bytes=[5, 1, 1], memory_limit=3)
    with pytest.raises(ValueError, match=r"stage 1 must hold units 1-3"):
        balance([1, 1, 1, 1], 2, unit_static_bytes=[3, 2, 2, 2], memory_limit=4)
    with pytest.raises(ValueError, match="more stages than units"):
        balance([1, 1], 3)


def test_imbalance_at_most_1_05_on_a_gpt_shape_with_embedding_and_head():
    # embedding (cheap), 24 blocks as attention + MLP units, a heavy head (vocab projection + loss)
    costs = [0.2] + [0.4, 0.6] * 24 + [1.8]
    layers = [None] + [i for i in range(24) for _ in range(2)] + [None]
    split = balance(costs, 4)
    assert split.imbalance <= 1.05
    by_count = layer_count_split(layers, [6, 6, 6, 6], unit_costs=costs)
    assert by_count.imbalance > 1.1 > split.imbalance
    # with whole blocks as units 1.05 is out of reach (a unit is 1/6.5 of a stage); still optimal
    whole = balance([0.2] + [1.0] * 24 + [1.8], 4)
    assert max(whole.stage_costs) == pytest.approx(7.0)


def test_layer_count_split_follows_the_counts():
    units = [None, 0, 1, 2, 3, None]       # embedding, 4 layers, head
    split = layer_count_split(units, [1, 3], unit_costs=[1, 2, 2, 2, 2, 1])
    assert split.boundaries == (0, 2) and split.stage_costs == (3.0, 7.0)
    with pytest.raises(ValueError, match="4 layers"):
        layer_count_split(units, [2, 3])
    with pytest.raises(ValueError, match="whole number >= 1"):
        layer_count_split(units, [4, 0])


def test_in_flight_counts_come_from_the_schedule():
    assert in_flight_for("1f1b", 4, 8) == [4, 3, 2, 1]
    assert in_flight_for("gpipe", 2, 6) == [6, 6]
    assert len(in_flight_for("interleaved_1f1b", 2, 4, 2)) == 4
    assert len(in_flight_for("dualpipev", 2, 4)) == 4


def test_plan_pipeline_splits_per_schedule_and_takes_the_fastest_that_fits():
    from cann_passes import schedules as S
    from cann_passes.stage_balance import plan_pipeline
    costs = [0.2] + [0.4, 0.6] * 16 + [1.8]
    free = plan_pipeline(costs, 4, 8)
    makespans = {}
    for name, v in S.DEFAULT_CANDIDATES:
        split = balance(costs, 4 * S.stages_per_rank(name, v))
        stage = [S.StageCost(c / 3, c / 3, c / 3) for c in split.stage_costs]
        makespans[name] = S.simulate(name, 4, 8, stage, v).makespan
    assert free.timeline.makespan == pytest.approx(min(makespans.values()))
    assert free.schedule == min(makespans, key=makespans.get) and "chosen" in free.table
    # a fixed schedule is split for its own stage count
    fixed = plan_pipeline(costs, 4, 8, schedule="interleaved_1f1b", v=2)
    assert fixed.schedule == "interleaved_1f1b" and fixed.split.n_stages == 8
    # GPipe keeps all 8 microbatches alive: under a tight limit it is refused, 1F1B is split to fit
    act = [1.0] * len(costs)
    tight = plan_pipeline(costs, 4, 8, unit_activation_bytes=act, memory_limit=40,
                          candidates=[("gpipe", 1), ("1f1b", 1)])
    assert tight.schedule == "1f1b" and max(tight.rank_bytes.values()) <= 40
    assert "gpipe" in tight.table and "refused" in tight.table
    with pytest.raises(ValueError, match="no pipeline schedule and split"):
        plan_pipeline(costs, 4, 8, unit_activation_bytes=act, memory_limit=3)


def test_cut_prices_are_optimal_against_brute_force_and_the_cheapest_cuts_win_ties():
    from cann_passes.stage_balance import cut_transfer_seconds
    rng = random.Random(5)
    for _ in range(150):
        n = rng.randint(2, 9)
        p = rng.randint(2, n)
        costs = [rng.random() for _ in range(n)]
        cut = [0.0] + [rng.choice([0.0, 0.05, 0.3]) for _ in range(n - 1)]
        split = balance(costs, p, cut_seconds=cut)
        best = None
        for cuts in itertools.combinations(range(1, n), p - 1):
            starts, ends = (0, *cuts), (*cuts, n)
            worst = max(sum(costs[b:e]) + (cut[b] if b else 0) + (cut[e] if e < n else 0)
                        for b, e in zip(starts, ends))
            spent = sum(cut[c] for c in cuts)
            if best is None or worst < best[0] - 1e-12 or (abs(worst - best[0]) <= 1e-12 and spent < best[1]):
                best = (worst, spent)
        got = max(c + t for c, t in zip(split.stage_costs, split.stage_transfer_s))
        assert got == pytest.approx(best[0], abs=1e-9)
        assert sum(cut[b] for b in split.boundaries[1:]) == pytest.approx(best[1], abs=1e-9)
    # a cut that costs more than the balance gains is avoided, a cheap one is taken
    split = balance([1, 1, 1, 1], 2, cut_seconds=[0, 0.001, 1.5, 0.001])   # 2 + 1.5 > 3 + 0.001
    assert split.boundaries == (0, 1) or split.boundaries == (0, 3)
    even = balance([1, 1, 1, 1], 2, cut_seconds=[0, 0.001, 0.002, 0.001])
    assert even.boundaries == (0, 2)            # 2 + 0.002 beats 3 + 0.001
    # the price of a cut: what one stage receives per microbatch over the link (latency, bandwidth),
    # a message per tensor
    assert cut_transfer_seconds([0, 1000, 0], (1e-6, 1e9)) == pytest.approx([0.0, 1e-6 + 1e-6, 1e-6])
    assert cut_transfer_seconds([0, 1000], (1e-6, 1e9), tensors=[0, 3], microbatches=2) == \
        pytest.approx([0.0, 2 * (3e-6 + 1e-6)])
    with pytest.raises(ValueError, match="cut_seconds"):
        balance([1, 1], 2, cut_seconds=[0.1])


def test_the_default_split_of_a_heavy_head_gpt_at_pp4_is_within_1_05_where_residual_cuts_are_not(
        one_intra_op_thread):
    # the 910B profile (fixed figures, not measured): 4 blocks and a 2048-word head on 4 stages
    import torch

    from cann_passes import Plan
    from cann_passes.compile import compile_program
    from graph_ir import capture_train_step
    from graph_ir.mesh import MeshDesc
    from graph_ir.meta import GraphAttr
    from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=4, vocab_size=2048, tie_weights=False, bias=False))
    idx = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    captured, _ = capture_train_step(model, optimizer, gpt_loss,
                                     (idx, torch.roll(idx, -1, dims=1)))
    common = dict(pp=4, microbatches=4, backend="eager", device_profile="ascend_910b", verify="off")
    residual_only = ("cleanup,grad_accumulation{microbatches=4},"
                     "pipeline_split{stages=4,pp=4,cut_slack=1.5},cleanup")
    info = {key: compile_program(captured, plan, MeshDesc.fake(pp=4)).attrs[GraphAttr.PIPELINE_PARALLEL]
            for key, plan in (("cost", Plan(**common)), ("residual", Plan(**common, pipeline=residual_only)),
                              ("layers", Plan(**common, pipeline_split=[1, 1, 1, 1])))}
    assert info["residual"]["imbalance"] > 1.05 and info["layers"]["imbalance"] > 1.05
    assert info["cost"]["imbalance"] <= 1.05, info["cost"]["imbalance"]
    assert info["cost"]["units"] > info["residual"]["units"]          # the finer cuts were admitted
    assert max(info["cost"]["boundary_tensors"]) <= 3                 # and what crosses stays small
