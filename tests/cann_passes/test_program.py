"""The compile driver and the Program: graphs by kind, nested pipelines, instruments, fake meshes, dumps."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from cann_passes import PassContext, PassManager, Pipeline, Plan, compile_for_npu
from cann_passes.compile import compile_program
from cann_passes.pass_manager import Instrument, PipelineError
from graph_ir import capture_train_step
from graph_ir.meta import GraphAttr, GraphKind
from graph_ir.mesh import MeshDesc
from graph_ir.placement import FlatShard, placement_of
from graph_ir.serialize import from_json
from graph_ir.verifier import VerificationError, verify
from tests.conftest import gpt_batches, make_optimizer, mlp_batches, tiny_gpt, tiny_mlp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _captured(kind="adamw"):
    model, loss_fn = tiny_mlp()
    optimizer = make_optimizer(kind, model.parameters())
    return capture_train_step(model, optimizer, loss_fn, mlp_batches(1)[0])[0], model


def test_a_nested_pipeline_prints_back_to_itself_and_runs_only_on_its_kind():
    text = "cleanup,grad_accumulation{microbatches=2},split_grad_apply,apply(cleanup{cse=false}),cleanup"
    pipeline = Pipeline.parse(text)
    assert str(pipeline) == text and Pipeline.parse(str(pipeline)) == pipeline
    graph, _ = _captured()
    manager = PassManager(pipeline, verify_level="deep")
    program = manager.run(graph, PassContext())
    assert list(program.graphs) == ["grad", "apply"]
    assert [(r.name, r.graph) for r in manager.records] == [
        ("cleanup", "step"), ("grad_accumulation", "step"), ("split_grad_apply", "program"),
        ("cleanup", "apply"), ("cleanup", "grad"), ("cleanup", "apply")]
    assert [str(f) for f in program.flows_between("grad", "apply")][0].startswith(
        "grad.step_state:grad_accumulation:grad/")


@pytest.mark.parametrize("text, message", [("apply(cleanup", "not closed"),
                                           ("apply(grad(cleanup))", "nests do not nest"),
                                           ("cleanup)", "unmatched")])
def test_bad_nesting_is_refused_by_name(text, message):
    with pytest.raises(PipelineError, match=message):
        Pipeline.parse(text)


def test_the_verifier_checks_each_graph_by_its_kind():
    graph, _ = _captured()
    program = PassManager("grad_accumulation,split_grad_apply").run(graph, PassContext())
    grad, apply = program["grad"], program["apply"]
    assert (grad.attrs[GraphAttr.KIND], apply.attrs[GraphAttr.KIND]) == ("grad", "apply")
    assert not [s for s in apply.signature.outputs if s.kind == "loss"]
    verify(grad, deep=True)
    verify(apply, deep=True)
    apply.attrs[GraphAttr.KIND] = GraphKind.STEP.value          # a whole step must report a loss
    with pytest.raises(VerificationError, match="exactly one loss"):
        verify(apply)
    grad.attrs[GraphAttr.KIND] = GraphKind.APPLY.value          # an apply graph computes no forward
    with pytest.raises(VerificationError, match="apply graph does not compute"):
        verify(grad)


def test_a_new_instrument_sees_every_pass_without_touching_the_runner():
    seen = []

    class Count(Instrument):
        def after_pass(self, run):
            seen.append((run.index, run.info.name, run.target, run.result.num_nodes()))

    graph, _ = _captured()
    manager = PassManager("cleanup,cleanup")
    manager.instruments.append(Count())
    manager.run(graph)
    assert [s[:3] for s in seen] == [(1, "cleanup", "step"), (2, "cleanup", "step")]
    assert [r.name for r in manager.records] == ["cleanup", "cleanup"]


def test_zero2_on_a_fake_four_rank_mesh_compiles_in_one_process_with_placements():
    model, loss_fn = tiny_gpt()
    optimizer = make_optimizer("adamw", model.parameters())
    captured, _ = capture_train_step(model, optimizer, loss_fn, gpt_batches(1)[0])
    plan = Plan(dp=4, zero_stage=2, backend="eager", verify="deep", bucket_mb=0.02)
    program = compile_program(captured, plan, MeshDesc.fake(dp=4, rank=3))
    assert not dist.is_initialized()
    graph = program["step"]
    params = dict(model.named_parameters())
    for name, p in params.items():
        placement = placement_of(graph, "opt_state", f"{name}:exp_avg")
        assert placement.shape == tuple(p.shape) and isinstance(placement.on("dp"), FlatShard)
        assert graph.input_node("opt_state", f"{name}:exp_avg").meta["val"].shape[0] == -(-p.numel() // 4)
        assert placement_of(graph, "param", name) is None            # stage 2: parameters stay whole
    report = program.state_bytes()["step"]
    padded = sum(-(-p.numel() // 4) for p in params.values())
    assert report.optimizer_state == 2 * 4 * padded + 4 * len(params)   # two fp32 moments + a scalar step
    assert report.params == 4 * sum(p.numel() for p in params.values())
    assert report.grads == 4 * padded                                   # reduce-scattered: a shard each
    assert "dp=4" in str(program) and "S(flat)" in str(program)


def test_a_plan_whose_degrees_differ_from_the_mesh_is_refused():
    graph, _ = _captured()
    with pytest.raises(Exception, match="plan field 'dp' = 2: the mesh has dp=4"):
        compile_program(graph, Plan(dp=2, zero_stage=1, backend="eager"), MeshDesc.fake(dp=4))


def test_an_accumulation_plan_dumps_grad_and_apply_graphs_verified_and_runnable(tmp_path):
    model, loss_fn = tiny_mlp()
    step = compile_for_npu(model, Plan(backend="eager", microbatches=2, verify="deep", dump_dir=str(tmp_path)),
                           optimizer=make_optimizer("sgd", model.parameters()), loss_fn=loss_fn)
    step(mlp_batches(1)[0])
    program = json.loads((tmp_path / "program.json").read_text())
    assert {n: g["kind"] for n, g in program["graphs"].items()} == {"grad": "grad", "apply": "apply"}
    assert "graph grad: kind grad" in (tmp_path / "program.txt").read_text()
    for name in ("grad", "apply"):
        records = json.loads((tmp_path / name / "passes.json").read_text())
        last = records[-1]
        stem = f"{last['index']:03d}_{last['name']}"
        with open(tmp_path / name / f"{stem}.json") as f:
            verify(from_json(json.load(f)), deep=True)                 # each dump verifies by its kind
        out = subprocess.run([sys.executable, str(tmp_path / name / f"{stem}.py")], capture_output=True,
                             text=True, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.startswith("loss" if name == "grad" else "outputs")


def test_npu_legalize_reads_group_sizes_from_a_fake_mesh_without_a_process_group():
    graph, _ = _captured("sgd")
    plan = Plan(dp=4, backend="eager", pipeline="data_parallel,npu_legalize{npu_kernels=false}")
    program = compile_program(graph, plan, MeshDesc.fake(dp=4))
    step = program["step"]
    reduces = [n for n in step.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    assert reduces and all(n.args[1] == "sum" for n in reduces)          # HCCL has no "avg"
    assert not dist.is_initialized()
    record = next(r for r in program.records if r.name == "npu_legalize")
    assert "all_reduce avg" in record.stats["rewritten"]


def test_zero3_rank_state_bytes_follow_the_zero_formula_on_a_fake_mesh():
    # (2 + 2 + K) Psi / N with K = 12 for mixed-precision Adam, here spelled as fp32 master
    # parameter (4), fp32 gradient (4) and two fp32 moments (8) per parameter, padding included.
    model, loss_fn = tiny_gpt(bias=False)
    optimizer = make_optimizer("adamw", model.parameters())
    captured, _ = capture_train_step(model, optimizer, loss_fn, gpt_batches(1)[0])
    plan = Plan(dp=8, zero_stage=3, precision="bf16", recompute="budget", recompute_budget=0.5,
                backend="eager", verify="shallow", bucket_mb=0.05)
    report = compile_program(captured, plan, MeshDesc.fake(dp=8)).state_bytes()["step"]
    padded = sum(-(-p.numel() // 8) for p in model.parameters())
    n = len(list(model.parameters()))
    assert (report.params, report.grads, report.optimizer_state) == (4 * padded, 4 * padded, 8 * padded + 4 * n)
    psi = sum(p.numel() for p in model.parameters())
    assert abs(report.model_state - 4 * n - (2 + 2 + 12) * psi / 8) <= 16 * (padded * 8 - psi) / 8 + 1e-6
    assert report.activations > 0
