"""The Flamingo recipe: a frozen vision tower the optimizer never touches, tanh gates that start
closed (the LM is exactly itself at initialisation), the caption loss falls when trained by the
compiled step, the step equals eager PyTorch, every plan in recipes/flamingo/plans compiles and
does what it says, and bf16 lowers to GE."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan
from graph_ir import InputKind, OutputKind
from tests.recipes._helpers import (assert_plan_does_what_it_says, bf16_lowers_to_ge, capture,
                                    max_difference_from_eager, plan_files, train_compiled)
from recipes.data.images import image_text_batch
from recipes.clip.train import make_optimizer
from recipes.common import warmup_cosine
from recipes.flamingo import RECIPE, Flamingo, evaluate, flamingo_3b, flamingo_loss, flamingo_tiny, reads_the_image


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
    return capture(model, flamingo_loss, image_text_batch("train", 0, 8))


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


def test_caption_loss_falls_and_the_captions_are_read_from_the_image():
    torch.manual_seed(0)
    model = Flamingo(flamingo_tiny())
    before = evaluate(model)
    assert before["caption_loss"] == before["mismatched_image_loss"] == before["blank_image_loss"]   # gates closed
    # The LM learns the captions' grammar first (about 50 steps); the tanh gates open, and the
    # image starts to count, after about 100 more.
    losses = train_compiled(model, flamingo_loss, Plan(backend="eager"), steps=150, batch_size=32, lr=3e-3)
    after = evaluate(model)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert after["caption_loss"] < 0.5 * before["caption_loss"], (before, after)
    assert after["token_accuracy"] > 0.3, after
    # The same trained model, the same captions: another picture's image or none makes them less
    # likely, so what the LM predicts comes through the resampler and the gated cross-attention.
    assert after["caption_loss"] < after["mismatched_image_loss"] - 0.1, after
    assert after["caption_loss"] < after["blank_image_loss"] - 0.1, after
    assert after["token_accuracy"] > after["mismatched_image_accuracy"], after
    assert reads_the_image(after).endswith("the model reads the image")
    assert reads_the_image(before).endswith("the image does not count yet")


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_gates_learn_at_ten_times_the_lr_through_the_schedule_and_the_compiled_step():
    """The command's optimizer: the tanh gates in a group of their own at 10x the lr (no weight
    decay), scaled by the warmup/cosine schedule like the rest; the compiled step with that
    group still equals eager PyTorch."""
    torch.manual_seed(0)
    model = Flamingo(flamingo_tiny())
    opt = make_optimizer(model, 1e-3, 0.05, RECIPE.lr_scale)
    gates = {id(p) for n, p in model.named_parameters() if n.endswith("_gate")}
    (group,) = [g for g in opt.param_groups if {id(p) for p in g["params"]} == gates]
    assert RECIPE.lr_scale == {"_gate": 10.0} and group["lr"] == 1e-2 and group["weight_decay"] == 0.0
    listed = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(listed) == sorted(id(p) for p in model.parameters() if p.requires_grad)   # each once
    schedule = warmup_cosine(opt, 100, warmup=10)
    for _ in range(30):
        schedule.step()
    assert group["lr"] == pytest.approx(10 * opt.param_groups[0]["lr"])
    with pytest.raises(ValueError, match="_no_such"):
        make_optimizer(model, 1e-3, 0.05, {"_no_such": 2.0})
    loss_diff, param_diff = max_difference_from_eager(
        model, flamingo_loss, [image_text_batch("train", 8 * i, 8) for i in range(3)],
        optimizer=lambda m: make_optimizer(m, 1e-3, 0.05, RECIPE.lr_scale))
    assert loss_diff <= 1e-5 and param_diff <= 1e-5, (loss_diff, param_diff)


@pytest.mark.parametrize("path", plan_files(RECIPE.plans_dir), ids=lambda p: p.stem)
def test_every_plan_compiles_and_does_what_it_says(captured, path):
    assert_plan_does_what_it_says(captured, path)


def test_bf16_final_graph_lowers_to_ge_with_no_unsupported_op(tmp_path, torchair):
    torch.manual_seed(0)
    ops = bf16_lowers_to_ge(Flamingo(flamingo_tiny()), flamingo_loss, image_text_batch("train", 0, 4),
                            RECIPE.plans_dir, tmp_path)
    assert ops.get("Tanh", 0) >= 2 and ops["Cast"] > 0, ops
