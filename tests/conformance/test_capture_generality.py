"""Capture of what the models users bring contain: tensor constants, 0-dim parameters, masks."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan
from graph_ir import capture_train_step
from tests.zoo import MODELS, ZooModel, build, compare


def _no_attr_constants(tg) -> bool:
    return not [n for n in tg.graph.nodes if n.op == "get_attr"]


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_tensor_constants_made_in_forward_become_graph_nodes(name):
    entry = build(name)
    tg, _ = capture_train_step(entry.model, torch.optim.SGD(entry.model.parameters(), lr=0.1),
                               entry.loss_fn, entry.make_batch(0))
    assert _no_attr_constants(tg)
    assert not [n for n in tg.graph.nodes if n.target == torch.ops.aten.lift_fresh_copy.default]


def test_a_model_with_tensor_constants_accumulates_like_eager():
    run = compare("gpt2", Plan(backend="eager", microbatches=2, verify="deep"), steps=2)
    assert run.max_loss_diff() <= 1e-5 and run.max_param_diff() <= 1e-5
    assert "grad_accumulation" in str(run.step.last.pipeline)


class _Weighted(torch.nn.Module):
    """A constant of unequal values made in forward: it stays a read of the graph module."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0])


def test_a_constant_of_unequal_values_trains_like_eager():
    model = _Weighted()
    batches = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    entry = ZooModel("weighted", model, lambda m, b: m(b).square().mean(), None, False, (), 1)
    run = compare(entry, Plan(backend="eager"), batches=batches)
    assert run.eager_losses == run.compiled_losses
    assert run.max_param_diff() == 0.0


def test_clip_logit_scale_keeps_its_dtype_through_adamw_and_matches_eager_bitwise():
    run = compare("clip", Plan(backend="eager"), steps=2)
    assert run.compiled_params["logit_scale"].dtype == torch.float32
    state = run.compiled_optimizer.state[dict(run.step.model.named_parameters())["logit_scale"]]
    assert {k: v.dtype for k, v in state.items()} == {"step": torch.float32, "exp_avg": torch.float32,
                                                      "exp_avg_sq": torch.float32}
    assert run.eager_losses == run.compiled_losses
    assert run.max_param_diff() == 0.0


def test_padded_and_all_ones_masks_share_one_compilation_and_match_eager():
    entry = build("llama")
    batches = [entry.make_batch(1, pad=True), entry.make_batch(2, pad=False), entry.make_batch(3, pad=True)]
    assert not bool(batches[0]["attention_mask"].all()) and bool(batches[1]["attention_mask"].all())
    run = compare(entry, Plan(backend="eager"), batches=batches)
    assert len(run.step._compiled) == 1
    # On the all-ones batch eager's transformers takes its shortcut (SDPA with is_causal=True and no
    # mask) where the one step keeps the causal mask it traced: two paths of the CPU flash-attention
    # kernel, which round alike on an AVX2 CPU and differ by about 1e-11 in the gradients on an
    # AVX512 one (Adam's first steps make that 4e-7 in the parameters).
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(run.compiled_losses, run.eager_losses))
    assert run.max_param_diff() <= 1e-6
    # Where eager masks as well (every batch padded), the step is bitwise eager's.
    padded = [entry.make_batch(seed, pad=True) for seed in (1, 3)]
    run = compare(build("llama"), Plan(backend="eager"), batches=padded)
    assert run.eager_losses == run.compiled_losses and run.max_param_diff() == 0.0


def test_every_zoo_models_block_prefixes_name_its_module_stacks():
    from tests.zoo import MODELS, build
    for name in MODELS:
        entry = build(name)
        modules = dict(entry.model.named_modules())
        for prefix in entry.block_prefixes:
            assert prefix in modules and f"{prefix}.0" in modules and f"{prefix}.1" in modules, (name, prefix)


@pytest.mark.parametrize("name", MODELS)
def test_every_family_trains_bitwise_like_eager_on_the_eager_backend(name):
    # The eager backend runs the captured ops with torch's own kernels and the backward as eager
    # runs it (no "infinitely differentiable" derivative forms), so nothing rounds differently.
    run = compare(name, Plan(backend="eager"), steps=2, layers=1)
    assert run.eager_losses == run.compiled_losses
    assert run.max_param_diff() == 0.0, name


@pytest.mark.parametrize("name", MODELS)
def test_every_family_trains_bitwise_like_eager_with_every_buffer_held_across_steps(name):
    # plan_buffers with no size floor: every intermediate its rules allow lives in a slot shared
    # with others and reused by the next step, so a slot handed on too early changes the numbers.
    run = compare(name, Plan(backend="eager", extra_passes=("plan_buffers{min_bytes=0}",)), steps=3, layers=1)
    assert run.eager_losses == run.compiled_losses
    assert run.max_param_diff() == 0.0, name
