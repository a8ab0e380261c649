"""grad_accumulation: per-parameter accumulators in step state, ``acc = acc_in + weight * grad`` in
backward, the optimizer reading ``scale * acc``; on the recipe MLP's captured SGD step."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.pass_manager import PassContext, PassFailure, PassManager
from graph_ir.meta import (ACCUMULATION_SCALE, ACCUMULATION_WEIGHT, ACCUMULATOR_PREFIX, ORIGIN_PASS, REGION,
                           GraphAttr)
from graph_ir.mesh import MeshDesc
from graph_ir.signature import InputKind, OutputKind, Spec
from tests.eager_reference import eager_steps
from tests.passes._tiny import mlp_batch, mlp_step, run

ACCUMULATE = "cleanup,grad_accumulation{microbatches=2}"


@pytest.fixture(scope="module")
def step():
    return mlp_step()


@pytest.fixture(scope="module")
def accumulating(step):
    return PassManager(ACCUMULATE, verify_level="deep").run(step.captured.copy(), PassContext(mesh=MeshDesc.fake()))


def _state(step, accumulators=None, weight=1.0, scale=1.0) -> dict[str, torch.Tensor]:
    """The step state the pass added: accumulators (zeros unless given), weight and scale."""
    state = {ACCUMULATION_WEIGHT: torch.tensor(weight), ACCUMULATION_SCALE: torch.tensor(scale)}
    for name, p in step.model.named_parameters():
        state[ACCUMULATOR_PREFIX + name] = (torch.zeros_like(p) if accumulators is None
                                            else accumulators[ACCUMULATOR_PREFIX + name])
    return state


class TestGradAccumulation:
    def test_every_trainable_parameter_gets_one_accumulator_in_and_out_as_step_state(self, step, accumulating):
        names = {ACCUMULATOR_PREFIX + n for n, _ in step.model.named_parameters()}
        inputs = {s.name for s in accumulating.signature.inputs if s.kind == InputKind.STEP_STATE}
        outputs = {s.name for s in accumulating.signature.outputs if s.kind == OutputKind.STEP_STATE}
        assert inputs == names | {ACCUMULATION_WEIGHT, ACCUMULATION_SCALE} and outputs == names
        declared = accumulating.attrs[GraphAttr.STEP_STATE]
        assert declared[ACCUMULATION_WEIGHT] == {"value": 1.0, "dtype": "float32", "shape": []}
        assert declared[ACCUMULATOR_PREFIX + "fc2.weight"] == {"value": 0.0, "dtype": "float32", "shape": [32, 32]}
        assert accumulating.attrs[GraphAttr.GRAD_ACCUMULATION] == {"microbatches": 2, "target": 0, "weight": "gradient"}

    def test_it_accumulates_in_backward_and_scales_at_the_start_of_the_optimizer(self, accumulating):
        added = Counter((str(n.target), str(n.meta[REGION])) for n in accumulating.compute_nodes()
                        if n.meta.get(ORIGIN_PASS) == "grad_accumulation")
        assert added == {("aten.mul.Tensor", "backward"): 6, ("aten.add.Tensor", "backward"): 6,
                         ("aten.mul.Tensor", "optimizer"): 6}
        optimizer = [n for n in accumulating.compute_nodes() if str(n.meta[REGION]) == "optimizer"]
        assert all(n.meta.get(ORIGIN_PASS) == "grad_accumulation" for n in optimizer[:6])

    def test_with_empty_accumulators_and_unit_weight_and_scale_it_is_bitwise_the_captured_step(
            self, step, accumulating):
        want, got = run(step.captured, step), run(accumulating, step, _state(step))
        for name in want:
            assert torch.equal(got[name], want[name]), name

    def test_the_accumulator_comes_out_as_its_input_plus_weight_times_the_gradient(self, step, accumulating):
        grads = run(accumulating, step, _state(step))           # 0 + 1 * grad: the gradient itself
        start = {k: torch.randn_like(v) for k, v in grads.items() if k.startswith(ACCUMULATOR_PREFIX)}
        got = run(accumulating, step, _state(step, start, weight=3.0))
        for name, acc_in in start.items():
            assert torch.equal(got[name], acc_in + grads[name] * torch.tensor(3.0)), name

    def test_the_update_reads_scale_times_the_accumulated_sum(self, step, accumulating):
        plain = run(accumulating, step, _state(step))
        grads = {k: v for k, v in plain.items() if k.startswith(ACCUMULATOR_PREFIX)}
        # A gradient already accumulated once, this microbatch's again, scale 1/2: (g + g) / 2 = g.
        twice = run(accumulating, step, _state(step, grads, scale=0.5))
        for name, _ in step.model.named_parameters():
            assert torch.equal(twice[name], plain[name]), name
            assert torch.equal(twice[f"{name}:momentum_buffer"], plain[f"{name}:momentum_buffer"]), name

    def test_two_microbatches_train_like_eager_gradient_accumulation(self, step):
        model, optimizer = step.fresh()
        reference, reference_optimizer = step.fresh()
        batches = [mlp_batch(10 + i) for i in range(3)]
        plan = Plan(backend="eager", microbatches=2, verify="deep", pipeline=ACCUMULATE + ",cleanup,split_grad_apply")
        compiled = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=step.loss_fn)
        losses = [compiled(b).item() for b in batches]
        assert set(compiled.last.program.graphs) == {"grad", "apply"}
        want = eager_steps(reference, reference_optimizer, step.loss_fn, batches, microbatches=2).losses
        assert losses == pytest.approx(want, rel=1e-6, abs=1e-7)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)

    @pytest.mark.parametrize("text, words", [
        ("cleanup,data_parallel,grad_accumulation", "must run before data_parallel"),
        ("grad_accumulation,grad_accumulation", "and once"),
        ("grad_accumulation{microbatches=0}", "out of range"),
    ])
    def test_it_refuses_to_run_after_synchronization_twice_or_with_no_microbatches(self, step, text, words):
        with pytest.raises(PassFailure, match=words) as info:
            PassManager(text).run(step.captured.copy(), PassContext(mesh=MeshDesc.fake(dp=2)))
        assert info.value.pass_name == "grad_accumulation"

    def test_the_loss_output_is_left_as_the_microbatchs_own(self, step, accumulating):
        assert accumulating.signature.outputs[0] == Spec(OutputKind.LOSS, "loss")
        assert torch.equal(run(accumulating, step, _state(step, weight=5.0))["loss"],
                           run(step.captured, step)["loss"])
