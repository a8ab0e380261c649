"""The Flamingo recipe: a frozen vision tower the optimizer never touches, tanh gates that start
closed (the LM is exactly itself at initialisation), the caption loss falls when trained by the
compiled step, the step equals eager PyTorch, every plan in recipes/flamingo/plans compiles and
does what it says, and bf16 lowers to GE."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan
from graph_ir import InputKind, OutputKind
from recipes.clip.checks import (capture, compile_plan, lower_to_ge, max_difference_from_eager, plan_effects,
                                 plan_files, train_compiled)
from recipes.clip.train import make_optimizer
from recipes.data.images import image_text_batch
from recipes.flamingo import RECIPE, Flamingo, evaluate, flamingo_3b, flamingo_loss, flamingo_tiny


def test_gates_start_closed_so_the_image_changes_nothing_at_initialisation():
    torch.manual_seed(0)
    model = Flamingo(flamingo_tiny()).eval()
    batch = image_text_batch("heldout", 0, 4)
    ids = batch["input_ids"][:, :-1]
    torch.testing.assert_close(model(batch["pixel_values"], ids), model(batch["pixel_values"].flip(0), ids))
    opened = Flamingo(flamingo_tiny(gate_init=0.5)).eval()
    assert not torch.allclose(opened(batch["pixel_values"], ids), opened(batch["pixel_values"].flip(0), ids))


def test_flamingo_3b_shape_trains_only_resampler_and_cross_attention():
    with torch.device("meta"):
        model = Flamingo(flamingo_3b())
    total = sum(p.numel() for p in model.parameters())
    trainable = {n.split(".")[0] if not n.startswith("layers") else "xattn"
                 for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"resampler", "xattn"}
    assert 2.5e9 < total < 3.3e9, total


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = Flamingo(flamingo_tiny())
    return capture(model, make_optimizer(model, 1e-3, 0.05), flamingo_loss, image_text_batch("train", 0, 8))


def test_frozen_vision_tower_is_read_only_input_with_no_gradient(captured):
    specs = captured.signature.inputs
    assert any(s.kind == InputKind.PARAM and s.name.startswith("vision.") for s in specs)
    assert not any(s.kind == InputKind.OPT_STATE and s.name.startswith("vision.") for s in specs)
    updated = {s.name for s in captured.signature.outputs if s.kind == OutputKind.PARAM}
    assert not any(name.startswith("vision.") for name in updated)
    assert any(name.startswith("resampler.") for name in updated)


def test_compiled_step_matches_eager_pytorch_fp32():
    torch.manual_seed(0)
    loss_diff, param_diff = max_difference_from_eager(Flamingo(flamingo_tiny()), flamingo_loss,
                                                      [image_text_batch("train", 8 * i, 8) for i in range(3)])
    assert loss_diff <= 1e-5 and param_diff <= 1e-5, (loss_diff, param_diff)


def test_caption_loss_falls_on_held_out_captions():
    torch.manual_seed(0)
    model = Flamingo(flamingo_tiny())
    before = evaluate(model)
    losses = train_compiled(model, flamingo_loss, Plan(backend="eager"), steps=30, batch_size=32, lr=3e-3)
    after = evaluate(model)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert after["caption_loss"] < 0.5 * before["caption_loss"], (before, after)
    assert after["token_accuracy"] > 0.3, after


@pytest.mark.parametrize("path", plan_files(RECIPE.plans_dir), ids=lambda p: p.stem)
def test_every_plan_compiles_and_does_what_it_says(captured, path):
    plan = Plan.load(path)
    assert plan_effects(plan, compile_plan(captured, plan)) == []


@pytest.fixture(scope="module")
def torchair():
    from cann_passes.lowering.ge_offline import TorchairUnavailable, load_torchair
    try:
        return load_torchair()
    except TorchairUnavailable as e:
        pytest.skip(f"torchair (torch_npu wheel) unavailable: {e}")


def test_bf16_final_graph_lowers_to_ge_with_no_unsupported_op(tmp_path, torchair):
    torch.manual_seed(0)
    report = lower_to_ge(Flamingo(flamingo_tiny()), flamingo_loss, image_text_batch("train", 0, 4),
                         Plan.load(RECIPE.plans_dir / "bf16.yaml"), tmp_path)
    assert report["unsupported"] == [], report["unsupported"]
    ops = report["op_histogram"]
    assert ops.get("Tanh", 0) >= 2 and ops["Cast"] > 0, ops
    assert "DT_BF16" in (tmp_path / "ge" / "step.ge.txt").read_text()
