"""pipeline_split, the pass on its own: the recipe MLP's accumulating SGD step cut into two stages
(forward, backward, its zero-bubble halves, and apply each), what crosses between them, who updates
what, and run in one process like eager accumulation. The multi-layer GPT, schedules and
multi-process runs are tests/pipeline's."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.pass_manager import PassContext, PassFailure, PassManager
from graph_ir.meta import GraphAttr, GraphKind, StageValue
from graph_ir.mesh import MeshDesc
from graph_ir.program import EVERY_MICROBATCH, EVERY_STEP, Run
from graph_ir.signature import InputKind, OutputKind
from tests.eager_reference import eager_steps
from tests.passes._tiny import mlp_batch, mlp_step

ACCUMULATE = "cleanup,grad_accumulation{microbatches=2},cleanup"
SPLIT = ACCUMULATE + ",pipeline_split{stages=2}"
PARTS = ("forward", "backward", "backward_input", "backward_weight", "apply")


@pytest.fixture(scope="module")
def step():
    return mlp_step()


@pytest.fixture(scope="module")
def split(step):
    manager = PassManager(SPLIT, verify_level="deep")
    program = manager.run(step.captured.copy(), PassContext(mesh=MeshDesc.fake(pp=2)))
    return program, manager.records[-1]


def _specs(graph, kind, outputs=False):
    return [s.name for s in (graph.signature.outputs if outputs else graph.signature.inputs) if s.kind == kind]


class TestPipelineSplit:
    def test_the_stage_graphs_generate_their_code_only_when_run(self, step):
        # The pass manager marks every graph for recompilation after each pass; a stage graph that
        # generated and compiled its Python code there paid for it once per later pass.
        from torch.fx._lazy_graph_module import _LazyGraphModule
        program = PassManager(SPLIT + ",cleanup").run(step.captured.copy(), PassContext(mesh=MeshDesc.fake(pp=2)))
        assert len(program.graphs) == 10
        for name, graph in program.graphs.items():
            assert isinstance(graph.gm, _LazyGraphModule) and graph.gm._needs_recompile(), name
        stage = program.graphs["stage0.forward"]
        assert "def forward" in stage.gm.code and not stage.gm._needs_recompile()

    def test_each_stage_gets_a_forward_a_backward_its_two_halves_and_an_apply_graph(self, split):
        program, record = split
        assert list(program.graphs) == [f"stage{s}.{part}" for s in range(2) for part in PARTS]
        for s in range(2):
            assert [program.kind(f"stage{s}.{part}") for part in PARTS] == [
                GraphKind.STAGE_FORWARD, GraphKind.STAGE_BACKWARD, GraphKind.STAGE_BACKWARD_INPUT,
                GraphKind.STAGE_BACKWARD_WEIGHT, GraphKind.STAGE_APPLY]
        assert record.stats["stages"] == 2 and program.attrs[GraphAttr.PIPELINE_PARALLEL]["stage_to_rank"] == [0, 1]

    def test_stages_run_per_microbatch_and_their_updates_once_per_step(self, split):
        program, _ = split
        runs = {run.graph: run.every for run in program.schedule}
        assert runs == {name: EVERY_STEP if name.endswith(".apply") else EVERY_MICROBATCH for name in program.graphs}
        assert Run("stage0.apply", EVERY_STEP) in program.schedule

    def test_only_the_last_stage_computes_the_loss_and_the_first_reads_only_the_batch(self, split):
        program, _ = split
        assert _specs(program["stage1.forward"], OutputKind.LOSS, outputs=True) == ["loss"]
        assert _specs(program["stage0.forward"], OutputKind.LOSS, outputs=True) == []
        assert _specs(program["stage0.forward"], StageValue.ACTIVATION) == []
        assert _specs(program["stage0.forward"], InputKind.BATCH) == ["batch[0]"]   # the features
        assert _specs(program["stage1.forward"], InputKind.BATCH) == ["batch[1]"]   # the labels

    def test_what_one_stage_sends_is_what_the_next_receives_forward_and_backward(self, split):
        program, _ = split
        sent = _specs(program["stage0.forward"], StageValue.ACTIVATION, outputs=True)
        assert sent and sent == _specs(program["stage1.forward"], StageValue.ACTIVATION)
        returned = _specs(program["stage1.backward"], StageValue.GRADIENT, outputs=True)
        assert returned and returned == _specs(program["stage0.backward"], StageValue.GRADIENT)
        assert program.check_flows() == []
        assert any(f.source == "stage0.forward" and f.target == "stage1.forward" for f in program.flows)

    def test_every_parameter_is_updated_by_exactly_one_stages_apply_graph(self, step, split):
        program, _ = split
        homes = program.attrs[GraphAttr.PIPELINE_PARALLEL]["param_stage"]
        updated = {name: s for s in range(2) for name in _specs(program[f"stage{s}.apply"], OutputKind.PARAM, True)}
        assert updated == homes and sorted(updated) == sorted(n for n, _ in step.model.named_parameters())
        assert set(homes.values()) == {0, 1}

    def test_each_stage_accumulates_the_gradients_of_its_own_parameters(self, split):
        program, _ = split
        homes = program.attrs[GraphAttr.PIPELINE_PARALLEL]["param_stage"]
        for s in range(2):
            accumulated = {n.removeprefix("grad_accumulation:grad/")
                           for n in _specs(program[f"stage{s}.backward"], OutputKind.STEP_STATE, outputs=True)}
            assert accumulated == {n for n, home in homes.items() if home == s}

    def test_two_stages_in_one_process_train_like_eager_accumulation(self, step):
        model, optimizer = step.fresh()
        reference, reference_optimizer = step.fresh()
        batches = [mlp_batch(30 + i) for i in range(3)]
        plan = Plan(backend="eager", pp=2, microbatches=2, verify="deep", pipeline=SPLIT)
        compiled = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=step.loss_fn)
        losses = [compiled(b).item() for b in batches]
        assert "stage1.apply" in compiled.last.program.graphs
        want = eager_steps(reference, reference_optimizer, step.loss_fn, batches, microbatches=2).losses
        assert losses == pytest.approx(want, rel=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)

    @pytest.mark.parametrize("text, words", [
        ("cleanup,pipeline_split{stages=2}", "run grad_accumulation first"),
        (ACCUMULATE + ",pipeline_split{stages=50}", "fewer than the 50 stages"),
        (ACCUMULATE + ",pipeline_split{stages=2,cut_slack=0.5}", "cut_slack=0.5 must be >= 1"),
        (ACCUMULATE + ",pipeline_split{stages=2,profile=abacus}", "unknown device profile 'abacus'"),
    ])
    def test_it_refuses_a_step_that_does_not_accumulate_more_stages_than_units_and_bad_options(
            self, step, text, words):
        with pytest.raises(PassFailure, match=words) as info:
            PassManager(text).run(step.captured.copy(), PassContext(mesh=MeshDesc.fake(pp=2)))
        assert info.value.pass_name == "pipeline_split"
