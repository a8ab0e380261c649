"""pipeline_split: the stage graphs of a captured step, and running them all in one process.

Without a process group a ``pp > 1`` plan runs every stage in this process
(``runtime/pipeline_parallel.run_local``): per microbatch all forwards, then all
backwards, then every stage's apply. That must be the unsplit step: bitwise
the accumulating (grad/apply) program, and eager PyTorch to rounding.
"""
from __future__ import annotations

import copy

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.compile import compile_program
from cann_passes.pass_manager import PassFailure
from cann_passes.plan import PlanError
from graph_ir import capture_train_step
from graph_ir.mesh import MeshDesc
from graph_ir.meta import RECOMPUTE_OF, GraphAttr, GraphKind, StageValue
from graph_ir.verifier import verify_program
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
from tests.zoo import build, compare, default_optimizer

PP = GraphAttr.PIPELINE_PARALLEL


def _gpt(layers=4, **kw):
    torch.manual_seed(0)
    return GPT(gpt_tiny(n_layer=layers, tie_weights=False, bias=False, **kw))


def _batch(seed, rows=4, seq=16):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (rows, seq), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _program(model, plan, rows=2, rank=0):
    opt = _sgd(model.parameters())
    captured, _ = capture_train_step(model, opt, gpt_loss, _batch(0, rows=rows))
    return compile_program(captured, plan, MeshDesc.fake(pp=plan.pp, dp=plan.dp, tp=plan.tp, rank=rank))


def _train(model, plan, steps=2):
    step = compile_for_npu(model, plan, optimizer=_sgd(model.parameters()), loss_fn=gpt_loss)
    losses = [float(step(_batch(100 + i))) for i in range(steps)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, step


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def pp2_program():
    """The 4-layer GPT's pp=2 program, compiled once for the tests that only read it."""
    return _program(_gpt(), Plan(pp=2, microbatches=2, backend="eager"))


class TestStageGraphs:
    def test_every_stage_has_forward_backward_parts_and_apply_and_verifies(self, pp2_program):
        program = pp2_program
        verify_program(program, deep=True)
        kinds = {name: program.kind(name) for name in program.graphs}
        for s in range(2):
            assert kinds[f"stage{s}.forward"] == GraphKind.STAGE_FORWARD
            assert kinds[f"stage{s}.backward"] == GraphKind.STAGE_BACKWARD
            assert kinds[f"stage{s}.backward_input"] == GraphKind.STAGE_BACKWARD_INPUT
            assert kinds[f"stage{s}.backward_weight"] == GraphKind.STAGE_BACKWARD_WEIGHT
            assert kinds[f"stage{s}.apply"] == GraphKind.STAGE_APPLY
        info = program.attrs[PP]
        assert info["stages"] == 2 and info["stage_to_rank"] == [0, 1]
        # Only the last stage computes the loss; the first receives nothing.
        assert [s.kind for s in program["stage1.forward"].signature.outputs].count("loss") == 1
        assert "loss" not in [s.kind for s in program["stage0.forward"].signature.outputs]
        assert not [s for s in program["stage0.forward"].signature.inputs if s.kind == StageValue.ACTIVATION]
        # The residual stream crosses as one tensor each way.
        acts = [s for s in program["stage1.forward"].signature.inputs if s.kind == StageValue.ACTIVATION]
        grads = [s for s in program["stage0.backward"].signature.inputs if s.kind == StageValue.GRADIENT]
        assert len(acts) == 1 and len(grads) == 1
        # Each parameter is updated by exactly one stage's apply graph.
        updated = [s.name for n in program.of_kind(GraphKind.STAGE_APPLY) for s in program[n].signature.outputs
                   if s.kind == "param"]
        assert sorted(updated) == sorted(n for n, _ in _gpt().named_parameters())

    def test_flows_connect_outputs_to_inputs_of_the_same_shape(self):
        program = _program(_gpt(), Plan(pp=4, microbatches=4, backend="eager"))
        assert program.check_flows() == []
        assert any(f.source == "stage1.forward" and f.target == "stage2.forward" for f in program.flows)
        assert any(f.source == "stage2.backward_input" and f.target == "stage1.backward_input"
                   for f in program.flows)
        assert any(f.source == "stage1.backward_input" and f.target == "stage1.backward_weight"
                   for f in program.flows)

    def test_backward_input_part_leaves_parameter_gradients_to_the_weight_part(self, pp2_program):
        program = pp2_program
        for s in range(2):
            bi, bw = program[f"stage{s}.backward_input"], program[f"stage{s}.backward_weight"]
            assert not [o for o in bi.signature.outputs if o.kind == "step_state"]
            assert [o for o in bw.signature.outputs if o.kind == "step_state"]
        # The first stage sends no gradient back: all of its backward is weight gradients.
        assert program["stage0.backward_input"].num_nodes() < program["stage0.backward_weight"].num_nodes()

    def test_layer_count_override_cuts_at_blocks(self):
        program = _program(_gpt(), Plan(pp=2, microbatches=2, backend="eager", pipeline_split=[3, 1]))
        info = program.attrs[PP]
        assert info["split"] == "layers"
        homes = info["param_stage"]
        assert {homes[f"layers.{i}.attn.qkv.weight"] for i in range(3)} == {0}
        assert homes["layers.3.attn.qkv.weight"] == 1 and homes["lm_head.weight"] == 1
        assert homes["wte.weight"] == 0

    def test_cost_split_balances_a_heavy_head_better_than_layer_counts(self):
        model = _gpt(layers=4, vocab_size=4096)   # the head and its loss weigh about two blocks
        cost = _program(model, Plan(pp=2, microbatches=2, backend="eager")).attrs[PP]
        layers = _program(model, Plan(pp=2, microbatches=2, backend="eager", pipeline_split=[2, 2])).attrs[PP]
        assert cost["imbalance"] < layers["imbalance"]
        assert cost["imbalance"] <= 1.10

    def test_compiles_for_one_rank_of_a_fake_mesh_without_processes(self):
        program = _program(_gpt(), Plan(pp=2, dp=2, microbatches=2, backend="eager"), rank=3)
        assert program.mesh.local_rank("pp") == 1 and program.mesh.local_rank("dp") == 1
        verify_program(program)
        # Each gradient's all-reduce lands in the apply graph of the stage that owns it.
        for name in program.of_kind(GraphKind.STAGE_APPLY):
            graph = program[name]
            reduces = [n for n in graph.graph.nodes if "all_reduce" in str(n.target)]
            assert len(reduces) == len([s for s in graph.signature.outputs if s.kind == "param"])


class TestWithTensorParallelism:
    def test_tp_stage_graphs_hold_their_collectives_over_this_ranks_tp_group(self):
        # Rank 3 of a (pp=2, dp=1, tp=2) mesh: pipeline rank 1, tp rank 1.
        program = _program(_gpt(), Plan(pp=2, tp=2, microbatches=2, backend="eager"), rank=3)
        verify_program(program, deep=True)
        assert program.mesh.local_rank("pp") == 1 and program.mesh.local_rank("tp") == 1
        tp_group = program.mesh.group_name("tp")
        counts = {}
        for name, graph in program.graphs.items():
            collectives = [n for n in graph.graph.nodes if n.op == "call_function"
                           and getattr(n.target, "namespace", "") == "_c10d_functional"
                           and "wait_tensor" not in str(n.target)]
            counts[name] = len(collectives)
            for node in collectives:
                assert node.args[-1] == tp_group, (name, node.name, node.args)
                # A collective's result is waited for in the graph that issues it.
                assert any("wait_tensor" in str(u.target) for u in node.users), (name, node.name)
        # Both stages' forwards and backwards reduce their row-parallel partial sums.
        for s in range(2):
            assert counts[f"stage{s}.forward"] > 0 and counts[f"stage{s}.backward"] > 0, counts
        # Boundary activations are this rank's values; the residual stream crosses replicated, full width.
        act = [n for s, n in zip(program["stage1.forward"].signature.inputs, program["stage1.forward"].placeholders())
               if s.kind == StageValue.ACTIVATION]
        assert any(a.meta["val"].shape == (2, 16, 32) for a in act), [a.meta["val"].shape for a in act]


class TestRefusals:
    def test_more_stages_than_units_is_refused(self):
        with pytest.raises(PlanError, match=r"plan field 'pp'.*cuttable unit"):
            _program(_gpt(layers=1), Plan(pp=8, microbatches=8, backend="eager", pipeline_schedule="gpipe"))


    def test_a_text_pipeline_scaling_the_loss_before_accumulation_is_refused_naming_the_order(self):
        text = ("cleanup,autocast{dtype=fp16,policy=cuda},loss_scale{mode=dynamic},grad_accumulation{microbatches=2},"
                "cleanup,pipeline_split{stages=2,pp=2}")
        with pytest.raises(PassFailure, match=r"loss_scale runs after grad_accumulation"):
            _program(_gpt(), Plan(pp=2, microbatches=2, backend="eager", precision="fp16", pipeline=text))

    def test_clipping_and_loss_scaling_with_several_stages_per_rank_combine_each_rank_s_stages(self):
        # Interleaved 1F1B, 4 stages on 2 ranks (stages 0, 2 on rank 0): each stage's apply graph reads
        # the accumulators of the other stage on its rank, sums both stages' terms and all-reduces that
        # over pp, once per local stage, so each all-reduce sums every stage once
        program = _program(_gpt(), Plan(pp=2, microbatches=4, backend="eager", precision="fp16",
                                        grad_clip_norm=1.0, pipeline_schedule="interleaved_1f1b",
                                        pipeline_virtual_stages=2))
        verify_program(program, deep=True)
        assert program.attrs[PP]["stage_to_rank"] == [0, 1, 0, 1]
        group = program.mesh.group_name("pp")

        def accumulators(s):
            return {i.name for i in program[f"stage{s}.apply"].signature.inputs
                    if i.kind == "step_state" and i.name.startswith("grad_accumulation:")}
        for s in range(4):
            other = (s + 2) % 4
            own = {o.name for o in program[f"stage{s}.backward"].signature.outputs
                   if o.kind == "step_state" and o.name.startswith("grad_accumulation:")}
            theirs = {o.name for o in program[f"stage{other}.backward"].signature.outputs
                      if o.kind == "step_state" and o.name.startswith("grad_accumulation:")}
            assert own <= accumulators(s) and theirs <= accumulators(s)
            reduces = TestAcrossStages._reduces(program[f"stage{s}.apply"])
            # the overflow flag (min of 0/1) and the clip's sum of squares
            assert sorted(r.args[1] for r in reduces) == ["min", "sum"] and {r.args[2] for r in reduces} == {group}
        flows = {(f.source, f.target) for f in program.flows if f.input.name in accumulators(0) - accumulators(1)}
        assert ("stage2.backward", "stage0.apply") in flows


class TestAcrossStages:
    """Values several stages meet on besides the boundary, all-reduced over the pipeline ranks."""

    @staticmethod
    def _reduces(graph):
        return [n for n in graph.graph.nodes if "all_reduce" in str(n.target)]

    def test_tied_embedding_is_held_by_both_stages_each_with_its_part_of_the_gradient(self):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(n_layer=2, tie_weights=True, bias=False))
        program = _program(model, Plan(pp=2, microbatches=2, backend="eager"))
        verify_program(program, deep=True)
        assert program.attrs[PP]["shared_params"] == {"wte.weight": [0, 1]}
        group = program.mesh.group_name("pp")
        part = "grad_accumulation:grad/wte.weight@stage1"
        for s in range(2):
            apply = program[f"stage{s}.apply"]
            assert "wte.weight" in [o.name for o in apply.signature.outputs if o.kind == "param"]
            (reduce,) = self._reduces(apply)
            assert reduce.args[1:] == ("sum", group)
        # The head's part accumulates on the last stage and never crosses to the first.
        assert part in [o.name for o in program["stage1.backward"].signature.outputs]
        assert part in [i.name for i in program["stage1.apply"].signature.inputs]
        grads = [i for i in program["stage0.backward"].signature.inputs if i.kind == StageValue.GRADIENT]
        assert len(grads) == 1
        with pytest.raises(Exception, match=r"tied across stages.*init_distributed"):
            _train(model, Plan(pp=2, microbatches=2, backend="eager"), steps=1)

    @pytest.mark.parametrize("clip", [None, 1.0])
    def test_a_weight_tied_within_one_rank_is_summed_there_and_updated_once(self, clip):
        # DualPipeV puts the first and the last stage on rank 0: the head's stage accumulates its part,
        # the home stage's apply adds it (a step-state input) and updates the weight; no all-reduce
        # for it, and the head's stage only reads the weight
        torch.manual_seed(0)
        tied = GPT(gpt_tiny(n_layer=2, tie_weights=True, bias=False))
        program = _program(tied, Plan(pp=2, microbatches=4, backend="eager", pipeline_schedule="dualpipev",
                                      grad_clip_norm=clip))
        verify_program(program, deep=True)
        info = program.attrs[PP]
        assert info["shared_params"] == {"wte.weight": [0, 3]} and info["stage_to_rank"] == [0, 1, 1, 0]
        assert info["pp_subgroups"] == {}
        part = "grad_accumulation:grad/wte.weight@stage3"
        home, head = program["stage0.apply"], program["stage3.apply"]
        assert part in [i.name for i in home.signature.inputs]
        assert "wte.weight" in [o.name for o in home.signature.outputs if o.kind == "param"]
        assert "wte.weight" not in [o.name for o in head.signature.outputs]
        assert ("stage3.backward", part) in {(f.source, f.input.name) for f in program.flows
                                             if f.target == "stage0.apply"}
        for s in range(4):   # only the clip's sum of squares crosses ranks
            shapes = [list(r.meta["val"].shape) for r in self._reduces(program[f"stage{s}.apply"])]
            assert shapes == ([[]] if clip else [])

    def test_a_weight_tied_across_ranks_with_clipping_under_several_stages_per_rank_pairs_its_all_reduces(self):
        # Interleaved 1F1B puts stages 0 and 3 (the tie) on ranks 0 and 1. Each rank's updating stage
        # all-reduces the tied gradient first (apply order 0, 3, then 1, 2) and hands the sum to its
        # other local stage's apply as step state (its clip term), so each rank issues the tied
        # all-reduce once and then one clip all-reduce per stage, in the same order
        torch.manual_seed(0)
        tied = GPT(gpt_tiny(n_layer=2, tie_weights=True, bias=False))
        program = _program(tied, Plan(pp=2, microbatches=4, backend="eager", grad_clip_norm=1.0,
                                      pipeline_schedule="interleaved_1f1b", pipeline_virtual_stages=2))
        verify_program(program, deep=True)
        info = program.attrs[PP]
        assert info["shared_params"] == {"wte.weight": [0, 3]} and info["stage_to_rank"] == [0, 1, 0, 1]
        assert info["apply_order"] == [0, 3, 1, 2]
        summed = "grad_accumulation:grad/wte.weight@summed"
        assert ("stage0.apply", "stage2.apply") in {(f.source, f.target) for f in program.flows
                                                    if f.input.name == summed}
        assert summed in [i.name for i in program["stage2.apply"].signature.inputs]
        for rank in (0, 1):
            issued = [list(r.meta["val"].shape) for s in info["apply_order"] if info["stage_to_rank"][s] == rank
                      for r in self._reduces(program[f"stage{s}.apply"])]
            assert issued == [[256, 32], [], []]

    def test_tied_embedding_at_pp4_is_summed_over_a_group_of_just_the_first_and_last_pipeline_ranks(self):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(n_layer=2, tie_weights=True, bias=False))
        program = _program(model, Plan(pp=4, microbatches=4, backend="eager"), rank=1)
        verify_program(program, deep=True)
        info = program.attrs[PP]
        assert info["shared_params"] == {"wte.weight": [0, 3]}
        (name,) = info["pp_subgroups"]
        assert info["pp_subgroups"][name] == [0, 3] and name != program.mesh.group_name("pp")
        for s in range(4):
            reduces = self._reduces(program[f"stage{s}.apply"])
            holds = "wte.weight" in [o.name for o in program[f"stage{s}.apply"].signature.outputs]
            assert holds == (s in (0, 3))
            assert [r.args[1:] for r in reduces] == ([("sum", name)] if holds else [])

    def test_a_pipeline_subgroup_is_the_same_ranks_on_each_of_its_members_at_every_dp_coordinate(self):
        from cann_passes.runtime.pipeline_parallel import pp_subgroup_members
        groups = {}
        for rank in range(8):   # (pp=4, dp=2): the pp groups are ranks {0, 2, 4, 6} and {1, 3, 5, 7}
            mesh = MeshDesc.fake(pp=4, dp=2, rank=rank)
            members = pp_subgroup_members(mesh, [0, 3])
            if mesh.local_rank("pp") in (0, 3):
                groups[rank] = members
        assert groups == {0: [0, 6], 6: [0, 6], 1: [1, 7], 7: [1, 7]}

    def test_global_grad_clipping_sums_each_stages_squared_norms_over_the_pipeline_ranks(self):
        program = _program(_gpt(), Plan(pp=2, microbatches=2, backend="eager", grad_clip_norm=1.0))
        verify_program(program, deep=True)
        assert len(program.attrs[PP]["stage_reductions"]) == 1
        for s in range(2):
            apply = program[f"stage{s}.apply"]
            (reduce,) = self._reduces(apply)
            assert reduce.args[1:] == ("sum", program.mesh.group_name("pp"))
            assert "grad_clip:grad_norm" in [o.name for o in apply.signature.outputs]
            # Nothing else than the parts of the norm crosses: no stage reads another's gradients.
            assert not [i for i in apply.signature.inputs if i.kind in StageValue.KINDS]


    def test_fp16_loss_scaling_checks_each_stages_gradients_and_combines_the_flags_over_the_pipeline_ranks(self):
        program = _program(_gpt(), Plan(pp=2, microbatches=2, backend="eager", precision="fp16"))
        verify_program(program, deep=True)
        assert [r.endswith("(and)") for r in program.attrs[PP]["stage_reductions"]] == [True]
        state = {"loss_scale:scale", "loss_scale:growth_tracker"}
        for s in range(2):
            apply = program[f"stage{s}.apply"]
            (reduce,) = self._reduces(apply)
            assert reduce.args[1:] == ("min", program.mesh.group_name("pp"))
            outputs = {o.name for o in apply.signature.outputs}
            assert state | {"loss_scale:found_inf"} <= outputs   # every stage skips and rescales alike
            assert not [i for i in apply.signature.inputs if i.kind in StageValue.KINDS]
        # The loss is scaled where it is: the last stage's backward seed.
        readers = [g for g, graph in program.graphs.items()
                   if "loss_scale:scale" in {i.name for i in graph.signature.inputs} and not g.endswith(".apply")]
        assert readers and all(g.startswith("stage1.backward") for g in readers)


class TestAllStagesInOneProcess:
    def test_gpt_equals_the_unsplit_accumulating_step_bitwise(self):
        base = _gpt()
        ref_losses, ref_params, _ = _train(copy.deepcopy(base), Plan(microbatches=4, backend="eager"))
        for plan in (Plan(pp=2, microbatches=4, backend="eager", pipeline_schedule="gpipe"),
                     Plan(pp=4, microbatches=4, backend="eager", pipeline_schedule="zb1p")):
            losses, params, step = _train(copy.deepcopy(base), plan)
            assert losses == ref_losses, plan.pipeline_schedule
            for name, want in ref_params.items():
                assert torch.equal(params[name], want), (plan.pipeline_schedule, name)

    def test_transformers_llama_matches_eager(self):
        run = compare("llama", Plan(pp=2, microbatches=2, backend="eager"), steps=2, layers=2,
                      optimizer=default_optimizer)
        for got, want in zip(run.compiled_losses, run.eager_losses, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want)
        assert run.max_param_diff() <= 1e-5
        info = run.step.last.program.attrs[PP]
        assert info["stages"] == 2 and info["units"] >= 4

    @pytest.mark.parametrize("model,pp", [("llama", 2), ("gpt_neox", 3)])
    def test_full_recompute_is_cut_only_between_the_spans_it_replays_and_matches_eager(self, model, pp):
        # Left to the balancer, a cut after a block's input norm would leave the norm's recomputed
        # copy (and the norm weight it reads) on the stage before the cut, while the attention
        # backward that reads it runs on the stage after.
        run = compare(model, Plan(pp=pp, microbatches=4, backend="eager", recompute="full"), steps=2,
                      optimizer=default_optimizer)
        for got, want in zip(run.compiled_losses, run.eager_losses, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want)
        assert run.max_param_diff() <= 1e-5
        program = run.step.last.program
        assert program.attrs[PP]["stages"] == pp
        # (values made from the batch alone, such as the mask and the rotary tables, are copied
        # into every stage that needs them)
        stages_of: dict[str, set] = {}
        for g, graph in program.graphs.items():
            if ".forward" in g:
                for node in graph.graph.nodes:
                    stages_of.setdefault(node.name, set()).add(g.split(".")[0])
        copies = [(g.split(".")[0], node.meta[RECOMPUTE_OF]) for g, graph in program.graphs.items()
                  if ".backward" in g for node in graph.graph.nodes if node.meta.get(RECOMPUTE_OF)]
        assert any(source in stages_of for _, source in copies)
        assert all(stage in stages_of.get(source, {stage}) for stage, source in copies)


def test_zero3_stages_hold_layers_and_each_stage_holding_a_tied_weight_gathers_it():
    # ZeRO-3 gathers every shard ahead of its use; those gathered values go with their reader, so
    # the stages are cut between layers (not after the loss), each stage gathering its own shards.
    plan = Plan(dp=2, pp=2, microbatches=2, zero_stage=3, verify="deep")
    program = _program(_gpt(), plan)
    forward = [program.graphs[f"stage{s}.forward"] for s in (0, 1)]
    for graph in forward:
        assert sum(n.target is torch.ops.aten.mm.default for n in graph.graph.nodes) >= 4
    # A weight tied across the stages (the embedding and the head) is gathered in both: each
    # stage's forward gathers its shard over dp, and the whole weight crosses no cut, in forward
    # (the head's matmul) or backward (the head's input gradient).
    torch.manual_seed(0)
    tied = GPT(gpt_tiny(n_layer=4, tie_weights=True, bias=False))
    program = _program(tied, plan)
    name = next(n for n, _ in tied.named_parameters() if n.endswith("wte.weight"))
    shape = tuple(dict(tied.named_parameters())[name].shape)
    assert program.attrs[PP]["shared_params"] == {name: [0, 1]}
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    for s in (0, 1):
        graph = program.graphs[f"stage{s}.forward"]
        held = [n for n, spec in zip(graph.placeholders(), graph.signature.inputs) if spec.name == name]
        assert [n for n in graph.graph.nodes if n.target is gather and n.args[0] in held], s
    for g, graph in program.graphs.items():
        crossing = [spec.name for n, spec in zip(graph.placeholders(), graph.signature.inputs)
                    if spec.kind in StageValue.KINDS and tuple(n.meta["val"].shape) == shape]
        assert not crossing, (g, crossing)


def test_the_split_names_two_ranks_whose_all_reduces_over_a_group_would_not_pair_up():
    """The check behind every pairing refusal: per group, each member rank's all-reduces, in its
    stages' apply order, must be the same list (reduction and shape)."""
    from types import SimpleNamespace

    from cann_passes.passes.pipeline_split.cross_stage import _unpaired_reductions
    graph = torch.fx.Graph()
    x = graph.placeholder("x")

    def reduce(shape, group="pp"):
        node = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", group))
        node.meta["val"] = torch.empty(shape)
        return node
    # interleaved 1F1B: stages 0-3 on ranks 0, 1, 0, 1; stages 0 and 3 update a tied weight
    tied0, clip0, clip1, clip2, tied3, clip3 = (reduce(s) for s in ([256, 32], [], [], [], [256, 32], []))
    stage = {tied0: 0, clip0: 0, clip1: 1, clip2: 2, tied3: 3, clip3: 3}
    rw = SimpleNamespace(graph=graph, nodes=SimpleNamespace(optimizer=list(stage)), stage=stage)
    ranks = [0, 1, 0, 1]
    assert _unpaired_reductions(rw, [0, 3, 1, 2], ranks, 2, "pp", {}) == ""
    assert _unpaired_reductions(rw, [0, 1, 2, 3], ranks, 2, "pp", {}) == (
        "over group pp, pipeline rank 0 would all-reduce ['sum of [256, 32]', 'sum of []', 'sum of []'] while "
        "rank 1 all-reduces ['sum of []', 'sum of [256, 32]', 'sum of []']")
    # a subgroup all-reduce issued by one of its two member ranks only
    stage[reduce([8], "pp.sub")] = 0
    rw.nodes.optimizer = list(stage)
    assert _unpaired_reductions(rw, [0, 3, 1, 2], ranks, 2, "pp", {"pp.sub": [0, 1]}) == (
        "over group pp.sub, pipeline rank 0 would all-reduce ['sum of [8]'] while rank 1 all-reduces []")


@pytest.mark.parametrize("schedule, runs, skips", [("1f1b", "backward", ("backward_input", "backward_weight")),
                                                   ("zb1p", "backward_input", ("backward",))])
def test_one_process_lowers_only_the_stage_graphs_its_schedule_runs(schedule, runs, skips):
    from cann_passes.runtime.pipeline_parallel import NotRunHere, PipelineRuntimeError
    plan = Plan(backend="eager", pp=2, microbatches=2, pipeline_schedule=schedule)
    losses, _, step = _train(_gpt(), plan)
    want, _, _ = _train(_gpt(), Plan(backend="eager", microbatches=2))
    assert losses == pytest.approx(want, rel=1e-5)
    runners = step.last.runners
    for s in range(2):
        assert not isinstance(runners[f"stage{s}.{runs}"], NotRunHere)
        assert not isinstance(runners[f"stage{s}.forward"], NotRunHere)
        for part in skips:
            skipped = runners[f"stage{s}.{part}"]
            assert isinstance(skipped, NotRunHere)
            with pytest.raises(PipelineRuntimeError, match=f"'stage{s}.{part}' was not lowered in this process "
                                                           f"\\({schedule} runs stage {s}'s backward as"):
                skipped()
