"""recompute: bitwise numerics for every policy, the budget at run time, solver quality, Megatron."""
from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.fx

from cann_passes import Plan, compile_for_npu
from cann_passes.cost_model import get_profile
from cann_passes.pass_manager import PassContext, PassManager, is_registered
from cann_passes.passes.recompute import _Builder
from cann_passes.recompute_solver import (evaluate, floor_bytes, fold, lower_bound, min_bytes, solve, solve_folded,
                                          solve_greedy, solve_milp, solve_mincut)
from graph_ir import capture_train_step, gather_inputs
from graph_ir.analysis import graph_cost, memory_profile
from graph_ir.analysis.memory import aliases_input
from graph_ir.analysis.structure import find_blocks
from graph_ir.meta import ORIGIN_PASS, RECOMPUTE, Region, module_path_of, nbytes, region_of
from recipes.models.gpt import GPT, gpt3_175b_layer, gpt_loss, gpt_tiny

BATCH, SEQ = 4, 32


def _model():
    torch.manual_seed(0)
    model = GPT(gpt_tiny(dropout=0.1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (BATCH, SEQ), generator=g),
             torch.randint(0, 256, (BATCH, SEQ), generator=g)) for _ in range(n)]


def _train(plan: Plan, steps: int = 5):
    model, opt = _model()
    step = compile_for_npu(model, plan, optimizer=opt, loss_fn=gpt_loss)
    torch.manual_seed(123)
    losses = torch.stack([step(b) for b in _batches(steps)])
    return losses, [p.detach().clone() for p in model.parameters()], step


@pytest.fixture(scope="module")
def reference():
    return _train(Plan(backend="eager", verify="deep"))


POLICIES = [dict(recompute="none", pipeline="cleanup,recompute{policy=none},cleanup"),
            dict(recompute="full"), dict(recompute="selective"),
            dict(recompute="every_n_layers", recompute_every_n=2)]
POLICIES += [dict(recompute="budget", recompute_budget=b) for b in (1.0, 0.5, 0.25, 0.1, 0.0)]


class TestRecomputeNumerics:
    @pytest.mark.parametrize("fields", POLICIES, ids=lambda f: f"{f['recompute']}-{f.get('recompute_budget', '')}")
    def test_recomputed_training_with_dropout_is_bitwise_identical_over_five_steps(self, reference, fields):
        # Shallow verification here keeps the suite fast; the deep verifier runs on the
        # same graphs in TestRecomputeBudget.
        losses, params, step = _train(Plan(backend="eager", verify="shallow", **fields))
        ref_losses, ref_params, _ = reference
        assert torch.equal(losses, ref_losses)
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
        record = next(r for r in step.records if r.name == "recompute")
        assert record.stats["saved_bytes_after"] <= record.stats["saved_bytes_before"]
        recomputed = [n for n in step.last.graph.graph.nodes if n.meta.get(RECOMPUTE)]
        assert all(region_of(n) == Region.BACKWARD for n in recomputed)
        # No random op is drawn twice: recompute never copies one.
        assert not any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                       for n in recomputed)


# -- the budget, measured -------------------------------------------------------------------------

def _captured():
    model, opt = _model()
    batch = _batches(1)[0]
    tg, layout = capture_train_step(model, opt, gpt_loss, batch)
    return tg, gather_inputs(model, opt, layout, batch)


class _LiveAtBackward(torch.fx.Interpreter):
    """Bytes of distinct storages made by forward nodes still alive when backward starts."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=True)
        self.live_bytes = None

    def run_node(self, n):
        if self.live_bytes is None and region_of(n) == Region.BACKWARD:
            storages = {}
            for node, value in self.env.items():
                if node.op == "call_function" and region_of(node) == Region.FORWARD:
                    for t in value if isinstance(value, (tuple, list)) else [value]:
                        if isinstance(t, torch.Tensor):
                            s = t.untyped_storage()
                            storages[s.data_ptr()] = s.nbytes()
            self.live_bytes = sum(storages.values())
        return super().run_node(n)


def _run_pass(tg, spec):
    manager = PassManager(f"cleanup,{spec}", verify_level="deep")
    out = manager.run(tg.copy(), PassContext())
    return out, manager.records[-1]


class TestRecomputeBudget:
    def test_saved_bytes_at_run_time_never_exceed_the_budget_and_peak_falls_with_it(self):
        tg, inputs = _captured()
        base = memory_profile(_run_pass(tg, "recompute{policy=none}")[0].graph).saved_bytes
        captured_saved = memory_profile(tg.graph).saved_bytes
        # What must be kept whatever the budget: each dropout mask as packed bits, and the loss.
        masks = [n for n in tg.graph.nodes if n.target is torch.ops.aten.bernoulli.p]
        loss = nbytes(tg.output_values()[0].meta["val"])
        floor = sum(math.ceil(n.meta["val"].numel() / 8) for n in masks) + loss
        assert base < captured_saved   # masks as bool, not float
        peaks = []
        for fraction in (1.0, 0.5, 0.25, 0.1, 0.0):
            out, ctx = _run_pass(tg, f"recompute{{policy=budget,budget={fraction}}}")
            tracker = _LiveAtBackward(out.gm)
            tracker.run(*inputs)
            limit = max(fraction * captured_saved, floor)
            assert tracker.live_bytes <= limit, (fraction, tracker.live_bytes, limit)
            # The analysis on the final graph is exact: it agrees with the run.
            assert memory_profile(out.graph).saved_bytes == tracker.live_bytes
            peaks.append(memory_profile(out.graph).peak_bytes)
        # Peak falls with the budget down to 0.1; at 0.0 every block recomputes its whole
        # prefix, which may cost a little more peak than keeping block inputs, but never
        # more than not recomputing at all.
        assert peaks[:4] == sorted(peaks[:4], reverse=True)
        assert peaks[4] <= peaks[0]

    def test_banned_ops_and_module_paths_are_never_recomputed(self):
        tg, _ = _captured()
        out, _ = _run_pass(tg, "recompute{policy=budget,budget=0.0,bans=aten.addmm;layers.1}")
        # Views compute nothing and are rebuilt wherever needed; everything else is checked.
        recomputed = [n for n in out.graph.nodes if n.meta.get(RECOMPUTE) and not aliases_input(n)]
        assert recomputed
        assert not any(str(n.target).startswith("aten.addmm") for n in recomputed)
        assert not any(module_path_of(n).startswith("layers.1") for n in recomputed)

    def test_every_decision_is_explained(self):
        tg, _ = _captured()
        _, record = _run_pass(tg, "recompute{policy=budget,budget=0.25}")
        rows = record.explanation
        assert {r["decision"] for r in rows} == {"saved", "recomputed"}
        assert all(set(r) == {"value", "bytes", "recompute_flops", "recompute_time_s", "decision", "reason"}
                   and r["reason"] for r in rows)
        assert any("random" in r["reason"] for r in rows)

    def test_a_loose_budget_keeps_dropout_masks_in_float_with_no_conversion_in_backward(self):
        tg, _ = _captured()
        none, none_ctx = _run_pass(tg, "recompute{policy=none}")
        loose, ctx = _run_pass(tg, "recompute{policy=budget,budget=1.0}")
        masks = [n for n in loose.graph.nodes if n.target is torch.ops.aten.bernoulli.p]
        assert masks

        def mask_copies(graph):
            return [n for n in graph.nodes if n.target is torch.ops.aten._to_copy.default
                    and any(a.target is torch.ops.aten.bernoulli.p for a in n.all_input_nodes)]
        # policy none keeps each mask as bool and converts it back in backward ...
        assert mask_copies(none.graph)
        # ... the budget policy, with room, keeps the forward's own float values instead.
        assert not mask_copies(loose.graph)
        assert not any(n.meta.get(ORIGIN_PASS) == "recompute" and region_of(n) == Region.FORWARD
                       for n in loose.graph.nodes)
        reads_mask_value = {a for n in loose.graph.nodes if region_of(n) == Region.BACKWARD
                            for a in n.all_input_nodes if any(m in a.all_input_nodes for m in masks)}
        assert reads_mask_value and all(region_of(a) == Region.FORWARD for a in reads_mask_value)
        assert ctx.stats["recompute_time_s"] < none_ctx.stats["recompute_time_s"]

    @pytest.mark.parametrize("options, field", [("policy=sometimes", "policy"), ("solver=magic", "solver"),
                                                ("policy=full,budget=0.5", "budget"),
                                                ("policy=budget", "budget")])
    def test_bad_options_name_the_option(self, options, field):
        tg, _ = _captured()
        with pytest.raises(Exception, match=f"'{field}'"):
            _run_pass(tg, f"recompute{{{options}}}")


# -- solver quality ------------------------------------------------------------------------------

class TestRecomputeSolvers:
    def test_fast_solvers_are_within_five_percent_of_the_exact_milp(self):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(dropout=0.1, n_layer=1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tg, _ = capture_train_step(model, opt, gpt_loss, _batches(1)[0])
        problem = _Builder(tg, get_profile("ascend_910b"), (), 1).build()
        top = sum(v.bytes for v in problem.values if v.needed and v.savable)
        floor = min_bytes(problem).bytes
        for fraction in (0.75, 0.5, 0.3, 0.15):
            budget = max(fraction * top, floor)
            exact = solve_milp(problem, budget)
            for fast in (solve_mincut(problem, budget), solve_greedy(problem, budget), solve(problem, budget)):
                assert fast.bytes <= budget
                assert fast.cost <= exact.cost * 1.05 + 1e-12, (fraction, fast.solver, fast.cost, exact.cost)


    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _stacked_problem(layers: int):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(dropout=0.1, n_layer=layers))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tg, _ = capture_train_step(model, opt, gpt_loss, _batches(1)[0])
        builder = _Builder(tg, get_profile("ascend_910b"), (), 1, find_blocks(tg.graph))
        return builder.build(), builder.stacks()

    def test_identical_blocks_fold_into_one_whose_answer_unfolds_to_a_valid_one(self):
        problem, stacks = self._stacked_problem(6)
        assert [len(blocks) for blocks in stacks] == [6]
        folding = fold(problem, stacks)
        assert folding is not None and folding.blocks >= 5
        members = sorted(i for group in folding.members for i in group)
        assert members == list(range(len(problem.values)))          # every value stands in exactly once
        assert len(folding.problem.values) < len(problem.values) // 3
        top = sum(v.bytes for v in problem.values if v.needed and v.savable)
        for fraction in (0.6, 0.3):
            budget = max(fraction * top, min_bytes(problem).bytes)
            saved = solve_milp(folding.problem, budget).saved
            folded = evaluate(folding.problem, saved, per_block=False)
            whole = evaluate(problem, folding.unfold(saved), per_block=False)
            # The folded problem recomputes a value in every block or none, and counts every block's
            # bytes: unfolded, the same saves cost at most that on the whole problem (one copy of
            # each value, as the solvers count; block by block, as the rewriter runs, no less).
            assert whole.bytes <= folded.bytes <= budget
            assert whole.cost <= folded.cost * (1 + 1e-12)
            assert evaluate(problem, folding.unfold(saved)).cost >= whole.cost * (1 - 1e-12)
            assert whole.saved and whole.saved <= folding.unfold(saved)

    def test_blocks_that_differ_are_not_folded_together(self):
        problem, stacks = self._stacked_problem(6)
        odd = copy.deepcopy(problem)
        for i in stacks[0][2]:                     # block 2 made dearer to recompute than the others
            odd.values[i].cost *= 3
        folding = fold(odd, stacks)
        assert folding is not None and folding.blocks == fold(problem, stacks).blocks - 1
        assert all(len(group) == 1 for group in folding.members if set(group) & set(stacks[0][2]))
        assert fold(problem, [blocks[:2] for blocks in stacks]) is None     # fewer than three blocks

    def test_the_saves_the_folded_lp_leaves_open_are_decided_down_the_stack_as_a_milp_decides_them(
            self, monkeypatch):
        import cann_passes.recompute_solver as recompute_solver
        problem, stacks = self._stacked_problem(8)
        top = sum(v.bytes for v in problem.values if v.needed and v.savable)
        for fraction in (0.6, 0.45, 0.2, 0.1):
            budget = max(fraction * top, min_bytes(problem).bytes)
            down = solve_folded(problem, budget, stacks, hops=True)
            with monkeypatch.context() as m:
                m.setattr(recompute_solver, "CHAIN_DP_OPEN", -1)      # no DP: the MILP over the open saves
                by_milp = solve_folded(problem, budget, stacks, hops=True)
            assert any("(a DP)" in n for n in down.notes), down.notes
            assert any("by a MILP" in n for n in by_milp.notes), by_milp.notes
            assert down.bytes <= budget and down.cost == pytest.approx(evaluate(problem, down.saved).cost)
            assert down.cost <= by_milp.cost * (1 + 1e-9), fraction
            with monkeypatch.context() as m:
                m.setattr(recompute_solver, "CHAIN_DP_STEPS", 8)   # bytes in coarse steps, rounded up
                coarse = solve_folded(problem, budget, stacks, hops=True)
            assert coarse.bytes <= budget and coarse.cost >= down.cost * (1 - 1e-9)
        # A block unlike the others breaks the stack's run of folded blocks: the MILP decides.
        odd = copy.deepcopy(problem)
        for i in stacks[0][3]:
            odd.values[i].cost *= 3
        budget = max(0.2 * top, min_bytes(odd).bytes)
        assert any("by a MILP" in n for n in solve_folded(odd, budget, stacks, hops=True).notes)

    def test_the_folded_solver_is_near_the_exact_milp_and_auto_keeps_it_only_when_proven(self):
        problem, stacks = self._stacked_problem(6)
        top = sum(v.bytes for v in problem.values if v.needed and v.savable)
        floor = min_bytes(problem).bytes
        kept = 0
        for fraction in (0.6, 0.35, 0.2):
            budget = max(fraction * top, floor)
            # the model of the rewriter's blocks, solved exactly
            exact = solve_milp(problem, budget, rel_gap=1e-3, hops=True)
            folded = solve_folded(problem, budget, stacks, hops=True)
            assert folded.bytes <= budget and folded.solver == "folded"
            assert folded.cost >= lower_bound(problem, budget, hops=True) * (1 - 1e-9)
            auto = solve(problem, budget, "auto", stacks)
            assert auto.bytes <= budget and auto.cost <= exact.cost * 1.05 + 1e-12, (fraction, auto.solver)
            if auto.solver == "folded":
                kept += 1
                assert any("against the LP bound" in n for n in auto.notes)
                assert auto.cost - lower_bound(problem, budget, hops=True) <= 0.05 * auto.cost
        assert kept >= 1

    def test_chains_of_recomputation_across_blocks_are_priced_and_avoided(self):
        from cann_passes.recompute_solver import _cutting_chains, _milp, chain_starts
        problem, stacks = self._stacked_problem(6)
        top = sum(v.bytes for v in problem.values if v.needed and v.savable)
        better = {"block model": 0, "chains cut": 0}
        for fraction in (0.4, 0.2, 0.1):
            budget = max(fraction * top, min_bytes(problem).bytes)
            blind = _milp(problem, budget)          # the MILP's own answer: one copy of each value
            once, as_run = evaluate(problem, blind, per_block=False), evaluate(problem, blind)
            assert as_run.cost >= once.cost * (1 - 1e-12)
            if as_run.copies > len(as_run.recomputed):
                assert chain_starts(problem, blind)
            answers = {"block model": solve(problem, budget, "milp"),
                       "chains cut": _cutting_chains(problem, budget, lambda p: solve_milp(p, budget))}
            for how, sol in answers.items():
                assert sol.bytes <= budget and sol.cost <= as_run.cost * (1 + 1e-12), how
                assert sol.cost == pytest.approx(evaluate(problem, sol.saved).cost)
                better[how] += sol.cost < as_run.cost * 0.9
        # at a tight budget both recompute less than the one-copy answer does as run
        assert better["block model"] >= 1 and better["chains cut"] >= 1, better

    def test_floor_over_forced_values_equals_the_cut_over_every_value(self):
        from cann_passes.recompute_solver import _cut, evaluate, relevant
        torch.manual_seed(0)
        model = GPT(gpt_tiny(dropout=0.1, n_layer=2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tg, _ = capture_train_step(model, opt, gpt_loss, _batches(1)[0])
        problem = _Builder(tg, get_profile("ascend_910b"), (), 1).build()

        def whole_cut(p):
            return evaluate(p, _cut(p, relevant(p), 1e9, 1.0)).bytes
        assert min_bytes(problem).bytes == floor_bytes(problem) == whole_cut(problem) > 0   # the masks' bits
        # Values that may not be recomputed (as a ban makes them) anywhere in the graph.
        savable = [i for i, v in enumerate(problem.values) if v.savable and v.recomputable and not v.kept]
        for start in range(0, 12, 3):
            banned = copy.deepcopy(problem)
            for i in savable[start::7]:
                banned.values[i].recomputable = False
            assert min_bytes(banned).bytes == floor_bytes(banned) == whole_cut(banned)
        free = copy.deepcopy(problem)
        for v in free.values:
            v.recomputable = v.recomputable or not v.kept
        assert min_bytes(free).bytes == floor_bytes(free) == 0

    def test_choosing_the_mask_form_is_never_worse_than_compact_masks_and_better_when_loose(self):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(dropout=0.1, n_layer=1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tg, _ = capture_train_step(model, opt, gpt_loss, _batches(1)[0])
        profile = get_profile("ascend_910b")
        free = _Builder(tg, profile, (), 1)
        free_problem = free.build()
        compact = _Builder(tg, profile, (), 1)
        compact_problem = compact.build()
        compact.compact_masks(compact_problem)
        assert free.derived   # mask / (1 - p) is recognised as mask-derived
        top = sum(v.bytes for v in free_problem.values if v.needed and v.savable)
        floor = min_bytes(free_problem).bytes
        costs = []
        for fraction in (1.0, 0.5, 0.2):
            budget = max(fraction * top, floor)
            chosen, fixed = solve_milp(free_problem, budget), solve_milp(compact_problem, budget)
            assert chosen.bytes <= budget
            assert chosen.cost <= fixed.cost * (1 + 1e-6) + 1e-12, fraction
            costs.append((chosen.cost, fixed.cost))
        assert costs[0][0] < costs[0][1]


# -- against Megatron (Korthikanti et al. 2022) ----------------------------------------------------

def _layer_saved_bytes(tg) -> int:
    """Bytes of activations that layers.0's backward (incl. its recompute) reads.

    Megatron counts activations only: a value computed from parameters alone (the
    bf16 copy of a weight) is a function of what the runtime holds anyway, not an
    activation, and is left out, as are the inputs themselves.
    """
    from graph_ir.analysis.memory import buffer_bytes, storage_roots
    root = storage_roots(tg.graph)
    # Activations: what depends on the batch or on a random draw (dropout masks).
    batch = {n for n in tg.placeholders() if n.name.startswith("batch")}
    batch |= {n for n in tg.graph.nodes if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())}
    for n in tg.graph.nodes:
        if n.op == "call_function" and any(a in batch for a in n.all_input_nodes):
            batch.add(n)
    seen = {}
    for n in tg.graph.nodes:
        if region_of(n) != Region.BACKWARD or not module_path_of(n).startswith("layers.0"):
            continue
        for a in n.all_input_nodes:
            base = root[a]
            if base.op == "call_function" and region_of(base) == Region.FORWARD and base in batch:
                seen[base] = buffer_bytes(base)
    return sum(seen.values())


@pytest.mark.skipif(not is_registered("autocast"), reason="the bf16 plan needs the 'autocast' pass, "
                    "which is not registered yet")
class TestRecomputeAgainstMegatron:
    def test_gpt3_layer_saved_bytes_match_megatron(self):
        cfg = gpt3_175b_layer()
        s, b, h, a = cfg.seq_len, 1, cfg.d_model, cfg.n_head
        with torch.device("meta"):
            model = GPT(cfg)
            batch = (torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tg, _ = capture_train_step(model, opt, gpt_loss, batch)
        base, _ = _run_pass(tg, "autocast{dtype=bf16},recompute{policy=none,profile=ascend_910b}")
        sel, sel_ctx = _run_pass(tg, "autocast{dtype=bf16},recompute{policy=selective,profile=ascend_910b}")
        sbh = s * b * h
        assert _layer_saved_bytes(base) == pytest.approx(sbh * (34 + 5 * a * s / h), rel=0.10)
        assert _layer_saved_bytes(sel) == pytest.approx(34 * sbh, rel=0.10)
        cost = graph_cost(sel.graph)
        layer_flops = sum(c for r, c in cost.flops_by_region.items() if r in ("forward", "backward"))
        assert sel_ctx.stats["recompute_flops"] <= 0.03 * layer_flops
        # The budget policy, given what selective keeps (34 sbh in the layer), finds a selection
        # at least as cheap.
        given = memory_profile(sel.graph).saved_bytes
        _, b_ctx = _run_pass(tg, f"autocast{{dtype=bf16}},recompute{{policy=budget,budget={given},"
                                 "profile=ascend_910b}")
        assert b_ctx.stats["saved_bytes_after"] <= given
        assert b_ctx.stats["recompute_time_s"] <= sel_ctx.stats["recompute_time_s"] * 1.0001


def test_a_ban_that_names_nothing_in_the_model_is_refused_by_its_plan_field():
    from cann_passes import PlanError
    from cann_passes.compile import compile_program
    tg, _ = _captured()
    with pytest.raises(PlanError, match=r"plan field 'recompute_bans'.*'no_such_module' names no op"):
        compile_program(tg, Plan(recompute="full", recompute_bans=("no_such_module",), backend="eager"))
    compile_program(tg, Plan(recompute="full", recompute_bans=("aten.addmm",), backend="eager"))
