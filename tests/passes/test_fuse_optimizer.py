"""fuse_optimizer: the per-parameter update chains become one ``_foreach_*`` op per chain position,
bitwise the unfused step and torch.optim's ``foreach=True``; what it cannot group stays as it was."""
from __future__ import annotations

import copy
import operator
from collections import Counter

import pytest
import torch

from cann_passes import Plan, compile_for_npu, compile_program
from cann_passes.pass_manager import PassContext, PassFailure, PassManager, PassOptionError, PipelineError
from cann_passes.pass_pipeline import build_pipeline
from cann_passes.plan import PlanError
from graph_ir.meta import ORIGIN_PASS, REUSES_OPERAND, Region
from graph_ir.multi_tensor_ops import FUSED_ADAM
from graph_ir.mesh import MeshDesc
from graph_ir.optimizers import UnsupportedOptimizer
from tests.conftest import gpt_batches, mlp_batches, tiny_gpt, tiny_mlp
from tests.eager_reference import eager_steps
from tests.passes._tiny import aten, fx_graph, mlp_step, run
from tests.zoo import compare

OPTIMIZERS = {
    "adamw": lambda p, **k: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, **k),
    "adam": lambda p, **k: torch.optim.Adam(p, lr=1e-2, **k),
    "adam_decay_amsgrad": lambda p, **k: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True, **k),
    "sgd": lambda p, **k: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4, **k),
    "sgd_nesterov": lambda p, **k: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, **k),
    "sgd_plain": lambda p, **k: torch.optim.SGD(p, lr=0.05, **k),
    "rmsprop": lambda p, **k: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True, weight_decay=0.1, **k),
    "adagrad": lambda p, **k: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.01, weight_decay=0.1, **k),
    "adamax": lambda p, **k: torch.optim.Adamax(p, lr=1e-2, weight_decay=0.1, **k),
    "nadam": lambda p, **k: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.1, **k),
    "radam": lambda p, **k: torch.optim.RAdam(p, lr=1e-2, weight_decay=0.1, **k),
}
# What stays one op per parameter because the foreach family has no such op.
UNFUSED = {"nadam": {"aten._to_copy.default"}, "radam": {"aten.gt.Scalar", "aten.where.self"}}
PARAMS = 6   # the recipe MLP's weights and biases


def _ops(graph, region: Region | None = Region.OPTIMIZER) -> Counter:
    """Ops run (getitem on a foreach op's list runs nothing), by name."""
    return Counter(str(n.target) for n in graph.compute_nodes(region) if n.target is not operator.getitem)


def _fuse(graph, before: str = "cleanup", mesh=None, options: str = "", after: str = ""):
    manager = PassManager(f"{before},fuse_optimizer{options}{after}", verify_level="deep")
    out = manager.run(graph.copy(), PassContext(mesh=mesh or MeshDesc.fake()))
    return out, manager.records[-1]


def _unfused(graph, before: str = "cleanup", mesh=None):
    return PassManager(before, verify_level="deep").run(graph.copy(), PassContext(mesh=mesh or MeshDesc.fake()))


@pytest.fixture(scope="module", params=sorted(OPTIMIZERS))
def captured(request):
    return request.param, mlp_step(OPTIMIZERS[request.param])


class TestFuseOptimizer:
    def test_the_fused_graph_computes_bitwise_what_the_unfused_one_did(self, captured):
        _, step = captured
        base = _unfused(step.captured)
        fused, _ = _fuse(step.captured)
        want, got = run(base, step), run(fused, step)
        assert set(want) == set(got)
        for name in want:
            assert torch.equal(want[name], got[name]), name

    def test_each_chain_position_costs_one_op_for_all_parameters(self, captured):
        name, step = captured
        base, (fused, record) = _unfused(step.captured), _fuse(step.captured)
        before, after = sum(_ops(base).values()), sum(_ops(fused).values())
        left = {op for op in _ops(fused) if not op.startswith("aten._foreach_")}
        unfused_per_parameter = {op for op in left if _ops(fused)[op] == PARAMS}
        assert unfused_per_parameter == UNFUSED.get(name, set())
        assert after * 3 <= before, (before, after)
        assert record.stats["foreach_ops"] == sum(n for op, n in _ops(fused).items() if op.startswith("aten._foreach_"))
        foreach = [n for n in fused.graph.nodes if str(n.target).startswith("aten._foreach_")]
        assert all(n.meta[ORIGIN_PASS] == "fuse_optimizer" for n in foreach)
        # one element per parameter (two for Adam's bias corrections of beta1 and beta2, which are one
        # op apart); the shared hyperparameter ops (1 - beta1, 1 - beta2) pair up
        lengths = [len(n.meta["val"]) for n in foreach]
        assert min(lengths) >= 2 and sum(n % PARAMS == 0 for n in lengths) >= len(lengths) - 3, lengths

    def test_forward_and_backward_are_left_alone(self, captured):
        _, step = captured
        base, (fused, _) = _unfused(step.captured), _fuse(step.captured)
        for region in (Region.FORWARD, Region.BACKWARD):
            assert _ops(fused, region) == _ops(base, region)

    def test_adamw_becomes_the_multi_tensor_ops_of_torch_optims_foreach_path(self):
        step = mlp_step(OPTIMIZERS["adamw"])
        fused, _ = _fuse(step.captured)
        ops = _ops(fused)
        assert sum(ops.values()) * 5 <= sum(_ops(_unfused(step.captured)).values())
        for op in ("aten._foreach_lerp.List", "aten._foreach_addcmul.Scalar", "aten._foreach_sqrt.default",
                   "aten._foreach_pow.List", "aten._foreach_div.List", "aten._foreach_mul.Tensor",
                   "aten._foreach_add.Scalar"):
            assert ops[op] >= 1, op
        # the step counts' float32 -> float64 copy as a product with a float64 one
        assert ops["aten._to_copy.default"] == 0 and ops["aten.full.default"] == 1

    def test_parameter_groups_with_their_own_hyperparameters_fuse_and_stay_bitwise(self):
        def grouped(params):
            params = list(params)
            return torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}],
                                     lr=1e-2, weight_decay=0.1)
        step = mlp_step(grouped)
        base, (fused, _) = _unfused(step.captured), _fuse(step.captured)
        assert sum(_ops(fused).values()) * 4 <= sum(_ops(base).values())
        want, got = run(base, step), run(fused, step)
        assert all(torch.equal(want[k], got[k]) for k in want)

    def test_only_tensors_a_foreach_op_accepts_together_are_grouped(self):
        def update(a, b, c, s):
            return [(a * s).sqrt().sum() + (b * s).sqrt().sum() + (c * s.double()).sqrt().sum()]
        graph = fx_graph(update, torch.rand(3, 4), torch.rand(5), torch.rand(2, dtype=torch.float64),
                         torch.tensor(2.0), region="optimizer")
        fused, record = _fuse(graph, before="cleanup{cse=false}")
        ops = _ops(fused)
        # a and b (float32, different shapes) share one op; c (float64) stays on its own
        assert ops["aten._foreach_mul.Tensor"] == 1 and ops["aten._foreach_sqrt.default"] == 1
        assert ops["aten.mul.Tensor"] == 1 and ops["aten.sqrt.default"] == 1
        inputs = [torch.rand(3, 4), torch.rand(5), torch.rand(2, dtype=torch.float64), torch.tensor(2.0)]
        assert torch.equal(graph.gm(*inputs)[0], fused.gm(*inputs)[0])

    def test_zero_1_shard_updates_fuse_like_whole_parameters(self):
        step = mlp_step(OPTIMIZERS["adamw"])
        mesh = MeshDesc.fake(dp=2, rank=1)
        before = "cleanup,optimizer_shard{stage=1,bucket_mb=1}"
        base = _unfused(step.captured, before, mesh)
        fused, record = _fuse(step.captured, before, mesh)
        assert record.stats["groups"] > 10
        assert sum(_ops(fused).values()) * 2 <= sum(_ops(base).values())
        collectives = [op for op in _ops(base) if "_c10d_functional" in op]
        assert {op: _ops(fused)[op] for op in collectives} == {op: _ops(base)[op] for op in collectives}

    def test_kernel_fused_is_refused_for_sgd_naming_the_option_and_why(self):
        with pytest.raises(PassFailure) as info:
            _fuse(mlp_step(OPTIMIZERS["sgd"]).captured, options="{kernel=fused}")
        cause = info.value.__cause__
        assert isinstance(cause, PassOptionError) and cause.option == "kernel" and cause.value == "fused"
        assert "no Adam update" in str(cause) and "kernel=foreach" in str(cause)

    @pytest.mark.parametrize("opt, stats", [("adamw", {"fused_adam_calls": 1}), ("sgd", {"groups": 4})])
    def test_kernel_fused_or_foreach_takes_fused_for_adam_state_and_foreach_otherwise(self, opt, stats):
        _, record = _fuse(mlp_step(OPTIMIZERS[opt]).captured, options="{kernel=fused_or_foreach}")
        assert {k: record.stats[k] for k in stats} == stats

    @pytest.mark.parametrize("opt", ["adamw", "adam", "adam_decay_amsgrad"])
    def test_kernel_fused_makes_one_fused_adam_call_of_every_chain_bitwise(self, opt):
        step = mlp_step(OPTIMIZERS[opt])
        base = _unfused(step.captured)
        fused, record = _fuse(step.captured, options="{kernel=fused}")
        assert record.stats == {"fused_adam_calls": 1, "tensors_fused": PARAMS}
        ops = _ops(fused)
        assert ops[str(FUSED_ADAM)] == 1
        # what is left per parameter is the step count's increment (the kernel reads the new count)
        assert set(ops) == {str(FUSED_ADAM), "aten.add.Tensor"} and ops["aten.add.Tensor"] == PARAMS
        want, got = run(base, step), run(fused, step)
        assert set(want) == set(got)
        model, _ = step.fresh()      # torch.optim's fused=True step from the same weights and batch
        optimizer = OPTIMIZERS[opt](model.parameters(), fused=True)
        step.loss_fn(model, step.batch).backward()
        optimizer.step()
        for name, param in model.named_parameters():
            assert torch.equal(got[name], param.detach()), name
            for key, value in optimizer.state[param].items():
                assert torch.equal(got[f"{name}:{key}"], value), (name, key)
        for name in want:   # the single-tensor chain rounds its own way
            assert (got[name] - want[name]).abs().max() < 1e-6, name

    @pytest.mark.parametrize("opt", ["adamw", "adam_decay_amsgrad"])
    def test_inductor_lowers_the_fused_call_as_one_writing_into_the_inputs(self, opt):
        # The functional op clones every parameter and moment first; the lowered copy runs the
        # mutating op on the step's inputs (AOTAutograd functionalizes it, inductor reinplaces it).
        from cann_passes.lowering.base import writable_inputs
        from cann_passes.lowering.inductor import mutate_inputs
        from graph_ir.multi_tensor_ops import FUSED_ADAM_IN_PLACE
        step = mlp_step(OPTIMIZERS[opt])
        fused, _ = _fuse(step.captured, options="{kernel=fused}")
        want = run(fused, step)
        lowered = fused.copy()
        mutated = mutate_inputs(lowered.gm, writable_inputs(lowered))
        targets = Counter(n.target for n in lowered.graph.nodes)
        assert targets[FUSED_ADAM_IN_PLACE] == 1 and targets[FUSED_ADAM] == 0
        names = {n: s.name for n, s in zip(lowered.placeholders(), lowered.signature.inputs)}
        moments = 3 if opt == "adam_decay_amsgrad" else 2
        written = {names[n] for n in mutated}
        assert {name for name, _ in step.model.named_parameters()} <= written
        assert sum(name.rsplit(":", 1)[-1] in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") for name in written) \
            == PARAMS * moments
        inputs = [t.clone() for t in step.inputs()]
        outputs = lowered.gm(*inputs)
        for spec, value in zip(lowered.signature.outputs, outputs):
            if spec.kind != "loss":
                assert torch.equal(value, want[spec.name]), spec.name
        for node in mutated:    # the inputs themselves hold the new values
            i = lowered.placeholders().index(node)
            assert torch.equal(inputs[i], want[names[node]]), names[node]

    def test_a_fused_call_whose_parameter_is_read_after_it_stays_functional(self):
        from cann_passes.lowering.base import writable_inputs
        from cann_passes.lowering.inductor import mutate_inputs
        fused, _ = _fuse(mlp_step(OPTIMIZERS["adamw"]).captured, options="{kernel=fused}")
        lowered = fused.copy()
        call = next(n for n in lowered.graph.nodes if n.target is FUSED_ADAM)
        param = call.args[0][0]
        out = lowered.graph.output_node()
        with lowered.graph.inserting_before(out):
            late = lowered.graph.call_function(aten.clone.default, (param,))   # the old value, after the update
        late.meta.update(param.meta, region="optimizer")
        mutate_inputs(lowered.gm, writable_inputs(lowered))
        assert any(n.target is FUSED_ADAM for n in lowered.graph.nodes)

    def test_an_unknown_kernel_is_refused_when_the_pipeline_is_parsed(self):
        with pytest.raises(PipelineError, match="must be one of 'foreach', 'fused'"):
            PassManager("fuse_optimizer{kernel=multi}")


class TestPipeline:
    def test_it_runs_after_the_update_rewrites_and_before_the_users_passes(self):
        passes = build_pipeline(Plan(dp=2, zero_stage=1, grad_clip_norm=1.0, extra_passes=("spell_out_alpha",)),
                                "inductor").passes
        names = [p.name for p in passes]
        at = names.index("fuse_optimizer")
        assert passes[at].text() == "fuse_optimizer{kernel=fused_or_foreach}"
        assert names[at - 2:at + 2] == ["optimizer_shard", "grad_clip", "fuse_optimizer", "spell_out_alpha"]
        assert "fuse_optimizer{kernel=foreach}" in str(build_pipeline(Plan(), "torchair"))
        # eager writes per-tensor updates in place (reuse_dead_operands); fusing there is asked for
        assert "fuse_optimizer" not in str(build_pipeline(Plan(), "eager"))
        assert "fuse_optimizer{kernel=foreach}" in str(build_pipeline(Plan(optimizer_kernel="foreach"), "eager"))

    def test_it_is_left_out_with_pipeline_stages_or_when_the_plan_says_none(self):
        assert "fuse_optimizer" not in str(build_pipeline(Plan(pp=2, microbatches=2), "inductor"))
        assert "fuse_optimizer" not in str(build_pipeline(Plan(optimizer_kernel="none"), "inductor"))
        assert Plan(optimizer_kernel=False).optimizer_kernel == "none"   # YAML's unquoted none/off

    def test_the_plan_field_is_checked_and_named(self):
        with pytest.raises(PlanError, match="must be one of") as info:
            Plan(optimizer_kernel="multi")
        assert info.value.field == "optimizer_kernel"
        with pytest.raises(PlanError, match="applies only at pp = 1"):
            Plan(pp=2, microbatches=2, optimizer_kernel="fused")
        with pytest.raises(PlanError, match="no GE converter"):
            Plan(backend="torchair", optimizer_kernel="fused")
        with pytest.raises(PlanError, match="'none' but there is a 'fuse_optimizer' pass"):
            Plan(pipeline="cleanup,fuse_optimizer", optimizer_kernel="none")

    def test_the_fused_refusal_reaches_the_user_as_the_plan_fields_error(self):
        model, loss_fn = tiny_mlp()
        step = compile_for_npu(model, Plan(backend="eager", optimizer_kernel="fused"),
                               optimizer=OPTIMIZERS["sgd"](model.parameters()), loss_fn=loss_fn)
        with pytest.raises(PlanError, match="no Adam update") as info:
            step(mlp_batches(1)[0])
        assert info.value.field == "optimizer_kernel"


def _train(factory, batches_of, make_optimizer, plan: Plan, steps: int = 3):
    model, loss_fn = factory()
    optimizer = make_optimizer(model.parameters())
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=loss_fn)
    losses = [step(b).item() for b in batches_of(steps)]
    return losses, model, optimizer, step


def _eager(factory, batches_of, make_optimizer, steps: int = 3):
    model, loss_fn = factory()
    optimizer = make_optimizer(model.parameters())
    return eager_steps(model, optimizer, loss_fn, batches_of(steps)).losses, model, optimizer


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        sa[k].keys() == sb[k].keys() and all(torch.equal(sa[k][s], sb[k][s]) for s in sa[k]) for k in sa)


FOREACH = Plan(backend="eager", verify="deep", optimizer_kernel="foreach")
MODELS = {"mlp": (tiny_mlp, mlp_batches), "gpt": (tiny_gpt, lambda n: gpt_batches(n, batch=2))}


class TestTraining:
    @pytest.mark.parametrize("opt", ["adamw", "adam", "sgd_nesterov"])
    @pytest.mark.parametrize("model", sorted(MODELS))
    def test_three_steps_are_bitwise_torch_optims_foreach_path_and_the_unfused_step(self, model, opt):
        factory, batches = MODELS[model]
        foreach = lambda p: OPTIMIZERS[opt](p, foreach=True)   # noqa: E731
        losses, trained, optimizer, step = _train(factory, batches, foreach, FOREACH)
        assert "fuse_optimizer{kernel=foreach}" in str(step.last.pipeline)
        assert next(r for r in step.records if r.name == "fuse_optimizer").stats["groups"] > 0
        ref_losses, ref, ref_optimizer = _eager(factory, batches, foreach)
        assert losses == ref_losses
        assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), ref.parameters()))
        assert _same_state(optimizer, ref_optimizer)
        plain_losses, plain, plain_optimizer, _ = _train(factory, batches, OPTIMIZERS[opt],
                                                         Plan(backend="eager", optimizer_kernel="none"))
        assert losses == plain_losses
        assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), plain.parameters()))
        assert _same_state(optimizer, plain_optimizer)

    @pytest.mark.parametrize("opt", ["adamw", "adam_decay_amsgrad"])
    @pytest.mark.parametrize("model", sorted(MODELS))
    def test_kernel_fused_trains_bitwise_like_torch_optims_fused_kernel_in_place(self, model, opt):
        factory, batches = MODELS[model]
        losses, trained, optimizer, step = _train(factory, batches, OPTIMIZERS[opt],
                                                  Plan(backend="eager", verify="deep", optimizer_kernel="fused"))
        ref_losses, ref, ref_optimizer = _eager(factory, batches, lambda p: OPTIMIZERS[opt](p, fused=True))
        assert losses == ref_losses
        assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), ref.parameters()))
        assert _same_state(optimizer, ref_optimizer)
        graph = step.last.graph
        fused = [n for n in graph.graph.nodes if n.target is FUSED_ADAM]
        assert len(fused) == 1 and fused[0].meta.get(REUSES_OPERAND)     # run in place on eager
        params = {n for n, _ in trained.named_parameters()}
        written = {s.name for s, n in zip(graph.signature.inputs, graph.placeholders())
                   if n.name in graph.attrs["written_inputs"]}
        assert params <= written

    @pytest.mark.parametrize("opt", ["adamw", "adam_decay_amsgrad"])
    def test_an_optimizer_made_with_fused_true_gets_its_kernel_and_trains_bitwise_like_eager(self, opt):
        # what the user wrote is what runs: AdamW(fused=True) under the plan's default
        fused = lambda p: OPTIMIZERS[opt](p, fused=True)   # noqa: E731
        losses, trained, optimizer, step = _train(tiny_mlp, mlp_batches, fused, Plan(backend="eager", verify="deep"))
        assert "fuse_optimizer{kernel=fused}" in str(step.last.pipeline)
        ref_losses, ref, ref_optimizer = _eager(tiny_mlp, mlp_batches, fused)
        assert losses == ref_losses
        assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), ref.parameters()))
        assert _same_state(optimizer, ref_optimizer)

    def test_a_fused_optimizer_the_step_cannot_run_as_eager_does_is_refused_by_name(self):
        model, loss_fn = tiny_mlp()
        with pytest.raises(UnsupportedOptimizer, match="SGD option fused=True is not supported"):
            compile_for_npu(model, Plan(backend="eager"), optimizer=torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                     fused=True), loss_fn=loss_fn)
        first, *rest = model.parameters()
        mixed = torch.optim.AdamW([{"params": [first], "fused": True}, {"params": rest}])
        with pytest.raises(UnsupportedOptimizer, match="fused is True in some param groups"):
            compile_for_npu(model, Plan(backend="eager"), optimizer=mixed, loss_fn=loss_fn)
        # the kernel runs at pp = 1 only: a pipeline would update one by one, not bitwise
        step = mlp_step(lambda p: OPTIMIZERS["adamw"](p, fused=True))
        with pytest.raises(PlanError, match="fused=True, whose kernel the step runs only at pp = 1") as info:
            compile_program(step.captured, Plan(pp=2, microbatches=2, verify="off"), MeshDesc.fake(pp=2))
        assert info.value.field == "pp"

    def test_llama_trains_bitwise_like_its_unfused_step(self):
        fused = compare("llama", FOREACH, steps=3)
        plain = compare("llama", Plan(backend="eager", optimizer_kernel="none"), steps=3)
        assert fused.compiled_losses == plain.compiled_losses
        assert all(torch.equal(fused.compiled_params[n], plain.compiled_params[n]) for n in plain.compiled_params)
        # eager llama's backward rounds differently from the captured one; the update adds nothing to that
        assert fused.max_param_diff() == plain.max_param_diff() < 1e-5
        graph = fused.step.last.program.main
        ops = _ops(graph)
        assert sum(n for op, n in ops.items() if not op.startswith("aten._foreach_")) < len(plain.compiled_params)

    def test_an_accumulating_plan_fuses_the_apply_graphs_update(self):
        plan = FOREACH.replace(microbatches=2)
        losses, trained, _, step = _train(tiny_mlp, mlp_batches, OPTIMIZERS["adamw"], plan)
        plain_losses, plain, _, _ = _train(tiny_mlp, mlp_batches, OPTIMIZERS["adamw"],
                                           plan.replace(optimizer_kernel="none"))
        assert losses == plain_losses
        assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), plain.parameters()))
        apply = step.last.program.graphs["apply"]
        assert any(op.startswith("aten._foreach_") for op in _ops(apply))

    @pytest.mark.slow
    @pytest.mark.parametrize("opt, kernel", [("adamw", "cann.fused_adam"), ("sgd_nesterov", "aten._foreach_")])
    def test_inductor_lowers_the_fused_update_within_1e5_of_torch_optim(self, opt, kernel):
        # inductor's default: torch's fused kernel for Adam/AdamW (inductor calls it rather than
        # compiling the update), foreach ops for any other optimizer
        make = lambda p: OPTIMIZERS[opt](p, foreach=True)   # noqa: E731
        losses, trained, _, step = _train(tiny_mlp, mlp_batches, make, Plan(backend="inductor"))
        assert "fuse_optimizer{kernel=fused_or_foreach}" in str(step.last.pipeline)
        assert any(op.startswith(kernel) for op in _ops(step.last.program.main)), kernel
        ref_losses, ref, _ = _eager(tiny_mlp, mlp_batches, make)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for p, q in zip(trained.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


class TestGeLowering:
    @pytest.mark.parametrize("opt", ["adamw", "sgd"])
    def test_the_fused_step_lowers_to_ge_foreach_ops_with_nothing_unsupported(self, torchair, opt):
        from cann_passes.lowering.ge_offline import lower_to_ge
        step = mlp_step(OPTIMIZERS[opt])
        legal, _ = _fuse(step.captured, after=",npu_legalize,cleanup")
        want, got = run(_unfused(step.captured), step), run(legal, step)
        assert all(torch.equal(want[k], got[k]) for k in want)   # each rewrite is the same op per element
        report = lower_to_ge(legal.gm, name=f"fused_{opt}")
        assert report.ok and report.unsupported == [], report.summary()
        foreach = {k: v for k, v in report.op_histogram.items() if k.startswith("Foreach")}
        assert sum(foreach.values()) >= (10 if opt == "adamw" else 3), foreach
        assert "ForeachAddcmulScalar" in foreach
