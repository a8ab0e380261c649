"""Pipelines as text, user passes, instrumentation, analyses caching and failure reports."""
from __future__ import annotations

import json
import os
from typing import Literal

import pytest
import torch

from cann_passes import (PassContext, PassFailure, PassManager, Pipeline, PipelineError, Plan,
                         compile_for_npu, register_pass)
from cann_passes.pass_manager import registered_passes
from graph_ir import Region, TrainGraph, capture_train_step
from tests.conftest import gpt_batches, make_optimizer, mlp_batches, tiny_gpt, tiny_mlp
from tests.passes._tiny import negating_lr_per_parameter


@register_pass("test_scale_loss")
def scale_loss_pass(graph: TrainGraph, ctx: PassContext, *, factor: float = 2.0,
                    label: str = "x") -> TrainGraph:
    """Multiply the reported loss by ``factor`` (a user pass that changes the graph observably)."""
    loss = graph.output_values()[0]
    with graph.graph.inserting_before(graph.output_node()):
        scaled = graph.graph.call_function(torch.ops.aten.mul.Tensor, (loss, factor))
    scaled.meta.update(val=loss.meta["val"] * factor, region="optimizer", module_path="")
    graph.set_outputs([scaled] + graph.output_values()[1:])
    ctx.stat("factor", factor)
    return graph


@register_pass("test_broken")
def broken_pass(graph: TrainGraph, ctx: PassContext, *, mode: str = "raise") -> TrainGraph:
    if mode == "raise":
        raise RuntimeError("deliberate failure")
    graph.set_outputs(graph.output_values()[:-1])  # breaks the signature
    return graph


def _mlp_graph():
    model, loss_fn = tiny_mlp()
    return capture_train_step(model, make_optimizer("sgd", model.parameters()), loss_fn,
                              mlp_batches(1)[0])[0]


def test_pipeline_text_round_trips_with_typed_options():
    text = 'cleanup{cse=false},test_scale_loss{factor=3,label="a b"},cleanup'
    pipeline = Pipeline.parse(text)
    assert str(pipeline) == 'cleanup{cse=false},test_scale_loss{factor=3.0,label="a b"},cleanup'
    assert Pipeline.parse(str(pipeline)) == pipeline
    assert dict(pipeline.passes[1].options) == {"factor": 3.0, "label": "a b"}


@pytest.mark.parametrize("text, message", [
    ("nosuchpass", "unknown pass 'nosuchpass'"),
    ("cleanup{nope=1}", "pass 'cleanup' has no option 'nope'"),
    ("test_scale_loss{factor=abc}", "option 'factor' must be float"),
    ("cleanup,,", "cannot parse pipeline"),
    ("cleanup,", "ends with a comma"),
])
def test_bad_pipeline_text_names_the_problem(text, message):
    with pytest.raises(PipelineError, match=message):
        Pipeline.parse(text)


def test_registering_a_pass_without_keyword_only_defaults_is_refused():
    with pytest.raises(PipelineError, match="signature"):
        register_pass("test_bad_signature")(lambda graph, ctx, factor: graph)


def test_custom_pass_changes_the_compiled_step_observably():
    model, loss_fn = tiny_gpt()
    ref, _ = tiny_gpt()
    batch = gpt_batches(1)[0]
    plain = compile_for_npu(ref, Plan(backend="eager"), optimizer=make_optimizer("sgd", ref.parameters()),
                            loss_fn=loss_fn)
    custom = compile_for_npu(model, Plan(backend="eager", extra_passes=["test_scale_loss{factor=3}"]),
                             optimizer=make_optimizer("sgd", model.parameters()), loss_fn=loss_fn)
    assert custom(batch).item() == pytest.approx(3 * plain(batch).item(), rel=1e-6)
    record = next(r for r in custom.records if r.name == "test_scale_loss")
    assert record.changed and record.ops_added == {"aten.mul.Tensor": 1}
    assert record.stats == {"factor": 3.0}
    assert "test_scale_loss" in registered_passes()


def test_pipeline_given_as_text_runs_and_records_every_pass():
    model, loss_fn = tiny_gpt()
    graph = capture_train_step(model, make_optimizer("adamw", model.parameters()), loss_fn,
                               gpt_batches(1)[0])[0]
    manager = PassManager("cleanup,test_scale_loss{factor=1.5},cleanup{cse=false}", verify_level="deep")
    manager.run(graph, PassContext())
    assert [r.name for r in manager.records] == ["cleanup", "test_scale_loss", "cleanup"]
    assert manager.records[0].changed and manager.records[0].nodes_after < manager.records[0].nodes_before
    assert not manager.records[2].changed
    assert all(r.seconds >= 0 and r.verify_seconds >= 0 for r in manager.records)


def test_failing_pass_is_named_with_a_reproducer(tmp_path):
    manager = PassManager("cleanup,test_broken", reproducer_dir=str(tmp_path))
    with pytest.raises(PassFailure) as info:
        manager.run(_mlp_graph(), PassContext())
    err = info.value
    assert err.pass_name == "test_broken" and "deliberate failure" in str(err)
    assert err.pipeline == "cleanup,test_broken"
    assert open(os.path.join(err.reproducer_dir, "pipeline.txt")).read().strip() == "test_broken"
    assert os.path.exists(os.path.join(err.reproducer_dir, "input.py"))
    # the graph and the pipeline text are the whole reproducer: passes read nothing else
    assert sorted(os.listdir(err.reproducer_dir)) == ["input.json", "input.py", "pass.json", "pipeline.txt"]


def test_pass_producing_an_invalid_graph_fails_verification_by_name(tmp_path):
    with pytest.raises(PassFailure, match="test_broken.*VerificationError"):
        PassManager("test_broken{mode=corrupt}", reproducer_dir=str(tmp_path)).run(_mlp_graph())


def test_deep_verification_checks_values_once_per_graph_state(monkeypatch):
    # Re-propagating fake values costs seconds on a large step; a pass that left the graph as it
    # was verified is checked structurally alone, a pass that changed it deeply again.
    import graph_ir.verifier as verifier
    checked = []
    real = verifier._check_values
    monkeypatch.setattr(verifier, "_check_values", lambda tg: checked.append(tg.num_nodes()) or real(tg))
    manager = PassManager("cleanup,cleanup,test_scale_loss,cleanup", verify_level="deep")
    manager.run(negating_lr_per_parameter(_mlp_graph()), PassContext())
    assert [r.changed for r in manager.records] == [True, False, True, False]
    assert len(checked) == 2           # after the first cleanup and after the loss was scaled
    assert all(r.verify_seconds > 0 for r in manager.records)     # each still verified structurally


def test_node_rules_are_checked_once_per_graph_state_and_kind(monkeypatch):
    # A pass that only marks nodes (what a lowering's passes do) leaves the graph's state as it was:
    # the lint and node rules are not run again; an edit, or a graph kind changed, runs them.
    import graph_ir.verifier as verifier
    checked = []
    real = verifier._check_nodes
    monkeypatch.setattr(verifier, "_check_nodes", lambda tg: checked.append(tg.num_nodes()) or real(tg))
    manager = PassManager("cleanup,test_edit_one_thing{what=none},test_edit_one_thing{what=region}")
    with pytest.raises(PassFailure, match="(?s)test_edit_one_thing.*regions must flow forward"):
        manager.run(negating_lr_per_parameter(_mlp_graph()), PassContext())
    assert len(checked) == 2           # after cleanup and after the region edit, not after the no-op
    assert [r.changed for r in manager.records] == [True, False]

    @register_pass("test_set_kind")
    def set_kind_pass(graph: TrainGraph, ctx: PassContext, *, kind: str = "apply") -> TrainGraph:
        graph.attrs["kind"] = kind     # an attribute alone: the nodes are as they were
        return graph

    checked.clear()
    with pytest.raises(PassFailure, match="(?s)test_set_kind.*VerificationError"):
        PassManager("cleanup,test_set_kind").run(_mlp_graph(), PassContext())
    assert len(checked) == 2


@register_pass("test_edit_one_thing")
def edit_one_thing_pass(graph: TrainGraph, ctx: PassContext, *, what: str = "none") -> TrainGraph:
    """Edit one fact of the first forward node, or nothing."""
    node = next(graph.compute_nodes(Region.FORWARD))
    if what == "region":
        node.meta["region"] = Region.BACKWARD.value
    elif what == "module_path":
        node.meta["module_path"] = node.meta.get("module_path", "") + ".moved"
    elif what == "value":          # a new fake value of the same layout: what a re-derivation leaves
        node.meta["val"] = torch.empty_like(node.meta["val"])
    elif what == "twin":           # an unused copy of the node's first argument, for "args"
        with graph.graph.inserting_before(node):
            twin = graph.graph.call_function(torch.ops.aten.clone.default, (node.args[0],))
        twin.meta.update(node.args[0].meta, test_twin=True)
    elif what == "args":           # the first argument swapped for its twin: no node added or removed
        twin = next(n for n in graph.graph.nodes if n.meta.get("test_twin"))
        node.args = (twin, *node.args[1:])
    elif what == "rename":
        node.name = node.name + "_renamed"
    return graph


@pytest.mark.parametrize("what", ["region", "module_path", "value", "args", "rename"])
def test_every_kind_of_edit_counts_as_a_change_and_drops_the_analyses(what):
    # Whether a pass changed a graph decides which analyses stay valid: an edit to one node's
    # tags, fake value, arguments or name alone must count.
    graph, ctx = _mlp_graph(), PassContext()
    graph = PassManager("cleanup").run(graph, ctx)
    if what == "args":
        PassManager("test_edit_one_thing{what=twin}", verify_level="off").run(graph, ctx)
    first = ctx.analyses.get("memory", graph)
    nodes = graph.num_nodes()
    manager = PassManager("test_edit_one_thing{what=none}", verify_level="off")
    manager.run(graph, ctx)
    assert not manager.records[0].changed and ctx.analyses.get("memory", graph) is first
    manager = PassManager(f"test_edit_one_thing{{what={what}}}", verify_level="off")
    manager.run(graph, ctx)
    assert graph.num_nodes() == nodes          # the edit alone, no node added or removed
    assert manager.records[0].changed and ctx.analyses.get("memory", graph) is not first


def test_analyses_are_cached_until_a_pass_changes_the_graph():
    graph, ctx = _mlp_graph(), PassContext()
    graph = PassManager("cleanup").run(graph, ctx)       # a captured step has duplicates to merge
    first = ctx.analyses.get("memory", graph)
    assert ctx.analyses.get("memory", graph) is first
    PassManager("cleanup").run(graph, ctx)               # nothing to clean: unchanged
    assert ctx.analyses.get("memory", graph) is first
    PassManager("test_scale_loss").run(graph, ctx)       # changes the graph
    assert ctx.analyses.get("memory", graph) is not first
    assert ctx.analyses.computed["memory"] == 2


def test_dumps_are_written_for_every_pass(tmp_path):
    model, loss_fn = tiny_mlp()
    step = compile_for_npu(model, Plan(backend="eager", dump_dir=str(tmp_path)),
                           optimizer=make_optimizer("adamw", model.parameters()), loss_fn=loss_fn)
    step(mlp_batches(1)[0])
    names = sorted(os.listdir(tmp_path))
    for stem in ("000_capture", "001_cleanup", "002_attention_masks_as_flags", "003_cleanup"):
        assert f"{stem}.py" in names and f"{stem}.json" in names
    assert {"passes.json", "pipeline.txt", "inputs.pt"} <= set(names)
    assert open(tmp_path / "pipeline.txt").read().strip() == str(step.last.pipeline)


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CANN_PASSES_DUMP", str(tmp_path))
    model, loss_fn = tiny_mlp()
    compile_for_npu(model, Plan(backend="eager"), optimizer=make_optimizer("sgd", model.parameters()),
                    loss_fn=loss_fn)(mlp_batches(1)[0])
    assert (tmp_path / "000_capture.json").exists()


def test_compile_for_npu_names_a_missing_optimizer():
    model, loss_fn = tiny_mlp()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        compile_for_npu(model, Plan(), optimizer=None, loss_fn=loss_fn)


def test_a_literal_option_is_checked_when_the_pipeline_is_parsed_so_a_plan_refuses_it_at_once():
    from cann_passes import Plan, PlanError
    from cann_passes.pass_manager import Pipeline, PipelineError, _REGISTRY, register_pass

    @register_pass("pick_one_of_two")
    def pick(graph, ctx, *, flavour: Literal["sweet", "sour"] = "sweet"):
        return graph

    try:
        assert dict(Pipeline.parse("pick_one_of_two{flavour=sour}").passes[0].options)["flavour"] == "sour"
        with pytest.raises(PipelineError, match=r"option 'flavour' = 'bitter': must be one of 'sweet', 'sour'"):
            Pipeline.parse("pick_one_of_two{flavour=bitter}")
    finally:
        _REGISTRY.pop("pick_one_of_two")
    with pytest.raises(PlanError, match=r"pass 'autocast' option 'dtype' = 'bf61': must be one of 'bf16', 'fp16'"):
        Plan(pipeline="cleanup,autocast{dtype=bf61}")
